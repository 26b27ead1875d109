package storetest

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// BenchAwaitWake measures how long after Finalize starts a waiting Await
// returns. Each iteration waits a random 0–300ms (the execution time of the
// awaited request) before finalizing, so a polling backoff is sampled at all
// its phases. It reports p50, p99 and max in milliseconds.
func BenchAwaitWake(b *testing.B, s stores.Store) {
	ctx := context.Background()
	const workers = 8
	lat := make([]time.Duration, b.N)
	var wg sync.WaitGroup
	b.ResetTimer()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := w; i < b.N; i += workers {
				key := NewKey(b)
				r := Reservation(key, Long, Long)
				if _, err := s.Reserve(ctx, r); err != nil {
					b.Error(err)
					return
				}
				done := make(chan time.Time, 1)
				go func() {
					if _, err := s.Await(ctx, key); err != nil {
						b.Error(err)
					}
					done <- time.Now()
				}()
				time.Sleep(time.Duration(rng.IntN(300)) * time.Millisecond)
				start := time.Now()
				if err := s.Finalize(ctx, key, r.Owner, stores.Response{Status: 200, Body: []byte("{}")}); err != nil {
					b.Error(err)
					return
				}
				lat[i] = (<-done).Sub(start)
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(ms(Percentile(lat, 0.50)), "p50-ms")
	b.ReportMetric(ms(Percentile(lat, 0.99)), "p99-ms")
	b.ReportMetric(ms(Percentile(lat, 1)), "max-ms")
}

// Percentile is the p-quantile (0 to 1) of d, which it leaves unsorted.
func Percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}
