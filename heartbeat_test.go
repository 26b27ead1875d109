package icebergidempotency

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// leaseLog records lease renewals, and any that comes once the key's
// execution has ended (Finalize or Release called).
type leaseLog struct {
	stores.Store
	mu       sync.Mutex
	renewals int
	ended    bool
	late     int
}

func (s *leaseLog) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	s.mu.Lock()
	s.renewals++
	if s.ended {
		s.late++
	}
	s.mu.Unlock()
	return s.Store.ExtendLease(ctx, key, owner, lease, ttl)
}

func (s *leaseLog) end() {
	s.mu.Lock()
	s.ended = true
	s.mu.Unlock()
}

// Finalize ends the execution once it returns: the lease is renewed while
// a Finalize runs (see TestLeaseHeldWhileFinalizeIsRetried).
func (s *leaseLog) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	err := s.Store.Finalize(ctx, key, owner, resp)
	s.end()
	return err
}

func (s *leaseLog) Release(ctx context.Context, key, owner string) error {
	s.end()
	return s.Store.Release(ctx, key, owner)
}

func (s *leaseLog) counts() (renewals, late int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.renewals, s.late
}

// The lease is renewed every third of it while the catalog executes, and
// never once the key is final or released: a renewal after Finalize or
// racing Release could only fail and be counted as a lost lease.
func TestHeartbeatRenewsWhileExecutingOnly(t *testing.T) {
	for _, status := range []int{200, 503} { // finalized, released
		log := &leaseLog{Store: newMemoryStore(t)}
		h := newTestHandler(t, log)
		h.Lease = caddy.Duration(30 * time.Millisecond) // renewed every 10ms
		slow := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
			time.Sleep(120 * time.Millisecond)
			w.WriteHeader(status)
			_, _ = io.WriteString(w, "{}")
			return nil
		}}
		if res := serve(t, h, slow, "POST", "/v1/namespaces", storetest.NewKey(t), nsBody); res.code() != status {
			t.Fatalf("status %d, want %d: %s", res.code(), status, res.body)
		}
		renewed, _ := log.counts()
		// 120ms at one renewal per 10ms: at least a few, whatever the
		// scheduler does.
		if renewed < 3 {
			t.Fatalf("status %d: %d renewals during a 120ms execution with a 30ms lease, want at least 3", status, renewed)
		}
		time.Sleep(40 * time.Millisecond) // four more periods
		after, late := log.counts()
		if late != 0 || after != renewed {
			t.Fatalf("status %d: %d renewals after the execution ended (%d late, %d in all)", status, after-renewed, late, after)
		}
	}
}

// On the memory store, as Caddy provisions it, a request takes its lease
// for the whole execution and renews nothing: no timer per request. A
// duplicate that arrives after `lease` has passed still finds the key in
// flight, not abandoned, and the request's store calls include no renewal.
func TestMemoryStoreLeaseCoversTheExecution(t *testing.T) {
	ctx := runningCaddyContext(t)
	h := &Handler{Lease: caddy.Duration(30 * time.Millisecond), InFlightWait: caddy.Duration(20 * time.Millisecond)}
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Cleanup() })
	started, finish := make(chan struct{}), make(chan struct{})
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-finish
		answerOK(w, r)
	})
	proxy := newReverseProxy(t, catalog.addr())
	extends := storeCalls(t, "memory", opExtendLease)
	key := storetest.NewKey(t)
	first := make(chan result, 1)
	go func() { first <- serve(t, h, proxy, "POST", commitPath, key, commitBody) }()
	<-started
	time.Sleep(100 * time.Millisecond) // three leases
	if dup := serve(t, h, proxy, "POST", commitPath, key, commitBody); dup.code() != http.StatusServiceUnavailable || dup.errorType() != typeUnavailable {
		t.Fatalf("duplicate during a long execution = %d %q, want 503 %s: still in flight", dup.code(), dup.body, typeUnavailable)
	}
	close(finish)
	if r := <-first; r.code() != http.StatusOK {
		t.Fatalf("first answer = %d %q, want 200", r.code(), r.body)
	}
	if got := storeCalls(t, "memory", opExtendLease) - extends; got != 0 {
		t.Fatalf("%v lease renewals on the memory store, want none", got)
	}
	if n := catalog.executed.Load(); n != 1 {
		t.Fatalf("the catalog executed %d times, want 1", n)
	}
}

