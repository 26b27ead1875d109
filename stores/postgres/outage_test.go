package postgres

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestOutageAndRecovery cuts the network to the server under an open Store,
// first refusing connections, then swallowing them: calls must fail within
// StatementTimeout, and work again once the server is back, without
// reopening the Store (LISTEN included).
func TestOutageAndRecovery(t *testing.T) {
	proxy, dsn := proxiedDSN(t)
	const timeout = time.Second
	s, _ := openStore(t, func(c *Config) {
		c.DSN = dsn
		c.StatementTimeout = timeout
		c.ListenNotify = true
	})
	ctx := context.Background()
	key := storetest.NewKey(t)
	r := storetest.Reservation(key, storetest.Long, storetest.Long)
	if _, err := s.Reserve(ctx, r); err != nil {
		t.Fatal(err)
	}

	calls := []func() error{
		func() error { _, err := s.Load(ctx, key); return err },
		func() error {
			_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
			return err
		},
		func() error { return s.Finalize(ctx, key, "x", stores.Response{Status: 200}) },
		func() error { _, err := s.TakeOver(ctx, key, "x", "y", time.Second, time.Minute); return err },
		// A renewal and a takeover whose reading of the server's clock
		// is old refresh it first, within the same timeout: the lease
		// counts a renewal as one call (until the build after f91aab0,
		// each took a timeout, two in all).
		func() error {
			s.clock.Expire()
			return s.ExtendLease(ctx, key, r.Owner, storetest.Long, storetest.Long)
		},
		func() error {
			s.clock.Expire()
			_, err := s.TakeOver(ctx, key, "x", "y", time.Second, time.Minute)
			return err
		},
		func() error { _, err := s.PurgeExpired(ctx, 10); return err },
	}
	for _, mode := range []string{"refused", "blackhole"} {
		proxy.Stop()
		if mode == "blackhole" {
			proxy.Blackhole()
		}
		for _, call := range calls {
			start := time.Now()
			err := call()
			if err == nil {
				t.Fatalf("%s: call succeeded with the database down", mode)
			}
			if el := time.Since(start); el > timeout+500*time.Millisecond {
				t.Fatalf("%s: call took %v with the database down (timeout %v): %v", mode, el, timeout, err)
			}
			t.Logf("%s: %v", mode, err)
		}
	}
	proxy.Stop()
	proxy.Start()

	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := s.Load(ctx, key)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no recovery: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Awaits wake by NOTIFY again once the listener has reconnected (its
	// backoff is at most 5s). The fallback poll (1s) would hide a dead
	// listener, so wait past it and measure.
	deadline = time.Now().Add(15 * time.Second)
	for {
		k := storetest.NewKey(t)
		r := storetest.Reservation(k, storetest.Long, storetest.Long)
		if _, err := s.Reserve(ctx, r); err != nil {
			t.Fatal(err)
		}
		done := make(chan time.Time, 1)
		go func() {
			if _, err := s.Await(ctx, k); err != nil {
				t.Error(err)
			}
			done <- time.Now()
		}()
		time.Sleep(1100 * time.Millisecond)
		start := time.Now()
		if err := s.Finalize(ctx, k, r.Owner, stores.Response{Status: 200}); err != nil {
			t.Fatal(err)
		}
		lat := (<-done).Sub(start)
		if lat < 300*time.Millisecond {
			t.Logf("NOTIFY wake-up after recovery: %v", lat)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Await woke %v after Finalize: the listener did not recover", lat)
		}
	}
}

// A call that gets no connection (a server that accepts connections and
// never answers, once the store was ready) is marked so: see
// sqltest.CallWithoutAConnection.
func TestCallWithoutAConnectionIsMarked(t *testing.T) {
	proxy, dsn := proxiedDSN(t)
	s, _ := openStore(t, func(c *Config) {
		c.DSN = dsn
		c.StatementTimeout = 300 * time.Millisecond
	})
	sqltest.CallWithoutAConnection(t, proxy, func() error {
		_, err := s.PurgeExpired(context.Background(), 10)
		return err
	}, func() { dropIdle(s) })
}
