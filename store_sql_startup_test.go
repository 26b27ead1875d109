package icebergidempotency

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	mysqldriver "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// sqlBackend is one SQL store's test server, reached directly or through a
// sqltest.Proxy.
type sqlBackend struct {
	name string
	// dsn returns the test DSN, skipping (failing under CI) when the
	// server is unreachable.
	dsn func(t *testing.T) string
	// viaProxy rewrites dsn to go through a proxy at addr, and returns the
	// server's host:port to proxy to.
	viaProxy func(t *testing.T, dsn, addr string) (proxied, target string)
	// tableExists tells whether table is in the test database.
	tableExists func(t *testing.T, dsn, table string) bool
	// drop drops table and its version table.
	drop func(t *testing.T, dsn, table string)
	// behindAndHeld creates table one schema version behind this build's
	// and holds a transaction that read it (a dump, a session left open)
	// until t ends: a migration cannot get its lock.
	behindAndHeld func(t *testing.T, dsn, table string)
	// rowsUser creates a user granted the README's privileges on table
	// (rows, not the schema) until t ends, and returns a DSN for it and
	// a function that revokes its SELECT and INSERT.
	rowsUser func(t *testing.T, dsn, table string) (userDSN string, revoke func())
}

var sqlBackends = []sqlBackend{
	{
		name: "postgres",
		dsn: func(t *testing.T) string {
			dsn := sqltest.DSN("ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN", "postgres://postgres@127.0.0.1:5432/iceberg_idempotency_test?sslmode=disable")
			if err := sqltest.EnsurePostgres(context.Background(), dsn); err != nil {
				sqltest.Unavailable(t, "PostgreSQL", "ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN",
					"pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start", err)
			}
			return dsn
		},
		viaProxy: func(t *testing.T, dsn, addr string) (string, string) {
			cc, err := pgx.ParseConfig(dsn)
			if err != nil {
				t.Fatal(err)
			}
			return fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", cc.User, addr, cc.Database),
				net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port)))
		},
		tableExists: func(t *testing.T, dsn, table string) bool {
			ctx := context.Background()
			conn, err := pgx.Connect(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			var exists bool
			if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL OR to_regclass($2) IS NOT NULL", table, table+"_schema").Scan(&exists); err != nil {
				t.Fatal(err)
			}
			return exists
		},
		drop: func(t *testing.T, dsn, table string) {
			ctx := context.Background()
			conn, err := pgx.Connect(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			if _, err := conn.Exec(ctx, "DROP TABLE IF EXISTS "+table+", "+table+"_schema"); err != nil {
				t.Error(err)
			}
		},
		behindAndHeld: func(t *testing.T, dsn, table string) {
			ctx := context.Background()
			conn, err := pgx.Connect(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = conn.Close(ctx) })
			for _, stmt := range statementsBehind(t, schema.Postgres, table) {
				if _, err := conn.Exec(ctx, stmt); err != nil {
					t.Fatal(err)
				}
			}
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = tx.Rollback(ctx) })
			if _, err := tx.Exec(ctx, "SELECT count(*) FROM "+table); err != nil {
				t.Fatal(err)
			}
		},
		rowsUser: func(t *testing.T, dsn, table string) (string, func()) {
			ctx := context.Background()
			conn, err := pgx.Connect(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = conn.Close(ctx) })
			role := "rows_" + table
			exec := func(stmt string) {
				if _, err := conn.Exec(ctx, stmt); err != nil {
					t.Fatal(err)
				}
			}
			exec("CREATE ROLE " + role + " LOGIN")
			t.Cleanup(func() {
				_, _ = conn.Exec(ctx, "DROP OWNED BY "+role)
				_, _ = conn.Exec(ctx, "DROP ROLE "+role)
			})
			exec(fmt.Sprintf("GRANT SELECT, INSERT, UPDATE, DELETE ON %s, %s_schema TO %s", table, table, role))
			cc := conn.Config()
			return fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", role, cc.Host, cc.Port, cc.Database),
				func() { exec(fmt.Sprintf("REVOKE SELECT, INSERT ON %s FROM %s", table, role)) }
		},
	},
	{
		name: "mysql",
		dsn: func(t *testing.T) string {
			dsn := sqltest.DSN("ICEBERG_IDEMPOTENCY_TEST_MYSQL_DSN", "root@tcp(127.0.0.1:3306)/iceberg_idempotency_test")
			if err := sqltest.EnsureMySQL(context.Background(), dsn); err != nil {
				sqltest.Unavailable(t, "MySQL/MariaDB", "ICEBERG_IDEMPOTENCY_TEST_MYSQL_DSN",
					"start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd", err)
			}
			return dsn
		},
		viaProxy: func(t *testing.T, dsn, addr string) (string, string) {
			mc, err := mysqldriver.ParseDSN(dsn)
			if err != nil {
				t.Fatal(err)
			}
			if mc.Net != "tcp" {
				t.Skipf("the test DSN uses %s, not tcp", mc.Net)
			}
			target := mc.Addr
			mc.Addr = addr
			return mc.FormatDSN(), target
		},
		tableExists: func(t *testing.T, dsn, table string) bool {
			db, err := sql.Open("mysql", dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			var n int
			if err := db.QueryRow("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name IN (?, ?)", table, table+"_schema").Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n > 0
		},
		drop: func(t *testing.T, dsn, table string) {
			db, err := sql.Open("mysql", dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			if _, err := db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_schema"); err != nil {
				t.Error(err)
			}
		},
		behindAndHeld: func(t *testing.T, dsn, table string) {
			db, err := sql.Open("mysql", dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			for _, stmt := range statementsBehind(t, schema.MySQL, table) {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatal(err)
				}
			}
			tx, err := db.Begin()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = tx.Rollback() })
			var n int
			if err := tx.QueryRow("SELECT COUNT(*) FROM " + table).Scan(&n); err != nil {
				t.Fatal(err)
			}
		},
		rowsUser: func(t *testing.T, dsn, table string) (string, func()) {
			db, err := sql.Open("mysql", dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			mc, err := mysqldriver.ParseDSN(dsn)
			if err != nil {
				t.Fatal(err)
			}
			user := "rows_" + table[len(table)-20:] // MariaDB's user names end at 80 characters, MySQL 5.7's at 32
			exec := func(stmt string) {
				if _, err := db.Exec(stmt); err != nil {
					t.Fatal(err)
				}
			}
			exec(fmt.Sprintf("CREATE USER '%s'@'%%' IDENTIFIED BY 'rows-only'", user))
			t.Cleanup(func() { _, _ = db.Exec(fmt.Sprintf("DROP USER '%s'@'%%'", user)) })
			for _, tb := range []string{table, table + "_schema"} {
				exec(fmt.Sprintf("GRANT SELECT, INSERT, UPDATE, DELETE ON %s.%s TO '%s'@'%%'", mc.DBName, tb, user))
			}
			mc.User, mc.Passwd = user, "rows-only"
			return mc.FormatDSN(), func() {
				exec(fmt.Sprintf("REVOKE SELECT, INSERT ON %s.%s FROM '%s'@'%%'", mc.DBName, table, user))
			}
		},
	},
}