// failingFinalize makes the first failures Finalize calls take stall and
// fail without reaching the store, as a SQL store's does for a write
// queued behind a busy combined_writes slot, or a combined batch that ran
// out of statement_timeout (a stand-in: no real store fails on cue).
type failingFinalize struct {
	stores.Store
	stall    time.Duration
	failures atomic.Int32
}

func (s *failingFinalize) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	if s.failures.Add(-1) >= 0 {
		time.Sleep(s.stall)
		return context.DeadlineExceeded
	}
	return s.Store.Finalize(ctx, key, owner, resp)
}

// The owner holds the catalog's answer while its Finalize fails and is
// retried: the lease stays renewed throughout, so that a duplicate on
// another node (under abandoned reexecute) does not read the record as
// abandoned and execute the commit again. Before, the heartbeat stopped
// with the execution and finalizeLater's counted a third of the lease
// afresh: the lease lapsed in between.
func TestLeaseHeldWhileFinalizeIsRetried(t *testing.T) {
	shared := newMemoryStore(t) // one store, two nodes
	slowNode := &failingFinalize{Store: shared, stall: 400 * time.Millisecond}
	slowNode.failures.Store(2)
	nodeA, nodeB := newTestHandler(t, slowNode), newTestHandler(t, shared)
	for _, h := range []*Handler{nodeA, nodeB} {
		h.Lease = caddy.Duration(600 * time.Millisecond) // renewed every 200ms
		h.Abandoned = abandonedReexecute
		h.InFlightWait = caddy.Duration(10 * time.Second)
	}
	var executed atomic.Int32
	catalog := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		executed.Add(1)
		time.Sleep(380 * time.Millisecond) // one renewal, at 200ms
		_, _ = io.WriteString(w, `{"namespace":["a"]}`)
		return nil
	}}
	key := storetest.NewKey(t)
	var wg sync.WaitGroup
	var first, duplicate result
	wg.Add(2)
	go func() { defer wg.Done(); first = serve(t, nodeA, catalog, "POST", "/v1/namespaces", key, nsBody) }()
	time.Sleep(100 * time.Millisecond)
	go func() { defer wg.Done(); duplicate = serve(t, nodeB, catalog, "POST", "/v1/namespaces", key, nsBody) }()
	wg.Wait()
	if n := executed.Load(); n != 1 {
		t.Fatalf("the catalog executed the commit %d times while its owner held the answer, want 1", n)
	}
	if first.code() != http.StatusOK || duplicate.code() != http.StatusOK || duplicate.header.Get(ReplayedHeader) != "true" {
		t.Fatalf("first %d, duplicate %d (replayed %q) %s; want 200 and its replay", first.code(), duplicate.code(),
			duplicate.header.Get(ReplayedHeader), duplicate.body)
	}
}

// tooLargeSlowly is a store whose Finalize takes a while and then refuses
// the response as too large (MySQL's max_allowed_packet), and whose
// renewals are slow (a busy database): a stand-in, to line the two up.
type tooLargeSlowly struct{ stores.Store }

func (s tooLargeSlowly) Finalize(context.Context, string, string, stores.Response) error {
	time.Sleep(300 * time.Millisecond)
	return stores.ErrResponseTooLarge
}

func (s tooLargeSlowly) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	time.Sleep(150 * time.Millisecond)
	return s.Store.ExtendLease(ctx, key, owner, lease, ttl)
}

// A response the store refuses as too large leaves the key unknown: the
// renewals of the Finalize try stop before the record is marked abandoned,
// so that none lands after it and makes the record read as in flight for
// another lease (duplicates would wait instead of hearing "unknown").
func TestNoRenewalAfterMarkedUnknown(t *testing.T) {
	shared := newMemoryStore(t)
	h := newTestHandler(t, tooLargeSlowly{Store: shared})
	h.Lease = caddy.Duration(300 * time.Millisecond) // a renewal every 100ms
	key := storetest.NewKey(t)
	if res := serve(t, h, answering(http.StatusOK, `{"namespace":["a"]}`), "POST", "/v1/namespaces", key, nsBody); res.code() != http.StatusOK {
		t.Fatalf("first: %d %s", res.code(), res.body)
	}
	// Watched for longer than a renewal under way (150 ms) takes to land:
	// one landing after the Abandon shows the record in flight for a lease.
	// Until the build after 0ce489d the record was read once, at once,
	// before such a renewal could have landed.
	for end := time.Now().Add(400 * time.Millisecond); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if rec, _ := shared.Load(context.Background(), key); rec == nil || !rec.Abandoned {
			t.Fatalf("after 'response too large: outcome unknown' the record is %+v, want abandoned", rec)
		}
	}
}

