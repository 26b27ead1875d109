package mysql

import (
	"time"

	"context"
	"testing"

	"go.uber.org/zap/zaptest"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestModel runs the randomized concurrency model (storetest.RunModel)
// over three nodes on one table, configured as a mixed cluster may be:
// one batch slot, none, and two.
func TestModel(t *testing.T) {
	storetest.RunModel(t, func(t *testing.T) storetest.ModelHarness {
		first, cfg := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
		nodes := []stores.Store{first}
		for _, mutate := range []func(*Config){
			func(c *Config) { c.CombinedWrites = 0 },
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