// `caddy validate` provisions the config — the handler opens its store —
// but never starts it: nothing may be written to the database, the schema
// migration included. caddy.Validate is what the command runs.
func TestValidateDoesNotWriteToTheDatabase(t *testing.T) {
	for _, b := range sqlBackends {
		t.Run(b.name, func(t *testing.T) {
			dsn := b.dsn(t)
			table := sqltest.TableName(t)
			t.Cleanup(func() { b.drop(t, dsn, table) })
			store, _ := json.Marshal(map[string]any{"backend": b.name, "dsn": dsn, "table": table, "auto_migrate": true})
			cfg := fmt.Sprintf(`{"apps": {"http": {"servers": {"validate": {
				"listen": ["127.0.0.1:0"],
				"routes": [{"handle": [{"handler": "iceberg_idempotency", "store": %s}]}]
			}}}}}`, store)
			var c caddy.Config
			if err := json.Unmarshal([]byte(cfg), &c); err != nil {
				t.Fatal(err)
			}
			if err := caddy.Validate(&c); err != nil {
				t.Fatalf("validate: %v", err)
			}
			if b.tableExists(t, dsn, table) {
				t.Fatalf("caddy validate created table %s", table)
			}
		})
	}
}

// A config whose database is down loads (every other site keeps working),
// the store answers errors meanwhile, and once the database answers the
// app's warm-up makes the first contact — the schema is created — without
// a restart.
func TestSQLStoreStartsWithDatabaseDown(t *testing.T) {
	for _, b := range sqlBackends {
		t.Run(b.name, func(t *testing.T) {
			dsn := b.dsn(t)
			_, target := b.viaProxy(t, dsn, "")
			proxy := sqltest.NewProxy(t, target)
			proxied, _ := b.viaProxy(t, dsn, proxy.Addr())
			proxy.Stop() // the database is down from the start

			table := sqltest.TableName(t)
			t.Cleanup(func() { b.drop(t, dsn, table) })
			ctx := newCaddyContext(t)
			provider, ps, err := openSQLStore(t, ctx, b.name, SQLStoreConfig{DSN: proxied, Table: table, StatementTimeout: caddy.Duration(time.Second)})
			if err != nil {
				t.Fatalf("opening the store with the database down: %v", err)
			}
			app := &App{}
			if err := app.Provision(ctx); err != nil {
				t.Fatal(err)
			}
			app.track(provider.StoreKey(), ps)

			r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
			if _, err := ps.Reserve(context.Background(), r); err == nil {
				t.Fatal("Reserve succeeded with the database down")
			}
			if err := app.Start(); err != nil {
				t.Fatal(err)
			}
			defer app.Stop()
			proxy.Start()
			deadline := time.Now().Add(30 * time.Second)
			for !b.tableExists(t, dsn, table) {
				if time.Now().After(deadline) {
					t.Fatal("the warm-up did not create the schema after the database came back")
				}
				time.Sleep(20 * time.Millisecond)
			}
			r = storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
			if res, err := ps.Reserve(context.Background(), r); err != nil || !res.Reserved {
				t.Fatalf("Reserve after recovery = %+v, %v", res, err)
			}
		})
	}
}

