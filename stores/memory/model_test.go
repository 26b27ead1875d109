package memory

import (
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestModel runs the randomized concurrency model (storetest.RunModel) on
// the real clock. The memory store serves one node: its "nodes" are one
// store shared by all workers.
func TestModel(t *testing.T) {
	storetest.RunModel(t, func(t *testing.T) storetest.ModelHarness {
		s, err := New(Options{MaxEntries: 100_000})
		if err != nil {
			t.Fatal(err)
		}
		return storetest.ModelHarness{Nodes: []stores.Store{s, s}, Slack: 5 * time.Millisecond, WakeBound: time.Second}
	})
}
