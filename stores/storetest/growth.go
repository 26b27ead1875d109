package storetest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// GrowthSizesEnv names the environment variable with the record counts
// GrowthSamples is the count of GrowthSamplesEnv, by default 2,000.
func GrowthSamples(b *testing.B) int {
	b.Helper()
	v := os.Getenv(GrowthSamplesEnv)
	if v == "" {
		return 2000
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		b.Fatalf("%s: %q is not a positive count", GrowthSamplesEnv, v)
	}
	return n
}

// BenchGrowth measures at, comma-separated, smallest first.
const GrowthSizesEnv = "ICEBERG_IDEMPOTENCY_BENCH_GROWTH_SIZES"

// GrowthSamplesEnv names the environment variable with how many calls of
// each operation BenchGrowth times at each size (per benchmark iteration).
const GrowthSamplesEnv = "ICEBERG_IDEMPOTENCY_BENCH_GROWTH_SAMPLES"

// GrowthBodySize is the size of the body of every record a fill inserts: a
// small CommitTableResponse.
const GrowthBodySize = 512

// GrowthKeyPrefix starts every key a fill inserts; GrowthKey(i) is the ith.
// The keys sort before the UUIDv7 keys of today (which start 01…), so fresh
// keys land at the right edge of an ordered index, as in production.
const GrowthKeyPrefix = "00000000-0000-7000-8000-"

// GrowthKey is the key of the ith record a fill inserts (i from 0): the
// prefix and i as 12 decimal digits, a 36-character version 7 UUID.
func GrowthKey(i int) string { return fmt.Sprintf("%s%012d", GrowthKeyPrefix, i) }

// GrowthRecord is what a fill stores under every key: a live final record,
// bound to the binding Reservation uses, whose response is a 200 with a
// Content-Type and a GrowthBodySize body.
func GrowthRecord() (stores.Binding, stores.Response) {
	return binding(1), stores.Response{
		Status: http.StatusOK,
		Header: http.Header{"Content-Type": {"application/json"}},
		Body:   []byte(strings.Repeat("x", GrowthBodySize)),
	}
}

// GrowthSizes are the record counts of GrowthSizesEnv, by default 10,000
// and 1,000,000, sorted.
func GrowthSizes(b *testing.B) []int {
	b.Helper()
	spec := os.Getenv(GrowthSizesEnv)
	if spec == "" {
		spec = "10000,1000000"
	}
	var sizes []int
	for _, f := range strings.Split(spec, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			b.Fatalf("%s: %q is not a positive record count", GrowthSizesEnv, f)
		}
		sizes = append(sizes, n)
	}
	slices.Sort(sizes)
	return slices.Compact(sizes)
}

// BenchGrowth measures how the cost of the request path's store calls grows
// with the number of records the store holds: Reserve of a fresh key (a
// first request) and Load of a final key (a replay), timed one call at a
// time, at every size of GrowthSizes. fill(b, from, to) must add the live
// final records GrowthKey(from) … GrowthKey(to-1), each as GrowthRecord
// describes; it is called with increasing ranges, so the store grows from
// one size to the next. Each Load reads a key drawn at random from all the
// filled ones; each fresh key is released after it was timed, so the store
// holds exactly the filled records when the next size is measured.
//
// Per size it reports p50 and p99 in microseconds, e.g. reserve-10k-p50-us,
// and, for more than one size, the ratios of the largest size to the
// smallest (x-reserve-p50, x-reserve-p99, x-load-p50, x-load-p99). It is
// meant for -benchtime 1x: every iteration times GrowthSamplesEnv calls
// (default 2,000) of each operation per size.
func BenchGrowth(b *testing.B, s stores.Store, fill func(b *testing.B, from, to int)) {
	sizes := GrowthSizes(b)
	samples := GrowthSamples(b) * b.N
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	reserve := map[int][]time.Duration{}
	load := map[int][]time.Duration{}
	have := 0
	b.ResetTimer()
	for _, n := range sizes {
		b.StopTimer()
		start := time.Now()
		fill(b, have, n)
		b.Logf("filled %d records up to %d in %v", n-have, n, time.Since(start).Round(time.Millisecond))
		have = n
		// One Load of a filled key checks what the fill wrote.
		checkGrowthRecord(b, s, GrowthKey(rng.IntN(n)))
		b.StartTimer()

		res := make([]time.Duration, samples)
		for i := range res {
			r := Reservation(NewKey(b), Long, Long)
			t0 := time.Now()
			got, err := s.Reserve(ctx, r)
			res[i] = time.Since(t0)
			if err != nil {
				b.Fatalf("Reserve at %d records: %v", n, err)
			}
			if !got.Reserved {
				b.Fatalf("Reserve of a fresh key at %d records: not reserved", n)
			}
			if err := s.Release(ctx, r.Key, r.Owner); err != nil {
				b.Fatalf("Release at %d records: %v", n, err)
			}
		}
		lds := make([]time.Duration, samples)
		for i := range lds {
			key := GrowthKey(rng.IntN(n))
			t0 := time.Now()
			rec, err := s.Load(ctx, key)
			lds[i] = time.Since(t0)
			if err != nil {
				b.Fatalf("Load at %d records: %v", n, err)
			}
			if rec == nil || rec.State != stores.StateFinal {
				b.Fatalf("Load of filled key %s at %d records: %+v, want a final record", key, n, rec)
			}
		}
		reserve[n], load[n] = res, lds
	}
	b.StopTimer()
	ReportGrowth(b, "reserve", time.Microsecond, sizes, reserve)
	ReportGrowth(b, "load", time.Microsecond, sizes, load)
}

