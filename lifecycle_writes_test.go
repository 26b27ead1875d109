package icebergidempotency

import (
	"context"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/postgres"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis/redistest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// Store writes whose outcome the handler cannot see at once: a reply lost
// while the statement still commits, and a client that leaves during a
// write. The stores here are stand-ins over the memory store, because the
// timing under test (a commit that lands after the caller gave up) cannot
// be arranged on a real database from a test.

// lateCommitStore's first Reserve fails at once, like a driver that gave up
// waiting for the reply, and its statement commits only after the first
// Release of that owner found nothing: a statement that was waiting for a
// lock or for its log flush when the connection failed.
type lateCommitStore struct {
	stores.Store
	mu        sync.Mutex
	failed    bool
	pending   *stores.Reservation
	committed chan struct{}
}

func (s *lateCommitStore) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.failed {
		s.failed = true
		s.pending = &r
		return stores.ReserveResult{}, errInjected
	}
	return s.Store.Reserve(ctx, r)
}

func (s *lateCommitStore) Release(ctx context.Context, key, owner string) error {
	err := s.Store.Release(ctx, key, owner)
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.pending; p != nil && p.Owner == owner {
		s.pending = nil
		if _, rerr := s.Store.Reserve(ctx, *p); rerr != nil {
			panic(rerr)
		}
		close(s.committed)
	}
	return err
}

// A reservation whose reply was lost and that commits only after the first
// attempt to undo it is released all the same: the retry executes. Before,
// the undo stopped at the first "not owner" and the late reservation held
// the key for a request nobody executed; its retry heard 503 until the
// lease lapsed, and then "outcome unknown" for a request never sent.
func TestLateReserveCommitIsReleased(t *testing.T) {
	s := &lateCommitStore{Store: newMemoryStore(t), committed: make(chan struct{})}
	h := newTestHandler(t, s)
	h.settleWindow = time.Second
	h.InFlightWait = caddy.Duration(5 * time.Second)
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusServiceUnavailable {
		t.Fatalf("first answer = %d %s, want 503", first.code(), first.body)
	}
	select {
	case <-s.committed:
	case <-time.After(10 * time.Second):
		t.Fatal("the undo never tried to release the reservation")
	}
	retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if retry.code() != http.StatusOK || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %s, executed %d; want 200, executed once", retry.code(), retry.body, catalog.executed.Load())
	}
}

// gatedStore holds the write it gates (Reserve, or TakeOver with
// takeOver set) until open is closed, then runs it; like a driver whose
// context ended mid-statement, it reports the context's error although the
// write committed. cancelled records whether the write saw its context end.
type gatedStore struct {
	stores.Store
	takeOver      bool
	entered, open chan struct{}
	mu            sync.Mutex
	cancelled     bool
}

func newGatedStore(s stores.Store, takeOver bool) *gatedStore {
	return &gatedStore{Store: s, takeOver: takeOver, entered: make(chan struct{}), open: make(chan struct{})}
}

func (s *gatedStore) gate(ctx context.Context) {
	close(s.entered)
	<-s.open
	if ctx.Err() != nil {
		s.mu.Lock()
		s.cancelled = true
		s.mu.Unlock()
	}
}

func (s *gatedStore) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	if s.takeOver {
		return s.Store.Reserve(ctx, r)
	}
	s.gate(ctx)
	res, err := s.Store.Reserve(ctx, r)
	if err == nil && ctx.Err() != nil {
		return stores.ReserveResult{}, ctx.Err()
	}
	return res, err
}

func (s *gatedStore) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	if !s.takeOver {
		return s.Store.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
	}
	s.gate(ctx)
	ok, err := s.Store.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
	if err == nil && ctx.Err() != nil {
		return false, ctx.Err()
	}
	return ok, err
}

