package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	mysqldriver "github.com/go-sql-driver/mysql"
	"go.uber.org/zap/zaptest"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// oldBody is a clear-text body with the bytes a careless codec would lose.
var oldBody = []byte("{\"metadata-location\":\"s3://b/m.json\"}\n\x00\xff")

// A table created by the previous build (schema version 1) holding a final
// clear-text row: without auto_migrate the store names 0002 and serves
// nothing; with it, the first contact migrates to version 2 and the old
// row replays as it was written, with no key id. Sealed rows written
// afterwards sit next to it, and 0002 applied again by hand changes nothing.
func TestUpgradeFromVersion1(t *testing.T) {
	ctx := context.Background()
	dsn, table, db := tableAtVersion(t, 1)
	// The row exactly as the version-1 Finalize left it.
	oldKey := storetest.NewKey(t)
	_, err := db.Exec("INSERT INTO "+table+" (`key`, operation, path, principal, fingerprint, state, owner, lease_until,"+
		` created_at, expires_at, status, headers, body)
	VALUES (?, 'createTable', '/v1/namespaces/ns/tables', 'p-old', 'fp-old', 'final', NULL, NULL,
		UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, 200, ?, ?)`,
		oldKey, `{"Content-Type":["application/json"],"Etag":["\"v1\""]}`, oldBody)
	if err != nil {
		t.Fatal(err)
	}

	// Without auto_migrate: reported, naming 0002 only.
	s, err := Open(ctx, Config{DSN: dsn, Table: table, RetryCooldown: time.Nanosecond}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Load(ctx, oldKey)
	s.Close()
	if err == nil || !errors.Is(err, sqlstore.ErrNotReady) {
		t.Fatalf("Load at version 1 without auto_migrate = %v, want ErrNotReady", err)
	}
	for _, want := range []string{"version 1", "needs 2", "sql/mysql/0002_key_id.sql", "auto_migrate"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "0001") {
		t.Errorf("error %q asks for 0001, which is applied", err)
	}
	if columnExists(t, db, table, "key_id") {
		t.Fatal("key_id added without auto_migrate")
	}

	// With auto_migrate: migrated at first contact.
	s, err = Open(ctx, Config{DSN: dsn, Table: table, AutoMigrate: true}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rec, err := s.Load(ctx, oldKey)
	if err != nil {
		t.Fatalf("Load after auto_migrate: %v", err)
	}
	checkVersion2(t, db, table)
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
	var oldID sql.NullString
	if err := db.QueryRow("SELECT key_id FROM "+table+" WHERE `key` = ?", oldKey).Scan(&oldID); err != nil || oldID.Valid {
		t.Fatalf("old row key_id = %v (%v), want NULL", oldID, err)
	}
	var (
		keyID           string
		status, headers sql.NullString
		body            []byte
	)
	err = db.QueryRow("SELECT key_id, status, headers, body FROM "+table+" WHERE `key` = ?", newKey).Scan(&keyID, &status, &headers, &body)
	if err != nil || keyID != sealed.KeyID || status.Valid || headers.Valid || string(body) != string(sealed.Body) {
		t.Fatalf("sealed row = key_id %q, status %v, headers %v, body %q (%v); want status and headers NULL", keyID, status, headers, body, err)
	}

	// The file is idempotent: applied again by hand, it changes nothing.
	ms, err := schema.Migrations(schema.MySQL)
	if err != nil {
		t.Fatal(err)
	}
	applyMigrations(t, db, table, ms[1:])
	checkVersion2(t, db, table)
	if rec, err := s.Load(ctx, newKey); err != nil || rec == nil || !reflect.DeepEqual(*rec.Response, sealed) {
		t.Fatalf("sealed record after re-applying 0002 = %+v, %v", rec, err)
	}
}

func checkVersion2(t *testing.T, db *sql.DB, table string) {
	t.Helper()
	var versions, maxVersion int
	if err := db.QueryRow("SELECT COUNT(*), MAX(version) FROM "+table+"_schema").Scan(&versions, &maxVersion); err != nil {
		t.Fatal(err)
	}
	if versions != 2 || maxVersion != 2 || !columnExists(t, db, table, "key_id") {
		t.Fatalf("%d versions, max %d, key_id present %v; want 2, 2, true", versions, maxVersion, columnExists(t, db, table, "key_id"))
	}
}

// columnExists reports whether table, in the connection's database, has column.
func columnExists(t *testing.T, db *sql.DB, table, column string) bool {
	t.Helper()
	var n int
	err := db.QueryRow(`SELECT COUNT(*) FROM information_schema.columns
		WHERE table_schema = DATABASE() AND table_name = ? AND column_name = ?`, table, column).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// A migration waits for its table's metadata lock only briefly
// (migrateLockTimeout), and its session goes back to the pool with the
// server's lock_wait_timeout. Before, a transaction that had read the table
// (a dump, a session left open) made each attempt run out its whole
// statement time, with the ALTER left waiting on the server after the node
// gave up. The next attempt, once the table is free, migrates.
func TestMigrationGivesUpOnABusyTable(t *testing.T) {
	ctx := context.Background()
	dsn, table, db := tableAtVersion(t, 1)
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	var n int
	if err := tx.QueryRow("SELECT COUNT(*) FROM " + table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	s, err := Open(ctx, Config{DSN: dsn, Table: table, AutoMigrate: true, MaxConns: 1, RetryCooldown: time.Nanosecond}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	key := storetest.NewKey(t)
	_, err = s.Load(ctx, key)
	if err == nil || !strings.Contains(err.Error(), "Error 1205") {
		t.Fatalf("Load while another transaction holds the table = %v; want the migration to give up on its lock (1205)", err)
	}
	// The table is behind, not out: fail_open must not pass keys beside
	// the older nodes that guard them with it (TestFailOpenDoesNotPassAStoreWhoseMigrationWaits).
	if se := (*sqlstore.SchemaError)(nil); !errors.As(err, &se) {
		t.Fatalf("Load while the migration waits = %T %v; want a *sqlstore.SchemaError", err, err)
	}
	var session, global int
	if err := s.db.QueryRowContext(ctx, "SELECT @@SESSION.lock_wait_timeout, @@GLOBAL.lock_wait_timeout").Scan(&session, &global); err != nil {
		t.Fatal(err)
	}
	if session != global {
		t.Fatalf("the pool's session has lock_wait_timeout %d after the migration, the server's is %d", session, global)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Load(ctx, key); err != nil {
		t.Fatalf("Load once the table is free: %v", err)
	}
	if !columnExists(t, db, table, "key_id") {
		t.Fatal("not migrated once the table was free")
	}
}

// tableAtVersion creates a table as an older build left it, by applying the
// first version schema migrations only, and returns the test DSN, the table
// and an admin connection.
func tableAtVersion(t *testing.T, version int) (dsn, table string, db *sql.DB) {
	t.Helper()
	dsn = testDSN(t)
	table = sqltest.TableName(t)
	dropOnCleanup(t, table)
	db = admin(t)
	ms, err := schema.Migrations(schema.MySQL)
	if err != nil {
		t.Fatal(err)
	}
	applyMigrations(t, db, table, ms[:version])
	return dsn, table, db
}

// Only the server's word that the table is busy makes a failed migration
// "behind" (no fail_open); a review found the first version calling every
// failed statement so, which kept fail_open from passing during an outage.
func TestTableBusy(t *testing.T) {
	for number, want := range map[uint16]bool{1205: true, 1213: true, 1021: false, 1290: false, 1050: false} {
		if got := tableBusy(fmt.Errorf("migrate: %w", &mysqldriver.MySQLError{Number: number})); got != want {
			t.Errorf("tableBusy(%d) = %v, want %v", number, got, want)
		}
	}
	if tableBusy(context.DeadlineExceeded) {
		t.Error("a deadline was taken for a busy table")
	}
}
