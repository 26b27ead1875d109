package icebergidempotency

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// reserveFailsAfterWait is a memory store whose fifth Reserve fails (a
// store blip): the first three reserve / find the key in flight, and of the
// two duplicates woken by the owner's release, the first to Reserve again
// wins the key and the second hits the blip.
type reserveFailsAfterWait struct {
	stores.Store
	reserves atomic.Int32
	awaiting atomic.Int32
	awoken   atomic.Int32
	won      chan struct{} // closed once the winner holds the key
}

func (s *reserveFailsAfterWait) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	switch s.reserves.Add(1) {
	case 4:
		// Both duplicates saw the release (two nodes' waiters wake
		// together): the first to Reserve again wins the key.
		for deadline := time.Now().Add(5 * time.Second); s.awoken.Load() < 2 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		res, err := s.Store.Reserve(ctx, r)
		close(s.won)
		return res, err
	case 5:
		// The blip hits the other duplicate once the key is held again.
		<-s.won
		return stores.ReserveResult{}, errInjected
	}
	return s.Store.Reserve(ctx, r)
}

func (s *reserveFailsAfterWait) Await(ctx context.Context, key string) (*stores.Record, error) {
	s.awaiting.Add(1)
	defer s.awoken.Add(1)
	return s.Store.Await(ctx, key)
}

// Two duplicates wait for an owner whose catalog answered 503 (released).
// One reserves the key and executes; the other's Reserve fails. The store
// has shown this request the key held by others, so fail_open must not
// apply: passing it through ran the commit a second time beside the
// duplicate that now holds the key. It gets 503 + Retry-After instead.
// (The store failing on cue is a stand-in: no real store does.)
func TestFailOpenDoesNotPassAKeyAnotherWokeWith(t *testing.T) {
	s := &reserveFailsAfterWait{Store: newMemoryStore(t), won: make(chan struct{})}
	h := newTestHandler(t, s)
	h.FailOpen = true
	h.InFlightWait = caddy.Duration(10 * time.Second)
	var executions atomic.Int32
	release := make(chan struct{})
	up := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		_, _ = io.ReadAll(r.Body)
		if executions.Add(1) == 1 {
			<-release
			w.WriteHeader(http.StatusServiceUnavailable) // released: not final
			return nil
		}
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{"namespace":["a"],"properties":{}}`)
		return nil
	}}
	key := storetest.NewKey(t)
	results := make(chan result, 3)
	go func() { results <- serve(t, h, up, "POST", "/v1/namespaces", key, nsBody) }()
	for s.reserves.Load() < 1 {
		time.Sleep(time.Millisecond)
	}
	for i := 0; i < 2; i++ {
		go func() { results <- serve(t, h, up, "POST", "/v1/namespaces", key, nsBody) }()
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.awaiting.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	close(release)
	var codes []int
	for i := 0; i < 3; i++ {
		codes = append(codes, (<-results).code())
	}
	if n := executions.Load(); n != 2 {
		t.Fatalf("catalog executed %d times (answers %v); want 2: the owner's (503, released) and one duplicate's. "+
			"The duplicate whose Reserve failed after its wait was passed through by fail_open beside the one holding the key", n, codes)
	}
}

// slowReserveThenExtendFails is a memory store whose first Reserve comes
// back slowly (a lock, a busy database: past a quarter of the lease), and
// whose renewal of that lease then fails once, once a duplicate is waiting
// on the record.
type slowReserveThenExtendFails struct {
	stores.Store
	reserves atomic.Int32
	extends  atomic.Int32
	awaiting atomic.Int32
	slow     time.Duration
}

func (s *slowReserveThenExtendFails) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	res, err := s.Store.Reserve(ctx, r)
	if s.reserves.Add(1) == 1 {
		time.Sleep(s.slow)
	}
	return res, err
}

func (s *slowReserveThenExtendFails) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	if s.extends.Add(1) == 1 {
		for deadline := time.Now().Add(5 * time.Second); s.awaiting.Load() < 1 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		return errInjected
	}
	return s.Store.ExtendLease(ctx, key, owner, lease, ttl)
}

func (s *slowReserveThenExtendFails) Await(ctx context.Context, key string) (*stores.Record, error) {
	s.awaiting.Add(1)
	return s.Store.Await(ctx, key)
}

// A request that reserved its key (a duplicate waits on it) and then
// failed to renew the lease releases the key. With fail_open it went to the
// catalog unguarded all the same, while the release woke the duplicate,
// which reserved and executed the same commit beside it. It gets 503 +
// Retry-After instead; nothing of it was sent.
func TestFailOpenDoesNotPassAKeyItReleased(t *testing.T) {
	s := &slowReserveThenExtendFails{Store: newMemoryStore(t), slow: 120 * time.Millisecond}
	h := newTestHandler(t, s)
	h.FailOpen = true
	h.Lease = caddy.Duration(400 * time.Millisecond) // renewed before executing after 100 ms
	h.InFlightWait = caddy.Duration(10 * time.Second)
	var executions atomic.Int32
	up := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		_, _ = io.ReadAll(r.Body)
		executions.Add(1)
		time.Sleep(50 * time.Millisecond)
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{"namespace":["a"],"properties":{}}`)
		return nil
	}}
	key := storetest.NewKey(t)
	results := make(chan result, 2)
	go func() { results <- serve(t, h, up, "POST", "/v1/namespaces", key, nsBody) }()
	for s.reserves.Load() < 1 {
		time.Sleep(time.Millisecond)
	}
	go func() { results <- serve(t, h, up, "POST", "/v1/namespaces", key, nsBody) }()
	codes := []int{(<-results).code(), (<-results).code()}
	if n := executions.Load(); n != 1 {
		t.Fatalf("catalog executed %d times (answers %v); want 1: the owner released its key and passed through unguarded (fail_open), "+
			"and the duplicate waiting on it reserved and executed too", n, codes)
	}
}