// ReportGrowth reports the p50 and p99 of op's latencies at each size in
// unit (time.Microsecond: "us", time.Millisecond: "ms"), e.g.
// reserve-10k-p50-us, and, for more than one size, their ratios of the
// largest size to the smallest, x-<op>-p50 and x-<op>-p99.
func ReportGrowth(b *testing.B, op string, unit time.Duration, sizes []int, latencies map[int][]time.Duration) {
	suffix := "-us"
	if unit == time.Millisecond {
		suffix = "-ms"
	}
	in := func(d time.Duration) float64 { return float64(d) / float64(unit) }
	for _, n := range sizes {
		name := op + "-" + SizeName(n)
		b.ReportMetric(in(Percentile(latencies[n], 0.50)), name+"-p50"+suffix)
		b.ReportMetric(in(Percentile(latencies[n], 0.99)), name+"-p99"+suffix)
	}
	if len(sizes) > 1 {
		lo, hi := latencies[sizes[0]], latencies[sizes[len(sizes)-1]]
		b.ReportMetric(float64(Percentile(hi, 0.50))/float64(Percentile(lo, 0.50)), "x-"+op+"-p50")
		b.ReportMetric(float64(Percentile(hi, 0.99))/float64(Percentile(lo, 0.99)), "x-"+op+"-p99")
	}
}

// checkGrowthRecord fails the benchmark unless key holds what GrowthRecord
// describes: a fill that wrote something else would measure the wrong thing.
func checkGrowthRecord(b *testing.B, s stores.Store, key string) {
	b.Helper()
	rec, err := s.Load(context.Background(), key)
	if err != nil {
		b.Fatalf("Load %s after the fill: %v", key, err)
	}
	bind, resp := GrowthRecord()
	switch {
	case rec == nil:
		b.Fatalf("Load %s after the fill: no record", key)
	case rec.State != stores.StateFinal || rec.Binding != bind || rec.Response == nil:
		b.Fatalf("Load %s after the fill: %+v, want a final record bound to %+v", key, rec, bind)
	case rec.Response.Status != resp.Status || string(rec.Response.Body) != string(resp.Body) ||
		rec.Response.Header.Get("Content-Type") != resp.Header.Get("Content-Type"):
		b.Fatalf("Load %s after the fill: response %d %v (%d body bytes), want %d %v (%d)", key,
			rec.Response.Status, rec.Response.Header, len(rec.Response.Body), resp.Status, resp.Header, len(resp.Body))
	}
}

// SizeName writes a record count the short way: 10k, 1M, 2500.
func SizeName(n int) string {
	switch {
	case n%1_000_000 == 0:
		return strconv.Itoa(n/1_000_000) + "M"
	case n%1000 == 0:
		return strconv.Itoa(n/1000) + "k"
	}
	return strconv.Itoa(n)
}
