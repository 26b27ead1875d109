package icebergidempotency

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"weak"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func newCaddyContext(t *testing.T) caddy.Context {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	return ctx
}

// The app's loop purges expired records of every tracked store, in batches,
// keeps live ones, and stops when told.
func TestAppPurgesTrackedStores(t *testing.T) {
	clock := storetest.NewFakeClock()
	s, err := memory.New(memory.Options{MaxEntries: 1000, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 35; i++ {
		if _, err := s.Reserve(t.Context(), storetest.Reservation(storetest.NewKey(t), time.Minute, time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	clock.Advance(2 * time.Minute)
	for i := 0; i < 5; i++ {
		if _, err := s.Reserve(t.Context(), storetest.Reservation(storetest.NewKey(t), time.Hour, time.Hour)); err != nil {
			t.Fatal(err)
		}
	}

	app := &App{CleanupInterval: caddy.Duration(10 * time.Millisecond), CleanupBatch: 10}
	if err := app.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	app.track("memory/test", s)
	if err := app.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.Len() != 5 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if err := app.Stop(); err != nil {
		t.Fatal(err)
	}
	if got := s.Len(); got != 5 {
		t.Fatalf("%d records left, want the 5 live ones", got)
	}
}

func TestAppDefaultsAndValidation(t *testing.T) {
	app := &App{}
	if err := app.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	if time.Duration(app.CleanupInterval) != DefaultCleanupInterval || app.CleanupBatch != DefaultCleanupBatch {
		t.Fatalf("defaults = %v, %d", time.Duration(app.CleanupInterval), app.CleanupBatch)
	}
	if app.MaxBufferedBytes != DefaultMaxBufferedBytes || app.bodies.max != DefaultMaxBufferedBytes {
		t.Fatalf("max_buffered_bytes = %d, budget %d; want %d", app.MaxBufferedBytes, app.bodies.max, DefaultMaxBufferedBytes)
	}
	if err := (&App{CleanupBatch: -1}).Validate(); err == nil {
		t.Fatal("negative cleanup_batch accepted")
	}
	if err := (&App{CleanupInterval: caddy.Duration(time.Minute), MaxBufferedBytes: 2 << 40}).Validate(); err == nil {
		t.Fatal("max_buffered_bytes of 2TiB accepted")
	}
	// JSON's nanoseconds: a run followed a run.
	if err := (&App{CleanupInterval: 1}).Validate(); err == nil || !strings.Contains(err.Error(), "cleanup_interval must be at least 1s") {
		t.Fatalf("cleanup_interval 1ns: %v", err)
	}
	if err := (&App{CleanupInterval: caddy.Duration(2500000 * time.Hour)}).Validate(); err == nil || !strings.Contains(err.Error(), "cleanup_interval must be at most") {
		t.Fatalf("cleanup_interval 2500000h: %v", err)
	}
	// Stop without Start (a config that failed to load) must not block.
	if err := (&App{}).Stop(); err != nil {
		t.Fatal(err)
	}
}

// closeCounter is a store that only counts Close calls.
type closeCounter struct {
	stores.Store
	closed atomic.Int32
}

func (c *closeCounter) Close() error { c.closed.Add(1); return nil }

// Reserve refuses once the store is closed, as the real stores do.
func (c *closeCounter) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	if c.closed.Load() > 0 {
		return stores.ReserveResult{}, stores.MarkNotSent(errors.New("store closed"))
	}
	return c.Store.Reserve(ctx, r)
}

// lingerFor sets how long dropped stores stay open after their last
// request (dropLinger) for the rest of t.
func lingerFor(t *testing.T, d time.Duration) {
	old := dropLinger
	dropLinger = d
	t.Cleanup(func() { dropLinger = old })
}

// waitClosed waits for the pool's asynchronous close.
func waitClosed(t *testing.T, c *closeCounter, want int32) {
	t.Helper()
	for range 600 {
		if c.closed.Load() == want {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("store closed %d times, want %d", c.closed.Load(), want)
}

type fakeProvider struct {
	key    string
	opened int
	store  *closeCounter
}

func (p *fakeProvider) StoreKey() string { return p.key }
func (p *fakeProvider) OpenStore(caddy.Context) (stores.Store, error) {
	p.opened++
	return p.store, nil
}

// Handlers with the same store key share one store, across reloads, and the
// last one to go closes it.
func TestStorePoolSharesAndClosesLast(t *testing.T) {
	ctx := newCaddyContext(t)
	p := &fakeProvider{key: "fake/" + storetest.NewKey(t), store: &closeCounter{}}
	a, err := acquireStore(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	b, err := acquireStore(ctx, p) // the new config's handler, during a reload
	if err != nil {
		t.Fatal(err)
	}
	if a != b || p.opened != 1 {
		t.Fatalf("opened %d stores, want 1 shared", p.opened)
	}
	old := &Handler{storeKey: p.key}
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	// Caddy calls Cleanup once; a second call must not drop the new
	// handler's reference.
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if refs, _ := storePool.References(p.key); refs != 1 {
		t.Fatalf("%d references to the store after the old handler's Cleanup, twice, want the new handler's 1", refs)
	}
	if p.store.closed.Load() != 0 {
		t.Fatal("store closed while the new handler still uses it")
	}
	lingerFor(t, 0)
	if err := (&Handler{storeKey: p.key}).Cleanup(); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, p.store, 1)
	// A handler whose Provision failed before acquiring a store.
	if err := (&Handler{}).Cleanup(); err != nil {
		t.Fatal(err)
	}
}

// A store dropped by a reload stays open until the requests of the old
// config that use it have finished: closing a connection pool under them
// would fail their Finalize after the catalog had answered.
func TestStorePoolClosesAfterRunningRequests(t *testing.T) {
	ctx := newCaddyContext(t)
	p := &fakeProvider{key: "fake/" + storetest.NewKey(t), store: &closeCounter{}}
	ps, err := acquireStore(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.WarnLevel)
	ps.logger = zap.New(core)
	// However long the request runs: its execution_timeout has no upper
	// bound, and closing the store under it would let its lease lapse.
	defer func(d time.Duration) { drainReportInterval = d }(drainReportInterval)
	drainReportInterval = 10 * time.Millisecond
	lingerFor(t, 0)
	leave := ps.enter()
	if err := (&Handler{storeKey: p.key}).Cleanup(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if n := p.store.closed.Load(); n != 0 {
		t.Fatalf("store closed %d times while a request still used it, 10 report intervals after its config was dropped", n)
	}
	if logs.FilterMessageSnippet("stays open for the requests still using it").Len() == 0 {
		t.Fatal("no warning that the store waits for its requests")
	}
	leave()
	leave() // leaving twice counts once
	waitClosed(t, p.store, 1)
}

// selfExpiringStore deletes expired records itself, like Redis; it counts
// the purges it is asked for.
type selfExpiringStore struct {
	stores.Store
	purges atomic.Int32
}

func (s *selfExpiringStore) SelfExpiring() bool { return true }

func (s *selfExpiringStore) PurgeExpired(context.Context, int) (int, error) {
	s.purges.Add(1)
	return 0, nil
}

// A store that expires records itself is left out of the purge rounds, and
// the app says so once, not every interval.
func TestAppSkipsSelfExpiringStores(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	app := &App{CleanupBatch: 10}
	if err := app.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	app.logger = zap.New(core)
	s := &selfExpiringStore{}
	app.track("redis/test", newPooledStore(s))
	for range 3 {
		app.PurgeOnce(t.Context())
	}
	if n := s.purges.Load(); n != 0 {
		t.Fatalf("PurgeExpired called %d times on a self-expiring store", n)
	}
	if n := logs.FilterMessageSnippet("expires records itself").Len(); n != 1 {
		t.Fatalf("logged %d times that the store expires records itself, want once", n)
	}
}

// slowPurger takes batchTime for every purge batch and records when each
// call started and ended.
type slowPurger struct {
	stores.Store
	batchTime time.Duration
	left      int
	starts    []time.Time
	ends      []time.Time
}

func (s *slowPurger) PurgeExpired(_ context.Context, limit int) (int, error) {
	s.starts = append(s.starts, time.Now())
	time.Sleep(s.batchTime)
	n := min(limit, s.left)
	s.left -= n
	s.ends = append(s.ends, time.Now())
	return n, nil
}

// A backlog is purged with a pause after each full batch twice as long as
// the batch took, so the requests get the database for at least two thirds
// of the time.
func TestPurgePausesBetweenBatches(t *testing.T) {
	s := &slowPurger{Store: newMemoryStore(t), batchTime: 20 * time.Millisecond, left: 35}
	app := &App{CleanupBatch: 10}
	if err := app.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	app.track("slow/test", s)
	app.PurgeOnce(t.Context())
	if len(s.starts) != 4 || s.left != 0 {
		t.Fatalf("%d batches, %d records left; want 4 batches (10, 10, 10, 5) and none left", len(s.starts), s.left)
	}
	for i := 1; i < len(s.starts); i++ {
		took := s.ends[i-1].Sub(s.starts[i-1])
		if gap := s.starts[i].Sub(s.ends[i-1]); gap < 2*took {
			t.Fatalf("batch %d started %v after batch %d ended, which took %v: want a pause at least twice as long", i, gap, i-1, took)
		}
	}
}

// A stopped app is not kept reachable by the app that replaced it (the
// admin API's fallback, for a config that fails to start): with it would
// stay every store it tracked, a closed memory store's records included.
func TestReplacedAppIsNotKept(t *testing.T) {
	start := func() *App {
		a := &App{}
		if err := a.Provision(newCaddyContext(t)); err != nil {
			t.Fatal(err)
		}
		if err := a.Start(); err != nil {
			t.Fatal(err)
		}
		return a
	}
	a := start()
	gone := weak.Make(a)
	b := start() // a reload: the new config starts, then the old one stops
	if err := a.Stop(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.Stop() }()
	a = nil
	for range 3 {
		runtime.GC()
	}
	if gone.Value() != nil {
		t.Fatal("the app of the replaced config is still reachable")
	}
	if running.Load() != b {
		t.Fatal("the admin API does not answer for the running app")
	}
}

// A reload to a config that keeps records elsewhere is warned of, with the
// dropped memory store's live records counted: their keys execute again on
// retry through the new config. An audit switched memory → postgres with 4
// keys in flight, each then executed twice, and nothing at the reload said
// so (until the build after b35c62e). A pool whose options alone changed
// keeps its place, and an empty memory store loses nothing.
func TestReloadToAnotherPlaceIsWarnedOf(t *testing.T) {
	full := newMemoryStore(t)
	if res, err := full.Reserve(t.Context(), storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)); err != nil || !res.Reserved {
		t.Fatal(res, err)
	}
	for _, tt := range []struct {
		name      string
		old, next string
		oldStore  stores.Store
		warned    bool
	}{
		{"memory to postgres", "memory", "postgres/t/1a2b", full, true},
		{"memory kept", "memory", "memory", full, false},
		{"an empty memory store", "memory", "postgres/t/1a2b", newMemoryStore(t), false},
		{"a pool option changed", "postgres/t/1a2b", "postgres/t/3c4d", newMemoryStore(t), false},
		{"another table", "postgres/t/1a2b", "postgres/u/3c4d", newMemoryStore(t), true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			prev := &App{stores: map[string]stores.Store{tt.old: newPooledStore(tt.oldStore)}}
			next := &App{logger: zap.New(core), stores: map[string]stores.Store{tt.next: newPooledStore(newMemoryStore(t))}}
			next.warnDroppedPlaces(prev)
			lines := logs.FilterMessageSnippet("keeps records elsewhere").All()
			if warned := len(lines) == 1; warned != tt.warned || len(lines) > 1 {
				t.Fatalf("%d warnings, want warned=%v: %v", len(lines), tt.warned, logs.All())
			}
			if tt.warned && tt.old == "memory" {
				if got := lines[0].ContextMap()["in_flight"]; got != int64(1) {
					t.Fatalf("in_flight = %v, want 1: %v", got, lines[0].ContextMap())
				}
			}
		})
	}
}