// slowRenewals is one node's view of a shared store whose call timeout is
// a quarter of the lease, the shortest lease checkLease accepts: its first
// renewal hangs for the whole timeout and fails (a database hiccup), the
// second, the retry, takes retry when set (it queues for a connection
// behind the same hiccup), and the others a third of the timeout; all but
// the first succeed. A stand-in: no real store stalls a renewal on cue.
type slowRenewals struct {
	stores.Store
	timeout, retry time.Duration
	calls          atomic.Int32
}

func (s *slowRenewals) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	switch n := s.calls.Add(1); {
	case n == 1:
		time.Sleep(s.timeout)
		return context.DeadlineExceeded
	case n == 2 && s.retry > 0:
		time.Sleep(s.retry)
	default:
		time.Sleep(s.timeout / 3)
	}
	return s.Store.ExtendLease(ctx, key, owner, lease, ttl)
}

// executeOnTwoNodes sends a keyed commit to node A, whose view of the
// shared store is slowNode, and half a timeout later its duplicate to node
// B, both under abandoned reexecute with a lease of minLeaseCalls timeouts; the
// catalog takes executeFor. It returns both answers and how often the
// catalog executed.
func executeOnTwoNodes(t *testing.T, slowNode, shared stores.Store, timeout, executeFor time.Duration) (first, duplicate result, executed int32) {
	t.Helper()
	nodeA, nodeB := newTestHandler(t, slowNode), newTestHandler(t, shared)
	for _, h := range []*Handler{nodeA, nodeB} {
		h.Lease = caddy.Duration(minLeaseCalls * timeout) // the shortest lease checkLease accepts
		h.Abandoned = abandonedReexecute
		h.InFlightWait = caddy.Duration(20 * time.Second)
	}
	var n atomic.Int32
	catalog := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		n.Add(1)
		time.Sleep(executeFor)
		_, _ = io.WriteString(w, `{"namespace":["a"]}`)
		return nil
	}}
	key := storetest.NewKey(t)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); first = serve(t, nodeA, catalog, "POST", "/v1/namespaces", key, nsBody) }()
	time.Sleep(timeout / 2)
	go func() { defer wg.Done(); duplicate = serve(t, nodeB, catalog, "POST", "/v1/namespaces", key, nsBody) }()
	wg.Wait()
	return first, duplicate, n.Load()
}

// One renewal that fails by taking its whole timeout must not let the
// lease of a live owner lapse. It ends two thirds of the lease after the
// lease was taken; the retry used to wait another third, reached the store
// as the lease ran out, and a duplicate on another node (abandoned
// reexecute) took the key over and executed the commit a second time.
func TestOneTimedOutRenewalKeepsTheLease(t *testing.T) {
	const timeout = 300 * time.Millisecond
	shared := newMemoryStore(t) // one store, two nodes
	// The catalog runs past the failed renewal's retry, and two more.
	first, duplicate, n := executeOnTwoNodes(t, &slowRenewals{Store: shared, timeout: timeout}, shared, timeout, 7*timeout)
	if n != 1 {
		t.Fatalf("the catalog executed the commit %d times after one timed-out renewal of its live owner, want 1 (first %d, duplicate %d %s)",
			n, first.code(), duplicate.code(), duplicate.body)
	}
	if first.code() != http.StatusOK || duplicate.header.Get(ReplayedHeader) != "true" {
		t.Fatalf("first %d, duplicate %d (replayed %q) %s; want 200 and its replay", first.code(), duplicate.code(),
			duplicate.header.Get(ReplayedHeader), duplicate.body)
	}
}

