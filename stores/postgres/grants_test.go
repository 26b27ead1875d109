package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// rowsOnlyRole creates a login role with the README's grant on table and
// its version table (SELECT, INSERT, UPDATE, DELETE: rows, not the schema),
// as a DBA who owns the schema gives the store, and returns a DSN for it.
// The role is dropped when the test ends.
func rowsOnlyRole(t *testing.T, table string) string {
	t.Helper()
	return roleWith(t, table, "SELECT, INSERT, UPDATE, DELETE")
}

// roleWith creates a role granted privileges on table and its version
// table and returns a DSN for it.
func roleWith(t *testing.T, table, privileges string) string {
	t.Helper()
	ctx := context.Background()
	a := admin(t)
	role := "idem_rows_" + sqltest.TableName(t)[len("idem_test_"):]
	for _, stmt := range []string{
		"CREATE ROLE " + role + " LOGIN",
		fmt.Sprintf("GRANT %s ON %s, %s_schema TO %s", privileges, table, table, role),
	} {
		if _, err := a.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		a.Exec(context.Background(), "DROP OWNED BY "+role)
		a.Exec(context.Background(), "DROP ROLE "+role)
	})
	cc, err := pgx.ParseConfig(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", role, cc.Host, cc.Port, cc.Database)
}

// TestRowsOnlyRole: a role that may read and write the store's rows but
// not change its schema runs the store, with auto_migrate on (it only
// reads the schema version when that is current) and listen_notify on.
func TestRowsOnlyRole(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		_, cfg := openStore(t, nil) // creates the table as its owner
		cfg.DSN, cfg.ListenNotify = rowsOnlyRole(t, cfg.Table), true
		return storetest.Harness{Store: openAs(t, cfg, zap.NewNop()), Advance: time.Sleep}
	})
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

