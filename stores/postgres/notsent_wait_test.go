package postgres

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A call that never got a connection from the pool never sent its
// statement, whether the pool's connect to a partitioned server hung or
// every connection was busy: the redis store marks that wait not sent
// (TestPoolWaitIsNotSent there). Unmarked, each keyed request failed by a
// partitioned PostgreSQL left a goroutine retrying its Release for two
// minutes, each try waiting on the same pool (live: 45 such goroutines
// from 8 clients after 65 s of a blackholed database, growing with the
// request rate).
func TestPoolWaitIsNotSent(t *testing.T) {
	ctx := context.Background()

	t.Run("connect_hangs", func(t *testing.T) {
		proxy, proxied := proxiedDSN(t)
		s, _ := openStore(t, func(c *Config) { c.DSN = proxied; c.StatementTimeout = time.Second })
		proxy.Blackhole()
		defer proxy.Stop()
		s.pool.Reset() // no idle connection: the call must dial, and the dial hangs
		err := s.Release(ctx, storetest.NewKey(t), "owner")
		if err == nil || !stores.NotSent(err) {
			t.Fatalf("Release whose connect hung: err = %v, NotSent = %v; want a not-sent error", err, stores.NotSent(err))
		}
		_, err = s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
		if err == nil || !stores.NotSent(err) {
			t.Fatalf("Reserve whose connect hung: err = %v, NotSent = %v; want a not-sent error", err, stores.NotSent(err))
		}
	})

	t.Run("pool_busy", func(t *testing.T) {
		s, _ := openStore(t, func(c *Config) { c.MaxConns = 1; c.StatementTimeout = time.Second })
		// Something else holds the pool's one connection.
		c, err := s.pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
		err = s.Release(ctx, storetest.NewKey(t), "owner")
		if err == nil || !stores.NotSent(err) {
			t.Fatalf("Release that found no free connection: err = %v, NotSent = %v; want a not-sent error", err, stores.NotSent(err))
		}
	})
}