// leaveDuringWrite sends a keyed request through h and makes its client
// leave while the store write s gates is under way.
func leaveDuringWrite(t *testing.T, h *Handler, s *gatedStore, up *upstream, key string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req := newRequest("POST", "/v1/namespaces", nsBody).WithContext(ctx)
	req.Header.Set(IdempotencyKeyHeader, key)
	done := make(chan any, 1)
	go func() {
		defer func() { done <- recover() }()
		serveRequest(h, up, req)
	}()
	<-s.entered
	cancel()
	close(s.open)
	if v := <-done; v != http.ErrAbortHandler {
		t.Fatalf("the request of a client that left ended with %v, want the connection broken off (http.ErrAbortHandler): "+
			"an HTTP/1 client that only half-closed would read an empty 200", v)
	}
	if s.cancelled {
		t.Fatal("the client's departure cancelled a store write under way")
	}
	if calls := up.calls.Load(); calls != 0 {
		t.Fatalf("the catalog was called %d times for a client that left before it was sent", calls)
	}
}

// A client that leaves while its key is being reserved neither cuts the
// reservation short (whose outcome would then be unknown) nor leaves the
// key held: the key is free as soon as the request ends, and the retry
// executes. Before, the store call was cancelled with the client, and the
// reservation it may have committed was left to a background undo.
func TestClientLeavingDuringReserve(t *testing.T) {
	mem := newMemoryStore(t)
	s := newGatedStore(mem, false)
	h := newTestHandler(t, s)
	up := answering(200, "{}")
	key := storetest.NewKey(t)
	leaveDuringWrite(t, h, s, up, key)
	if rec, err := mem.Load(context.Background(), key); err != nil || rec != nil {
		t.Fatalf("record after the client left = %+v, %v; want the key free", rec, err)
	}
	h.store = mem
	if retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); retry.code() != http.StatusOK || up.calls.Load() != 1 {
		t.Fatalf("retry = %d %s, calls %d; want 200, executed once", retry.code(), retry.body, up.calls.Load())
	}
}

// Under abandoned reexecute, a client that leaves during the takeover
// leaves the record abandoned, as it found it, for its retry to take over
// and execute.
func TestClientLeavingDuringTakeOver(t *testing.T) {
	h, clock := newClockedHandler(t)
	h.Abandoned = abandonedReexecute
	mem := h.store
	key := storetest.NewKey(t)
	reserveAsDeadNode(t, mem, clock, key)
	s := newGatedStore(mem, true)
	h.store = s
	up := answering(200, "{}")
	leaveDuringWrite(t, h, s, up, key)
	if rec, err := mem.Load(context.Background(), key); err != nil || rec == nil || rec.State != stores.StateInFlight || !rec.Abandoned {
		t.Fatalf("record after the client left = %+v, %v; want it abandoned, as before", rec, err)
	}
	h.store = mem
	if retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); retry.code() != http.StatusOK || up.calls.Load() != 1 {
		t.Fatalf("retry = %d %s, calls %d; want 200, executed once", retry.code(), retry.body, up.calls.Load())
	}
}

