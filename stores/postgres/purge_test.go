package postgres

import (
	"context"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestPurgeAtScale(t *testing.T) {
	s, cfg := openStore(t, nil)
	ctx := context.Background()
	conn := admin(t)
	const expired, live, batch = 25_000, 100, 1000
	// Expired by the database clock: expires_at in the past of now().
	_, err := conn.Exec(ctx, `INSERT INTO `+cfg.Table+`
		(key, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at, status, headers, body)
		SELECT gen_random_uuid()::text, 'updateTable', '/v1/namespaces/ns/tables/t', 'p', 'fp',
			CASE WHEN g % 2 = 0 THEN 'final' ELSE 'in_flight' END,
			CASE WHEN g % 2 = 0 THEN NULL ELSE 'owner' END,
			CASE WHEN g % 2 = 0 THEN NULL ELSE now() - interval '1 hour' END,
			now() - interval '2 hours', now() - g * interval '1 millisecond',
			CASE WHEN g % 2 = 0 THEN 200 END,
			CASE WHEN g % 2 = 0 THEN '{}' END,
			CASE WHEN g % 2 = 0 THEN '\x00ff'::bytea END
		FROM generate_series(1, $1::int) AS g`, expired)
	if err != nil {
		t.Fatal(err)
	}
	var liveKeys []string
	for range live {
		k := storetest.NewKey(t)
		liveKeys = append(liveKeys, k)
		if res, err := s.Reserve(ctx, storetest.Reservation(k, storetest.Long, storetest.Long)); err != nil || !res.Reserved {
			t.Fatalf("Reserve = %+v, %v", res, err)
		}
	}
	total, calls := 0, 0
	for {
		n, err := s.PurgeExpired(ctx, batch)
		if err != nil {
			t.Fatal(err)
		}
		calls++
		if n > batch {
			t.Fatalf("PurgeExpired deleted %d > %d", n, batch)
		}
		total += n
		if n < batch {
			break
		}
	}
	t.Logf("purged %d rows in %d calls", total, calls)
	if total != expired {
		t.Fatalf("purged %d, want %d", total, expired)
	}
	var left int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM "+cfg.Table).Scan(&left); err != nil || left != live {
		t.Fatalf("%d rows left (%v), want %d", left, err, live)
	}
	for _, k := range liveKeys {
		if rec, err := s.Load(ctx, k); err != nil || rec == nil {
			t.Fatalf("live record %s: %+v, %v", k, rec, err)
		}
	}
}
