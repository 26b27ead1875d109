package icebergidempotency

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// lostReserves is a store that went away behind something that accepts
// connections and then drops them (a proxy or load balancer in front of
// it, a server restarting): every Reserve's reply is lost (not provably
// unsent), and every call after that hangs until its deadline.
type lostReserves struct {
	stores.Store
	releasing, peak atomic.Int64
	unblock         chan struct{} // closed: the store answers again
}

func (*lostReserves) Reserve(context.Context, stores.Reservation) (stores.ReserveResult, error) {
	return stores.ReserveResult{}, errInjected
}

func (s *lostReserves) Release(ctx context.Context, _, _ string) error {
	n := s.releasing.Add(1)
	defer s.releasing.Add(-1)
	for {
		p := s.peak.Load()
		if n <= p || s.peak.CompareAndSwap(p, n) {
			break
		}
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-s.unblock:
		return errInjected
	}
}

// wantRepairsAtMost bounds the repairs running at once in the test.
const wantRepairsAtMost = 64

// The background repairs of lost replies are bounded while the store is
// down: each failed request used to start a goroutine of its own that
// retried its Release for two minutes, so that their number (and the calls
// they hold open at the store, all of them at once when it comes back)
// grew with the request rate times two minutes. Live, a Redis cut for 3 s
// under 16 clients left 1700 of them; 2000 failing requests a second would
// keep 240,000.
func TestLostReplyRepairsAreBounded(t *testing.T) {
	s := &lostReserves{Store: newMemoryStore(t), unblock: make(chan struct{})}
	h := newTestHandler(t, s)
	// One try each, then the repairs end: the test waits for them.
	h.repairWindow, h.settleWindow = time.Millisecond, time.Millisecond
	t.Cleanup(func() {
		close(s.unblock)
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			h.repairs.mu.Lock()
			idle := h.repairs.workers == 0
			h.repairs.mu.Unlock()
			if idle {
				return
			}
		}
		t.Error("the repairs did not end once the store answered")
	})
	up := answering(200, "{}")
	before := runtime.NumGoroutine()
	const requests = 300
	for range requests {
		if res := serve(t, h, up, "POST", "/v1/namespaces", storetest.NewKey(t), nsBody); res.code() != 503 {
			t.Fatalf("keyed request with the store failing = %d %s, want 503", res.code(), res.body)
		}
	}
	time.Sleep(200 * time.Millisecond) // the repairs start their first tries
	grown := runtime.NumGoroutine() - before
	if p := s.peak.Load(); p > wantRepairsAtMost || grown > wantRepairsAtMost+20 {
		t.Fatalf("after %d requests whose Reserve reply was lost: %d Releases at once at the store, %d more goroutines; want at most %d of either",
			requests, p, grown, wantRepairsAtMost)
	}
	if up.calls.Load() != 0 {
		t.Fatalf("the catalog was called %d times", up.calls.Load())
	}
}

// An undo try that began inside the settle window and found nothing does
// not end the job, however late its reply: its statement may have read
// the key before a write held up on its way landed, within the window.
// The job used to end on such a try when its reply came back after the
// window, and (until the build after 5759674) after the repair window
// too, when the settle window was as long: a DSN's lock wait of 2 minutes
// or more. The undo here is a stand-in: a real store cannot be made to
// answer "nothing there" at one moment and deliver the reply at another
// on demand.
func TestUndoTryBegunInsideTheSettleWindowDoesNotEndIt(t *testing.T) {
	const settle = 300 * time.Millisecond
	for _, repair := range []time.Duration{time.Minute, 100 * time.Millisecond} {
		t.Run(fmt.Sprintf("repair=%v", repair), func(t *testing.T) {
			failed := time.Now()
			var tries atomic.Int32
			var lastBegan atomic.Int64
			done := make(chan struct{})
			var q repairQueue
			q.add(&repairJob{
				undo: func(ctx context.Context, _ stores.Store, _, _ string) error {
					lastBegan.Store(time.Now().UnixNano())
					if tries.Add(1) == 1 {
						// Nothing found now; the reply comes back after the window.
						time.Sleep(time.Until(failed.Add(settle + 100*time.Millisecond)))
					}
					return stores.ErrNotOwner
				},
				key: "k", owner: "o",
				failed: failed, settle: settle, repair: repair, wait: 10 * time.Millisecond,
				leave: func() { close(done) },
			})
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("the undo never ended")
			}
			if n := tries.Load(); n < 2 {
				t.Fatalf("the job ended after %d try, one that began inside the settle window", n)
			}
			if began := time.Unix(0, lastBegan.Load()); began.Sub(failed) < settle {
				t.Fatalf("the last try began %v after the failure, inside the %v window", began.Sub(failed), settle)
			}
		})
	}
}