// A renewal that fails after its whole timeout, then a retry that takes
// nearly as long, must both fit in the lease. Renewed every third of the
// lease, the two calls filled the two thirds left, and the retry landed
// after the lease ran out: another node (abandoned reexecute) executed the
// commit again. Renewed every quarter, they end by 0.78 of it.
func TestFailedRenewalAndSlowRetryKeepTheLease(t *testing.T) {
	const timeout = 600 * time.Millisecond
	shared := newMemoryStore(t) // one store, two nodes
	slow := &slowRenewals{Store: shared, timeout: timeout, retry: timeout * 97 / 100}
	first, duplicate, n := executeOnTwoNodes(t, slow, shared, timeout, 5*timeout)
	if n != 1 {
		t.Fatalf("the catalog executed the commit %d times (first %d, duplicate %d %s), want 1", n, first.code(), duplicate.code(), duplicate.body)
	}
}

// lostReplyTakeOver is a store client that resends a TakeOver whose reply
// was lost (go-redis's cluster client does): the first run committed, the
// resend finds the owner changed and reports false, a whole call later.
// Its renewals are slowRenewals'. A stand-in: no real store loses a reply
// on cue.
type lostReplyTakeOver struct {
	*slowRenewals
}

func (s *lostReplyTakeOver) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	ok, err := s.Store.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
	if err != nil || !ok {
		return ok, err
	}
	time.Sleep(s.timeout * 95 / 100)
	return false, nil
}

// A request that finds its own record (its TakeOver committed though it
// reported false) adopts a lease taken a call before its Reserve was sent.
// It renews it before executing; here that renewal times out, and node B
// gives the key back with a 503 rather than execute on a lease it cannot
// vouch for. Before, the heartbeat counted from the Reserve, the first
// renewal came a call late, and its timing out let the lease lapse while B
// executed: a duplicate on node C executed the commit again.
func TestAdoptedRecordRenewsBeforeExecuting(t *testing.T) {
	const timeout = 300 * time.Millisecond
	shared := newMemoryStore(t) // one store, three nodes
	nodeA := newTestHandler(t, shared)
	nodeB := newTestHandler(t, &lostReplyTakeOver{&slowRenewals{Store: shared, timeout: timeout}})
	nodeC := newTestHandler(t, shared)
	for _, h := range []*Handler{nodeA, nodeB, nodeC} {
		h.Lease = caddy.Duration(minLeaseCalls * timeout)
		h.Abandoned = abandonedReexecute
		h.InFlightWait = caddy.Duration(10 * time.Second)
	}
	key := storetest.NewKey(t)
	// Node A reaches the catalog and loses the connection: abandoned.
	broken := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		replacerOf(r).Set(upstreamVar, "catalog:8181")
		return io.ErrUnexpectedEOF
	}}
	if res := serve(t, nodeA, broken, "POST", "/v1/namespaces", key, nsBody); res.code() != http.StatusBadGateway {
		t.Fatalf("node A: %d %s, want 502", res.code(), res.body)
	}
	var executed atomic.Int32
	catalog := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		executed.Add(1)
		time.Sleep(6 * timeout)
		_, _ = io.WriteString(w, `{"namespace":["a"]}`)
		return nil
	}}
	var wg sync.WaitGroup
	var retryB, retryC result
	wg.Add(2)
	go func() { defer wg.Done(); retryB = serve(t, nodeB, catalog, "POST", "/v1/namespaces", key, nsBody) }()
	time.Sleep(timeout / 3)
	go func() { defer wg.Done(); retryC = serve(t, nodeC, catalog, "POST", "/v1/namespaces", key, nsBody) }()
	wg.Wait()
	if n := executed.Load(); n != 1 {
		t.Fatalf("the catalog executed the retried commit %d times (B %d, C %d %s), want 1", n, retryB.code(), retryC.code(), retryC.body)
	}
}

// failingRenewals is a store reachable for everything but lease renewals,
// as in a brief outage of the owner's node alone. A fake: no real store
// fails one kind of call on demand.
type failingRenewals struct{ stores.Store }

func (s failingRenewals) ExtendLease(context.Context, string, string, time.Duration, time.Duration) error {
	return errors.New("store unreachable")
}

