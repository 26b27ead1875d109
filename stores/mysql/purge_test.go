package mysql

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestPurgeAtScale(t *testing.T) {
	s, cfg := openStore(t, nil)
	ctx := context.Background()
	db := admin(t)
	const expired, live, batch, chunk = 25_000, 100, 1000, 2500
	// Expired by the database clock: expires_at in the past of
	// UTC_TIMESTAMP(6). Multi-row INSERTs, as MySQL 8 caps recursive CTEs
	// at 1000 rows by default.
	for from := 0; from < expired; from += chunk {
		var rows []string
		for g := from; g < from+chunk; g++ {
			if g%2 == 0 {
				rows = append(rows, fmt.Sprintf("('%s', 'updateTable', '/v1/t', 'p', 'fp', 'final', NULL, NULL, "+
					"UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND, 200, '{}', X'00FF')", uuid.NewString(), (g+1)*1000))
			} else {
				rows = append(rows, fmt.Sprintf("('%s', 'updateTable', '/v1/t', 'p', 'fp', 'in_flight', 'owner', UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, "+
					"UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND, NULL, NULL, NULL)", uuid.NewString(), (g+1)*1000))
			}
		}
		_, err := db.ExecContext(ctx, "INSERT INTO "+cfg.Table+
			" (`key`, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at, status, headers, body) VALUES "+
			strings.Join(rows, ", "))
		if err != nil {
			t.Fatal(err)
		}
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
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+cfg.Table).Scan(&left); err != nil || left != live {
		t.Fatalf("%d rows left (%v), want %d", left, err, live)
	}
	for _, k := range liveKeys {
		if rec, err := s.Load(ctx, k); err != nil || rec == nil {
			t.Fatalf("live record %s: %+v, %v", k, rec, err)
		}
	}
}