// TestMigrationRefused: with auto_migrate on, a role that may not change
// the schema meets a migration of a newer build. Until the build after
// 384283e its error was the bare "must be owner of table", and the
// background retries logged it as "database unreachable". Now it is a
// schema verdict, logged as one, naming the files to apply and saying who
// may; once the table's owner applied them, the store becomes ready by
// itself.
func TestMigrationRefused(t *testing.T) {
	_, table, conn := tableAtVersion(t, 2)
	cfg := Config{DSN: rowsOnlyRole(t, table), Table: table, AutoMigrate: true,
		RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond, RetryCooldown: time.Nanosecond}
	core, logs := observer.New(zap.InfoLevel)
	s := openAs(t, cfg, zap.New(core))
	ctx := context.Background()
	err := s.Ready(ctx)
	var se *sqlstore.SchemaError
	if !errors.As(err, &se) {
		t.Fatalf("Ready = %v, want a schema verdict", err)
	}
	for _, want := range []string{"may not change the schema", "must be owner", "apply sql/postgres/0003_watched.sql", "psql --single-transaction"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	s.Warm()
	waitLogged(t, logs, "database schema check failed, will retry")
	if n := logs.FilterMessageSnippet("database unreachable").Len(); n != 0 {
		t.Errorf("the refused migration was logged %d times as an unreachable database", n)
	}
	ms, err := schema.Migrations(schema.Postgres)
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range ms[2].Statements(table) {
		if _, err := conn.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	waitLogged(t, logs, "database reachable, store ready")
	if _, err := s.Load(ctx, storetest.NewKey(t)); err != nil {
		t.Fatalf("Load after the owner applied the migration: %v", err)
	}
}

// TestRoleWithoutDelete: PostgreSQL checks a privilege only as a statement
// runs, and until the build after 068a81b a role without DELETE made a
// ready store whose every Release failed: a key the catalog provably did
// not execute was left to lapse into "unknown" (500 to its retries), and
// no purge ever deleted a row. Now the store is not ready, with the same
// verdict as MySQL's, until the role is granted DELETE.
func TestRoleWithoutDelete(t *testing.T) {
	_, cfg := openStore(t, nil) // creates the table as its owner
	cfg.DSN = roleWith(t, cfg.Table, "SELECT, INSERT, UPDATE")
	cfg.RetryMin, cfg.RetryMax, cfg.RetryCooldown = 10*time.Millisecond, 50*time.Millisecond, time.Nanosecond
	core, logs := observer.New(zap.InfoLevel)
	s := openAs(t, cfg, zap.New(core))
	ctx := context.Background()
	err := s.Ready(ctx)
	var ae *sqlstore.AccessError
	if !errors.As(err, &ae) {
		t.Fatalf("Ready = %v, want the refusal of a privilege", err)
	}
	for _, want := range []string{"lacks DELETE", "grant it SELECT, INSERT, UPDATE and DELETE on " + cfg.Table} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	s.Warm()
	waitLogged(t, logs, "database refused the store's user a statement, will retry")
	cc, err := pgx.ParseConfig(cfg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin(t).Exec(ctx, fmt.Sprintf("GRANT DELETE ON %s TO %s", cfg.Table, cc.User)); err != nil {
		t.Fatal(err)
	}
	waitLogged(t, logs, "database reachable, store ready")
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve after the grant: %+v, %v", res, err)
	}
	if err := s.Release(ctx, r.Key, r.Owner); err != nil {
		t.Fatalf("Release after the grant: %v", err)
	}
}

// TestRoleWithColumnGrants: a role granted SELECT, INSERT and UPDATE column
// by column, as a DBA may, and DELETE runs the store; the privilege check
// of the build after 068a81b, which asked for them on the whole table,
// refused it at first.
func TestRoleWithColumnGrants(t *testing.T) {
	_, cfg := openStore(t, nil) // creates the table as its owner
	ctx := context.Background()
	var cols string
	if err := admin(t).QueryRow(ctx, `SELECT string_agg(quote_ident(column_name), ', ') FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name = $1`, cfg.Table).Scan(&cols); err != nil {
		t.Fatal(err)
	}
	cfg.DSN = roleWith(t, cfg.Table, "SELECT, DELETE") // on both tables
	cc, err := pgx.ParseConfig(cfg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin(t).Exec(ctx, fmt.Sprintf("REVOKE SELECT ON %[1]s FROM %[2]s; GRANT SELECT (%[3]s), INSERT (%[3]s), UPDATE (%[3]s) ON %[1]s TO %[2]s",
		cfg.Table, cc.User, cols)); err != nil {
		t.Fatal(err)
	}
	s := openAs(t, cfg, zap.NewNop())
	if err := s.Ready(ctx); err != nil {
		t.Fatalf("Ready: %v", err)
	}
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve: %+v, %v", res, err)
	}
	if err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: []byte("{}")}); err != nil {
		t.Fatalf("Finalize: %v", err)
	}
	if rec, err := s.Load(ctx, r.Key); err != nil || rec == nil || rec.State != stores.StateFinal {
		t.Fatalf("Load: %+v, %v", rec, err)
	}

	// One column short of UPDATE: its statements would fail, and the
	// store is not ready.
	cfg.DSN = roleWith(t, cfg.Table, "SELECT, INSERT, DELETE")
	cc, err = pgx.ParseConfig(cfg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin(t).Exec(ctx, fmt.Sprintf("GRANT UPDATE (state) ON %s TO %s", cfg.Table, cc.User)); err != nil {
		t.Fatal(err)
	}
	err = openAs(t, cfg, zap.NewNop()).Ready(ctx)
	if ae := (*sqlstore.AccessError)(nil); !errors.As(err, &ae) || !strings.Contains(err.Error(), "lacks UPDATE") {
		t.Fatalf("Ready with UPDATE on one column = %v, want the refusal naming UPDATE", err)
	}
}

// TestGrantRevokedWhileRunning: a grant revoked from the store's role
// while the store runs makes its operations fail with an AccessError, as
// the refusal at first contact does, so that fail_open does not pass the
// request. Until the build after d4fe47c it was a plain store error, and
// fail_open executed every keyed request again, the retries of answered
// keys too, for as long as the grant was missing (an audit: 3 executions
// of one key).
func TestGrantRevokedWhileRunning(t *testing.T) {
	_, cfg := openStore(t, nil) // creates the table as its owner
	cfg.DSN = rowsOnlyRole(t, cfg.Table)
	s := openAs(t, cfg, zap.NewNop())
	ctx := context.Background()
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve before the revocation: %+v, %v", res, err)
	}
	cc, err := pgx.ParseConfig(cfg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin(t).Exec(ctx, fmt.Sprintf("REVOKE SELECT ON %s FROM %s", cfg.Table, cc.User)); err != nil {
		t.Fatal(err)
	}
	_, err = s.Reserve(ctx, r)
	var ae *sqlstore.AccessError
	if !errors.As(err, &ae) || !strings.Contains(err.Error(), "grant the store's database user SELECT, INSERT, UPDATE and DELETE on "+cfg.Table) {
		t.Fatalf("Reserve after SELECT was revoked = %v; want an AccessError saying what to grant", err)
	}
	if !strings.Contains(err.Error(), "postgres reserve") || !strings.Contains(err.Error(), "42501") {
		t.Errorf("error %q does not name the operation and the server's refusal", err)
	}
}
