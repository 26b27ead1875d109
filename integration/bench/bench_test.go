// Package bench measures what the iceberg_idempotency handler costs, as a
// ratio to plain reverse_proxy measured in the same run, on real Caddy
// processes in front of one upstream. It holds benchmarks only:
//
//	go test -run '^$' -bench . -benchtime 3000x ./bench/
//
// Each sub-benchmark reports ns/op and x-plain (its ns/op divided by the
// plain reverse_proxy case of the same run). BenchmarkSecret's cases with a
// secret also report x-nosecret: the same case without a secret, same run.
package bench

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/testdb"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/workload"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

func TestMain(m *testing.M) { os.Exit(caddyproc.Main(m)) }

// The request and the answer measured (see package workload).
var (
	commitBody   = workload.CommitBody
	responseBody = workload.ResponseBody
)

var client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16, DisableCompression: true}}

func upstream(b *testing.B) string {
	srv := httptest.NewServer(http.HandlerFunc(workload.Answer))
	b.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

func newKey() string { return uuid.Must(uuid.NewV7()).String() }

func post(b *testing.B, url, key string) {
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(commitBody))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := client.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b.Fatalf("status %d", resp.StatusCode)
	}
}

func tableName() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("bench_%x", b)
}

// The Redis server the benchmark uses: the one the Redis store's own tests
// use, found the same way.
const (
	redisAddrEnv   = "ICEBERG_IDEMPOTENCY_TEST_REDIS_ADDR"
	redisStartHint = `redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no`
)

// redisStoreBlock is a redis store block under a fresh key prefix, or the
// reason the server cannot be reached. The server is shared with other
// tests, so the benchmark never flushes it: when it ends it deletes only
// the keys under its own prefix. It talks to the server through redis-cli,
// as testdb does PostgreSQL through psql, so that this module needs no Redis
// client of its own.
func redisStoreBlock(b *testing.B) (string, error) {
	addr := sqltest.DSN(redisAddrEnv, "127.0.0.1:6379")
	cli := func(args ...string) ([]byte, error) {
		return exec.Command("redis-cli", append([]string{"-u", "redis://" + addr}, args...)...).CombinedOutput()
	}
	if out, err := cli("PING"); err != nil || strings.TrimSpace(string(out)) != "PONG" {
		return "", fmt.Errorf("redis-cli PING: %v: %s", err, bytes.TrimSpace(out))
	}
	prefix := "iceberg_idempotency_bench_" + strings.TrimPrefix(tableName(), "bench_") + ":"
	b.Cleanup(func() {
		out, err := cli("--scan", "--pattern", prefix+"*")
		if err != nil {
			b.Logf("listing the keys under %s: %v: %s", prefix, err, out)
			return
		}
		keys := strings.Fields(string(out))
		for len(keys) > 0 {
			n := min(len(keys), 500)
			if out, err := cli(append([]string{"UNLINK"}, keys[:n]...)...); err != nil {
				b.Logf("deleting the keys under %s: %v: %s", prefix, err, out)
				return
			}
			keys = keys[n:]
		}
	})
	return fmt.Sprintf("redis {\naddress %s\nkey_prefix %s\n}", addr, prefix), nil
}

// secretEnv names the environment variable the benchmark's Caddy reads its
// secret from, as a deployment would.
const secretEnv = "ICEBERG_IDEMPOTENCY_BENCH_SECRET"

// BenchmarkSecret measures what `secret` costs on the request path: fresh
// and replayed keyed mutations with and without a secret, on the memory
// store and on PostgreSQL, each as a ratio to plain reverse_proxy in the
// same run (x-plain) and, with a secret, to the same case without one
// (x-nosecret). The answer is about 2 KB, a small CommitTableResponse; with
// a secret every fresh key seals it and every replay opens it.
func BenchmarkSecret(b *testing.B) {
	up := upstream(b)
	const path = "/v1/namespaces/ns/tables/t"
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	env := caddyproc.Options{Env: []string{secretEnv + "=" + fmt.Sprintf("%x", secret)}}
	start := func(store string, withSecret bool) string {
		opts := "store " + store
		if withSecret {
			opts += "\nsecret {env." + secretEnv + "}"
		}
		site := "iceberg_idempotency {\n" + opts + "\n}\nreverse_proxy " + up
		return caddyproc.StartWith(b, caddyproc.Caddyfile("", site), env).URL()
	}

	plainURL := caddyproc.Start(b, caddyproc.Caddyfile("", "reverse_proxy "+up)).URL()
	var plainNs float64
	withoutSecret := map[string]float64{} // ns/op of each case without a secret
	run := func(b *testing.B, group, name string, fn func(b *testing.B)) {
		b.Run(group+"/"+name, func(b *testing.B) {
			b.ReportAllocs()
			b.ResetTimer()
			fn(b)
			b.StopTimer()
			ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			switch {
			case group == "plain_reverse_proxy":
				plainNs = ns
				return
			case strings.HasSuffix(group, "_secret"):
				if base := withoutSecret[strings.TrimSuffix(group, "_secret")+"/"+name]; base > 0 {
					b.ReportMetric(ns/base, "x-nosecret")
				}
			default:
				withoutSecret[group+"/"+name] = ns
			}
			if plainNs > 0 {
				b.ReportMetric(ns/plainNs, "x-plain")
			}
		})
	}
	fresh := func(url string) func(b *testing.B) {
		return func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				post(b, url+path, newKey())
			}
		}
	}
	replay := func(url string) func(b *testing.B) {
		return func(b *testing.B) {
			key := newKey()
			post(b, url+path, key)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				post(b, url+path, key)
			}
		}
	}

	run(b, "plain_reverse_proxy", "no_key", fresh(plainURL))
	stores := []struct {
		name  string
		block func() string
	}{
		{"memory", func() string { return "memory" }},
		{"postgres", func() string { return storeBlock(b, testdb.Postgres) }},
	}
	for _, s := range stores {
		// Without and with a secret on separate nodes (and tables), each
		// case measured right after its counterpart.
		plain, sealed := start(s.block(), false), start(s.block(), true)
		run(b, s.name, "fresh_key", fresh(plain))
		run(b, s.name+"_secret", "fresh_key", fresh(sealed))
		run(b, s.name, "replay", replay(plain))
		run(b, s.name+"_secret", "replay", replay(sealed))
	}
}

// storeBlock is a store block of server on a fresh table, dropped (with
// its schema-version table) when the benchmark ends.
func storeBlock(b *testing.B, server *testdb.Server) string {
	dsn := server.DSN(b)
	table := tableName()
	dropAtEnd(b, server, dsn, table)
	return fmt.Sprintf("%s {\ndsn %q\ntable %s\n}", server.Name, dsn, table)
}

// dropAtEnd drops table when the benchmark ends; a failure is only
// logged, as the measurement stands.
func dropAtEnd(b *testing.B, server *testdb.Server, dsn, table string) {
	b.Cleanup(func() {
		if err := server.Drop(dsn, table); err != nil {
			b.Logf("dropping %s: %v", table, err)
		}
	})
}
