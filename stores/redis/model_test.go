package redis

import (
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestModel runs the randomized concurrency model (storetest.RunModel)
// over two nodes (two clients, each with its pool and subscription) on
// one key prefix. The fallback poll is 10s, far longer than WakeBound, so
// that a waiter that a lost message left waiting shows.
func TestModel(t *testing.T) {
	storetest.RunModel(t, func(t *testing.T) storetest.ModelHarness {
		first, cfg := openStore(t, func(c *Config) { c.NotifyFallback = 10 * time.Second })
		second, err := Open(cfg, zaptest.NewLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { second.Close() })
		first.Warm()
		second.Warm()
		time.Sleep(300 * time.Millisecond) // let the subscriptions start
		return storetest.ModelHarness{Nodes: []stores.Store{first, second}, WakeBound: 1500 * time.Millisecond}
	})
}
