package mysql

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestMigrateConcurrentAndIdempotent(t *testing.T) {
	dsn := testDSN(t)
	table := sqltest.TableName(t)
	dropOnCleanup(t, table)
	const nodes = 8
	var wg sync.WaitGroup
	errs := make(chan error, nodes)
	start := make(chan struct{})
	for range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			s, err := Open(context.Background(), Config{DSN: dsn, Table: table, AutoMigrate: true}, zaptest.NewLogger(t))
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			if err := s.Ready(context.Background()); err != nil {
				errs <- err
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("concurrent Open: %v", err)
	}
	db := admin(t)
	var versions, maxVersion int
	if err := db.QueryRow("SELECT COUNT(*), MAX(version) FROM "+table+"_schema").Scan(&versions, &maxVersion); err != nil {
		t.Fatal(err)
	}
	if versions != 2 || maxVersion != 2 {
		t.Fatalf("schema table has %d rows, max version %d; want two rows, version 2", versions, maxVersion)
	}
	for _, auto := range []bool{true, false} {
		s, err := Open(context.Background(), Config{DSN: dsn, Table: table, AutoMigrate: auto}, zaptest.NewLogger(t))
		if err != nil {
			t.Fatalf("reopen (auto_migrate=%v): %v", auto, err)
		}
		if err := s.Ready(context.Background()); err != nil {
			t.Fatalf("reopen (auto_migrate=%v): %v", auto, err)
		}
		s.Close()
	}
}

// Without auto_migrate a missing schema does not stop Open (Caddy starts);
// the first contact checks it, and operations fail naming the file to
// apply, until it is applied: then they work, without reopening.
func TestMissingSchemaWithoutAutoMigrate(t *testing.T) {
	table := sqltest.TableName(t)
	dropOnCleanup(t, table)
	core, logs := observer.New(zap.InfoLevel)
	s, err := Open(context.Background(), Config{DSN: testDSN(t), Table: table,
		RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond, RetryCooldown: time.Nanosecond}, zap.New(core))
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer s.Close()
	_, err = s.Reserve(context.Background(), storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
	if err == nil {
		t.Fatal("Reserve without schema and without auto_migrate succeeded")
	}
	for _, want := range []string{table, "version 0", "sql/mysql/0001_records.sql, then sql/mysql/0002_key_id.sql", "auto_migrate"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if !errors.Is(err, sqlstore.ErrNotReady) || sqlstore.IsTransient(err) {
		t.Errorf("error %q: want ErrNotReady, not transient", err)
	}
	// The database answers, but the store never sent the Reserve: marked
	// so (the connect errors of a database that is down are marked by the
	// driver's classification; this is the store's own readiness).
	if !stores.NotSent(err) {
		t.Errorf("error %q: not marked not sent", err)
	}
	t.Log(err)
	s.Warm()
	waitLogged(t, logs, "database schema check failed, will retry")
	db := admin(t)
	var n int
	if err := db.QueryRow("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?", table).Scan(&n); err != nil || n != 0 {
		t.Fatalf("table created without auto_migrate (%v)", err)
	}

	// The DBA applies the files: the store becomes ready by itself.
	ms, err := schema.Migrations(schema.MySQL)
	if err != nil {
		t.Fatal(err)
	}
	applyMigrations(t, db, table, ms)
	waitLogged(t, logs, "database reachable, store ready")
	if _, err := s.Reserve(context.Background(), storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)); err != nil {
		t.Fatalf("Reserve after the schema was applied: %v", err)
	}
}

// waitLogged waits until msg has been logged.
func waitLogged(t *testing.T, logs *observer.ObservedLogs, msg string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for logs.FilterMessage(msg).Len() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%q not logged; logged: %v", msg, logs.All())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestInvalidTableName(t *testing.T) {
	_, err := Open(context.Background(), Config{DSN: "root@tcp(127.0.0.1:1)/db", Table: "t; DROP TABLE users"}, nil)
	if err == nil || !strings.Contains(err.Error(), "invalid table name") {
		t.Fatalf("Open = %v, want invalid table name", err)
	}
}
