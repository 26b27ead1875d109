package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/testdb"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// Environment variables that size BenchmarkContention; the defaults are the
// benchmark's, smaller values are for checking it quickly.
const (
	contentionDupsEnv  = "ICEBERG_IDEMPOTENCY_BENCH_CONTENTION_DUPLICATES" // one_key_N: N, default 1000
	contentionKeysEnv  = "ICEBERG_IDEMPOTENCY_BENCH_CONTENTION_KEYS"       // N_keys_x5: N, default 200
	contentionDelayEnv = "ICEBERG_IDEMPOTENCY_BENCH_CONTENTION_DELAY"      // catalog time, default 300ms
)

// BenchmarkContention sends bursts of concurrent duplicates: one key sent
// 1,000 times at once (one_key_1000), and 200 keys sent 5 times each, all
// at once (200_keys_x5). PostgreSQL, MariaDB/MySQL and Redis run on two
// Caddy nodes sharing one table or key prefix, the requests alternating
// between them; memory runs on one node, since its records live in one
// process. The catalog (a caddyproc.Backend) takes 300 ms per commit, so
// the duplicates really wait for the first request.
//
// Every key must execute exactly once, and every duplicate must get either
// the original's answer replayed (200, same body) or 503 with Retry-After
// (it waited longer than in_flight_wait); anything else fails the
// benchmark. Per burst it reports executions, the answers by kind
// (executed, replayed, 503s, errors), late (duplicates sent after the
// original was answered, which did not wait), and the wake-up of the
// replays: from the moment the catalog's answer to the original left for
// Caddy to the replay's arrival at the client, p50-ms, p99-ms and max-ms.
// Each iteration is one burst with fresh keys; run it with -benchtime 1x:
//
//	go test -run '^$' -bench Contention -benchtime 1x ./bench/
func BenchmarkContention(b *testing.B) {
	dups := envInt(b, contentionDupsEnv, 1000)
	keys := envInt(b, contentionKeysEnv, 200)
	delay := envDuration(b, contentionDelayEnv, 300*time.Millisecond, true)
	cases := []struct {
		name       string
		keys, each int
	}{
		{fmt.Sprintf("one_key_%d", dups), 1, dups},
		{fmt.Sprintf("%d_keys_x5", keys), keys, 5},
	}

	type storeCase struct {
		name  string
		nodes int
		block func(b *testing.B) string // the store subdirective's argument
	}
	storeCases := []storeCase{
		{"memory", 1, func(*testing.B) string { return "memory" }},
		{"postgres", 2, func(b *testing.B) string { return storeBlock(b, testdb.Postgres) }},
		{"mysql", 2, func(b *testing.B) string { return storeBlock(b, testdb.MySQL) }},
		{"redis", 2, func(b *testing.B) string {
			block, err := redisStoreBlock(b)
			if err != nil {
				sqltest.Unavailable(b, "Redis", redisAddrEnv, redisStartHint, err)
			}
			return block
		}},
	}
	for _, sc := range storeCases {
		for _, c := range cases {
			b.Run(sc.name+"/"+c.name, func(b *testing.B) {
				backend := caddyproc.NewBackend(b)
				front := newAnswerClock(b, backend)
				// One store block for every node: the nodes share its table
				// or key prefix.
				site := "iceberg_idempotency {\nstore " + sc.block(b) + "\n}\nreverse_proxy " + front.addr()
				var nodes []string
				for range sc.nodes {
					nodes = append(nodes, caddyproc.Start(b, caddyproc.Caddyfile("", site)).URL())
				}
				cl := burstClient(c.keys * c.each)
				warmUp(b, cl, nodes, c.keys*c.each)

				var sum contentionResult
				b.ResetTimer()
				for range b.N {
					r := contentionBurst(b, cl, nodes, backend, front, c.keys, c.each, delay)
					sum.add(r)
				}
				b.StopTimer()
				sum.report(b)
			})
		}
	}
}

