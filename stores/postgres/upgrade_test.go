package postgres

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap/zaptest"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// oldBody is a clear-text body with the bytes a careless codec would lose.
var oldBody = []byte("{\"metadata-location\":\"s3://b/m.json\"}\n\x00\xff")

// A table created by an older build (schema version 1) holding a final
// clear-text row: without auto_migrate the store names 0002 and 0003 and
// serves nothing; with it, the first contact migrates to version 3 and the old
// row replays as it was written, with no key id. Sealed rows written
// afterwards sit next to it.
func TestUpgradeFromVersion1(t *testing.T) {
	ctx := context.Background()
	dsn, table, conn := tableAtVersion(t, 1)
	// The row exactly as the version-1 Finalize left it.
	oldKey := storetest.NewKey(t)
	_, err := conn.Exec(ctx, `INSERT INTO `+table+` (key, operation, path, principal, fingerprint, state, owner, lease_until,
		created_at, expires_at, status, headers, body)
	VALUES ($1, 'createTable', '/v1/namespaces/ns/tables', 'p-old', 'fp-old', 'final', NULL, NULL,
		now(), now() + interval '1 hour', 200, $2, $3)`,
		oldKey, `{"Content-Type":["application/json"],"Etag":["\"v1\""]}`, oldBody)
	if err != nil {
		t.Fatal(err)
	}

	// Without auto_migrate: reported, naming 0002 and 0003 only.
	wantNotReady(t, Config{DSN: dsn, Table: table}, oldKey, 1,
		[]string{"version 1", "needs 3", "sql/postgres/0002_key_id.sql, then sql/postgres/0003_watched.sql", "auto_migrate"},
		"0001")
	if columnExists(t, table, "key_id") {
		t.Fatal("key_id added without auto_migrate")
	}

	// With auto_migrate: migrated at first contact.
	s, err := Open(ctx, Config{DSN: dsn, Table: table, AutoMigrate: true}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rec, err := s.Load(ctx, oldKey)
	if err != nil {
		t.Fatalf("Load after auto_migrate: %v", err)
	}
	var versions, maxVersion int
	if err := conn.QueryRow(ctx, "SELECT count(*), max(version) FROM "+table+"_schema").Scan(&versions, &maxVersion); err != nil {
		t.Fatal(err)
	}
	if versions != 3 || maxVersion != 3 || !columnExists(t, table, "key_id") || !columnExists(t, table, "watched") {
		t.Fatalf("after auto_migrate: %d versions, max %d, key_id present %v, watched present %v; want 3, 3, true, true",
			versions, maxVersion, columnExists(t, table, "key_id"), columnExists(t, table, "watched"))
	}
	want := stores.Response{Status: 200, Header: map[string][]string{"Content-Type": {"application/json"}, "Etag": {`"v1"`}}, Body: oldBody}
	if rec == nil || rec.State != stores.StateFinal || rec.Response == nil || !reflect.DeepEqual(*rec.Response, want) {
		t.Fatalf("old row = %+v, want final %#v", rec, want)
	}
	if rec.Principal != "p-old" || rec.Fingerprint != "fp-old" || rec.Operation != "createTable" {
		t.Fatalf("old row binding = %+v", rec.Binding)
	}
	res, err := s.Reserve(ctx, storetest.Reservation(oldKey, storetest.Long, storetest.Long))
	if err != nil || res.Reserved || res.Existing == nil || !reflect.DeepEqual(*res.Existing.Response, want) {
		t.Fatalf("Reserve of the old key = %+v, %v; want the old response", res, err)
	}

	// A sealed response next to it: key_id set, status and headers NULL.
	newKey := storetest.NewKey(t)
	r := storetest.Reservation(newKey, storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	sealed := stores.Response{KeyID: "5eed0001", Body: []byte("\x00opaque\x00")}
	if err := s.Finalize(ctx, newKey, r.Owner, sealed); err != nil {
		t.Fatal(err)
	}
	var oldID *string
	if err := conn.QueryRow(ctx, "SELECT key_id FROM "+table+" WHERE key = $1", oldKey).Scan(&oldID); err != nil || oldID != nil {
		t.Fatalf("old row key_id = %v (%v), want NULL", oldID, err)
	}
	var (
		keyID   string
		status  *int
		headers *string
		body    []byte
	)
	err = conn.QueryRow(ctx, "SELECT key_id, status, headers, body FROM "+table+" WHERE key = $1", newKey).Scan(&keyID, &status, &headers, &body)
	if err != nil || keyID != sealed.KeyID || status != nil || headers != nil || string(body) != string(sealed.Body) {
		t.Fatalf("sealed row = key_id %q, status %v, headers %v, body %q (%v); want status and headers NULL", keyID, status, headers, body, err)
	}
}

// columnExists reports whether table has column, in the search path.
func columnExists(t *testing.T, table, column string) bool {
	t.Helper()
	var n int
	err := admin(t).QueryRow(context.Background(), `SELECT count(*) FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped`, table, column).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// A table at schema version 2 holding an in-flight row written by that
// build: without auto_migrate the store names 0003 only and serves
// nothing; with it, the first contact adds watched (false on the old row),
// and a waiter marks the old row so that its owner's Finalize notifies.
func TestUpgradeFromVersion2(t *testing.T) {
	ctx := context.Background()
	dsn, table, conn := tableAtVersion(t, 2)
	// The row exactly as the version-2 Reserve left it.
	key, owner := storetest.NewKey(t), "owner-v2"
	_, err := conn.Exec(ctx, `INSERT INTO `+table+` (key, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at)
	VALUES ($1, 'createTable', '/v1/namespaces/ns/tables', 'p-old', 'fp-old', 'in_flight', $2, now() + interval '1 hour', now(), now() + interval '1 hour')`,
		key, owner)
	if err != nil {
		t.Fatal(err)
	}

	// Without auto_migrate: reported, naming 0003 only.
	wantNotReady(t, Config{DSN: dsn, Table: table, ListenNotify: true}, key, 2,
		[]string{"version 2", "needs 3", "apply sql/postgres/0003_watched.sql with", "auto_migrate"},
		"0001", "0002")
	if columnExists(t, table, "watched") {
		t.Fatal("watched added without auto_migrate")
	}

	// With auto_migrate: migrated at first contact; the old row is
	// unwatched until a waiter marks it.
	cfg := Config{DSN: dsn, Table: table, AutoMigrate: true, ListenNotify: true}
	s, err := Open(ctx, cfg, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if rec, err := s.Load(ctx, key); err != nil || rec == nil || rec.State != stores.StateInFlight {
		t.Fatalf("Load after auto_migrate = %+v, %v", rec, err)
	}
	if watched(t, table, key) {
		t.Fatal("the old row is watched after the migration")
	}
	l := listenTo(t, cfg)
	got := awaitAsync(t, ctx, s, key)
	waitWatched(t, table, key)
	if err := s.Finalize(ctx, key, owner, finalResp); err != nil {
		t.Fatal(err)
	}
	if p := l.next(); p != key {
		t.Fatalf("notification %q, want %q", p, key)
	}
	if rec := <-got; rec == nil || rec.State != stores.StateFinal {
		t.Fatalf("Await = %+v, want the final record", rec)
	}
}

// wantNotReady opens a store on cfg without auto_migrate, on a schema at
// version, and checks that loading key fails as not ready with an error
// that names every piece of mention and none of the applied files.
func wantNotReady(t *testing.T, cfg Config, key string, version int, mention []string, applied ...string) {
	t.Helper()
	cfg.AutoMigrate, cfg.RetryCooldown = false, time.Nanosecond
	s, err := Open(context.Background(), cfg, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Load(context.Background(), key)
	s.Close()
	if err == nil || !errors.Is(err, sqlstore.ErrNotReady) {
		t.Fatalf("Load at version %d without auto_migrate = %v, want ErrNotReady", version, err)
	}
	for _, want := range mention {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	for _, file := range applied {
		if strings.Contains(err.Error(), file) {
			t.Errorf("error %q asks for %s, which is applied", err, file)
		}
	}
}

// tableAtVersion creates a table as an older build left it, by applying the
// first version schema migrations only, and returns the test DSN, the table
// (dropped at the end) and an admin connection.
func tableAtVersion(t *testing.T, version int) (dsn, table string, conn *pgx.Conn) {
	t.Helper()
	dsn = testDSN(t)
	table = sqltest.TableName(t)
	dropOnCleanup(t, table)
	conn = admin(t)
	ms, err := schema.Migrations(schema.Postgres)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms[:version] {
		for _, stmt := range m.Statements(table) {
			if _, err := conn.Exec(context.Background(), stmt); err != nil {
				t.Fatal(err)
			}
		}
	}
	return dsn, table, conn
}

// A migration waits for its table lock only briefly (migrateLockTimeout):
// while it waits, every statement on the table queues behind it, on every
// node. Before, a transaction holding the table (a pg_dump, a psql session
// left open) made each attempt wait out statement_timeout, and the old
// nodes' writes stood still for 5 s of every 6 while an upgraded node kept
// trying. The attempt now fails on the lock, and the next one, after the
// blocker is gone, migrates.
func TestMigrationGivesUpOnABusyTable(t *testing.T) {
	ctx := context.Background()
	dsn, table, _ := tableAtVersion(t, 2)
	blocker, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Close(ctx)
	tx, err := blocker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT count(*) FROM "+table); err != nil {
		t.Fatal(err)
	}
	s, err := Open(ctx, Config{DSN: dsn, Table: table, AutoMigrate: true, RetryCooldown: time.Nanosecond}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	key := storetest.NewKey(t)
	_, err = s.Load(ctx, key)
	if err == nil || !strings.Contains(err.Error(), "lock timeout") || !strings.Contains(err.Error(), "55P03") {
		t.Fatalf("Load while another transaction holds the table = %v; want the migration to give up on its lock (55P03)", err)
	}
	// The table is behind, not out: fail_open must not pass keys beside
	// the older nodes that guard them with it (TestFailOpenDoesNotPassAStoreWhoseMigrationWaits).
	if se := (*sqlstore.SchemaError)(nil); !errors.As(err, &se) {
		t.Fatalf("Load while the migration waits = %T %v; want a *sqlstore.SchemaError", err, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Load(ctx, key); err != nil {
		t.Fatalf("Load once the table is free: %v", err)
	}
	if !columnExists(t, table, "watched") {
		t.Fatal("not migrated once the table was free")
	}
}

// Only the server's word that the table is busy makes a failed migration
// "behind" (no fail_open); a review found the first version calling every
// failed statement so, a failover's admin_shutdown and a full disk too,
// which kept fail_open from passing during an outage.
func TestTableBusy(t *testing.T) {
	for code, want := range map[string]bool{"55P03": true, "40P01": true, "57P01": false, "53100": false, "25006": false, "42P07": false} {
		if got := tableBusy(fmt.Errorf("migrate: %w", &pgconn.PgError{Code: code})); got != want {
			t.Errorf("tableBusy(%s) = %v, want %v", code, got, want)
		}
	}
	if tableBusy(context.DeadlineExceeded) {
		t.Error("a deadline was taken for a busy table")
	}
}
