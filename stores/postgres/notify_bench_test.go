package postgres

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// BenchmarkFinalizeNotify measures fresh mutations (Reserve, then Finalize
// of a new key) from 32 goroutines on one store with listen_notify on and
// nobody waiting: the common case, which should not pay for NOTIFY. It
// reports ops/s. Run with e.g.
//
//	go test -run '^$' -bench FinalizeNotify -benchtime 3s ./stores/postgres/
func BenchmarkFinalizeNotify(b *testing.B) {
	const workers = 32
	s, _ := openStore(b, func(c *Config) {
		c.ListenNotify = true
		c.MaxConns = workers
	})
	ctx := context.Background()
	resp := stores.Response{Status: 200, Body: []byte("{}")}
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(b.N) {
				key := storetest.NewKey(b)
				r := storetest.Reservation(key, storetest.Long, storetest.Long)
				if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
					b.Errorf("Reserve = %+v, %v", res, err)
					return
				}
				if err := s.Finalize(ctx, key, r.Owner, resp); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "ops/s")
}