// contentionResult is what the bursts of one sub-benchmark observed.
type contentionResult struct {
	bursts                                           int
	executions, executed, replayed, s503, errs, late int
	wake                                             []time.Duration
}

func (r *contentionResult) add(o contentionResult) {
	r.bursts += o.bursts
	r.executions += o.executions
	r.executed += o.executed
	r.replayed += o.replayed
	r.s503 += o.s503
	r.errs += o.errs
	r.late += o.late
	r.wake = append(r.wake, o.wake...)
}

func (r *contentionResult) report(b *testing.B) {
	per := func(n int) float64 { return float64(n) / float64(r.bursts) }
	b.ReportMetric(per(r.executions), "executions")
	b.ReportMetric(per(r.executed), "executed")
	b.ReportMetric(per(r.replayed), "replayed")
	b.ReportMetric(per(r.s503), "503s")
	b.ReportMetric(per(r.errs), "errors")
	b.ReportMetric(per(r.late), "late")
	if len(r.wake) > 0 {
		b.ReportMetric(percentileMs(r.wake, 0.50), "p50-ms")
		b.ReportMetric(percentileMs(r.wake, 0.99), "p99-ms")
		b.ReportMetric(percentileMs(r.wake, 1), "max-ms")
	}
}

// contentionBurst sends each of keys fresh keys each times, all at once,
// request i to nodes[i%len(nodes)], and checks the answers.
func contentionBurst(b *testing.B, cl *http.Client, nodes []string, backend *caddyproc.Backend, front *answerClock,
	keys, each int, delay time.Duration) contentionResult {
	type sent struct {
		key, path string
		start     time.Time // when the request was sent
		arrived   time.Time // when its answer was read in full
		status    int
		header    http.Header
		body      []byte
		err       error
	}
	reqs := make([]sent, 0, keys*each)
	for range keys {
		key := newKey()
		path := "/v1/namespaces/bench/tables/t" + strings.ReplaceAll(key, "-", "")
		backend.Script(path, caddyproc.Reply{Delay: delay})
		for range each {
			reqs = append(reqs, sent{key: key, path: path})
		}
	}
	// Send the keys interleaved, so that they start spread over the burst,
	// not key after key; request i goes to node i%len(nodes), so that the
	// duplicates of every key alternate between the nodes.
	order := make([]int, 0, len(reqs))
	for j := range each {
		for k := range keys {
			order = append(order, k*each+j)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ready := make(chan struct{})
	var wg sync.WaitGroup
	for _, i := range order {
		wg.Go(func() {
			r := &reqs[i]
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, nodes[i%len(nodes)]+r.path, bytes.NewReader(commitBody))
			if err != nil {
				r.err = err
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", r.key)
			<-ready
			r.start = time.Now()
			resp, err := cl.Do(req)
			if err != nil {
				r.err = err
				return
			}
			r.body, r.err = io.ReadAll(resp.Body)
			r.arrived = time.Now()
			resp.Body.Close()
			r.status, r.header = resp.StatusCode, resp.Header
		})
	}
	close(ready)
	wg.Wait()

	res := contentionResult{bursts: 1}
	reported := 0
	fail := func(format string, args ...any) {
		res.errs++
		if reported++; reported <= 10 {
			b.Errorf(format, args...)
		}
	}
	for k := range keys {
		path := reqs[k*each].path
		count := backend.Count(path)
		res.executions += count
		if count != 1 {
			b.Errorf("key %s executed %d times, want exactly 1", reqs[k*each].key, count)
		}
		var original []byte
		if sentBodies := backend.Sent(path); len(sentBodies) > 0 {
			original = sentBodies[0]
		}
		answered, hasAnswer := front.answeredAt(path)
		for _, r := range reqs[k*each : (k+1)*each] {
			switch {
			case r.err != nil:
				fail("key %s: %v", r.key, r.err)
			case r.status == http.StatusOK && r.header.Get("Idempotent-Replayed") == "":
				res.executed++
				if !bytes.Equal(r.body, original) {
					fail("key %s: executed answer %q, the catalog sent %q", r.key, r.body, original)
				}
			case r.status == http.StatusOK:
				res.replayed++
				if !bytes.Equal(r.body, original) {
					fail("key %s: replayed %q, the catalog sent %q", r.key, r.body, original)
				}
				if !hasAnswer {
					fail("key %s: replayed, but the catalog never answered it", r.key)
					continue
				}
				if r.start.After(answered) {
					res.late++
				}
				res.wake = append(res.wake, r.arrived.Sub(answered))
			case r.status == http.StatusServiceUnavailable && r.header.Get("Retry-After") != "":
				res.s503++
			default:
				fail("key %s: status %d (Retry-After %q): %s", r.key, r.status, r.header.Get("Retry-After"), r.body)
			}
		}
	}
	if res.executed != keys && res.errs == 0 {
		b.Errorf("%d answers were executions, want %d (one per key)", res.executed, keys)
	}
	return res
}

// answerClock is a reverse proxy in front of the Backend that notes, per
// path, when the Backend's answer was handed on to Caddy: the moment the
// original request's response left the catalog.
type answerClock struct {
	srv *httptest.Server
	mu  sync.Mutex
	at  map[string]time.Time
}

func newAnswerClock(b *testing.B, backend *caddyproc.Backend) *answerClock {
	target, err := url.Parse(backend.URL())
	if err != nil {
		b.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.Transport = &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}
	c := &answerClock{at: map[string]time.Time{}}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		proxy.ServeHTTP(w, r)
		// The answer is buffered until the handler flushes it: note the
		// time first, so no replay can seem to arrive before it.
		c.mu.Lock()
		c.at[r.URL.EscapedPath()] = time.Now()
		c.mu.Unlock()
		_ = http.NewResponseController(w).Flush()
	}))
	b.Cleanup(c.srv.Close)
	return c
}

