package postgres

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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
	cc, err := pgx.ParseConfig(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	proxy := sqltest.NewProxy(t, net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port))))
	host, port, _ := net.SplitHostPort(proxy.Addr())
	const pw = "S3cr?t-startup" // trust authentication ignores it
	dsn := fmt.Sprintf("postgres://%s:%s@%s:%s/%s?sslmode=disable", cc.User, pw, host, port, cc.Database)
	table := sqltest.TableName(t)
	dropOnCleanup(t, table)
	const timeout = time.Second
	proxy.Stop()

	core, logs := observer.New(zap.DebugLevel)
	s, err := Open(context.Background(), Config{
		DSN: dsn, Table: table, AutoMigrate: true, ListenNotify: true, StatementTimeout: timeout,
		RetryMin: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond,
	}, zap.New(core))
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
		// Concurrent callers share one attempt; all fail within the bound.
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
			if strings.Contains(err.Error(), pw) {
				t.Fatalf("password in %v", err)
			}
		}
		if _, err := s.TakeOver(ctx, storetest.NewKey(t), "a", "b", time.Second, time.Minute); err == nil || !stores.NotSent(err) {
			t.Fatalf("%s: TakeOver while the first contact fails: err = %v; want a not-sent error", mode, err)
		}
		t.Logf("%s: %v", mode, reserve())
	}
	proxy.Stop()

	s.Warm()
	waitLogged(t, logs, "database unreachable, will retry")
	for _, e := range logs.All() {
		if line := fmt.Sprint(e.Message, e.ContextMap()); strings.Contains(line, pw) {
			t.Fatalf("password in log: %s", line)
		}
	}
	warned := logs.FilterMessage("database unreachable, will retry").All()[0]
	if got := warned.ContextMap()["dsn"]; got != sqlstore.RedactDSN(dsn) || !strings.Contains(fmt.Sprint(got), host+":"+port) {
		t.Errorf("logged dsn %v, want %s", got, sqlstore.RedactDSN(dsn))
	}
	if warned.Level != zap.WarnLevel {
		t.Errorf("logged at %v, want warn", warned.Level)
	}

	proxy.Start()
	waitLogged(t, logs, "database reachable, store ready")
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve after recovery = %+v, %v", res, err)
	}
	if err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200}); err != nil {
		t.Fatalf("Finalize after recovery: %v", err)
	}
	if s.listener.Load() == nil {
		t.Fatal("LISTEN not started at the first contact")
	}
}

// A DSN's session settings do not break the reading of the server's clock
// at the first contact: it went as a text timestamp over the simple
// protocol, which DateStyle SQL, DMY wrote in a form pgx cannot read ("can't
// scan into dest[0] (col: now): invalid PostgreSQL date/time value"), and
// which pgx refuses under a client_encoding other than UTF8 or
// standard_conforming_strings off. Until the build after e190896 each
// failed every keyed request's store call with that error; now the store
// works under each.
func TestDSNSessionSettingsDoNotBreakTheClockReading(t *testing.T) {
	for _, setting := range []string{"DateStyle=SQL, DMY", "client_encoding=LATIN1", "standard_conforming_strings=off"} {
		t.Run(setting, func(t *testing.T) {
			name, value, _ := strings.Cut(setting, "=")
			dsn := testDSN(t)
			if strings.Contains(dsn, "://") {
				sep := "?"
				if strings.Contains(dsn, "?") {
					sep = "&"
				}
				dsn += sep + name + "=" + strings.ReplaceAll(value, " ", "%20")
			} else {
				dsn += " " + name + "='" + value + "'"
			}
			s, _ := openStore(t, func(c *Config) { c.DSN = dsn })
			ctx := context.Background()
			r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
			if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
				t.Fatalf("Reserve: %+v, %v", res, err)
			}
			if err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: []byte(`{"name":"é"}`)}); err != nil {
				t.Fatalf("Finalize: %v", err)
			}
			if rec, err := s.Load(ctx, r.Key); err != nil || rec == nil || rec.State != stores.StateFinal || string(rec.Response.Body) != `{"name":"é"}` {
				t.Fatalf("Load: %+v, %v", rec, err)
			}
		})
	}
}
