package mysql

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
	db := admin(t)
	var versions, maxVersion int
	if err := db.QueryRow("SELECT COUNT(*), MAX(version) FROM "+table+"_schema").Scan(&versions, &maxVersion); err != nil {
		t.Fatal(err)
	}
	if versions != 1 || maxVersion != 1 {
		t.Fatalf("schema table has %d rows, max version %d; want one row, version 1", versions, maxVersion)
	}
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
	for _, want := range []string{table, "version 0", "sql/mysql/0001_records.sql", "auto_migrate"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	t.Log(err)
	var n int
	if err := admin(t).QueryRow("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?", table).Scan(&n); err != nil || n != 0 {
		t.Fatalf("table created without auto_migrate (%v)", err)
	}
}

func TestInvalidTableName(t *testing.T) {
	_, err := Open(context.Background(), Config{DSN: "root@tcp(127.0.0.1:1)/db", Table: "t; DROP TABLE users"}, nil)
	if err == nil || !strings.Contains(err.Error(), "invalid table name") {
		t.Fatalf("Open = %v, want invalid table name", err)
	}
}