// A SQL store's statements may commit up to about twice its statement
// timeout after a failed call (see writeSettler), plus the second a
// Reserve or TakeOver may arrive after its call's end, so the undo of a
// lost reservation keeps trying at least that long: a store configured
// with a long statement_timeout lengthens the settle window, and the
// default (5 s) now does too, by that second.
func TestSettleWindowFollowsStatementTimeout(t *testing.T) {
	long := SQLStoreConfig{DSN: "nobody@tcp(127.0.0.1:1)/none", StatementTimeout: caddy.Duration(30 * time.Second)}
	for _, c := range []struct {
		provider StoreProvider
		want     time.Duration
	}{
		{&MemoryStore{}, defaultSettleWindow},
		{&PostgresStore{SQLStoreConfig: SQLStoreConfig{DSN: "postgres://nobody@127.0.0.1:1/none"}}, 11 * time.Second},
		{&PostgresStore{SQLStoreConfig: long}, 61 * time.Second},
		{&MySQLStore{SQLStoreConfig: long}, 61 * time.Second},
		// Redis: twice the longest of its timeouts plus the second a
		// script may run after its call's end (until the build after
		// c0abdb8, 10 s whatever they were).
		{&RedisStore{Addresses: []string{"127.0.0.1:1"}}, 11 * time.Second},
		{&RedisStore{Addresses: []string{"127.0.0.1:1"}, ReadTimeout: caddy.Duration(2 * time.Second), DialTimeout: caddy.Duration(12 * time.Second)}, 25 * time.Second},
		// A DSN's own innodb_lock_wait_timeout is kept, and a statement
		// may wait that long for a row lock on the server, then commit:
		// the window used to stay at 10 s with 50 here.
		{&MySQLStore{SQLStoreConfig: SQLStoreConfig{DSN: "nobody@tcp(127.0.0.1:1)/none?innodb_lock_wait_timeout=50"}}, 56 * time.Second},
		// Whatever the case of its name (until the build after 0aecb25,
		// 11 s: the window of the store's own bound).
		{&MySQLStore{SQLStoreConfig: SQLStoreConfig{DSN: "nobody@tcp(127.0.0.1:1)/none?INNODB_LOCK_WAIT_TIMEOUT=50"}}, 56 * time.Second},
		// A DSN's readTimeout below statement_timeout ends a call before
		// the end its statement carries (until the build after f2207cc,
		// 11 s).
		{&MySQLStore{SQLStoreConfig: SQLStoreConfig{DSN: "nobody@tcp(127.0.0.1:1)/none?readTimeout=1s"}}, 15 * time.Second},
		// A TakeOver held on its way until just before its bound (0.95 s
		// after its caller's failure at 500 ms), then 11.8 s on a row
		// lock, committed 12.80 s after the failure: the window was 12.5 s.
		{&MySQLStore{SQLStoreConfig: SQLStoreConfig{DSN: "nobody@tcp(127.0.0.1:1)/none?innodb_lock_wait_timeout=12",
			StatementTimeout: caddy.Duration(500 * time.Millisecond)}}, 13500 * time.Millisecond},
	} {
		if err := c.provider.(caddy.Provisioner).Provision(newCaddyContext(t)); err != nil {
			t.Fatal(err)
		}
		if got := settleWindowFor(c.provider); got != c.want {
			t.Errorf("%s: settle window %v, want %v", c.provider.StoreKey(), got, c.want)
		}
	}
}

// outageStore's first Reserve commits but reports a failure, like a
// connection cut after the statement was sent, and every Release fails
// until back is closed: the database stays unreachable after the cut.
type outageStore struct {
	stores.Store
	reserved       atomic.Bool
	back           chan struct{}
	releaseAttempt atomic.Int32
	released       chan struct{}
	releasedOnce   sync.Once
	mu             sync.Mutex
	releaseTimes   []time.Time // when each Release was tried
}

func (s *outageStore) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	res, err := s.Store.Reserve(ctx, r)
	if err == nil && s.reserved.CompareAndSwap(false, true) {
		return stores.ReserveResult{}, errInjected
	}
	return res, err
}

func (s *outageStore) Release(ctx context.Context, key, owner string) error {
	s.mu.Lock()
	s.releaseTimes = append(s.releaseTimes, time.Now())
	s.mu.Unlock()
	s.releaseAttempt.Add(1)
	select {
	case <-s.back:
	default:
		return errInjected
	}
	err := s.Store.Release(ctx, key, owner)
	if err == nil {
		s.releasedOnce.Do(func() { close(s.released) })
	}
	return err
}

// When a store's writes may settle later than the repair window (a MySQL
// DSN's own innodb_lock_wait_timeout, say), the undo of a lost
// reservation keeps retrying through an outage for the whole settle
// window: the store that comes back inside it gets the release, and the
// retry executes. Before, the undo stopped at the repair window (2 minutes
// in production) and the reservation held the key until its lease lapsed,
// then read "outcome unknown" for a request the catalog never saw. The
// windows are shortened here; their order is what production has.
func TestLostReserveUndoOutlastsTheRepairWindow(t *testing.T) {
	s := &outageStore{Store: newMemoryStore(t), back: make(chan struct{}), released: make(chan struct{})}
	h := newTestHandler(t, s)
	h.repairWindow = 300 * time.Millisecond
	h.settleWindow = 20 * time.Second
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusServiceUnavailable {
		t.Fatalf("first answer = %d %s, want 503", first.code(), first.body)
	}
	// Let the undo fail past the repair window (its tries run at about
	// 0, 0.1, 0.3, 0.7 and 1.5 s) before the store comes back.
	gaveUp := func() {
		t.Fatalf("the undo gave up after %d tries: the lost reservation still holds the key", s.releaseAttempt.Load())
	}
	for deadline := time.Now().Add(15 * time.Second); s.releaseAttempt.Load() < 5; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			gaveUp()
		}
	}
	close(s.back)
	select {
	case <-s.released:
	case <-time.After(15 * time.Second):
		gaveUp()
	}
	retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if retry.code() != http.StatusOK || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %s, executed %d; want 200, executed once", retry.code(), retry.body, catalog.executed.Load())
	}
}

