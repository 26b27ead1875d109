package bench

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/workload"
)

// concurrencies are the client counts each load case runs at: one client
// shows the latency a request adds, 32 shows what serializes.
func concurrencies(b *testing.B) []int {
	spec := os.Getenv("ICEBERG_IDEMPOTENCY_BENCH_CLIENTS")
	if spec == "" {
		spec = "1,32"
	}
	var out []int
	for _, f := range strings.Split(spec, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			b.Fatalf("ICEBERG_IDEMPOTENCY_BENCH_CLIENTS: %q is not a list of positive client counts", spec)
		}
		out = append(out, n)
	}
	return out
}

// loadClient keeps one idle connection per concurrent client, so every
// client runs on its own keep-alive connection as an Iceberg client's
// connection pool does.
var loadClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, DisableCompression: true}}

// routeHeader picks the route of the one Caddy process under test that a
// request takes (see BenchmarkProxy); plainRoute is plain reverse_proxy's.
const (
	routeHeader = "X-Bench-Route"
	plainRoute  = "plain"
)

// send makes one request on route and checks it got want. It returns an
// error rather than failing the benchmark, so that client goroutines can
// call it.
func send(method, url, route, key string, want int) error {
	req, err := workload.NewRequest(method, url, key)
	if err != nil {
		return err
	}
	// Plain requests name their route too: both sides of a ratio then
	// parse, match and forward the same headers (one header costs Caddy
	// about 3% of a request).
	if route == "" {
		route = plainRoute
	}
	req.Header.Set(routeHeader, route)
	resp, err := loadClient.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != want {
		return fmt.Errorf("%s %s: status %d, want %d", method, url, resp.StatusCode, want)
	}
	return nil
}

// drive runs op b.N times from clients concurrent goroutines and reports
// req/s and the p50 and p99 latency of one op. It returns ns per op of the
// whole run (wall time over b.N), the figure the ratios compare.
func drive(b *testing.B, clients int, op func(i int) error) float64 {
	b.Helper()
	lat := make([]time.Duration, b.N)
	var (
		next   atomic.Int64
		failed atomic.Pointer[error]
		wg     sync.WaitGroup
	)
	b.ResetTimer()
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= b.N || failed.Load() != nil {
					return
				}
				start := time.Now()
				if err := op(i); err != nil {
					failed.CompareAndSwap(nil, &err)
					return
				}
				lat[i] = time.Since(start)
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	if err := failed.Load(); err != nil {
		b.Fatal(*err)
	}
	ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(1e9/ns, "req/s")
	b.ReportMetric(percentileMs(lat, 0.50), "p50-ms")
	b.ReportMetric(percentileMs(lat, 0.99), "p99-ms")
	return ns
}
