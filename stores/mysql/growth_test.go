package mysql

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// BenchmarkGrowth measures Reserve (fresh key) and Load (replay) at 10,000
// and at 1,000,000 final records (ICEBERG_IDEMPOTENCY_BENCH_GROWTH_SIZES),
// filled by one INSERT … SELECT per size from cross-joined digits,
// followed by ANALYZE TABLE. Run with
//
//	go test -run '^$' -bench Growth -benchtime 1x ./stores/mysql/
func BenchmarkGrowth(b *testing.B) {
	s, cfg := openStore(b, nil)
	db := admin(b)
	bind, resp := storetest.GrowthRecord()
	headers, err := sqlstore.EncodeHeader(resp.Header)
	if err != nil {
		b.Fatal(err)
	}
	// Digits cross-joined give 0 … 10^k-1 without a recursion limit (MySQL
	// caps recursive CTEs at 1,000 rows by default) or MariaDB's SEQUENCE
	// engine, which MySQL lacks; k is as small as the range allows.
	insert := func(to int) string {
		terms, joins := []string{"d0.n"}, []string{"d d0"}
		for k, p := 1, 10; p < to; k, p = k+1, p*10 {
			terms = append(terms, fmt.Sprintf("%d*d%d.n", p, k))
			joins = append(joins, fmt.Sprintf("d d%d", k))
		}
		return fmt.Sprintf("INSERT INTO %s\n"+
			"\t(`key`, operation, path, principal, fingerprint, state, created_at, expires_at, status, headers, body)\n"+
			"WITH d(n) AS (SELECT 0 UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4\n"+
			"\tUNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9),\n"+
			"seq(i) AS (SELECT %s FROM %s)\n"+
			"SELECT CONCAT(?, LPAD(i, 12, '0')), ?, ?, ?, ?, 'final', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 DAY, ?, ?, ?\n"+
			"FROM seq WHERE i >= ? AND i < ?", cfg.Table, strings.Join(terms, " + "), strings.Join(joins, ", "))
	}
	fill := func(b *testing.B, from, to int) {
		ctx := context.Background()
		res, err := db.ExecContext(ctx, insert(to), storetest.GrowthKeyPrefix, bind.Operation, bind.Path, bind.Principal,
			bind.Fingerprint, resp.Status, string(headers), resp.Body, from, to)
		if err != nil {
			b.Fatalf("filling records %d to %d: %v", from, to, err)
		}
		if got, err := res.RowsAffected(); err != nil || got != int64(to-from) {
			b.Fatalf("filling records %d to %d: inserted %d, %v", from, to, got, err)
		}
		if _, err := db.ExecContext(ctx, "ANALYZE TABLE "+cfg.Table); err != nil {
			b.Fatal(err)
		}
	}
	storetest.BenchGrowth(b, s, fill)
}