// The undo of a lost Reserve keeps trying at least twice a second while the
// store is away, so that it lands soon after the store comes back, before
// the reservation's lease lapses. Before, its pauses doubled up to 2 s: in a
// CI run a try that failed just after a 3 s database outage pushed the next
// past the 6 s lease, and a never-executed commit's retry heard "unknown".
func TestLostReserveUndoRetriesTwiceASecond(t *testing.T) {
	s := &outageStore{Store: newMemoryStore(t), back: make(chan struct{}), released: make(chan struct{})}
	h := newTestHandler(t, s)
	h.repairWindow = time.Minute
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusServiceUnavailable {
		t.Fatalf("first answer = %d %s, want 503", first.code(), first.body)
	}
	const tries = 7 // the pauses were 0.1, 0.2, 0.4, 0.8, 1.6 and 2 s; now at most 0.5 s
	for deadline := time.Now().Add(15 * time.Second); s.releaseAttempt.Load() < tries; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("only %d undo tries in 15 s", s.releaseAttempt.Load())
		}
	}
	close(s.back)
	s.mu.Lock()
	times := append([]time.Time(nil), s.releaseTimes...)
	s.mu.Unlock()
	for i := 1; i < tries; i++ {
		// 0.3 s of slack for a loaded machine's timers
		if gap := times[i].Sub(times[i-1]); gap > 800*time.Millisecond {
			t.Errorf("undo tries %d and %d were %v apart, want at most 0.5 s", i, i+1, gap.Round(time.Millisecond))
		}
	}
	select {
	case <-s.released:
	case <-time.After(15 * time.Second):
		t.Fatal("the undo never released the reservation")
	}
	if retry := serve(t, h, proxy, "POST", commitPath, key, commitBody); retry.code() != http.StatusOK || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %s, executed %d; want 200, executed once", retry.code(), retry.body, catalog.executed.Load())
	}
}

// resendingStore runs Reserve and TakeOver twice and answers with the
// second run, as a client library that resends a command whose reply was
// lost does (go-redis's cluster client resends on a broken connection). A
// stand-in: a real server cannot be made to lose exactly that reply.
type resendingStore struct {
	stores.Store
	reserve, takeOver, finalize bool // which of them it resends
}

func (s resendingStore) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	if s.finalize {
		_ = s.Store.Finalize(ctx, key, owner, resp)
	}
	return s.Store.Finalize(ctx, key, owner, resp)
}

func (s resendingStore) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	if s.reserve {
		_, _ = s.Store.Reserve(ctx, r)
	}
	return s.Store.Reserve(ctx, r)
}

func (s resendingStore) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	if s.takeOver {
		_, _ = s.Store.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
	}
	return s.Store.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
}

// A resent Reserve finds the record its first run wrote, under this
// request's own token: the key is this request's, and it executes. Before,
// it waited for itself, answered 503, and every retry then heard
// "unknown" for a request that never reached the catalog.
func TestResentReserveFindsItsOwnRecord(t *testing.T) {
	h := newTestHandler(t, resendingStore{Store: newMemoryStore(t), reserve: true})
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusOK {
		t.Fatalf("first answer = %d %q, want 200", first.code(), first.body)
	}
	if retry := serve(t, h, proxy, "POST", commitPath, key, commitBody); retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "true" {
		t.Fatalf("retry = %d replayed=%q, want the stored 200", retry.code(), retry.header.Get(ReplayedHeader))
	}
	if n := catalog.executed.Load(); n != 1 {
		t.Fatalf("the catalog executed %d times, want 1", n)
	}
}