// A lifetime shorter than the execution, and the owner's renewals fail:
// the lease lapses while the catalog still runs the commit. The record
// must then read as abandoned, so that the client's retry is told the
// outcome is unknown; it used to expire with the lease, and the retry
// executed the commit a second time beside the first.
func TestLapsedLeaseOfShortLifetimeIsNotExecutedAgain(t *testing.T) {
	h := newTestHandler(t, failingRenewals{newMemoryStore(t)}) // wrapped: leases renewed as on a shared store
	h.Lifetime = caddy.Duration(100 * time.Millisecond)
	zero := caddy.Duration(0)
	h.Grace = &zero
	h.Lease = caddy.Duration(60 * time.Millisecond)
	h.ExecutionTimeout = caddy.Duration(5 * time.Second)
	h.InFlightWait = caddy.Duration(50 * time.Millisecond)
	release := make(chan struct{})
	slow := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		_, _ = io.ReadAll(r.Body)
		select {
		case <-release:
		case <-time.After(2 * time.Second): // a second execution: the retry is not released
		}
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, "{}")
		return nil
	}}
	key := storetest.NewKey(t)
	done := make(chan result, 1)
	go func() { done <- serve(t, h, slow, "POST", commitPath, key, commitBody) }()
	time.Sleep(300 * time.Millisecond) // the lease (60ms) and the lifetime (100ms) ended
	retry := serve(t, h, slow, "POST", commitPath, key, commitBody)
	close(release)
	first := <-done
	if n := slow.calls.Load(); n != 1 {
		t.Fatalf("the catalog executed the commit %d times (retry: %d %s)", n, retry.code(), retry.body)
	}
	if retry.code() != http.StatusInternalServerError || !strings.Contains(retry.body, "CommitStateUnknownException") {
		t.Fatalf("retry during the first execution = %d %s, want 500 CommitStateUnknownException", retry.code(), retry.body)
	}
	if first.code() != http.StatusOK {
		t.Fatalf("first request = %d, want 200", first.code())
	}
}

// slowRenewal's ExtendLease takes hold to come back. One whose caller's
// context ends first returns that context's error while its statement,
// already at the server, still commits a moment later: what a SQL driver
// or a Redis client does with a write whose context is cancelled once it
// was sent (a stand-in: no real store is slow on cue).
type slowRenewal struct {
	stores.Store
	hold time.Duration
}

func (s *slowRenewal) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	select {
	case <-time.After(s.hold):
		return s.Store.ExtendLease(ctx, key, owner, lease, ttl)
	case <-ctx.Done():
		go func() {
			time.Sleep(50 * time.Millisecond)
			_ = s.Store.ExtendLease(context.Background(), key, owner, lease, ttl)
		}()
		return ctx.Err()
	}
}

// A renewal under way when execution_timeout ends the catalog call must
// not land after the key was marked unknown: the record would read as in
// flight, not abandoned, for a whole lease more, and every retry meanwhile
// hear "still in flight" (found by TestHandlerModel on MySQL with two
// nodes: C7, the record left in flight after every request ended).
func TestRenewalCutOffByExecutionTimeoutLandsBeforeAbandon(t *testing.T) {
	mem := newMemoryStore(t)
	h := newTestHandler(t, &slowRenewal{Store: mem, hold: 300 * time.Millisecond})
	h.Lease = caddy.Duration(600 * time.Millisecond) // renewed every 150ms
	h.ExecutionTimeout = caddy.Duration(400 * time.Millisecond)
	key := commitTimingOut(t, h)
	time.Sleep(150 * time.Millisecond) // the cut-off renewal has landed
	rec, err := mem.Load(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	if rec == nil || rec.State != stores.StateInFlight || !rec.Abandoned {
		t.Fatalf("record after the execution timed out: %s, want in flight and abandoned (outcome unknown)", hmRecString(rec))
	}
}

// lostRenewalStore loses the reply of its first lease renewal: the call
// fails as a cut connection does, and its statement commits later, just
// after the first Abandon (a stand-in: no real store can be made to commit
// a statement on cue after its connection broke). The late statement
// extends the lease by a minute, so that the record reads as in flight for
// as long, unless the key is marked abandoned again.
type lostRenewalStore struct {
	stores.Store
	renewals  atomic.Int32
	abandoned chan struct{} // closed at the first Abandon
	once      sync.Once
	landed    chan time.Time // when the late renewal committed
}

func (s *lostRenewalStore) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	if s.renewals.Add(1) > 1 {
		return s.Store.ExtendLease(ctx, key, owner, lease, ttl)
	}
	go func() {
		<-s.abandoned
		_ = s.Store.ExtendLease(context.Background(), key, owner, time.Minute, ttl+time.Minute)
		s.landed <- time.Now()
	}()
	return errors.New("read tcp 127.0.0.1:50000->127.0.0.1:5432: read: connection reset by peer")
}

