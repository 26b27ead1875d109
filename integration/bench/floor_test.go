package bench

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"fmt"
	"testing"

	_ "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/workload"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/mysql"
)

// The floor of a durable store: what a fresh keyed mutation cannot avoid
// writing. One op is the reservation INSERT and the finalizing UPDATE
// with a 2 KB answer, each its own autocommit transaction, as the stores
// run them: the same statements without what only matters when they lose
// (the postgres reserve statement's SELECT of the blocking row, MySQL's
// ON DUPLICATE KEY clause) and without a NOTIFY. The loop runs over a pool
// of the store's size, built by the same driver from the same DSN, at the
// same concurrency as the proxy case it is compared with.

var (
	floorPrincipal   = hexSum("principal")
	floorFingerprint = hexSum("fingerprint")
	floorHeaders     = `{"Content-Type":["application/json"]}`
)

const (
	floorLeaseMicros = 30_000_000
	floorTTLMicros   = 3_600_000_000
	floorOperation   = "updateTable"
	floorPath        = workload.CommitPath
)

func hexSum(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// pgFloor returns the floor op on table, over a pgx pool of maxConns
// (0: pgx's default, as the store's).
func pgFloor(b *testing.B, dsn, table string, maxConns int) func(key string) error {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		b.Fatal(err)
	}
	if maxConns > 0 {
		cfg.MaxConns = int32(maxConns)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	insert := fmt.Sprintf(`INSERT INTO %s (key, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at)
VALUES ($1, $2, $3, $4, $5, 'in_flight', $6,
	now() + $7::bigint * interval '1 microsecond', now(),
	now() + $8::bigint * interval '1 microsecond')
ON CONFLICT (key) DO NOTHING`, table)
	update := fmt.Sprintf(`UPDATE %s SET state = 'final', owner = NULL, lease_until = NULL,
	status = $3, headers = $4, body = $5, key_id = $6
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now()`, table)
	ctx := context.Background()
	return func(key string) error {
		owner := newKey()
		if _, err := pool.Exec(ctx, insert, key, floorOperation, floorPath, floorPrincipal, floorFingerprint, owner, floorLeaseMicros, floorTTLMicros); err != nil {
			return fmt.Errorf("floor insert: %w", err)
		}
		tag, err := pool.Exec(ctx, update, key, owner, 200, floorHeaders, responseBody, nil)
		if err != nil {
			return fmt.Errorf("floor update: %w", err)
		}
		if tag.RowsAffected() != 1 {
			return fmt.Errorf("floor update changed %d rows", tag.RowsAffected())
		}
		return nil
	}
}

// mysqlFloor returns the floor op on table, with prepared statements (as
// the store's) over a database/sql pool of maxConns (0: the store's
// default).
func mysqlFloor(b *testing.B, dsn, table string, maxConns int) func(key string) error {
	if maxConns == 0 {
		maxConns = mysql.DefaultMaxConns
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	insert, err := db.Prepare(fmt.Sprintf("INSERT INTO %s (`key`, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at)\n"+
		"VALUES (?, ?, ?, ?, ?, 'in_flight', ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)", table))
	if err != nil {
		b.Fatal(err)
	}
	update, err := db.Prepare(fmt.Sprintf("UPDATE %s SET state = 'final', owner = NULL, lease_until = NULL, status = ?, headers = ?, body = ?, key_id = ?\n"+
		"WHERE `key` = ? AND owner = ? AND state = 'in_flight' AND expires_at > UTC_TIMESTAMP(6)", table))
	if err != nil {
		b.Fatal(err)
	}
	return func(key string) error {
		owner := newKey()
		if _, err := insert.Exec(key, floorOperation, floorPath, floorPrincipal, floorFingerprint, owner, floorLeaseMicros, floorTTLMicros); err != nil {
			return fmt.Errorf("floor insert: %w", err)
		}
		res, err := update.Exec(200, floorHeaders, responseBody, nil, key, owner)
		if err != nil {
			return fmt.Errorf("floor update: %w", err)
		}
		if n, _ := res.RowsAffected(); n != 1 {
			return fmt.Errorf("floor update changed %d rows", n)
		}
		return nil
	}
}
