package mysql

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// rowsOnlyUser creates a user with the README's grant on table and its
// version table (SELECT, INSERT, UPDATE, DELETE: rows, not the schema), as
// a DBA who owns the schema gives the store, and returns a DSN for it. The
// user is dropped when the test ends.
func rowsOnlyUser(t *testing.T, table string) string {
	t.Helper()
	return userWith(t, table, "SELECT, INSERT, UPDATE, DELETE")
}

// userWith creates a user granted privileges on table and its version
// table and returns a DSN for it.
func userWith(t *testing.T, table, privileges string) string {
	t.Helper()
	a := admin(t)
	mc, err := mysql.ParseDSN(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	user := "idem_rows_" + sqltest.TableName(t)[len("idem_test_"):]
	stmts := []string{fmt.Sprintf("CREATE USER '%s'@'%%' IDENTIFIED BY 'rows-only'", user)}
	for _, tb := range []string{table, table + "_schema"} {
		stmts = append(stmts, fmt.Sprintf("GRANT %s ON %s.%s TO '%s'@'%%'", privileges, mc.DBName, tb, user))
	}
	for _, stmt := range stmts {
		if _, err := a.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { a.Exec(fmt.Sprintf("DROP USER '%s'@'%%'", user)) })
	mc.User, mc.Passwd = user, "rows-only"
	return mc.FormatDSN()
}

// openAs opens a store on cfg and closes it when the test ends.
func openAs(t *testing.T, cfg Config, log *zap.Logger) *Store {
	t.Helper()
	s, err := Open(context.Background(), cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestRowsOnlyUser: a user who may read and write the store's rows but
// not change its schema runs the store with auto_migrate on, which only
// reads the schema version when that is current.
func TestRowsOnlyUser(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		_, cfg := openStore(t, nil) // creates the table as root
		cfg.DSN = rowsOnlyUser(t, cfg.Table)
		return storetest.Harness{Store: openAs(t, cfg, zap.NewNop()), Advance: time.Sleep}
	})
}

// TestMigrationRefused: with auto_migrate on, a user who may not change
// the schema meets a migration of a newer build. Until the build after
// 384283e its error was the bare "ALTER command denied", and the
// background retries logged it as "database unreachable". Now it is a
// schema verdict, logged as one, naming the files to apply and saying who
// may; once they are applied, the store becomes ready by itself.
func TestMigrationRefused(t *testing.T) {
	_, table, db := tableAtVersion(t, 1)
	cfg := Config{DSN: rowsOnlyUser(t, table), Table: table, AutoMigrate: true,
		RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond, RetryCooldown: time.Nanosecond}
	core, logs := observer.New(zap.InfoLevel)
	s := openAs(t, cfg, zap.New(core))
	ctx := context.Background()
	err := s.Ready(ctx)
	var se *sqlstore.SchemaError
	if !errors.As(err, &se) {
		t.Fatalf("Ready = %v, want a schema verdict", err)
	}
	for _, want := range []string{"may not change the schema", "denied", "apply sql/mysql/0002_key_id.sql", "mysql DATABASE < FILE"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	s.Warm()
	waitLogged(t, logs, "database schema check failed, will retry")
	if n := logs.FilterMessageSnippet("database unreachable").Len(); n != 0 {
		t.Errorf("the refused migration was logged %d times as an unreachable database", n)
	}
	ms, err := schema.Migrations(schema.MySQL)
	if err != nil {
		t.Fatal(err)
	}
	applyMigrations(t, db, table, ms[1:2])
	waitLogged(t, logs, "database reachable, store ready")
	if _, err := s.Load(ctx, storetest.NewKey(t)); err != nil {
		t.Fatalf("Load after the migration was applied: %v", err)
	}
}

// TestUserWithoutDelete: the server checks a statement's privileges as the
// store prepares it, so a user granted rows but not DELETE leaves the
// store unready. Until the build after 068a81b the refusal was logged as
// "database unreachable"; now it is an error that names the grant, and
// once the grant is given the store becomes ready by itself.
func TestUserWithoutDelete(t *testing.T) {
	_, cfg := openStore(t, nil) // creates the table as root
	cfg.DSN = userWith(t, cfg.Table, "SELECT, INSERT, UPDATE")
	cfg.RetryMin, cfg.RetryMax, cfg.RetryCooldown = 10*time.Millisecond, 50*time.Millisecond, time.Nanosecond
	core, logs := observer.New(zap.InfoLevel)
	s := openAs(t, cfg, zap.New(core))
	err := s.Ready(context.Background())
	var ae *sqlstore.AccessError
	if !errors.As(err, &ae) {
		t.Fatalf("Ready = %v, want the refusal of a privilege", err)
	}
	for _, want := range []string{"DELETE command denied", "grant it SELECT, INSERT, UPDATE and DELETE on " + cfg.Table} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	s.Warm()
	waitLogged(t, logs, "database refused the store's user a statement, will retry")
	if n := logs.FilterMessageSnippet("database unreachable").Len(); n != 0 {
		t.Errorf("the refused privilege was logged %d times as an unreachable database", n)
	}
	mc, err := mysql.ParseDSN(cfg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin(t).Exec(fmt.Sprintf("GRANT DELETE ON %s.%s TO '%s'@'%%'", mc.DBName, cfg.Table, mc.User)); err != nil {
		t.Fatal(err)
	}
	waitLogged(t, logs, "database reachable, store ready")
}

// TestGrantRevokedWhileRunning: a grant revoked from the store's user
// while the store runs (a table's grant takes effect at the user's next
// statement) makes its operations fail with an AccessError, as the refusal
// at first contact does, so that fail_open does not pass the request.
// Until the build after d4fe47c it was a plain store error, and fail_open
// executed every keyed request again, the retries of answered keys too,
// for as long as the grant was missing.
func TestGrantRevokedWhileRunning(t *testing.T) {
	_, cfg := openStore(t, nil) // creates the table as root
	cfg.DSN = rowsOnlyUser(t, cfg.Table)
	s := openAs(t, cfg, zap.NewNop())
	ctx := context.Background()
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve before the revocation: %+v, %v", res, err)
	}
	mc, err := mysql.ParseDSN(cfg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin(t).Exec(fmt.Sprintf("REVOKE SELECT, INSERT ON %s FROM '%s'@'%%'", cfg.Table, mc.User)); err != nil {
		t.Fatal(err)
	}
	_, err = s.Reserve(ctx, r)
	var ae *sqlstore.AccessError
	if !errors.As(err, &ae) || !strings.Contains(err.Error(), "grant the store's database user SELECT, INSERT, UPDATE and DELETE on "+cfg.Table) {
		t.Fatalf("Reserve after SELECT and INSERT were revoked = %v; want an AccessError saying what to grant", err)
	}
	if strings.Contains(err.Error(), "rows-only") {
		t.Errorf("error %q carries the user's password", err)
	}
}
