package postgres

import (
	"context"
	"fmt"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// BenchmarkGrowth measures Reserve (fresh key) and Load (replay) at 10,000
// and at 1,000,000 final records (ICEBERG_IDEMPOTENCY_BENCH_GROWTH_SIZES),
// filled by one INSERT … SELECT FROM generate_series per size, followed by
// ANALYZE. Run with
//
//	go test -run '^$' -bench Growth -benchtime 1x ./stores/postgres/
func BenchmarkGrowth(b *testing.B) {
	s, cfg := openStore(b, nil)
	conn := admin(b)
	bind, resp := storetest.GrowthRecord()
	headers, err := sqlstore.EncodeHeader(resp.Header)
	if err != nil {
		b.Fatal(err)
	}
	insert := fmt.Sprintf(`INSERT INTO %s
	(key, operation, path, principal, fingerprint, state, created_at, expires_at, status, headers, body)
SELECT $1 || lpad(i::text, 12, '0'), $2, $3, $4, $5, 'final', now(), now() + interval '1 day', $6, $7, $8
FROM generate_series($9::bigint, $10::bigint - 1) AS i`, cfg.Table)
	fill := func(b *testing.B, from, to int) {
		ctx := context.Background()
		tag, err := conn.Exec(ctx, insert, storetest.GrowthKeyPrefix, bind.Operation, bind.Path, bind.Principal,
			bind.Fingerprint, resp.Status, string(headers), resp.Body, from, to)
		if err != nil {
			b.Fatalf("filling records %d to %d: %v", from, to, err)
		}
		if got := tag.RowsAffected(); got != int64(to-from) {
			b.Fatalf("filling records %d to %d: inserted %d", from, to, got)
		}
		if _, err := conn.Exec(ctx, "ANALYZE "+cfg.Table); err != nil {
			b.Fatal(err)
		}
	}
	storetest.BenchGrowth(b, s, fill)
}