// The same for a resent TakeOver under `abandoned reexecute`: its first
// run took the abandoned record over, its second reports false; the
// request finds its own token on the record and executes.
func TestResentTakeOverFindsItsOwnRecord(t *testing.T) {
	h := newTestHandler(t, resendingStore{Store: newMemoryStore(t), takeOver: true})
	h.Abandoned = abandonedReexecute
	key := storetest.NewKey(t)
	lost := newReverseProxy(t, newCountingCatalog(t, answerNothing).addr())
	if first := serve(t, h, lost, "POST", commitPath, key, commitBody); first.code() != http.StatusBadGateway {
		t.Fatalf("first answer = %d, want 502 (answer lost)", first.code())
	}
	catalog := newCountingCatalog(t, answerOK)
	if retry := serve(t, h, newReverseProxy(t, catalog.addr()), "POST", commitPath, key, commitBody); retry.code() != http.StatusOK {
		t.Fatalf("retry under reexecute = %d %q, want 200", retry.code(), retry.body)
	}
	if n := catalog.executed.Load(); n != 1 {
		t.Fatalf("the retry executed %d times, want 1", n)
	}
}

// slowReserveStore makes its first Reserve come back late, as one held up
// by a row lock or a busy database does, and runs then (a stand-in for
// another node acting meanwhile). It counts ExtendLease calls.
type slowReserveStore struct {
	stores.Store
	delay   time.Duration
	then    func(r stores.Reservation)
	slowed  atomic.Bool
	extends atomic.Int32
	// extendDelay slows each ExtendLease; firstExtendBack is when the
	// first one returned.
	extendDelay     time.Duration
	firstExtendBack atomic.Pointer[time.Time]
}

func (s *slowReserveStore) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	res, err := s.Store.Reserve(ctx, r)
	if s.slowed.CompareAndSwap(false, true) {
		time.Sleep(s.delay)
		if s.then != nil {
			s.then(r)
		}
	}
	return res, err
}

func (s *slowReserveStore) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	s.extends.Add(1)
	time.Sleep(s.extendDelay)
	err := s.Store.ExtendLease(ctx, key, owner, lease, ttl)
	s.firstExtendBack.CompareAndSwap(nil, ptrTo(time.Now()))
	return err
}

func ptrTo[T any](v T) *T { return &v }

// A reservation that came back after its lease had run out, and that
// another node took over meanwhile (abandoned reexecute), is not executed:
// the other node is executing it. Before, both did.
func TestReservationBackAfterItsLeaseDoesNotExecute(t *testing.T) {
	mem := newMemoryStore(t)
	lease := 30 * time.Millisecond
	s := &slowReserveStore{Store: mem, delay: 2 * lease, then: func(r stores.Reservation) {
		if ok, err := mem.TakeOver(context.Background(), r.Key, r.Owner, "another node", time.Minute, time.Minute); !ok || err != nil {
			t.Errorf("the other node's takeover = %v, %v", ok, err)
		}
	}}
	h := newTestHandler(t, s)
	h.Abandoned = abandonedReexecute
	h.Lease = caddy.Duration(lease)
	h.InFlightWait = caddy.Duration(50 * time.Millisecond)
	catalog := newCountingCatalog(t, answerOK)
	r := serve(t, h, newReverseProxy(t, catalog.addr()), "POST", commitPath, storetest.NewKey(t), commitBody)
	if n := catalog.executed.Load(); n != 0 {
		t.Fatalf("the request whose key was taken over executed %d times (answer %d), want 0", n, r.code())
	}
	if r.code() != http.StatusServiceUnavailable {
		t.Fatalf("answer = %d %q, want 503: the key is in flight on the other node", r.code(), r.body)
	}
}

