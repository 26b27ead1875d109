package bench

import (
	"fmt"
	"net/http"
	"os"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/testdb"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/workload"
)

// baselineEnv names a Caddy binary built from an earlier commit (see
// scripts/bench.sh --baseline). When set, a second process runs the same
// configuration on it, every case runs there right before the current
// one, and the current one reports vs-baseline: an optimization's before
// and after in one run.
const baselineEnv = "ICEBERG_IDEMPOTENCY_BENCH_BASELINE_BINARY"

// maxConnsEnv sets max_conns of the SQL stores and the size of their floor
// loop's pool, for choosing the default; unset, both use the default.
const maxConnsEnv = "ICEBERG_IDEMPOTENCY_BENCH_MAX_CONNS"

// BenchmarkProxy measures the handler on every store beside plain
// reverse_proxy and, for the SQL stores, beside the floor loop (floor.go),
// at each client count of ICEBERG_IDEMPOTENCY_BENCH_CLIENTS (default 1
// and 32). Each case reports req/s, p50-ms, p99-ms and ratios of its
// throughput to cases measured in the same round: vs-plain (plain
// reverse_proxy, same method), vs-floor (SQL fresh keys: the floor loop),
// vs-bound (SQL fresh keys: over 1/(1/floor + 1/plain), the most a request
// needing both the floor's statements and plain proxying can reach when
// both run on the same CPUs) and, with a baseline binary, vs-baseline (its
// vs-plain over the baseline's, each process against its own plain route).
//
// Plain reverse_proxy and every store are routes of one Caddy process,
// picked by a request header: separate processes for the two sides of a
// ratio differed by up to 30% at 32 clients on a 2-core machine with the
// very same binary, whichever side ran first.
func BenchmarkProxy(b *testing.B) {
	up := upstream(b)
	baseline := os.Getenv(baselineEnv)
	maxConns := envInt(b, maxConnsEnv, 0)
	poolLine := ""
	if maxConns > 0 {
		poolLine = fmt.Sprintf("max_conns %d\n", maxConns)
	}

	// routes are the handle blocks of a process, by route name; the route
	// without a name is plain reverse_proxy. The baseline process gets
	// tables of its own: an older binary may not know the current schema.
	type sqlStore struct{ name, dsn, table, baseTable string }
	var sqls []sqlStore
	for _, server := range []*testdb.Server{testdb.Postgres, testdb.MySQL} {
		s := sqlStore{server.Name, server.DSN(b), tableName(), tableName()}
		dropAtEnd(b, server, s.dsn, s.table)
		dropAtEnd(b, server, s.dsn, s.baseTable)
		sqls = append(sqls, s)
	}
	redis, redisErr := redisStoreBlock(b)
	if redisErr != nil {
		b.Logf("redis cases skipped: %v", redisErr)
	}
	caddyfile := func(baseline bool) string {
		routes := [][2]string{{"memory", "memory"}}
		for _, s := range sqls {
			table := s.table
			if baseline {
				table = s.baseTable
			}
			routes = append(routes, [2]string{s.name, fmt.Sprintf("%s {\ndsn %q\ntable %s\n%s}", s.name, s.dsn, table, poolLine)})
		}
		if redis != "" {
			routes = append(routes, [2]string{"redis", redis})
		}
		return routedCaddyfile(up, routes)
	}
	head := caddyproc.Start(b, caddyfile(false)).URL()
	base := ""
	if baseline != "" {
		base = caddyproc.StartWith(b, caddyfile(true), caddyproc.Options{Binary: baseline}).URL()
	}
	// The first keyed request of a SQL route makes its store's first
	// contact, which creates the table the floor loop writes to.
	for _, s := range sqls {
		for _, url := range []string{head, base} {
			if url == "" {
				continue
			}
			if err := send(http.MethodPost, url+floorPath, s.name, newKey(), http.StatusOK); err != nil {
				b.Fatal(err)
			}
		}
	}
	floors := map[string]func(string) error{}
	for _, s := range sqls {
		if s.name == "postgres" {
			floors[s.name] = pgFloor(b, s.dsn, s.table, maxConns)
		} else {
			floors[s.name] = mysqlFloor(b, s.dsn, s.table, maxConns)
		}
	}

	for _, clients := range concurrencies(b) {
		b.Run(fmt.Sprintf("c=%d", clients), func(b *testing.B) {
			perSec := map[string]float64{} // req/s of the cases of this round
			// run measures one case and reports its throughput's ratio to
			// each earlier case of the round named in ratios.
			run := func(name string, op func(i int) error, ratios map[string]string) {
				b.Run(name, func(b *testing.B) {
					rate := 1e9 / drive(b, clients, op)
					perSec[name] = rate
					for metric, of := range ratios {
						if ref := perSec[of]; ref > 0 {
							b.ReportMetric(rate/ref, metric)
						}
					}
					// vs-bound: the floor's statements and plain proxying
					// share this machine's CPUs, so a proxied request that
					// needs the work of both cannot beat
					// 1/(1/floor + 1/plain) on them.
					if floor, plain := perSec[ratios["vs-floor"]], perSec[ratios["vs-plain"]]; floor > 0 && plain > 0 {
						b.ReportMetric(rate*(1/floor+1/plain), "vs-bound")
					}
					if base := perSec[name+"/baseline"]; base > 0 && ratios["vs-plain"] != "" {
						if plain, basePlain := perSec[ratios["vs-plain"]], perSec[ratios["vs-plain"]+"/baseline"]; plain > 0 && basePlain > 0 {
							b.ReportMetric((rate/plain)/(base/basePlain), "vs-baseline")
						}
					}
				})
			}
			// both runs a case on the baseline process first, if any.
			both := func(name string, op func(url string) func(int) error, ratios map[string]string) {
				if base != "" {
					run(name+"/baseline", op(base), nil)
				}
				run(name, op(head), ratios)
			}
			post := func(route string) func(string) func(int) error {
				return func(url string) func(int) error {
					return func(int) error { return send(http.MethodPost, url+floorPath, route, "", http.StatusOK) }
				}
			}
			get := func(route string) func(string) func(int) error {
				return func(url string) func(int) error {
					return func(int) error { return send(http.MethodGet, url+workload.ReadPath, route, "", http.StatusOK) }
				}
			}
			fresh := func(route string) func(string) func(int) error {
				return func(url string) func(int) error {
					return func(int) error { return send(http.MethodPost, url+floorPath, route, newKey(), http.StatusOK) }
				}
			}
			replay := func(route string) func(string) func(int) error {
				return func(url string) func(int) error {
					key := newKey()
					if err := send(http.MethodPost, url+floorPath, route, key, http.StatusOK); err != nil {
						b.Fatal(err)
					}
					return func(int) error { return send(http.MethodPost, url+floorPath, route, key, http.StatusOK) }
				}
			}
			vsPost := map[string]string{"vs-plain": "plain/post"}
			vsGet := map[string]string{"vs-plain": "plain/get"}

			both("plain/post", post(""), nil)
			both("plain/get", get(""), nil)
			both("memory/no_key", post("memory"), vsPost)
			both("memory/get", get("memory"), vsGet)
			both("memory/fresh_key", fresh("memory"), vsPost)
			both("memory/replay", replay("memory"), vsPost)
			for _, s := range sqls {
				floor := floors[s.name]
				run(s.name+"/floor", func(int) error { return floor(newKey()) }, vsPost)
				both(s.name+"/fresh_key", fresh(s.name), map[string]string{"vs-plain": "plain/post", "vs-floor": s.name + "/floor"})
				both(s.name+"/replay", replay(s.name), vsPost)
			}
			if redis != "" {
				both("redis/fresh_key", fresh("redis"), vsPost)
				both("redis/replay", replay("redis"), vsPost)
			}
		})
	}
}
