package mysql

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestStartWithDatabaseDown opens a Store while its database is
// unreachable (refusing, then swallowing connections): Open succeeds
// without touching it, operations fail fast with a transient ErrNotReady,
// Warm logs that it will retry (password redacted), and once the database
// answers the store migrates and works without being reopened.
func TestStartWithDatabaseDown(t *testing.T) {
	mc, err := mysql.ParseDSN(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	if mc.Net != "tcp" {
		t.Skipf("the test DSN uses %s, not tcp", mc.Net)
	}
	if mc.Passwd != "" {
		t.Skip("the test DSN has a password; this test puts its own in")
	}
	proxy := sqltest.NewProxy(t, mc.Addr)
	mc.Addr = proxy.Addr()
	dsn := mc.FormatDSN()
	// A password containing '?' and '@': the server refuses it until
	// the test puts the real (empty) one back, so check redaction only.
	const pw = "S3cr?t@startup"
	badDSN := strings.Replace(dsn, mc.User+"@", mc.User+":"+pw+"@", 1)
	table := sqltest.TableName(t)
	dropOnCleanup(t, table)
	const timeout = time.Second
	proxy.Stop()

	core, logs := observer.New(zap.DebugLevel)
	cfg := Config{
		DSN: dsn, Table: table, AutoMigrate: true, StatementTimeout: timeout,
		RetryMin: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond,
	}
	s, err := Open(context.Background(), cfg, zap.New(core))
	if err != nil {
		t.Fatalf("Open with the database down: %v", err)
	}
	defer s.Close()

	ctx := context.Background()
	reserve := func() error {
		_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
		return err
	}
	for _, mode := range []string{"refused", "blackhole"} {
		if mode == "blackhole" {
			proxy.Blackhole()
		}
		var wg sync.WaitGroup
		errs := make(chan error, 10)
		start := time.Now()
		for range 10 {
			wg.Add(1)
			go func() { defer wg.Done(); errs <- reserve() }()
		}
		wg.Wait()
		close(errs)
		if el := time.Since(start); el > timeout+time.Second {
			t.Errorf("%s: operations took %v with the database down (timeout %v)", mode, el, timeout)
		}
		for err := range errs {
			if err == nil || !errors.Is(err, sqlstore.ErrNotReady) || !sqlstore.IsTransient(err) {
				t.Fatalf("%s: Reserve = %v, want a transient ErrNotReady", mode, err)
			}
			// Marked not sent, so that the handler does not undo it.
			if !stores.NotSent(err) {
				t.Fatalf("%s: Reserve while the first contact fails: err = %v, NotSent = false; want a not-sent error", mode, err)
			}
		}
		if _, err := s.TakeOver(ctx, storetest.NewKey(t), "a", "b", time.Second, time.Minute); err == nil || !stores.NotSent(err) {
			t.Fatalf("%s: TakeOver while the first contact fails: err = %v; want a not-sent error", mode, err)
		}
		t.Logf("%s: %v", mode, reserve())
	}
	proxy.Stop()

	// The warning names the server, never the password.
	badCore, badLogs := observer.New(zap.DebugLevel)
	bad, err := Open(context.Background(), Config{DSN: badDSN, Table: table, StatementTimeout: timeout,
		RetryMin: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond}, zap.New(badCore))
	if err != nil {
		t.Fatal(err)
	}
	bad.Warm()
	waitLogged(t, badLogs, "database unreachable, will retry")
	bad.Close()
	for _, e := range badLogs.All() {
		if line := fmt.Sprint(e.Message, e.ContextMap()); strings.Contains(line, pw) || strings.Contains(line, "S3cr") {
			t.Fatalf("password in log: %s", line)
		}
	}
	warned := badLogs.FilterMessage("database unreachable, will retry").All()[0]
	if got := fmt.Sprint(warned.ContextMap()["dsn"]); got != sqlstore.RedactDSN(badDSN) || !strings.Contains(got, proxy.Addr()) {
		t.Errorf("logged dsn %v, want %s", got, sqlstore.RedactDSN(badDSN))
	}
	if warned.Level != zap.WarnLevel {
		t.Errorf("logged at %v, want warn", warned.Level)
	}

	s.Warm()
	waitLogged(t, logs, "database unreachable, will retry")
	proxy.Start()
	waitLogged(t, logs, "database reachable, store ready")
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve after recovery = %+v, %v", res, err)
	}
	if err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200}); err != nil {
		t.Fatalf("Finalize after recovery: %v", err)
	}
}