func (s *lostRenewalStore) Abandon(ctx context.Context, key, owner string) error {
	err := s.Store.Abandon(ctx, key, owner)
	s.once.Do(func() { close(s.abandoned) })
	return err
}

// A renewal whose reply was lost may commit after the key was marked
// unknown, and give the record a live lease again: every retry would hear
// "still in flight" for that lease (30 s by default) instead of the
// outcome. The key is marked abandoned again once the settle window since
// the failed renewal has passed.
func TestLostRenewalLandingAfterAbandonIsAbandonedAgain(t *testing.T) {
	mem := newMemoryStore(t)
	s := &lostRenewalStore{Store: mem, abandoned: make(chan struct{}), landed: make(chan time.Time, 1)}
	h := newTestHandler(t, s)
	// The first renewal (at 300ms) comes well before the execution ends
	// (1.5s), and the second Abandon (at 3.3s) well after the late renewal
	// landed, also on a busy machine.
	h.Lease = caddy.Duration(1200 * time.Millisecond) // renewed every 300ms
	h.ExecutionTimeout = caddy.Duration(1500 * time.Millisecond)
	h.settleWindow = 3 * time.Second
	key := commitTimingOut(t, h)
	var landed time.Time
	select {
	case landed = <-s.landed:
	case <-time.After(10 * time.Second):
		t.Fatal("the lost renewal never landed: no renewal failed, or the key was never marked abandoned")
	}
	rec, err := mem.Load(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	if rec == nil || rec.Abandoned {
		t.Fatalf("record just after the late renewal landed: %s, want in flight with a live lease", hmRecString(rec))
	}
	for deadline := landed.Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		rec, err = mem.Load(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if rec != nil && rec.State == stores.StateInFlight && rec.Abandoned {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("record 10 s after the late renewal landed: %s, want in flight and abandoned (outcome unknown)", hmRecString(rec))
		}
	}
}

// commitTimingOut sends a keyed commit through h to a catalog that answers
// only a second past h's execution_timeout, and checks that it was
// answered "outcome unknown". It returns the key.
func commitTimingOut(t *testing.T, h *Handler) string {
	t.Helper()
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(time.Duration(h.ExecutionTimeout) + time.Second)
		answerOK(w, r)
	})
	key := storetest.NewKey(t)
	res := serve(t, h, newReverseProxy(t, catalog.addr()), "POST", commitPath, key, commitBody)
	if res.errorType() != typeCommitStateUnknown {
		t.Fatalf("answer %d %q, want outcome unknown", res.code(), res.body)
	}
	return key
}

// slowSuccessThenFail: the first renewal commits at once (the store sets
// the lease from its statement's start) but its reply takes 0.97 of the
// call timeout (a commit waiting on a log flush or synchronous replication);
// the second takes the whole timeout and fails; the retry takes 0.97 of it
// and succeeds. Every call is within the store's timeout. A fake: no real
// store can be made to reply late on cue.
type slowSuccessThenFail struct {
	stores.Store
	timeout time.Duration
	calls   atomic.Int32
}

// sleepOrDone waits d, or until ctx ends (as a real store call does).
func sleepOrDone(ctx context.Context, d time.Duration) error {
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *slowSuccessThenFail) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	switch n := s.calls.Add(1); {
	case n == 1:
		err := s.Store.ExtendLease(ctx, key, owner, lease, ttl)
		if e := sleepOrDone(ctx, s.timeout*97/100); e != nil {
			return e // committed, reply lost
		}
		return err
	case n == 2:
		_ = sleepOrDone(ctx, s.timeout)
		return context.DeadlineExceeded
	case n == 3:
		if err := sleepOrDone(ctx, s.timeout*97/100); err != nil {
			return err
		}
	default:
		if err := sleepOrDone(ctx, s.timeout/3); err != nil {
			return err
		}
	}
	return s.Store.ExtendLease(ctx, key, owner, lease, ttl)
}

