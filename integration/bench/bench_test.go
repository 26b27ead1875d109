// Package bench measures what the iceberg_idempotency handler costs, as a
// ratio to plain reverse_proxy measured in the same run, on real Caddy
// processes in front of one upstream. It holds benchmarks only:
//
//	go test -run '^$' -bench . -benchtime 3000x ./bench/
//
// Each sub-benchmark reports ns/op and x-plain (its ns/op divided by the
// plain reverse_proxy case of the same run).
package bench

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

func TestMain(m *testing.M) { os.Exit(caddyproc.Main(m)) }

// commitBody is about the size of a small Iceberg table commit request, and
// responseBody of its CommitTableResponse.
var (
	commitBody   = []byte(`{"requirements":[{"type":"assert-ref-snapshot-id","ref":"main","snapshot-id":1}],"updates":[{"action":"add-snapshot","snapshot":{"snapshot-id":2,"sequence-number":2,"timestamp-ms":1700000000000,"manifest-list":"s3://bucket/warehouse/ns/t/metadata/snap-2.avro","summary":{"operation":"append"}}}]}`)
	responseBody = bytes.Repeat([]byte(`{"metadata-location":"s3://bucket/warehouse/ns/t/metadata/00002.metadata.json"}`), 24)
)

var client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16, DisableCompression: true}}

func upstream(b *testing.B) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(responseBody)
	}))
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

func BenchmarkProxy(b *testing.B) {
	up := upstream(b)
	plainURL := caddyproc.Start(b, caddyproc.Caddyfile("", "reverse_proxy "+up)).URL()
	memURL := caddyproc.Start(b, caddyproc.Caddyfile("", "iceberg_idempotency\nreverse_proxy "+up)).URL()
	const path = "/v1/namespaces/ns/tables/t"

	var plainNs float64
	run := func(b *testing.B, name string, fn func(b *testing.B)) {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			b.ResetTimer()
			fn(b)
			b.StopTimer()
			ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			if name == "plain_reverse_proxy" {
				plainNs = ns
			} else if plainNs > 0 {
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

	run(b, "plain_reverse_proxy", fresh(plainURL))
	run(b, "memory/no_key", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			post(b, memURL+path, "")
		}
	})
	run(b, "memory/fresh_key", fresh(memURL))
	run(b, "memory/replay", replay(memURL))

	sqlStores := []struct{ name, env, def, block string }{
		{"postgres", "ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN", "postgres://postgres@127.0.0.1:5432/iceberg_idempotency_test?sslmode=disable", "postgres"},
		{"mysql", "ICEBERG_IDEMPOTENCY_TEST_MYSQL_DSN", "root@tcp(127.0.0.1:3306)/iceberg_idempotency_test", "mysql"},
	}
	for _, s := range sqlStores {
		dsn := sqltest.DSN(s.env, s.def)
		site := fmt.Sprintf("iceberg_idempotency {\nstore %s {\ndsn %q\ntable %s\n}\n}\nreverse_proxy %s", s.block, dsn, tableName(), up)
		inst := caddyproc.Start(b, caddyproc.Caddyfile("", site))
		run(b, s.name+"/fresh_key", fresh(inst.URL()))
		run(b, s.name+"/replay", replay(inst.URL()))
	}
}
