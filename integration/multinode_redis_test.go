package integration_test

// The multi-node tests on the Redis store: two real Caddy processes sharing
// one Redis server under a fresh key prefix, in front of one counting
// backend. The server is shared with other tests, so each test deletes only
// its own keys (never FLUSHALL).

import (
	"bytes"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis/redistest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

func redisStoreBlock(addr, prefix string, options ...string) string {
	s := "store redis {\naddress " + addr + "\nkey_prefix " + prefix + "\n"
	for _, o := range options {
		s += o + "\n"
	}
	return s + "}"
}

// TestMultiNodeRedis: the multi-node guarantees on Redis — duplicates
// across nodes execute once, a response is replayed by the other node,
// a dead owner's key gets the abandoned policy's answer once its lease
// lapses, an unreachable Redis means 503 and recovery without a restart,
// and a node starts while Redis is down.
func TestMultiNodeRedis(t *testing.T) {
	t.Parallel()
	addr := redistest.Addr(t)

	t.Run("concurrent_duplicates", func(t *testing.T) {
		t.Parallel()
		b := caddyproc.NewBackend(t)
		cfg := multiNodeSite(b, redisStoreBlock(addr, redistest.Prefix(t)), "in_flight_wait 30s")
		nodes := []*caddyproc.Instance{caddyproc.Start(t, cfg), caddyproc.Start(t, cfg)}
		path := multiNodePath("concurrent")
		gate := b.Stall(path)
		key := newKey(t)
		const n = 20
		var got []response
		var burstErr error
		done := make(chan struct{})
		go func() {
			defer close(done)
			got, burstErr = burstRequests(nodes, path, key, n)
		}()
		gate.WaitArrived(t, 1, 30*time.Second)
		deadline := time.Now().Add(30 * time.Second)
		for countLogLines(nodes, "waiting for its owner", key) < n-1 {
			if time.Now().After(deadline) {
				gate.Release()
				t.Fatalf("only %d of %d duplicates waited for the owner", countLogLines(nodes, "waiting for its owner", key), n-1)
			}
			time.Sleep(20 * time.Millisecond)
		}
		for i := range nodes {
			if countLogLines(nodes[i:i+1], "waiting for its owner", key) == 0 {
				t.Errorf("no duplicate waited on node %d", i)
			}
		}
		released := time.Now()
		gate.Release()
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			t.Fatal("requests did not finish")
		}
		if burstErr != nil {
			t.Fatal(burstErr)
		}
		// Waiters wake on the change message, not on the 1s fallback poll.
		t.Logf("all %d answers %v after the release", n, time.Since(released))
		executed := 0
		for i, r := range got {
			wantStatus(t, fmt.Sprintf("request %d", i), r, http.StatusOK)
			if !bytes.Equal(r.Body, got[0].Body) {
				t.Errorf("request %d: body %q, request 0 got %q", i, r.Body, got[0].Body)
			}
			if !r.replayed() {
				executed++
			}
		}
		if executed != 1 {
			t.Errorf("%d answers were executions, want exactly 1", executed)
		}
		wantCount(t, b, path, 1)
	})

	t.Run("replay_across_nodes", func(t *testing.T) {
		t.Parallel()
		b := caddyproc.NewBackend(t)
		cfg := multiNodeSite(b, redisStoreBlock(addr, redistest.Prefix(t)))
		nodeA, nodeB := caddyproc.Start(t, cfg), caddyproc.Start(t, cfg)
		ok := multiNodePath("ok")
		key := newKey(t)
		orig := commit(t, nodeA, ok, key)
		wantStatus(t, "first request on A", orig, http.StatusOK)
		wantExecuted(t, "first request on A", orig)
		for _, node := range []*caddyproc.Instance{nodeB, nodeA, nodeB} {
			wantReplayOf(t, fmt.Sprintf("retry on :%d", node.Port), commit(t, node, ok, key), orig)
		}
		wantCount(t, b, ok, 1)

		conflict := multiNodePath("conflict")
		b.Script(conflict, caddyproc.Reply{
			Status: http.StatusConflict,
			Body:   []byte(`{"error":{"message":"Requirement failed: branch main has changed","type":"CommitFailedException","code":409}}`),
		})
		key = newKey(t)
		orig = commit(t, nodeA, conflict, key)
		wantStatus(t, "conflicting commit on A", orig, http.StatusConflict)
		wantReplayOf(t, "conflicting commit retried on B", commit(t, nodeB, conflict, key), orig)
		wantCount(t, b, conflict, 1)
	})

	for _, policy := range []string{"unknown", "reexecute"} {
		t.Run("crash_abandoned_"+policy, func(t *testing.T) {
			t.Parallel()
			// The 3s lease needs calls bounded by a quarter of it.
			testCrash(t, redisStoreBlock(addr, redistest.Prefix(t), "timeout 750ms"), policy)
		})
	}

	t.Run("outage", func(t *testing.T) {
		t.Parallel()
		proxy := sqltest.NewProxy(t, addr)
		b := caddyproc.NewBackend(t)
		store := redisStoreBlock(proxy.Addr(), redistest.Prefix(t), "timeout 1s")
		node := caddyproc.Start(t, multiNodeSite(b, store, "retry_after 2s"))
		before := multiNodePath("before")
		keyBefore := newKey(t)
		orig := commit(t, node, before, keyBefore)
		wantExecuted(t, "before the outage", orig)

		path := multiNodePath("outage")
		key := newKey(t)
		for _, mode := range []string{"blackhole", "refused"} {
			if mode == "blackhole" {
				proxy.Blackhole()
			} else {
				proxy.Stop()
			}
			for attempt := range 2 {
				what := fmt.Sprintf("%s: commit, attempt %d", mode, attempt+1)
				start := time.Now()
				r := commit(t, node, path, key)
				wantIcebergError(t, what, r, http.StatusServiceUnavailable, "ServiceUnavailableException")
				wantRetryAfter(t, what, r, "2")
				if el := time.Since(start); el > 3*time.Second {
					t.Errorf("%s: the 503 took %v (timeout 1s)", what, el)
				}
			}
			wantCount(t, b, path, 0)
		}
		proxy.Stop()
		proxy.Start()
		first := commit(t, node, path, key)
		wantStatus(t, "retry once Redis is back", first, http.StatusOK)
		wantExecuted(t, "retry once Redis is back", first)
		wantReplayOf(t, "second retry once Redis is back", commit(t, node, path, key), first)
		wantCount(t, b, path, 1)
		wantReplayOf(t, "record from before the outage", commit(t, node, before, keyBefore), orig)
	})

	t.Run("start_with_redis_down", func(t *testing.T) {
		t.Parallel()
		proxy := sqltest.NewProxy(t, addr)
		proxy.Stop()
		b := caddyproc.NewBackend(t)
		store := redisStoreBlock(proxy.Addr(), redistest.Prefix(t), "timeout 1s")
		node := caddyproc.Start(t, multiNodeSite(b, store))
		path := multiNodePath("startdown")
		key := newKey(t)
		r := commit(t, node, path, key)
		wantIcebergError(t, "commit with Redis down", r, http.StatusServiceUnavailable, "ServiceUnavailableException")
		wantCount(t, b, path, 0)
		proxy.Start()
		first := commit(t, node, path, key)
		wantStatus(t, "retry once Redis is up", first, http.StatusOK)
		wantExecuted(t, "retry once Redis is up", first)
		wantReplayOf(t, "second retry", commit(t, node, path, key), first)
		wantCount(t, b, path, 1)
	})
}
