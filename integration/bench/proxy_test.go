package bench

import (
	"fmt"
	"net/http"
	"os"
	"strconv"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

// baselineEnv names a Caddy binary built from an earlier commit (see
// scripts/bench.sh --baseline). When set, every case of the module also
// runs against that binary right before the current one, and the current
// one reports vs-baseline: an optimization's before and after in one run.
const baselineEnv = "ICEBERG_IDEMPOTENCY_BENCH_BASELINE_BINARY"

// maxConnsEnv sets max_conns of the SQL stores and the size of their floor
// loop's pool, for choosing the default; unset, both use the default.
const maxConnsEnv = "ICEBERG_IDEMPOTENCY_BENCH_MAX_CONNS"

// BenchmarkProxy measures the handler on every store beside plain
// reverse_proxy and, for the SQL stores, beside the floor loop (floor.go),
// at each client count of ICEBERG_IDEMPOTENCY_BENCH_CLIENTS (default 1
// and 32). Each case reports req/s, p50-ms, p99-ms and ratios of its
// throughput measured in the same round: vs-plain (to plain reverse_proxy,
// same method), vs-floor (SQL fresh keys, to the floor loop) and, with a
// baseline binary, vs-baseline.
func BenchmarkProxy(b *testing.B) {
	up := upstream(b)
	baseline := os.Getenv(baselineEnv)
	maxConns := 0
	if v := os.Getenv(maxConnsEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			b.Fatalf("%s=%q: not a positive integer", maxConnsEnv, v)
		}
		maxConns = n
	}

	// target is one Caddy process under test, and the same configuration
	// on the baseline binary.
	type target struct{ url, baseURL string }
	start := func(site string) target {
		t := target{url: caddyproc.Start(b, caddyproc.Caddyfile("", site)).URL()}
		if baseline != "" {
			t.baseURL = caddyproc.StartWith(b, caddyproc.Caddyfile("", site), caddyproc.Options{Binary: baseline}).URL()
		}
		return t
	}
	plain := caddyproc.Start(b, caddyproc.Caddyfile("", "reverse_proxy "+up)).URL()
	memory := start("iceberg_idempotency\nreverse_proxy " + up)

	type sqlTarget struct {
		name  string
		node  target
		floor func(key string) error
	}
	var sqls []sqlTarget
	poolLine := ""
	if maxConns > 0 {
		poolLine = fmt.Sprintf("max_conns %d\n", maxConns)
	}
	pgDSN := sqltest.DSN("ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN", "postgres://postgres@127.0.0.1:5432/iceberg_idempotency_test?sslmode=disable")
	myDSN := sqltest.DSN("ICEBERG_IDEMPOTENCY_TEST_MYSQL_DSN", "root@tcp(127.0.0.1:3306)/iceberg_idempotency_test")
	for _, s := range []struct{ name, dsn string }{{"postgres", pgDSN}, {"mysql", myDSN}} {
		table := tableName()
		dropTableAtEnd(b, s.name, s.dsn, table)
		site := fmt.Sprintf("iceberg_idempotency {\nstore %s {\ndsn %q\ntable %s\n%s}\n}\nreverse_proxy %s", s.name, s.dsn, table, poolLine, up)
		node := start(site)
		// The first request makes the store's first contact, which
		// creates the table the floor loop writes to.
		if err := send(http.MethodPost, node.url+floorPath, newKey(), http.StatusOK); err != nil {
			b.Fatal(err)
		}
		floor := pgFloor
		if s.name == "mysql" {
			floor = mysqlFloor
		}
		sqls = append(sqls, sqlTarget{s.name, node, floor(b, s.dsn, table, maxConns)})
	}
	var redis *target
	if block, err := redisStoreBlock(b); err == nil {
		t := start("iceberg_idempotency {\nstore " + block + "\n}\nreverse_proxy " + up)
		redis = &t
	} else {
		b.Logf("redis cases skipped: %v", err)
	}

	for _, clients := range concurrencies(b) {
		b.Run(fmt.Sprintf("c=%d", clients), func(b *testing.B) {
			ref := map[string]float64{} // ns/op of the reference cases of this round
			// run measures one case; ratios name the reference cases it
			// is compared with, by metric.
			run := func(name string, op func(i int) error, ratios map[string]string) {
				b.Run(name, func(b *testing.B) {
					ns := drive(b, clients, op)
					ref[name] = ns
					for metric, of := range ratios {
						if base := ref[of]; base > 0 {
							b.ReportMetric(base/ns, metric)
						}
					}
				})
			}
			post := func(url string) func(int) error {
				return func(int) error { return send(http.MethodPost, url+floorPath, "", http.StatusOK) }
			}
			get := func(url string) func(int) error {
				return func(int) error { return send(http.MethodGet, url+"/v1/namespaces/ns", "", http.StatusOK) }
			}
			fresh := func(url string) func(int) error {
				return func(int) error { return send(http.MethodPost, url+floorPath, newKey(), http.StatusOK) }
			}
			replay := func(url string) func(int) error {
				key := newKey()
				if err := send(http.MethodPost, url+floorPath, key, http.StatusOK); err != nil {
					b.Fatal(err)
				}
				return func(int) error { return send(http.MethodPost, url+floorPath, key, http.StatusOK) }
			}
			// both runs a case of an iceberg_idempotency node, first on
			// the baseline binary when there is one.
			both := func(name string, node target, op func(url string) func(int) error, ratios map[string]string) {
				if node.baseURL != "" {
					run(name+"/baseline", op(node.baseURL), ratios)
					r := map[string]string{"vs-baseline": name + "/baseline"}
					for k, v := range ratios {
						r[k] = v
					}
					ratios = r
				}
				run(name, op(node.url), ratios)
			}
			vsPost := map[string]string{"vs-plain": "plain/post"}
			vsGet := map[string]string{"vs-plain": "plain/get"}

			run("plain/post", post(plain), nil)
			run("plain/get", get(plain), nil)
			both("memory/no_key", memory, post, vsPost)
			both("memory/get", memory, get, vsGet)
			both("memory/fresh_key", memory, fresh, vsPost)
			both("memory/replay", memory, replay, vsPost)
			for _, s := range sqls {
				run(s.name+"/floor", func(int) error { return s.floor(newKey()) }, vsPost)
				both(s.name+"/fresh_key", s.node, fresh, map[string]string{"vs-plain": "plain/post", "vs-floor": s.name + "/floor"})
				both(s.name+"/replay", s.node, replay, vsPost)
			}
			if redis != nil {
				both("redis/fresh_key", *redis, fresh, vsPost)
				both("redis/replay", *redis, replay, vsPost)
			}
		})
	}
}
