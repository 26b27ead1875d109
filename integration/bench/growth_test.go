package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/testdb"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// BenchmarkGrowth is the end-to-end counterpart of the stores' own
// BenchmarkGrowth: through one Caddy node, the latency of a fresh-key
// commit and of a replay when the PostgreSQL or MariaDB/MySQL table holds
// 10,000 and 1,000,000 live final records (ICEBERG_IDEMPOTENCY_BENCH_GROWTH_SIZES).
//
// The fill clones a real record: one commit goes through Caddy first, and
// each size is reached with one INSERT … SELECT that copies its row (its
// binding, status, headers and ~1.9 KB body) under fresh keys, followed by
// ANALYZE. Each replay sends the commit again under a key drawn at random
// from all the filled ones and must get the stored answer back (200,
// Idempotent-Replayed, the same body); any other answer fails the
// benchmark. Per size it reports p50 and p99 in milliseconds
// (fresh-10k-p50-ms, replay-1M-p99-ms, …) of 2,000 sequential requests of
// each kind (ICEBERG_IDEMPOTENCY_BENCH_GROWTH_SAMPLES), and the ratios of
// the largest size to the smallest (x-fresh-p50, x-fresh-p99, x-replay-p50,
// x-replay-p99). Run it with -benchtime 1x:
//
//	go test -run '^$' -bench Growth -benchtime 1x ./bench/
func BenchmarkGrowth(b *testing.B) {
	sizes := storetest.GrowthSizes(b)
	samples := storetest.GrowthSamples(b)
	up := upstream(b)
	const path = "/v1/namespaces/ns/tables/t"
	for _, db := range []growthDB{pgGrowthDB(), myGrowthDB()} {
		b.Run(db.name, func(b *testing.B) {
			dsn := db.dsn(b)
			table := tableName()
			b.Cleanup(func() { db.drop(b, dsn, table) })
			site := fmt.Sprintf("iceberg_idempotency {\nstore %s {\ndsn %q\ntable %s\n}\n}\nreverse_proxy %s", db.name, dsn, table, up)
			url := caddyproc.Start(b, caddyproc.Caddyfile("", site)).URL() + path
			probe := newKey()
			post(b, url, probe)
			// Warm the connections, the store's pool and Caddy before the
			// first size is timed.
			for range 200 {
				post(b, url, newKey())
				post(b, url, probe)
			}

			rng := rand.New(rand.NewPCG(1, 2))
			fresh, replay := map[int][]time.Duration{}, map[int][]time.Duration{}
			have := 0
			b.ResetTimer()
			for range b.N {
				for _, n := range sizes {
					b.StopTimer()
					if n > have {
						t0 := time.Now()
						got, err := db.fill(context.Background(), dsn, table, probe, have, n)
						if err != nil {
							b.Fatalf("filling records %d to %d: %v", have, n, err)
						}
						if got != n-have {
							b.Fatalf("filling records %d to %d: inserted %d", have, n, got)
						}
						b.Logf("filled %d records up to %d in %v", n-have, n, time.Since(t0).Round(time.Millisecond))
						have = n
					}
					b.StartTimer()

					fl := make([]time.Duration, samples)
					for i := range fl {
						t0 := time.Now()
						post(b, url, newKey())
						fl[i] = time.Since(t0)
					}
					rl := make([]time.Duration, samples)
					for i := range rl {
						t0 := time.Now()
						replayFilled(b, url, storetest.GrowthKey(rng.IntN(n)))
						rl[i] = time.Since(t0)
					}
					fresh[n], replay[n] = fl, rl
				}
			}
			b.StopTimer()
			storetest.ReportGrowth(b, "fresh", time.Millisecond, sizes, fresh)
			storetest.ReportGrowth(b, "replay", time.Millisecond, sizes, replay)
		})
	}
}

// replayFilled sends the commit under a filled key and fails unless the
// stored answer comes back.
func replayFilled(b *testing.B, url, key string) {
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(commitBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(body, responseBody) {
		b.Fatalf("replay of filled key %s: status %d, Idempotent-Replayed %q, body %.200q; want the stored 200",
			key, resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), body)
	}
}

// growthDB is one database server as BenchmarkGrowth uses it.
type growthDB struct {
	name string // store module
	dsn  func(testing.TB) string
	// fill inserts the live final records storetest.GrowthKey(from) … storetest.GrowthKey(to-1),
	// clones of the row of key probe, and reports how many went in.
	fill func(ctx context.Context, dsn, table, probe string, from, to int) (int, error)
	drop func(b *testing.B, dsn, table string)
}

func pgGrowthDB() growthDB {
	pg := pgPurgeDB()
	return growthDB{
		name: "postgres",
		dsn:  testdb.Postgres.DSN,
		fill: func(ctx context.Context, dsn, table, probe string, from, to int) (int, error) {
			out, err := testdb.PsqlQuery(ctx, dsn, fmt.Sprintf(`WITH ins AS (
	INSERT INTO %[1]s (key, operation, path, principal, fingerprint, state, created_at, expires_at, status, headers, body, key_id)
	SELECT '%[2]s' || lpad(i::text, 12, '0'), p.operation, p.path, p.principal, p.fingerprint, 'final',
		now(), now() + interval '1 day', p.status, p.headers, p.body, p.key_id
	FROM generate_series(%[4]d, %[5]d) AS i, (SELECT * FROM %[1]s WHERE key = '%[3]s' AND state = 'final') AS p
	RETURNING 1
) SELECT count(*) FROM ins`, table, storetest.GrowthKeyPrefix, probe, from, to-1))
			if err != nil {
				return 0, err
			}
			n, err := strconv.Atoi(out)
			if err != nil {
				return 0, err
			}
			_, err = testdb.PsqlQuery(ctx, dsn, "ANALYZE "+table)
			return n, err
		},
		drop: pg.drop,
	}
}

func myGrowthDB() growthDB {
	my := myPurgeDB()
	return growthDB{
		name: "mysql",
		dsn:  testdb.MySQL.DSN,
		fill: func(ctx context.Context, dsn, table, probe string, from, to int) (int, error) {
			db, _, err := testdb.OpenMySQL(dsn)
			if err != nil {
				return 0, err
			}
			defer db.Close()
			stmt := fmt.Sprintf("INSERT INTO %[1]s\n"+
				"\t(`key`, operation, path, principal, fingerprint, state, created_at, expires_at, status, headers, body, key_id)\n"+
				"%[2]s\n"+
				"SELECT CONCAT(?, LPAD(i, 12, '0')), p.operation, p.path, p.principal, p.fingerprint, 'final',\n"+
				"\tUTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 DAY, p.status, p.headers, p.body, p.key_id\n"+
				"FROM seq, (SELECT * FROM %[1]s WHERE `key` = ? AND state = 'final') AS p\n"+
				"WHERE i >= ? AND i < ?", table, digitsCTE(to))
			res, err := db.ExecContext(ctx, stmt, storetest.GrowthKeyPrefix, probe, from, to)
			if err != nil {
				return 0, err
			}
			n, err := res.RowsAffected()
			if err != nil {
				return 0, err
			}
			_, err = db.ExecContext(ctx, "ANALYZE TABLE "+table)
			return int(n), err
		},
		drop: my.drop,
	}
}
