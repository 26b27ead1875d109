package bench

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/testdb"
)

// Environment variables that size BenchmarkPurgeUnderLoad.
const (
	purgeSecondsEnv = "ICEBERG_IDEMPOTENCY_BENCH_PURGE_SECONDS" // load without purge, default 5
	purgeRowsEnv    = "ICEBERG_IDEMPOTENCY_BENCH_PURGE_ROWS"    // expired rows inserted, default 1,000,000
	purgeTimeoutEnv = "ICEBERG_IDEMPOTENCY_BENCH_PURGE_TIMEOUT" // longest purge waited for, default 10m
)

// purgeClients is how many keep-alive clients send the load.
const purgeClients = 32

// purgeKeyPrefix starts the keys of the expired rows the benchmark inserts;
// the load's UUIDv7 keys of today start 01…, so they never collide.
const purgeKeyPrefix = "e0000000-0000-7000-8000-"

// BenchmarkPurgeUnderLoad measures what the purge of expired records costs
// the requests running beside it, on PostgreSQL and on MariaDB/MySQL. One
// Caddy node guards a fast upstream with a store on a fresh table, and its
// app purges every second (cleanup_interval 1s, default cleanup_batch).
//
// Phase A: 32 keep-alive clients send fresh-key commits for 5 s
// (ICEBERG_IDEMPOTENCY_BENCH_PURGE_SECONDS): p50-ms and p99-ms without a
// purge. Phase B: with the load stopped, 1,000,000 expired final rows
// (ICEBERG_IDEMPOTENCY_BENCH_PURGE_ROWS) go into the table in one INSERT …
// SELECT, each with the ~1.9 KB body the load's upstream answers (the bench
// responseBody), so the table holds what a busy catalog leaves behind; then
// the same load runs until no expired row is left (polled) or 10 minutes
// pass (ICEBERG_IDEMPOTENCY_BENCH_PURGE_TIMEOUT): purge-p50-ms and
// purge-p99-ms. It reports x-p99 (p99 with the purge over p99 without; the
// goal is at most 2), x-p50, purge-s (from the end of the insert until no
// expired row is left, so it includes up to one cleanup interval before the
// purge starts), insert-s, rows (inserted), rows-left (expired rows still
// there at the end: anything but 0 fails the benchmark), requests,
// purge-requests, rps and purge-rps (the load's throughput without and
// with the purge), and errors (any answer but 200 fails it). Run it with -benchtime 1x:
//
//	go test -run '^$' -bench PurgeUnderLoad -benchtime 1x -timeout 30m ./bench/
func BenchmarkPurgeUnderLoad(b *testing.B) {
	seconds := envInt(b, purgeSecondsEnv, 5)
	rows := envInt(b, purgeRowsEnv, 1_000_000)
	timeout := envDuration(b, purgeTimeoutEnv, 10*time.Minute, false)
	up := upstream(b)
	for _, db := range []purgeDB{pgPurgeDB(), myPurgeDB()} {
		b.Run(db.name, func(b *testing.B) {
			dsn := db.dsn(b)
			table := tableName()
			b.Cleanup(func() { db.drop(b, dsn, table) })
			global := "iceberg_idempotency {\ncleanup_interval 1s\n}"
			site := fmt.Sprintf("iceberg_idempotency {\nstore %s {\ndsn %q\ntable %s\n%s}\n}\nreverse_proxy %s", db.name, dsn, table, sqlOptions(), up)
			inst := caddyproc.Start(b, caddyproc.Caddyfile(global, site))
			url := inst.URL() + "/v1/namespaces/ns/tables/t"
			cl := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * purgeClients, DisableCompression: true}}
			// A short load first: connections open, the store migrates the
			// table and warms its pool.
			runLoad(cl, url, func(start time.Time) bool { return time.Since(start) < time.Second })

			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				ctx := context.Background()
				base := runLoad(cl, url, func(start time.Time) bool { return time.Since(start) < time.Duration(seconds)*time.Second })

				t0 := time.Now()
				inserted, err := db.insertExpired(ctx, dsn, table, rows)
				if err != nil {
					b.Fatalf("inserting %d expired rows: %v", rows, err)
				}
				insertDur := time.Since(t0)
				if inserted != rows {
					b.Fatalf("inserted %d expired rows, want %d", inserted, rows)
				}

				b.StartTimer()
				purgeStart := time.Now()
				var purgeDur time.Duration
				var pollErr error
				under := runLoad(cl, url, func(time.Time) bool {
					// Polled by one client between its requests; the others
					// keep going meanwhile.
					if time.Since(purgeStart) > timeout {
						return false
					}
					left, err := db.anyExpired(ctx, dsn, table)
					if err != nil {
						pollErr = err
						return false
					}
					if !left {
						purgeDur = time.Since(purgeStart)
						return false
					}
					time.Sleep(250 * time.Millisecond)
					return true
				})
				b.StopTimer()
				if pollErr != nil {
					b.Fatalf("polling the expired rows: %v", pollErr)
				}
				left, err := db.countExpired(ctx, dsn, table)
				if err != nil {
					b.Fatalf("counting the expired rows: %v", err)
				}
				if left != 0 {
					b.Errorf("%d of %d expired rows left after %v of purging", left, rows, timeout)
					purgeDur = time.Since(purgeStart)
				}
				for _, line := range strings.Split(inst.Logs(), "\n") {
					if strings.Contains(line, "purged expired records") {
						b.Log(line)
					}
				}

				for _, r := range []loadResult{base, under} {
					for _, e := range r.errs[:min(len(r.errs), 10)] {
						b.Error(e)
					}
					if len(r.errs) > 0 {
						b.Errorf("%d of %d requests failed", len(r.errs), r.requests)
					}
				}
				p50, p99 := percentileMs(base.lat, 0.50), percentileMs(base.lat, 0.99)
				pp50, pp99 := percentileMs(under.lat, 0.50), percentileMs(under.lat, 0.99)
				b.ReportMetric(p50, "p50-ms")
				b.ReportMetric(p99, "p99-ms")
				b.ReportMetric(pp50, "purge-p50-ms")
				b.ReportMetric(pp99, "purge-p99-ms")
				b.ReportMetric(pp50/p50, "x-p50")
				b.ReportMetric(pp99/p99, "x-p99")
				b.ReportMetric(purgeDur.Seconds(), "purge-s")
				b.ReportMetric(insertDur.Seconds(), "insert-s")
				b.ReportMetric(float64(inserted), "rows")
				b.ReportMetric(float64(left), "rows-left")
				b.ReportMetric(float64(base.requests), "requests")
				b.ReportMetric(float64(under.requests), "purge-requests")
				b.ReportMetric(float64(base.requests)/base.elapsed.Seconds(), "rps")
				b.ReportMetric(float64(under.requests)/under.elapsed.Seconds(), "purge-rps")
				b.ReportMetric(float64(len(base.errs)+len(under.errs)), "errors")
			}
		})
	}
}