func (c *answerClock) addr() string { return strings.TrimPrefix(c.srv.URL, "http://") }

func (c *answerClock) answeredAt(path string) (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t, ok := c.at[path]
	return t, ok
}

// burstClient keeps a connection per concurrent request: no limit per
// host, and at least n idle ones kept for the next burst.
func burstClient(n int) *http.Client {
	return &http.Client{Transport: &http.Transport{
		MaxConnsPerHost:     0,
		MaxIdleConns:        0,
		MaxIdleConnsPerHost: max(n, 1000),
		IdleConnTimeout:     5 * time.Minute,
		DisableCompression:  true,
	}}
}

// warmUp opens about n connections to the nodes with concurrent GETs (the
// catalog answers them at once), so that a burst measures the store, not
// a storm of TCP handshakes.
func warmUp(b *testing.B, cl *http.Client, nodes []string, n int) {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			resp, err := cl.Get(nodes[i%len(nodes)] + "/v1/config")
			if err != nil {
				errs <- err
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatalf("warming up connections: %v", err)
	}
}

// percentileMs is storetest.Percentile in milliseconds.
func percentileMs(d []time.Duration, p float64) float64 {
	return float64(storetest.Percentile(d, p)) / float64(time.Millisecond)
}

// envDuration reads a duration from env, or returns def when it is unset;
// zeroOK admits 0, any other value must be positive.
func envDuration(b *testing.B, env string, def time.Duration, zeroOK bool) time.Duration {
	b.Helper()
	v := os.Getenv(env)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	switch {
	case err != nil || d < 0:
		b.Fatalf("%s: %q is not a duration", env, v)
	case d == 0 && !zeroOK:
		b.Fatalf("%s: %q is not a positive duration", env, v)
	}
	return d
}

func envInt(b *testing.B, env string, def int) int {
	b.Helper()
	v := os.Getenv(env)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		b.Fatalf("%s: %q is not a positive integer", env, v)
	}
	return n
}
