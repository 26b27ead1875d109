package postgres

import (
	"context"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap/zaptest"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
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
			s.Close()
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("concurrent Open: %v", err)
	}
	conn := admin(t)
	var versions, maxVersion int
	if err := conn.QueryRow(context.Background(), "SELECT count(*), max(version) FROM "+table+"_schema").Scan(&versions, &maxVersion); err != nil {
		t.Fatal(err)
	}
	if versions != 1 || maxVersion != 1 {
		t.Fatalf("schema table has %d rows, max version %d; want one row, version 1", versions, maxVersion)
	}
	// Again, with and without AutoMigrate: nothing to do, no error.
	for _, auto := range []bool{true, false} {
		s, err := Open(context.Background(), Config{DSN: dsn, Table: table, AutoMigrate: auto}, zaptest.NewLogger(t))
		if err != nil {
			t.Fatalf("reopen (auto_migrate=%v): %v", auto, err)
		}
		s.Close()
	}
}

func TestMissingSchemaWithoutAutoMigrate(t *testing.T) {
	table := sqltest.TableName(t)
	dropOnCleanup(t, table)
	_, err := Open(context.Background(), Config{DSN: testDSN(t), Table: table}, zaptest.NewLogger(t))
	if err == nil {
		t.Fatal("Open without schema and without auto_migrate succeeded")
	}
	for _, want := range []string{table, "version 0", "sql/postgres/0001_records.sql", "auto_migrate"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	t.Log(err)
	var exists bool
	if err := admin(t).QueryRow(context.Background(), "SELECT to_regclass($1) IS NOT NULL", table).Scan(&exists); err != nil || exists {
		t.Fatalf("table created without auto_migrate (%v)", err)
	}
}

func TestInvalidTableName(t *testing.T) {
	_, err := Open(context.Background(), Config{DSN: "postgres://x@127.0.0.1:1/db", Table: "t; DROP TABLE users"}, nil)
	if err == nil || !strings.Contains(err.Error(), "invalid table name") {
		t.Fatalf("Open = %v, want invalid table name", err)
	}
}