// A store whose table is behind this build's schema and that may not
// migrate it (auto_migrate off, or a user without the privilege: a DBA
// applies the files during a rolling upgrade) is no outage: fail_open does
// not pass keyed requests through it, which it did for as long as the
// table stayed behind, unguarded beside the older nodes that guard them
// (a commit whose answer it lost was executed again by the retry another
// node took). They get 503, whose log names the files to apply.
func TestFailOpenDoesNotPassAStoreWhoseSchemaIsBehind(t *testing.T) {
	for _, b := range sqlBackends {
		t.Run(b.name, func(t *testing.T) {
			dsn := b.dsn(t)
			table := sqltest.TableName(t)
			t.Cleanup(func() { b.drop(t, dsn, table) })
			off := false
			_, ps, err := openSQLStore(t, newCaddyContext(t), b.name,
				SQLStoreConfig{DSN: dsn, Table: table, AutoMigrate: &off, StatementTimeout: caddy.Duration(time.Second)})
			if err != nil {
				t.Fatal(err)
			}
			failOpenRefuses(t, ps, "with the table behind")
		})
	}
}

// An upgraded node whose migration cannot get its table's lock in time (a
// dump, a session left open on the table) leaves the table behind, as one
// that may not migrate does: fail_open does not pass keyed requests
// through it either. Before, the lock's timeout was a plain store error,
// and fail_open passed every keyed request unguarded while the older
// nodes, guarding with the same table, held the answers: an answered
// key's retries executed it again (3 executions of one key, on PostgreSQL
// and on MariaDB, in an audit of a rolling upgrade). They get 503.
func TestFailOpenDoesNotPassAStoreWhoseMigrationWaits(t *testing.T) {
	for _, b := range sqlBackends {
		t.Run(b.name, func(t *testing.T) {
			dsn := b.dsn(t)
			table := sqltest.TableName(t)
			t.Cleanup(func() { b.drop(t, dsn, table) })
			b.behindAndHeld(t, dsn, table)
			_, ps, err := openSQLStore(t, newCaddyContext(t), b.name,
				SQLStoreConfig{DSN: dsn, Table: table, StatementTimeout: caddy.Duration(5 * time.Second)})
			if err != nil {
				t.Fatal(err)
			}
			failOpenRefuses(t, ps, "while the migration waits for its lock")
		})
	}
}