// loadResult is what one run of the load saw.
type loadResult struct {
	lat      []time.Duration
	requests int
	errs     []error
	elapsed  time.Duration // from the first request sent to the last answered
}

// runLoad sends fresh-key commits to url from purgeClients keep-alive
// clients until more, asked by one client between its requests, says
// stop; requests under way then finish and are counted.
func runLoad(cl *http.Client, url string, more func(start time.Time) bool) loadResult {
	start := time.Now()
	var stop atomic.Bool
	var mu sync.Mutex
	var out loadResult
	var wg sync.WaitGroup
	for c := range purgeClients {
		wg.Go(func() {
			var lat []time.Duration
			var errs []error
			for !stop.Load() {
				if c == 0 && !more(start) {
					stop.Store(true)
					break
				}
				t0 := time.Now()
				err := postOnce(cl, url, newKey())
				lat = append(lat, time.Since(t0))
				if err != nil {
					errs = append(errs, err)
				}
			}
			mu.Lock()
			out.lat = append(out.lat, lat...)
			out.requests += len(lat)
			out.errs = append(out.errs, errs...)
			mu.Unlock()
		})
	}
	wg.Wait()
	out.elapsed = time.Since(start)
	return out
}

// postOnce is post for goroutines other than the benchmark's: it returns
// what went wrong instead of failing.
func postOnce(cl *http.Client, url, key string) error {
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(commitBody))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := cl.Do(req)
	if err != nil {
		return err
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("key %s: status %d: %s", key, resp.StatusCode, body)
	}
	return nil
}

// purgeDB is one database server as BenchmarkPurgeUnderLoad uses it.
type purgeDB struct {
	name string // store module
	dsn  func(testing.TB) string
	// insertExpired inserts n expired final rows and reports how many
	// went in.
	insertExpired func(ctx context.Context, dsn, table string, n int) (int, error)
	anyExpired    func(ctx context.Context, dsn, table string) (bool, error)
	countExpired  func(ctx context.Context, dsn, table string) (int, error)
	drop          func(b *testing.B, dsn, table string)
}

// The expired rows: keys purgeKeyPrefix + i as 12 digits, bound like the
// load's commits, 64 hex digits of principal and fingerprint as the handler
// writes them, final 200 answers with the load's headers and body, created
// two hours ago and expired an hour ago, one millisecond apart (the purge
// deletes the oldest first).
const purgeHeaders = `{"Content-Type":["application/json"]}`

