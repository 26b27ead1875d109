package postgres

import (
	"context"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestStrictIsolation runs the store on sessions whose
// default_transaction_isolation is stricter than PostgreSQL's default, as
// a database or role may set it. Until the build after 4f53fed, the
// server's rollbacks for conflicts failed the store's calls, and the
// handler answered 503 for them: under REPEATABLE READ, reservations of one
// key racing each other; under SERIALIZABLE, also 146 of 4,800
// reserve-and-finalize pairs of distinct keys, 32 at a time. The store now
// runs a statement rolled back for a conflict again.
func TestStrictIsolation(t *testing.T) {
	for _, iso := range []string{"repeatable read", "serializable"} {
		t.Run(iso, func(t *testing.T) {
			strict := func(c *Config) {
				c.DSN += "&default_transaction_isolation=" + url.PathEscape(iso)
				c.MaxConns = 32
			}
			t.Run("one key, 16 racers", func(t *testing.T) {
				s, _ := openStore(t, strict)
				reserveRace(t, s)
			})
			t.Run("distinct keys, 32 at a time", func(t *testing.T) {
				s, _ := openStore(t, strict)
				distinctKeys(t, s, 32, 100)
			})
			t.Run("combined writes", func(t *testing.T) {
				s, _ := openStore(t, func(c *Config) { strict(c); c.CombinedWrites = 1 })
				distinctKeys(t, s, 32, 100)
			})
		})
	}
	t.Run("conformance, serializable", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) storetest.Harness {
			s, _ := openStore(t, func(c *Config) { c.DSN += "&default_transaction_isolation=serializable" })
			return storetest.Harness{Store: s, Advance: time.Sleep}
		})
	})
}

// distinctKeys has workers goroutines each reserve and finalize n fresh
// keys with a 2 KB answer, and fails the test on any error.
func distinctKeys(t *testing.T, s *Store, workers, n int) {
	ctx := context.Background()
	var failed atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range n {
				r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
				res, err := s.Reserve(ctx, r)
				if err == nil && !res.Reserved {
					t.Errorf("Reserve of a fresh key = %+v", res)
					continue
				}
				if err == nil {
					err = s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: make([]byte, 2048)})
				}
				if err != nil && failed.Add(1) <= 3 {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if f := failed.Load(); f > 0 {
		t.Fatalf("%d of %d reserve-and-finalize pairs failed", f, workers*n)
	}
}
