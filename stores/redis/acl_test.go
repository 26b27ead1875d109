package redis

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis/redistest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// aclUser creates an ACL user with rules, deleted when the test ends.
func aclUser(t *testing.T, rules ...string) (user, password string) {
	t.Helper()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	user, password = "iceberg_idempotency_test_"+hex.EncodeToString(b[:]), hex.EncodeToString(b[:])
	c := redistest.Admin(t)
	ctx := context.Background()
	args := append([]any{"ACL", "SETUSER", user, "on", ">" + password}, anys(rules)...)
	if err := c.Do(ctx, args...).Err(); err != nil {
		sqltest.Missing(t, fmt.Sprintf("the test server refuses ACL SETUSER: %v", err))
	}
	t.Cleanup(func() { c.Do(context.Background(), "ACL", "DELUSER", user) })
	return user, password
}

func anys(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// openAs opens a store under a fresh key prefix as user, its log observed.
func openAs(t *testing.T, user, password string) (*Store, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zap.InfoLevel)
	cfg := Config{Addrs: []string{redistest.Addr(t)}, KeyPrefix: redistest.Prefix(t), Username: user, Password: password}
	s, err := Open(cfg, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, logs
}

// warnedOfChannel waits for s's subscription to succeed or be refused and
// returns the warnings of a denied channel.
func warnedOfChannel(s *Store, logs *observer.ObservedLogs) []observer.LoggedEntry {
	s.Warm()
	deadline := time.Now().Add(5 * time.Second)
	for logs.FilterMessageSnippet("change channel").Len() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	return logs.FilterMessageSnippet("may not use the store's change channel").All()
}

// TestChannelDenied: every script that changes a record announces it on
// the store's channel after its writes, and Redis does not undo a script's
// writes when a later command fails. Until the build after 6b01777, a user
// denied the channel had every Finalize, Release, Abandon, TakeOver and
// Forget write its change and then fail: the handler retried a Finalize
// that had landed, treated a landed Release as failed, and answered 503
// to a retry whose TakeOver had landed, leaving the key to a lease nobody
// renewed. Now the change stands and is reported as made, and the
// subscription's warning gives the grant to make. The user is one an
// operator following Redis 7's ACL documentation would make: its keys and
// every command, but no channel (acl-pubsub-default resetchannels, said
// here too in case the server's default differs).
func TestChannelDenied(t *testing.T) {
	user, password := aclUser(t, "~iceberg_idempotency_test_*", "resetchannels", "+@all")
	t.Run("warns with the grant", func(t *testing.T) {
		s, logs := openAs(t, user, password)
		warned := warnedOfChannel(s, logs)
		if len(warned) != 1 {
			t.Fatalf("%d warnings of the denied channel, want 1: %v", len(warned), logs.All())
		}
		if fix, want := warned[0].ContextMap()["fix"], "ACL SETUSER "+user+" &"+s.channel; fix != want {
			t.Fatalf("the warning's fix is %q, want %q", fix, want)
		}
	})
	harness := func(t *testing.T) storetest.Harness {
		s, _ := openAs(t, user, password)
		return storetest.Harness{Store: s, Advance: time.Sleep}
	}
	t.Run("conformance", func(t *testing.T) { storetest.Run(t, harness) })
	t.Run("admin", func(t *testing.T) { storetest.RunAdmin(t, harness) })
}

// TestREADMEGrant: the README's ACL for the store (its keys and channel,
// every command but @dangerous) is enough: no warning, and the suites pass.
func TestREADMEGrant(t *testing.T) {
	user, password := aclUser(t, "~iceberg_idempotency_test_*", "&iceberg_idempotency_test_*", "+@all", "-@dangerous")
	s, logs := openAs(t, user, password)
	if warned := warnedOfChannel(s, logs); len(warned) != 0 {
		t.Fatalf("warned of the channel: %v", warned)
	}
	if n := logs.FilterLevelExact(zap.WarnLevel).Len(); n != 0 {
		t.Fatalf("%d warnings: %v", n, logs.All())
	}
	harness := func(t *testing.T) storetest.Harness {
		s, _ := openAs(t, user, password)
		return storetest.Harness{Store: s, Advance: time.Sleep}
	}
	t.Run("conformance", func(t *testing.T) { storetest.Run(t, harness) })
	t.Run("admin", func(t *testing.T) { storetest.RunAdmin(t, harness) })
}

// TestREADMECommandList: a user granted exactly the commands the README
// lists, not +@all, runs the store without a warning, its subscription
// staying up past its idle pings, and the admin API's listing works.
// Until the build after d4fe47c the subscription's ping of an idle
// connection (PING, which the list did not name) was refused: the
// subscription was dropped and taken again each idle period, with a
// warning each time that asked for the channel the user had, and the
// admin API's stats failed for want of SCAN.
func TestREADMECommandList(t *testing.T) {
	prefix := redistest.Prefix(t)
	user, password := aclUser(t, "resetchannels", "-@all", "~"+prefix+"*", "&"+prefix+"changed",
		"+eval", "+evalsha", "+time", "+hset", "+hget", "+hmget", "+hgetall", "+hdel", "+del", "+pexpire", "+pttl", "+publish",
		"+subscribe", "+scan")
	core, logs := observer.New(zap.InfoLevel)
	cfg := Config{Addrs: []string{redistest.Addr(t)}, KeyPrefix: prefix, Username: user, Password: password,
		NotifyFallback: 100 * time.Millisecond} // the subscription's idle period: pings come soon
	s, err := Open(cfg, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.Warm()
	ctx := context.Background()
	r := storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve: %+v, %v", res, err)
	}
	// Ten idle periods: each pings the subscription.
	time.Sleep(time.Second)
	if n := logs.FilterLevelExact(zap.WarnLevel).Len() + logs.FilterLevelExact(zap.ErrorLevel).Len(); n != 0 {
		t.Fatalf("%d warnings and errors: %v", n, logs.All())
	}
	if _, err := s.Count(ctx); err != nil {
		t.Fatalf("the admin API's count: %v", err)
	}
}

// TestUserWithoutDelete: an ACL user refused one command the store needs
// (here DEL, which only Release and Forget run) leaves the store holding
// back every operation, sending nothing, with an error that names the
// command and the grant, until it is granted. Before, Reserve and Finalize
// worked and every Release failed: a key whose request the catalog never
// saw (its 503) lapsed into "outcome unknown" and its retries got 500 for
// the record's life, where without the module they would have executed.
func TestUserWithoutDelete(t *testing.T) {
	user, password := aclUser(t, "~iceberg_idempotency_test_*", "&iceberg_idempotency_test_*", "+@all", "-@dangerous", "-del")
	s, logs := openAs(t, user, password)
	s.Warm()
	redistest.AwaitRefusal(t, s)
	ctx := context.Background()
	key := storetest.NewKey(t)
	_, err := s.Reserve(ctx, storetest.Reservation(key, time.Minute, time.Hour))
	var denied *sqlstore.AccessError
	if !errors.As(err, &denied) || !stores.NotSent(err) || !strings.Contains(err.Error(), "DEL") {
		t.Fatalf("Reserve by a user without DEL = %v; want a not-sent AccessError naming DEL", err)
	}
	if n := redistest.Admin(t).Exists(ctx, s.key(key)).Val(); n != 0 {
		t.Fatal("the refused Reserve wrote the key's record")
	}
	if n := logs.FilterMessageSnippet("refused the store's user a command").Len(); n != 1 {
		t.Fatalf("%d errors logged of the refused command, want 1: %v", n, logs.All())
	}
	if err := redistest.Admin(t).Do(ctx, "ACL", "SETUSER", user, "+del").Err(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		r := storetest.Reservation(key, time.Minute, time.Hour)
		res, err := s.Reserve(ctx, r)
		if err == nil {
			if !res.Reserved {
				t.Fatalf("Reserve once DEL is granted = %+v, want it reserved", res)
			}
			if err := s.Release(ctx, key, r.Owner); err != nil {
				t.Fatalf("Release once DEL is granted: %v", err)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("Reserve still refused 5 s after DEL was granted: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestUserWithoutEvalsha: a user refused EVALSHA, which runs every script,
// has every operation refused before it is sent. Before, each Reserve's
// NOPERM counted as a lost reply, and each keyed request started a
// background release that retried twice a second for 2 minutes (240
// refused calls in 10 s for 10 requests, in an audit), which Caddy's exit
// then waited out.
func TestUserWithoutEvalsha(t *testing.T) {
	user, password := aclUser(t, "~iceberg_idempotency_test_*", "&iceberg_idempotency_test_*", "+@all", "-@dangerous", "-evalsha")
	s, _ := openAs(t, user, password)
	s.Warm()
	redistest.AwaitRefusal(t, s)
	_, err := s.Reserve(context.Background(), storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour))
	var denied *sqlstore.AccessError
	if !errors.As(err, &denied) || !stores.NotSent(err) || !strings.Contains(err.Error(), "evalsha") {
		t.Fatalf("Reserve by a user without EVALSHA = %v; want a not-sent AccessError naming evalsha", err)
	}
}

// TestGrantRevokedWhileRunning: a refusal by the ACL of an operation of a
// store whose check passed (DEL revoked while Caddy runs) asks for a check
// again, and the operations after it are held back until the grant is
// back. Before, only the first check counted: every release failed from
// then on, and its key lapsed into "unknown" (an audit: 0 executions,
// then 500 for the key's life).
func TestGrantRevokedWhileRunning(t *testing.T) {
	user, password := aclUser(t, "~iceberg_idempotency_test_*", "&iceberg_idempotency_test_*", "+@all", "-@dangerous")
	s, _ := openAs(t, user, password)
	ctx := context.Background()
	held := storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)
	if _, err := s.Reserve(ctx, held); err != nil {
		t.Fatal(err)
	}
	admin := redistest.Admin(t)
	if err := admin.Do(ctx, "ACL", "SETUSER", user, "-del").Err(); err != nil {
		t.Fatal(err)
	}
	// The refusal of the operation itself, before any check has seen it,
	// is an AccessError too, or fail_open would pass its request (until
	// the build after d4fe47c: one request per revocation at least, and
	// every one before the check's verdict).
	err := s.Release(ctx, held.Key, held.Owner)
	var denied *sqlstore.AccessError
	if !errors.As(err, &denied) || !strings.Contains(err.Error(), "grant it ") {
		t.Fatalf("Release without DEL = %v; want an AccessError saying what to grant", err)
	}
	redistest.AwaitRefusal(t, s)
	fresh := storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)
	_, err = s.Reserve(ctx, fresh)
	if !errors.As(err, &denied) || !stores.NotSent(err) {
		t.Fatalf("Reserve after DEL was revoked = %v; want a not-sent AccessError", err)
	}
	if err := admin.Do(ctx, "ACL", "SETUSER", user, "+del").Err(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if err = s.Release(ctx, held.Key, held.Owner); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Release still failing 5 s after DEL was granted back: %v", err)
		}
	}
}