// unreadableRecords is a store whose records this build cannot read, as
// the SQL and Redis stores report a record a newer build wrote in a state
// this one does not know.
type unreadableRecords struct {
	stores.Store
	releases atomic.Int32
}

var errDoneV9 = fmt.Errorf("%w: record has unknown state %q", stores.ErrUnreadableRecord, "done_v9")

func (*unreadableRecords) Reserve(context.Context, stores.Reservation) (stores.ReserveResult, error) {
	return stores.ReserveResult{}, errDoneV9
}

func (*unreadableRecords) Load(context.Context, string) (*stores.Record, error) {
	return nil, errDoneV9
}

func (s *unreadableRecords) Release(ctx context.Context, key, owner string) error {
	s.releases.Add(1)
	return s.Store.Release(ctx, key, owner)
}

// A record the store found but cannot read stands for a request that may
// have executed: under fail_open it is not passed through, and without it
// the answer is not a 503 the client would retry until the record expires.
// Either way the retry hears "outcome unknown" and the catalog is not
// called. Before, fail_open passed it through (a second execution) and
// without it every retry got 503 for the record's life.
func TestUnreadableRecordIsNotPassedThrough(t *testing.T) {
	for _, failOpen := range []bool{true, false} {
		s := &unreadableRecords{Store: newMemoryStore(t)}
		h := newTestHandler(t, s)
		h.FailOpen = failOpen
		catalog := newCountingCatalog(t, answerOK)
		got := serve(t, h, newReverseProxy(t, catalog.addr()), http.MethodPost, commitPath, storetest.NewKey(t), commitBody)
		if got.code() != http.StatusInternalServerError || got.errorType() != typeCommitStateUnknown || catalog.executed.Load() != 0 {
			t.Fatalf("fail_open %v: %d %q, catalog executed %d; want 500 %s and no execution",
				failOpen, got.code(), got.body, catalog.executed.Load(), typeCommitStateUnknown)
		}
		// The store answered: no reservation of this request's can be
		// left behind, so nothing is undone in the background (which
		// sent a Release every few hundred milliseconds for the whole
		// settle window, on every retry).
		time.Sleep(300 * time.Millisecond)
		if n := s.releases.Load(); n != 0 {
			t.Fatalf("fail_open %v: %d background Releases after an unreadable record", failOpen, n)
		}
	}
	// A key of a version key_versions leaves out is looked up; a record
	// found but unreadable is answered as unreadable, not 503 until it
	// expires.
	h := newTestHandler(t, &unreadableRecords{Store: newMemoryStore(t)})
	catalog := newCountingCatalog(t, answerOK)
	v4 := "3f1c2b7e-9a4d-4c1e-8b2a-5d6e7f809a1b"
	if got := serve(t, h, newReverseProxy(t, catalog.addr()), http.MethodPost, commitPath, v4, commitBody); got.code() != http.StatusInternalServerError || got.errorType() != typeCommitStateUnknown {
		t.Fatalf("v4 key over an unreadable record: %d %q, want 500 %s", got.code(), got.body, typeCommitStateUnknown)
	}
}
