package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap/zaptest"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

const (
	dsnEnv     = "ICEBERG_IDEMPOTENCY_TEST_MYSQL_DSN"
	defaultDSN = "root@tcp(127.0.0.1:3306)/iceberg_idempotency_test"
	startHint  = "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd"
)

var (
	setupOnce sync.Once
	setupErr  error
)

// testDSN returns the test database's DSN, creating the database on first
// use; it skips (fails under CI=true) when the server is unreachable.
func testDSN(t testing.TB) string {
	t.Helper()
	dsn := sqltest.DSN(dsnEnv, defaultDSN)
	setupOnce.Do(func() { setupErr = sqltest.EnsureMySQL(context.Background(), dsn) })
	if setupErr != nil {
		sqltest.Unavailable(t, "MySQL/MariaDB", dsnEnv, startHint, setupErr)
	}
	return dsn
}

// admin runs a test's own SQL (setup, inspection, cleanup).
func admin(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// dropOnCleanup drops table and its version table when the test ends.
func dropOnCleanup(t testing.TB, table string) {
	t.Helper()
	db := admin(t)
	t.Cleanup(func() {
		if _, err := db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_schema"); err != nil {
			t.Errorf("drop %s: %v", table, err)
		}
	})
}

// openStore opens a Store on a fresh table that is dropped after the test.
func openStore(t testing.TB, mutate func(*Config)) (*Store, Config) {
	t.Helper()
	cfg := Config{DSN: testDSN(t), Table: sqltest.TableName(t), AutoMigrate: true, MaxConns: 16}
	if mutate != nil {
		mutate(&cfg)
	}
	dropOnCleanup(t, cfg.Table)
	s, err := Open(context.Background(), cfg, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	// Make the first contact now, so that tests of one operation neither
	// pay for nor count the migration.
	if err := s.Ready(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s, cfg
}

// applyMigrations applies ms by hand, as a DBA would with the mysql client:
// in one session, which 0002's session variable needs.
func applyMigrations(t testing.TB, db *sql.DB, table string, ms []schema.Migration) {
	t.Helper()
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, m := range ms {
		for _, stmt := range m.Statements(table) {
			if _, err := conn.ExecContext(ctx, stmt); err != nil {
				t.Fatalf("%s: %v", m.File, err)
			}
		}
	}
}

// holdKey begins a transaction that inserts an in-flight row for a fresh
// key and keeps the row locked until it ends (rolled back at the test's end
// if the test has not): a Reserve of that key waits for it.
func holdKey(t testing.TB, db *sql.DB, table string) (*sql.Tx, string) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	key := storetest.NewKey(t)
	if _, err := tx.ExecContext(ctx, fmt.Sprintf("INSERT INTO %s (`key`, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at)"+
		" VALUES (?, 'op', '/p', 'p', 'f', 'in_flight', 'o', UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)", table), key); err != nil {
		t.Fatal(err)
	}
	return tx, key
}

// proxiedDSN starts a sqltest.Proxy to the test server and returns it with
// the test DSN pointed through it; it skips t when the DSN is not TCP.
func proxiedDSN(t *testing.T) (*sqltest.Proxy, string) {
	t.Helper()
	mc, err := mysql.ParseDSN(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	if mc.Net != "tcp" {
		t.Skipf("the test DSN uses %s, not tcp", mc.Net)
	}
	proxy := sqltest.NewProxy(t, mc.Addr)
	mc.Addr = proxy.Addr()
	return proxy, mc.FormatDSN()
}

// dropIdle closes s's idle connections: the next call must connect.
func dropIdle(s *Store) {
	s.db.SetMaxIdleConns(0)
	s.db.SetMaxIdleConns(2)
}
