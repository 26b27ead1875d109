package postgres

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap/zaptest"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

const (
	dsnEnv     = "ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN"
	defaultDSN = "postgres://postgres@127.0.0.1:5432/iceberg_idempotency_test?sslmode=disable"
	startHint  = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
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
	setupOnce.Do(func() { setupErr = sqltest.EnsurePostgres(context.Background(), dsn) })
	if setupErr != nil {
		sqltest.Unavailable(t, "PostgreSQL", dsnEnv, startHint, setupErr)
	}
	return dsn
}

// admin runs a test's own SQL (setup, inspection, cleanup).
func admin(t testing.TB) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// dropOnCleanup drops table and its version table when the test ends.
func dropOnCleanup(t testing.TB, table string) {
	t.Helper()
	conn := admin(t)
	t.Cleanup(func() {
		if _, err := conn.Exec(context.Background(), "DROP TABLE IF EXISTS "+table+", "+table+"_schema"); err != nil {
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

// holdKey writes an in-flight row of a new key in a transaction it leaves
// open: a store's statements on that key wait for its row lock until the
// transaction ends (or the test does).
func holdKey(t testing.TB, table string) (pgx.Tx, string) {
	t.Helper()
	ctx := context.Background()
	tx, err := admin(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	key := storetest.NewKey(t)
	if _, err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (key, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at)
VALUES ($1, 'op', '/p', 'p', 'f', 'in_flight', 'o', now() + interval '1 hour', now(), now() + interval '1 hour')`, table), key); err != nil {
		t.Fatal(err)
	}
	return tx, key
}

// proxiedDSN starts a sqltest.Proxy to the test server and returns it with
// the test DSN pointed through it.
func proxiedDSN(t *testing.T) (*sqltest.Proxy, string) {
	t.Helper()
	cc, err := pgx.ParseConfig(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	proxy := sqltest.NewProxy(t, net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port))))
	host, port, _ := net.SplitHostPort(proxy.Addr())
	return proxy, fmt.Sprintf("postgres://%s@%s:%s/%s?sslmode=disable", cc.User, host, port, cc.Database)
}

// dropIdle closes s's idle connections: the next call must connect.
func dropIdle(s *Store) { s.pool.Reset() }