// The purge loop and the admin API may be the first to call a store that
// has not made its first contact: the statement they run is prepared by
// that contact, inside the call. Before, they passed the still-nil
// statement in and the call panicked.
func TestFirstCallPreparesItsStatement(t *testing.T) {
	for _, call := range []struct {
		name string
		run  func(s *Store) error
	}{
		{"purge", func(s *Store) error { _, err := s.PurgeExpired(context.Background(), 10); return err }},
		{"forget", func(s *Store) error { _, err := s.Forget(context.Background(), storetest.NewKey(t), true); return err }},
	} {
		t.Run(call.name, func(t *testing.T) {
			cfg := Config{DSN: testDSN(t), Table: sqltest.TableName(t), AutoMigrate: true}
			dropOnCleanup(t, cfg.Table)
			s, err := Open(context.Background(), cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			if err := call.run(s); err != nil {
				t.Fatalf("%s as the first call: %v", call.name, err)
			}
		})
	}
}

// A server whose greeting is cut short fails the store's first contact
// with an error. go-sql-driver before v1.10.2 indexed past the end of such
// a packet (GHSA-9qjq-77h9-895w); the panic came in the goroutine of the
// first contact, where nothing recovers it, and took the whole Caddy
// process down with it. No real server sends such a greeting, so the
// server here is a listener that writes one and hangs up.
func TestTruncatedGreetingIsAnError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			// A packet of 4 bytes, sequence 0: protocol version 10 and a
			// server version with no NUL to end it, nothing after.
			_, _ = c.Write([]byte{4, 0, 0, 0, 10, '1', '1', '.'})
			c.Close()
		}
	}()
	cfg := Config{
		DSN:   "root@tcp(" + ln.Addr().String() + ")/test",
		Table: sqltest.TableName(t), AutoMigrate: true, StatementTimeout: time.Second,
	}
	s, err := Open(context.Background(), cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = s.Ready(ctx)
	if !errors.Is(err, mysql.ErrMalformPkt) || !errors.Is(err, sqlstore.ErrNotReady) {
		t.Fatalf("Ready against a truncated greeting: %v; want ErrNotReady from a malformed packet", err)
	}
}

// A DSN's session variables cannot take from the store what its statements
// need: the driver sends them as SET on each connection, and the store
// sets its own in their place. Under autocommit=0, every statement run
// alone stayed uncommitted on its connection and was rolled back when that
// connection closed: a record finalized so was gone, and the key's retry,
// on another node, reserved it again and executed a second time (a
// combined batch, between START TRANSACTION and COMMIT, was not hit). Under
// sql_select_limit=0, the first contact failed with "mysql connect: sql: no
// rows in result set". Both until the build after 78f683d.
func TestDSNSessionVariablesKeepTheStoreWhole(t *testing.T) {
	for _, params := range []map[string]string{
		{"autocommit": "0"},
		{"AutoCommit": "OFF"},
		{"sql_select_limit": "0"},
		{"SQL_SELECT_LIMIT": "0", "autocommit": "0"},
	} {
		t.Run(fmt.Sprint(params), func(t *testing.T) {
			other, cfg := openStore(t, nil)
			mc, err := mysql.ParseDSN(testDSN(t))
			if err != nil {
				t.Fatal(err)
			}
			mc.Params = params
			ctx := context.Background()
			s, err := Open(ctx, Config{DSN: mc.FormatDSN(), Table: cfg.Table, AutoMigrate: true}, zap.NewNop())
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Ready(ctx); err != nil {
				s.Close()
				t.Fatalf("first contact: %v", err)
			}
			r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
			if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
				s.Close()
				t.Fatalf("Reserve: %+v, %v", res, err)
			}
			if err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: []byte(`{}`)}); err != nil {
				s.Close()
				t.Fatalf("Finalize: %v", err)
			}
			s.Close() // its connections close: anything left uncommitted is rolled back
			retry := r
			retry.Owner = "the retry's"
			res, err := other.Reserve(ctx, retry)
			if err != nil || res.Reserved || res.Existing == nil || res.Existing.State != stores.StateFinal {
				t.Fatalf("a retry on another node after the first one's connections closed: %+v, %v; want the final record", res, err)
			}
		})
	}
}