func pgPurgeDB() purgeDB {
	return purgeDB{
		name: "postgres",
		dsn:  testdb.Postgres.DSN,
		insertExpired: func(ctx context.Context, dsn, table string, n int) (int, error) {
			out, err := testdb.PsqlQuery(ctx, dsn, fmt.Sprintf(`WITH ins AS (
	INSERT INTO %s (key, operation, path, principal, fingerprint, state, created_at, expires_at, status, headers, body)
	SELECT '%s' || lpad(i::text, 12, '0'), 'updateTable', '/v1/namespaces/ns/tables/t',
		md5(i::text) || md5((-i)::text), md5((i+1)::text) || md5((-i-1)::text), 'final',
		now() - interval '2 hours' - i * interval '1 millisecond',
		now() - interval '1 hour' - i * interval '1 millisecond',
		200, '%s', '\x%s'::bytea
	FROM generate_series(0, %d) AS i
	RETURNING 1
) SELECT count(*) FROM ins`, table, purgeKeyPrefix, purgeHeaders, hex.EncodeToString(responseBody), n-1))
			if err != nil {
				return 0, err
			}
			return strconv.Atoi(out)
		},
		anyExpired: func(ctx context.Context, dsn, table string) (bool, error) {
			out, err := testdb.PsqlQuery(ctx, dsn, "SELECT EXISTS (SELECT FROM "+table+" WHERE expires_at <= now())")
			return out == "t", err
		},
		countExpired: func(ctx context.Context, dsn, table string) (int, error) {
			out, err := testdb.PsqlQuery(ctx, dsn, "SELECT count(*) FROM "+table+" WHERE expires_at <= now()")
			if err != nil {
				return 0, err
			}
			return strconv.Atoi(out)
		},
		drop: func(b *testing.B, dsn, table string) {
			if err := testdb.Postgres.Drop(dsn, table); err != nil {
				b.Logf("dropping %s: %v", table, err)
			}
		},
	}
}

func myPurgeDB() purgeDB {
	var (
		mu  sync.Mutex
		dbs = map[string]*sql.DB{}
	)
	open := func(dsn string) (*sql.DB, error) {
		mu.Lock()
		defer mu.Unlock()
		if db := dbs[dsn]; db != nil {
			return db, nil
		}
		db, _, err := testdb.OpenMySQL(dsn)
		if err != nil {
			return nil, err
		}
		dbs[dsn] = db
		return db, nil
	}
	return purgeDB{
		name: "mysql",
		dsn:  testdb.MySQL.DSN,
		insertExpired: func(ctx context.Context, dsn, table string, n int) (int, error) {
			db, err := open(dsn)
			if err != nil {
				return 0, err
			}
			stmt := fmt.Sprintf("INSERT INTO %s\n"+
				"\t(`key`, operation, path, principal, fingerprint, state, created_at, expires_at, status, headers, body)\n"+
				"%s\n"+
				"SELECT CONCAT(?, LPAD(i, 12, '0')), 'updateTable', '/v1/namespaces/ns/tables/t',\n"+
				"\tSHA2(i, 256), SHA2(-i, 256), 'final',\n"+
				"\tUTC_TIMESTAMP(6) - INTERVAL 2 HOUR - INTERVAL i*1000 MICROSECOND,\n"+
				"\tUTC_TIMESTAMP(6) - INTERVAL 1 HOUR - INTERVAL i*1000 MICROSECOND,\n"+
				"\t200, ?, ?\n"+
				"FROM seq WHERE i < ?", table, digitsCTE(n))
			res, err := db.ExecContext(ctx, stmt, purgeKeyPrefix, purgeHeaders, responseBody, n)
			if err != nil {
				return 0, err
			}
			got, err := res.RowsAffected()
			return int(got), err
		},
		anyExpired: func(ctx context.Context, dsn, table string) (bool, error) {
			db, err := open(dsn)
			if err != nil {
				return false, err
			}
			var left bool
			err = db.QueryRowContext(ctx, "SELECT EXISTS (SELECT 1 FROM "+table+" WHERE expires_at <= UTC_TIMESTAMP(6))").Scan(&left)
			return left, err
		},
		countExpired: func(ctx context.Context, dsn, table string) (int, error) {
			db, err := open(dsn)
			if err != nil {
				return 0, err
			}
			var n int
			err = db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table+" WHERE expires_at <= UTC_TIMESTAMP(6)").Scan(&n)
			return n, err
		},
		drop: func(b *testing.B, dsn, table string) {
			db, err := open(dsn)
			if err == nil {
				_, err = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_schema")
			}
			if err != nil {
				b.Logf("dropping %s: %v", table, err)
			}
			mu.Lock()
			defer mu.Unlock()
			if db := dbs[dsn]; db != nil {
				db.Close()
				delete(dbs, dsn)
			}
		},
	}
}

// digitsCTE is a WITH clause defining seq(i) as 0 … 10^k-1, the smallest
// such range holding n numbers, from cross-joined digits: MariaDB and
// MySQL 8 both run it, without MySQL's 1,000-row default limit on
// recursive CTEs or MariaDB's SEQUENCE engine, which MySQL lacks.
func digitsCTE(n int) string {
	terms, joins := []string{"d0.n"}, []string{"d d0"}
	for k, p := 1, 10; p < n; k, p = k+1, p*10 {
		terms = append(terms, fmt.Sprintf("%d*d%d.n", p, k))
		joins = append(joins, fmt.Sprintf("d d%d", k))
	}
	return "WITH d(n) AS (SELECT 0 UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4\n" +
		"\tUNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9),\n" +
		"seq(i) AS (SELECT " + strings.Join(terms, " + ") + " FROM " + strings.Join(joins, ", ") + ")"
}
