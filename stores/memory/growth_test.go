package memory

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// BenchmarkGrowth measures Reserve (fresh key) and Load (replay) at 10,000
// and at 1,000,000 final records (ICEBERG_IDEMPOTENCY_BENCH_GROWTH_SIZES),
// filled through the store's own API with bounds raised so that nothing is
// evicted. Run with
//
//	go test -run '^$' -bench Growth -benchtime 1x ./stores/memory/
func BenchmarkGrowth(b *testing.B) {
	var evicted atomic.Int64
	s, err := New(Options{
		MaxEntries: 1 << 30,
		MaxBytes:   1 << 40,
		OnEvict:    func(Eviction) { evicted.Add(1) },
	})
	if err != nil {
		b.Fatal(err)
	}
	bind, resp := storetest.GrowthRecord()
	ctx := context.Background()
	fill := func(b *testing.B, from, to int) {
		for i := from; i < to; i++ {
			r := stores.Reservation{Key: storetest.GrowthKey(i), Binding: bind, Owner: uuid.NewString(), Lease: storetest.Long, TTL: storetest.Long}
			if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
				b.Fatalf("filling record %d: reserved %v, %v", i, res.Reserved, err)
			}
			if err := s.Finalize(ctx, r.Key, r.Owner, resp); err != nil {
				b.Fatalf("filling record %d: %v", i, err)
			}
		}
		if n := evicted.Load(); n > 0 {
			b.Fatalf("%d records evicted while filling: the bounds are too small for the benchmark", n)
		}
	}
	storetest.BenchGrowth(b, s, fill)
	if n := evicted.Load(); n > 0 {
		b.Errorf("%d records evicted during the benchmark", n)
	}
}