// A renewal that succeeds but replies a whole call timeout late, then one
// that takes its whole timeout and fails, then the retry: all within the
// lease, at the shortest lease checkLease accepts. With three timeouts
// (the bound before), the next renewal started only as the slow reply came
// back, a third of the lease late, the failure and the retry ran past the
// lease's end, and a duplicate on another node (abandoned reexecute) took
// the key over and executed the commit again.
func TestSlowRenewalThenATimedOutOneKeepsTheLease(t *testing.T) {
	const timeout = 600 * time.Millisecond
	shared := newMemoryStore(t)
	slow := &slowSuccessThenFail{Store: shared, timeout: timeout}
	first, duplicate, n := executeOnTwoNodes(t, slow, shared, timeout, 6*timeout)
	if n != 1 {
		t.Fatalf("the catalog executed the commit %d times (first %d %s, duplicate %d %s), want 1",
			n, first.code(), first.body, duplicate.code(), duplicate.body)
	}
}

// slowTakeOverLostRenewal: once armed, TakeOver takes longer than a quarter
// of the lease (so slowLeaseRenewed renews before executing), and that
// renewal's reply is lost: it fails as a reset connection does, and its
// statement commits just after the request's Abandon (lostRenewalStore's
// lost renewal, after a slow TakeOver instead of in the heartbeat).
type slowTakeOverLostRenewal struct {
	*lostRenewalStore
	armed atomic.Bool
	slow  time.Duration
}

func (s *slowTakeOverLostRenewal) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	ok, err := s.Store.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
	if s.armed.Load() {
		time.Sleep(s.slow)
	}
	return ok, err
}

func (s *slowTakeOverLostRenewal) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	if !s.armed.Load() {
		return s.Store.ExtendLease(ctx, key, owner, lease, ttl)
	}
	return s.lostRenewalStore.ExtendLease(ctx, key, owner, lease, ttl)
}

func (s *slowTakeOverLostRenewal) Abandon(ctx context.Context, key, owner string) error {
	if !s.armed.Load() {
		return s.Store.Abandon(ctx, key, owner)
	}
	return s.lostRenewalStore.Abandon(ctx, key, owner)
}

// The renewal slowLeaseRenewed makes after a slow TakeOver, when its reply
// is lost and it commits after markUnknown's Abandon, must not leave the
// record in flight with a live lease: like the heartbeat's lost renewals it
// gets a second Abandon after the settle window (abandonAfterLostRenewal).
// Before, it got none, and retries heard "still in flight" for the late
// renewal's whole lease.
func TestLostRenewalAfterASlowTakeOverIsAbandonedAgain(t *testing.T) {
	mem := newMemoryStore(t)
	s := &slowTakeOverLostRenewal{
		lostRenewalStore: &lostRenewalStore{Store: mem, abandoned: make(chan struct{}), landed: make(chan time.Time, 1)},
		slow:             200 * time.Millisecond,
	}
	h := newTestHandler(t, s)
	h.Lease = caddy.Duration(600 * time.Millisecond) // a quarter: 150ms
	h.ExecutionTimeout = caddy.Duration(300 * time.Millisecond)
	h.Abandoned = abandonedReexecute
	h.settleWindow = time.Second
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(time.Duration(h.ExecutionTimeout) + 500*time.Millisecond)
		answerOK(w, r)
	})
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if res := serve(t, h, proxy, "POST", commitPath, key, commitBody); res.errorType() != typeCommitStateUnknown {
		t.Fatalf("first: %d %s, want outcome unknown", res.code(), res.body)
	}
	s.armed.Store(true)
	res := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	t.Logf("retry: %d %s", res.code(), res.body)
	var landed time.Time
	select {
	case landed = <-s.landed:
	case <-time.After(5 * time.Second):
		t.Fatal("the lost renewal never landed")
	}
	for deadline := landed.Add(3 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		rec, err := mem.Load(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if rec != nil && rec.State == stores.StateInFlight && rec.Abandoned {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("record 3 s after the late renewal landed (settle window 1 s): %s, want in flight and abandoned; "+
				"retries hear 'still in flight' for the late renewal's whole lease", hmRecString(rec))
		}
	}
}