// A reservation that took more than a renewal interval (a quarter of its
// lease) to come back has its lease renewed, and the renewal back, before
// the request executes, so that a heartbeat due a renewal interval later
// still finds it. The renewal takes 50 ms here: the heartbeat, which
// starts due at once after such a reservation, also renews early, but
// beside the call, whose catalog then hears the request first (until the
// build after 0ce489d the test counted renewals begun, which the heartbeat
// alone satisfied).
func TestSlowReservationRenewsItsLeaseFirst(t *testing.T) {
	lease := 400 * time.Millisecond
	s := &slowReserveStore{Store: newMemoryStore(t), delay: lease / 2, extendDelay: 50 * time.Millisecond}
	h := newTestHandler(t, s)
	h.Lease = caddy.Duration(lease)
	var called atomic.Pointer[time.Time]
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		called.CompareAndSwap(nil, ptrTo(time.Now()))
		answerOK(w, r)
	})
	if r := serve(t, h, newReverseProxy(t, catalog.addr()), "POST", commitPath, storetest.NewKey(t), commitBody); r.code() != http.StatusOK {
		t.Fatalf("answer = %d %q, want 200", r.code(), r.body)
	}
	back, at := s.firstExtendBack.Load(), called.Load()
	if back == nil || at == nil || !back.Before(*at) {
		t.Fatalf("renewal back at %v, catalog called at %v: the lease of a reservation that took half of it was not renewed before the catalog was called", back, at)
	}
}

// releaseFailsOnce fails the first Release before it reaches the store, as
// a network blip or a timeout would (a stand-in: no real store can be made
// to fail one chosen call).
type releaseFailsOnce struct {
	stores.Store
	failed atomic.Bool
}

func (s *releaseFailsOnce) Release(ctx context.Context, key, owner string) error {
	if s.failed.CompareAndSwap(false, true) {
		return errInjected
	}
	return s.Store.Release(ctx, key, owner)
}

// A 503 from the catalog releases the key. When that Release fails, it is
// retried in the background: left in flight, the record's lease would lapse
// and every retry would hear "outcome unknown" for a request the catalog
// refused.
func TestFailedReleaseIsRetried(t *testing.T) {
	s := &releaseFailsOnce{Store: newMemoryStore(t)}
	h := newTestHandler(t, s)
	h.Lease = caddy.Duration(100 * time.Millisecond)
	h.InFlightWait = caddy.Duration(2 * time.Second)
	key := storetest.NewKey(t)
	if first := serve(t, h, answering(http.StatusServiceUnavailable, `{"error":{}}`), "POST", "/v1/namespaces", key, nsBody); first.code() != http.StatusServiceUnavailable {
		t.Fatalf("first: %d", first.code())
	}
	time.Sleep(300 * time.Millisecond) // past the lease: the store is back, the client retries
	up := answering(http.StatusOK, "{}")
	retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
	if retry.code() != http.StatusOK || up.calls.Load() != 1 {
		t.Fatalf("retry of a request the catalog refused: %d %s, executed %d times; want it executed once", retry.code(), retry.body, up.calls.Load())
	}
}

// A resent Finalize hears "not the owner" from its second run: its first
// stored the answer. The request sees its own response stored and counts
// the key finalized, instead of logging an error that it was not stored.
func TestResentFinalizeFindsItsAnswerStored(t *testing.T) {
	h := newTestHandler(t, resendingStore{Store: newMemoryStore(t), finalize: true})
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	up := answering(http.StatusOK, `{"namespace":["a"]}`)
	key := storetest.NewKey(t)
	if first := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); first.code() != http.StatusOK {
		t.Fatalf("first answer = %d %q", first.code(), first.body)
	}
	if n := logs.Len(); n != 0 {
		t.Fatalf("a Finalize that stored the answer logged %d warnings or errors, first %q", n, logs.All()[0].Message)
	}
	if retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); retry.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
		t.Fatalf("retry = %d replayed=%q, %d executions; want the stored answer", retry.code(), retry.header.Get(ReplayedHeader), up.calls.Load())
	}
}

// releaseCountingStore counts the Release calls that reach the store under
// it, a real one: it only observes.
type releaseCountingStore struct {
	stores.Store
	releases atomic.Int32
}

func (s *releaseCountingStore) Release(ctx context.Context, key, owner string) error {
	s.releases.Add(1)
	return s.Store.Release(ctx, key, owner)
}

