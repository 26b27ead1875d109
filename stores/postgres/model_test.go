package postgres

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestModel runs the randomized concurrency model (storetest.RunModel)
// over three nodes on one table, with one batch slot, none, and two. Two
// wait with LISTEN/NOTIFY, with a fallback poll of a minute, so that a
// waiter that a lost notification left waiting shows; the third polls,
// as a node with listen_notify off does beside them.
func TestModel(t *testing.T) {
	storetest.RunModel(t, func(t *testing.T) storetest.ModelHarness {
		first, cfg := openStore(t, func(c *Config) { c.CombinedWrites, c.ListenNotify, c.NotifyFallback = 1, true, time.Minute })
		nodes := []stores.Store{first}
		for _, mutate := range []func(*Config){
			func(c *Config) { c.CombinedWrites, c.ListenNotify = 0, false },
			func(c *Config) { c.CombinedWrites = 2 },
		} {
			c := cfg
			mutate(&c)
			s, err := Open(context.Background(), c, zaptest.NewLogger(t))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			if err := s.Ready(context.Background()); err != nil {
				t.Fatal(err)
			}
			nodes = append(nodes, s)
		}
		return storetest.ModelHarness{Nodes: nodes, WakeBound: 1500 * time.Millisecond}
	})
}