// A grant revoked from the store's user while Caddy runs (a DBA tidying
// privileges) is no outage either: the records answer the retries of
// commits that landed. Until the build after d4fe47c only the refusal at
// first contact was an AccessError; an operation's own refusal was a plain
// store error, and fail_open executed an answered key's retries again for
// as long as the grant was missing (an audit: 3 executions of one key on
// PostgreSQL). They get 503.
func TestFailOpenDoesNotPassAStoreWhoseGrantIsRevoked(t *testing.T) {
	for _, b := range sqlBackends {
		t.Run(b.name, func(t *testing.T) {
			dsn := b.dsn(t)
			table := sqltest.TableName(t)
			t.Cleanup(func() { b.drop(t, dsn, table) })
			cfg := SQLStoreConfig{DSN: dsn, Table: table, StatementTimeout: caddy.Duration(5 * time.Second)}
			_, owner, err := openSQLStore(t, newCaddyContext(t), b.name, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := owner.Load(context.Background(), storetest.NewKey(t)); err != nil {
				t.Fatalf("creating the table: %v", err)
			}
			userDSN, revoke := b.rowsUser(t, dsn, table)
			cfg.DSN = userDSN
			_, ps, err := openSQLStore(t, newCaddyContext(t), b.name, cfg)
			if err != nil {
				t.Fatal(err)
			}
			h := newTestHandler(t, ps)
			h.FailOpen = true
			up := answering(200, "{}")
			key := storetest.NewKey(t)
			if res := serve(t, h, up, http.MethodPost, "/v1/namespaces", key, nsBody); res.code() != http.StatusOK || up.calls.Load() != 1 {
				t.Fatalf("first request = %d %q, catalog called %d times", res.code(), res.body, up.calls.Load())
			}
			revoke()
			res := serve(t, h, up, http.MethodPost, "/v1/namespaces", key, nsBody)
			if res.code() != http.StatusServiceUnavailable || up.calls.Load() != 1 {
				t.Fatalf("retry of an answered key with SELECT and INSERT revoked = %d %q, catalog called %d times; want 503 and no second call",
					res.code(), res.body, up.calls.Load())
			}
		})
	}
}

// failOpenRefuses sends a keyed request through a fail_open handler on
// store, and fails the test unless it is answered 503 without a catalog
// call; when names the store's state in the message.
func failOpenRefuses(t *testing.T, store stores.Store, when string) {
	t.Helper()
	h := newTestHandler(t, store)
	h.FailOpen = true
	up := answering(200, "{}")
	res := serve(t, h, up, http.MethodPost, "/v1/namespaces", storetest.NewKey(t), nsBody)
	if res.code() != http.StatusServiceUnavailable || up.calls.Load() != 0 {
		t.Fatalf("keyed request %s = %d %q, catalog called %d times; want 503 and no call",
			when, res.code(), res.body, up.calls.Load())
	}
}

// statementsBehind are the statements that create a table one schema
// version behind this build's, in dialect.
func statementsBehind(t *testing.T, dialect, table string) []string {
	t.Helper()
	ms, err := schema.Migrations(dialect)
	if err != nil {
		t.Fatal(err)
	}
	var stmts []string
	for _, m := range ms[:len(ms)-1] {
		stmts = append(stmts, m.Statements(table)...)
	}
	return stmts
}

// openSQLStore provisions the store of backend (postgres or mysql) that
// cfg describes and takes it from the pool, as a handler does; the pool
// lets it go when t ends.
func openSQLStore(t *testing.T, ctx caddy.Context, backend string, cfg SQLStoreConfig) (StoreProvider, *pooledStore, error) {
	t.Helper()
	var provider StoreProvider
	switch backend {
	case "postgres":
		provider = &PostgresStore{SQLStoreConfig: cfg}
	default:
		provider = &MySQLStore{SQLStoreConfig: cfg}
	}
	if err := provider.(caddy.Provisioner).Provision(ctx); err != nil {
		t.Fatal(err)
	}
	ps, err := acquireStore(ctx, provider)
	if err != nil {
		return nil, nil, err
	}
	t.Cleanup(func() { _ = (&Handler{storeKey: provider.StoreKey()}).Cleanup() })
	return provider, ps, nil
}
