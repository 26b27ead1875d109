package icebergidempotency

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// Scan planning changes nothing a client reads (see rerunnable): a plan
// or a task fetch whose answer was lost is released, and its retry runs
// again, as without the module. iceberg-go retries them with the same key
// on 5xx; under "unknown" every retry heard 500 CommitStateUnknownException
// and the scan failed. A commit whose answer was lost stays unknown
// (TestResponseLostAfterCommitIsUnknown).
func TestScanPlanningWhoseAnswerWasLostRunsAgain(t *testing.T) {
	for _, path := range []string{commitPath + "/plan", commitPath + "/tasks"} {
		t.Run(path, func(t *testing.T) {
			lost := newCountingCatalog(t, answerNothing)
			h := newTestHandler(t, newMemoryStore(t))
			key := storetest.NewKey(t)
			first := serve(t, h, newReverseProxy(t, lost.addr()), http.MethodPost, path, key, `{}`)
			if first.code() != http.StatusBadGateway || first.errorType() != typeServiceFailure || lost.executed.Load() != 1 {
				t.Fatalf("first = %d %q, executed %d; want 502 %s after one execution", first.code(), first.body, lost.executed.Load(), typeServiceFailure)
			}
			catalog := newCountingCatalog(t, answerOK)
			retry := serve(t, h, newReverseProxy(t, catalog.addr()), http.MethodPost, path, key, `{}`)
			if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "" || catalog.executed.Load() != 1 {
				t.Fatalf("retry = %d %q (replayed %q), executed %d; want it to run again", retry.code(), retry.body,
					retry.header.Get(ReplayedHeader), catalog.executed.Load())
			}
		})
	}
}

// A scan plan whose owner's node died (its lease lapsed) is taken over by
// its retry under the default `abandoned unknown` too, as a commit is only
// under `abandoned reexecute` (TestAbandonedPolicies).
func TestAbandonedScanPlanIsTakenOver(t *testing.T) {
	h, clock := newClockedHandler(t)
	key, path := storetest.NewKey(t), commitPath+"/plan"
	if _, err := h.store.Reserve(context.Background(), stores.Reservation{
		Key: key, Owner: "dead-node", Lease: time.Second, TTL: time.Hour,
		Binding: stores.Binding{Operation: "planTableScan", Path: path, Principal: sha256Hex(nil),
			Fingerprint: requestFingerprint(http.MethodPost, path, "", []byte(`{}`))},
	}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(2 * time.Second)
	up := answering(200, `{"status":"completed"}`)
	if res := serve(t, h, up, http.MethodPost, path, key, `{}`); res.code() != http.StatusOK || up.calls.Load() != 1 {
		t.Fatalf("retry of an abandoned scan plan = %d %q, calls %d; want it to run again", res.code(), res.body, up.calls.Load())
	}
	if again := serve(t, h, up, http.MethodPost, path, key, `{}`); again.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
		t.Fatalf("the next retry = %d, replayed %q, calls %d; want the stored answer", again.code(), again.header.Get(ReplayedHeader), up.calls.Load())
	}
}
