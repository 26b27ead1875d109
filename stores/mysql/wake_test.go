package mysql

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A change made through the store wakes the Awaits of its own node at
// once: with polls an hour apart, only the wake can end these waits, and
// every change that ends a wait does.
func TestChangeWakesLocalAwaits(t *testing.T) {
	s, _ := openStore(t, func(c *Config) { c.PollMin, c.PollMax = time.Hour, time.Hour })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, tt := range []struct {
		name   string
		change func(key, owner string) error
		want   func(*stores.Record) bool
	}{
		{"finalize", func(key, owner string) error {
			return s.Finalize(ctx, key, owner, stores.Response{Status: 200, Body: []byte("{}")})
		}, func(r *stores.Record) bool { return r != nil && r.State == stores.StateFinal }},
		{"release", func(key, owner string) error { return s.Release(ctx, key, owner) },
			func(r *stores.Record) bool { return r == nil }},
		{"abandon", func(key, owner string) error { return s.Abandon(ctx, key, owner) },
			func(r *stores.Record) bool { return r != nil && r.Abandoned }},
		{"forget", func(key, _ string) error { _, err := s.Forget(ctx, key, true); return err },
			func(r *stores.Record) bool { return r == nil }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			key := storetest.NewKey(t)
			r := storetest.Reservation(key, storetest.Long, storetest.Long)
			if _, err := s.Reserve(ctx, r); err != nil {
				t.Fatal(err)
			}
			const waiters = 20
			got := make([]*stores.Record, waiters)
			errs := make([]error, waiters)
			var wg sync.WaitGroup
			for i := range waiters {
				wg.Add(1)
				go func() {
					defer wg.Done()
					got[i], errs[i] = s.Await(ctx, key)
				}()
			}
			waitForAwaits(t, s, key, waiters)
			if err := tt.change(key, r.Owner); err != nil {
				t.Fatal(err)
			}
			wg.Wait()
			for i := range waiters {
				if errs[i] != nil || !tt.want(got[i]) {
					t.Fatalf("Await %d after %s: %+v, %v", i, tt.name, got[i], errs[i])
				}
			}
		})
	}
}

// waitForAwaits waits until n Awaits of key share one wait on s.
func waitForAwaits(t *testing.T, s *Store, key string, n int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if s.awaits.Waiting(key) >= n {
			return
		}
	}
	t.Fatal(errors.New("the Awaits did not start"))
}