// A reservation the store proves it never sent has nothing to undo: with
// the database down, no request leaves a background release behind. Before,
// each one did, retried every 2 s for two minutes: 500 requests against an
// unreachable PostgreSQL had sent 7,500 Releases 30 s later, all meeting
// the database at once when it came back. (A write whose reply was lost is
// still undone: TestLateReserveCommitIsReleased.)
func TestUnsentReservationIsNotUndone(t *testing.T) {
	// A database on its way down or up: it takes each connection and
	// drops it at once. (A closed port would refuse too, but another test
	// could be given it meanwhile.)
	down, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { down.Close() })
	go func() {
		for {
			c, err := down.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	pg, err := postgres.Open(context.Background(), postgres.Config{
		DSN:              "postgres://caddy@" + down.Addr().String() + "/iceberg?sslmode=disable",
		Table:            "iceberg_idempotency_records",
		StatementTimeout: time.Second,
	}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Close() })
	s := &releaseCountingStore{Store: pg}
	h := newTestHandler(t, s)
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	for range 20 {
		if got := serve(t, h, proxy, "POST", commitPath, storetest.NewKey(t), commitBody); got.code() != http.StatusServiceUnavailable {
			t.Fatalf("answer with the database down = %d %s, want 503", got.code(), got.body)
		}
	}
	time.Sleep(500 * time.Millisecond) // an undo's first Release goes out at once
	if n := s.releases.Load(); n != 0 || catalog.executed.Load() != 0 {
		t.Fatalf("after 20 reservations that never reached the database: %d Releases sent, catalog executed %d; want 0 and 0",
			n, catalog.executed.Load())
	}
}

// An execution whose outcome is unknown while the store cannot be reached:
// the Abandon that marks it fails, and is tried again in the background
// until it lands, so that the record reads as abandoned once the store is
// back. Before, the record stayed in flight under a lease nobody renews,
// and every retry heard 503 "still in flight" for the rest of the lease
// (found by the handler model with faults on the store link, on MariaDB
// and Redis). A real Redis, behind a TCP proxy the catalog stops while it
// executes (a proxy stands in for the network fault).
func TestFailedAbandonIsRetriedInTheBackground(t *testing.T) {
	ctx := newCaddyContext(t)
	addr, prefix := redistest.Addr(t), redistest.Prefix(t)
	link := sqltest.NewProxy(t, addr)
	timeout := caddy.Duration(500 * time.Millisecond)
	open := func(addr string) stores.Store {
		p := &RedisStore{Addresses: []string{addr}, KeyPrefix: prefix, DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout}
		if err := p.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		s, err := p.OpenStore(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	direct := open(addr)
	pooled := newPooledStore(open(link.Addr()))
	h := newTestHandler(t, pooled)
	h.pooled = pooled
	h.Lease = caddy.Duration(30 * time.Second) // no renewal, and no lapse, during the test
	h.ExecutionTimeout = caddy.Duration(time.Second)
	stopped := make(chan struct{})
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		link.Stop() // the store is unreachable when the execution times out
		close(stopped)
		time.Sleep(time.Duration(h.ExecutionTimeout) + time.Second)
		answerOK(w, r)
	})
	key := storetest.NewKey(t)
	res := serve(t, h, newReverseProxy(t, catalog.addr()), "POST", commitPath, key, commitBody)
	if res.errorType() != typeCommitStateUnknown {
		t.Fatalf("answer %d %q, want outcome unknown", res.code(), res.body)
	}
	<-stopped
	link.Start()
	if !pooled.waitIdle(time.Minute) {
		t.Fatal("the background store writes still run a minute after the store came back")
	}
	rec, err := direct.Load(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	if rec == nil || rec.State != stores.StateInFlight || !rec.Abandoned {
		t.Fatalf("record once the store is back: %s, want abandoned (outcome unknown), not in flight for the rest of its lease", hmRecString(rec))
	}
	if n := catalog.executed.Load(); n != 1 {
		t.Fatalf("catalog executed %d times, want 1", n)
	}
}
