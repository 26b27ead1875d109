package icebergidempotency

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// evictionCount reads caddy_iceberg_idempotency_memory_evictions_total for
// reason through a registry, the way Caddy's /metrics sees it.
func evictionCount(t *testing.T, reason string) float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := registerMetrics(reg); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "caddy_iceberg_idempotency_memory_evictions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "reason" && lp.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no eviction series for reason %q", reason)
	return 0
}

// finalize stores a final answer with a body of n bytes under a fresh key.
func finalize(t *testing.T, s stores.Store, n int) string {
	t.Helper()
	r := storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)
	if res, err := s.Reserve(t.Context(), r); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	if err := s.Finalize(t.Context(), r.Key, r.Owner, stores.Response{Status: 200, Body: make([]byte, n)}); err != nil {
		t.Fatal(err)
	}
	return r.Key
}

// A flood of evictions moves the counter by exactly their number and writes
// one warning at once, then one per interval with the count since the last:
// not a line per eviction.
func TestMemoryStoreEvictionsCountedAndLogRateLimited(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	clock := storetest.NewFakeClock()
	var scheduled []func()
	after := func(_ time.Duration, f func()) func() bool {
		scheduled = append(scheduled, f)
		return func() bool { return true }
	}
	s, err := openMemoryStore(memory.Limits{MaxEntries: 10, MaxBytes: 1 << 20}, nil, zap.New(core), clock.Now, after)
	if err != nil {
		t.Fatal(err)
	}
	beforeEntries, beforeBytes := evictionCount(t, "entries"), evictionCount(t, "bytes")

	for range 1000 {
		finalize(t, s, 10)
	}
	if got := evictionCount(t, "entries") - beforeEntries; got != 990 {
		t.Fatalf("entries evictions counted %v, want 990", got)
	}
	if got := evictionCount(t, "bytes") - beforeBytes; got != 0 {
		t.Fatalf("bytes evictions counted %v, want 0", got)
	}
	if n := logs.Len(); n != 1 {
		t.Fatalf("%d warnings for a burst of 990 evictions, want 1 at once", n)
	}
	if len(scheduled) != 1 {
		t.Fatalf("%d trailing warnings scheduled, want 1", len(scheduled))
	}
	scheduled[0]() // the interval passed
	clock.Advance(memory.EvictionLogInterval)
	finalize(t, s, 10) // the next eviction after the interval is told at once
	entries := logs.AllUntimed()
	if len(entries) != 3 {
		t.Fatalf("%d warnings, want 3", len(entries))
	}
	total := int64(0)
	for _, e := range entries {
		total += e.ContextMap()["evicted"].(int64)
	}
	if total != 991 {
		t.Fatalf("warnings report %d evictions, want 991", total)
	}
	if got := entries[0].ContextMap()["max_entries"]; got != int64(10) {
		t.Fatalf("warning names max_entries %v, want 10", got)
	}

	// A burst cut short by Close is still told.
	clock.Advance(time.Second)
	finalize(t, s, 10)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if logs.Len() != 4 {
		t.Fatalf("%d warnings after Close, want the pending one written", logs.Len())
	}
}

// A reload that changes the bounds keeps the one shared store and its
// records; within one config the larger bounds win; a later config shrinks
// the store once it starts, evicting least recently used final records
// (counted), and not before.
func TestMemoryStoreReloadResizesInPlace(t *testing.T) {
	// A store earlier tests kept would hold their records.
	forgetKeptMemory(t)
	provider := func(ctx caddy.Context, maxEntries int) *MemoryStore {
		p := &MemoryStore{MaxEntries: maxEntries}
		if err := p.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		return p
	}
	release := func() {
		if err := (&Handler{storeKey: memoryStoreKey}).Cleanup(); err != nil {
			t.Fatal(err)
		}
	}

	cfg1 := newCaddyContext(t)
	first, err := acquireStore(cfg1, provider(cfg1, 10_000))
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for range 261 {
		keys = append(keys, finalize(t, first, 10))
	}

	// Reload: the new config's two handlers acquire before the old one's
	// cleanup.
	cfg2 := newCaddyContext(t)
	second, err := acquireStore(cfg2, provider(cfg2, 20_000))
	if err != nil {
		t.Fatal(err)
	}
	third, err := acquireStore(cfg2, provider(cfg2, 5_000))
	if err != nil {
		t.Fatal(err)
	}
	release() // the old config goes
	if second != first || third != first {
		t.Fatal("a reload that changed max_entries opened a new store")
	}
	for _, k := range keys {
		if rec, _ := second.Load(t.Context(), k); rec == nil || rec.State != stores.StateFinal {
			t.Fatalf("record %s lost across the reload: %+v", k, rec)
		}
	}
	ms := second.Store.(*memoryStore)
	if got := ms.Limits().MaxEntries; got != 20_000 {
		t.Fatalf("max_entries %d after a config asking 20000 and 5000, want the larger", got)
	}

	// Reload to a smaller bound: the newest records stay. The running
	// config's app (cfg2's) is started; the new config's starts too.
	oldApp := startMemoryApp(t, cfg2, second)
	before := evictionCount(t, "entries")
	held := ms.Stats().Final
	cfg3 := newCaddyContext(t)
	fourth, err := acquireStore(cfg3, provider(cfg3, 100))
	if err != nil {
		t.Fatal(err)
	}
	newApp := startMemoryApp(t, cfg3, fourth)
	defer func() { _ = newApp.Stop() }()
	// Until the old config stops, nothing shrinks: Caddy stops it only
	// once every app of the new config has started, and a reload that
	// fails before (a handler not provisioned, a later app refusing to
	// start) keeps the running config, which must not have lost records.
	if fourth != first || ms.Limits().MaxEntries != 20_000 || ms.Stats().Final != held {
		t.Fatalf("shrinking reload before the old config stopped: same store %v, max_entries %d, %d of %d final records",
			fourth == first, ms.Limits().MaxEntries, ms.Stats().Final, held)
	}
	if running.Load() != newApp {
		t.Fatal("the admin API does not answer for the new config's app")
	}
	if err := oldApp.Stop(); err != nil {
		t.Fatal(err)
	}
	release()
	release()
	defer release()
	if ms.Limits().MaxEntries != 100 {
		t.Fatalf("shrinking reload once the old config stopped: max_entries %d, want 100", ms.Limits().MaxEntries)
	}
	if got := evictionCount(t, "entries") - before; got != float64(held-100) {
		t.Fatalf("shrinking counted %v evictions, want %d", got, held-100)
	}
	for i, k := range keys {
		rec, _ := fourth.Load(t.Context(), k)
		if kept := i >= len(keys)-100; kept != (rec != nil) {
			t.Fatalf("record %d of %d: kept %v, want %v", i, len(keys), rec != nil, kept)
		}
	}
}

// A new config whose app started, and which Caddy then stops because a
// later app refused to start, changes nothing: the running config keeps
// its bounds, its records and the admin API.
func TestRefusedStartKeepsTheRunningConfig(t *testing.T) {
	// A store earlier tests kept would hold their records.
	forgetKeptMemory(t)
	cfg1, s := acquireInNewConfig(t, &MemoryStore{MaxEntries: 100})
	defer func() { _ = (&Handler{storeKey: memoryStoreKey}).Cleanup() }()
	for range 100 {
		finalize(t, s, 10)
	}
	runningApp := startMemoryApp(t, cfg1, s)
	defer func() { _ = runningApp.Stop() }()

	cfg2, _ := acquireInNewConfig(t, &MemoryStore{MaxEntries: 10})
	refused := startMemoryApp(t, cfg2, s)
	if err := refused.Stop(); err != nil { // a later app of cfg2 refused to start
		t.Fatal(err)
	}
	_ = (&Handler{storeKey: memoryStoreKey}).Cleanup() // cfg2's handler goes
	ms := unpooled(s).(*memoryStore)
	if st := ms.Stats(); st.Final != 100 || st.Limits.MaxEntries != 100 {
		t.Fatalf("after a refused start: %d of 100 final records, max_entries %d", st.Final, st.Limits.MaxEntries)
	}
	if running.Load() != runningApp {
		t.Fatal("after a refused start the admin API does not answer for the running config")
	}
}

// when_full is the running config's until a reload is in force. A reload
// to when_full refuse that Caddy refuses (another module fails to
// provision after the handler was, so no app of it starts or stops) leaves
// evict on: before, refuse stayed on, and the running config answered 503
// to every new key on a full store until the next reload. One that
// succeeds turns refuse on once the old config stops.
func TestReloadToWhenFullRefuseTakesEffectOnceInForce(t *testing.T) {
	// A store earlier tests kept would hold their records.
	forgetKeptMemory(t)
	cfg1, s := acquireInNewConfig(t, &MemoryStore{MaxEntries: 3}) // when_full evict
	defer func() { _ = (&Handler{storeKey: memoryStoreKey}).Cleanup() }()
	runningApp := startMemoryApp(t, cfg1, s)
	for range 3 {
		finalize(t, s, 10)
	}
	ms := unpooled(s).(*memoryStore)

	// A refused config of two handlers (two sites, say): before, the
	// second one's refuse was taken at once.
	refused := newCaddyContext(t)
	for range 2 {
		p := &MemoryStore{MaxEntries: 3, WhenFull: whenFullRefuse}
		if err := p.Provision(refused); err != nil {
			t.Fatal(err)
		}
		if _, err := acquireStore(refused, p); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		_ = (&Handler{storeKey: memoryStoreKey}).Cleanup() // refused: its handlers go
	}
	if _, err := s.Reserve(t.Context(), storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)); err != nil {
		t.Fatalf("after a refused reload to when_full refuse, the running config (evict) got %v; limits %+v", err, ms.Limits())
	}

	cfg3, _ := acquireInNewConfig(t, &MemoryStore{MaxEntries: 3, WhenFull: whenFullRefuse})
	newApp := startMemoryApp(t, cfg3, s)
	defer func() { _ = newApp.Stop() }()
	if err := runningApp.Stop(); err != nil { // the old config goes
		t.Fatal(err)
	}
	_ = (&Handler{storeKey: memoryStoreKey}).Cleanup()
	if _, err := s.Reserve(t.Context(), storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)); !errors.Is(err, memory.ErrFull) {
		t.Fatalf("once the reload to when_full refuse is in force, a new key on a full store got %v, want %v; limits %+v", err, memory.ErrFull, ms.Limits())
	}
}

// acquireInNewConfig provisions p in a new config and takes the pooled
// store for it, as a handler of that config does.
func acquireInNewConfig(t *testing.T, p *MemoryStore) (caddy.Context, stores.Store) {
	t.Helper()
	cfg := newCaddyContext(t)
	if err := p.Provision(cfg); err != nil {
		t.Fatal(err)
	}
	s, err := acquireStore(cfg, p)
	if err != nil {
		t.Fatal(err)
	}
	return cfg, s
}

// Reconfigure refuses a store of another kind instead of misusing it.
func TestMemoryStoreReconfigureRejectsOtherStore(t *testing.T) {
	ctx := newCaddyContext(t)
	err := (&MemoryStore{}).Reconfigure(ctx, &closeCounter{})
	if err == nil || !strings.Contains(err.Error(), "not the memory store") {
		t.Fatalf("Reconfigure(other store) = %v", err)
	}
}

func TestMemoryStoreDefaults(t *testing.T) {
	p := &MemoryStore{}
	if err := p.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	if p.MaxEntries != DefaultMaxEntries || p.MaxBytes != DefaultMaxBytes {
		t.Fatalf("defaults %+v", p)
	}
	if DefaultMaxBytes > 256<<20 {
		t.Fatalf("default max_bytes %d above 256 MiB", DefaultMaxBytes)
	}
	if p.StoreKey() != (&MemoryStore{MaxEntries: 1, MaxBytes: 1}).StoreKey() {
		t.Fatal("StoreKey depends on the bounds: a reload changing them would open an empty store")
	}
	// JSON gives what the Caddyfile refuses.
	if err := (&MemoryStore{MaxBytes: maxSize + 1}).Provision(newCaddyContext(t)); err == nil || !strings.Contains(err.Error(), "max_bytes must be at most 1TiB") {
		t.Fatalf("max_bytes past 1TiB: %v", err)
	}
}

// startMemoryApp provisions and starts the app of the config ctx, tracking
// the memory store s.
func startMemoryApp(t *testing.T, ctx caddy.Context, s stores.Store) *App {
	t.Helper()
	app := &App{}
	if err := app.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	app.track(memoryStoreKey, s)
	if err := app.Start(); err != nil {
		t.Fatal(err)
	}
	return app
}

// handlerOnMemoryStore is a handler on a memory store of its own that m
// configures.
func handlerOnMemoryStore(t *testing.T, m *MemoryStore) *Handler {
	t.Helper()
	if err := m.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	s, err := openMemoryStore(m.limits(), nil, zap.NewNop(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	return newTestHandler(t, s)
}

// when_full refuse: on a store full of records that have not expired, a
// new keyed request is answered 503 + Retry-After without reaching the
// catalog, and the retry of a stored one is still replayed. With the
// default (evict), the new request pushes the stored record out and that
// record's retry executes the commit a second time: what a flood of keyed
// requests (any principal's) does to everybody's records.
func TestMemoryStoreWhenFullRefuse(t *testing.T) {
	for _, c := range []struct {
		whenFull          string
		second            int
		firstRetryReplays bool
	}{
		{whenFullRefuse, http.StatusServiceUnavailable, true},
		{whenFullEvict, http.StatusOK, false},
	} {
		t.Run(c.whenFull, func(t *testing.T) {
			h := handlerOnMemoryStore(t, &MemoryStore{MaxEntries: 1, WhenFull: c.whenFull})
			catalog := newCountingCatalog(t, answerOK)
			proxy := newReverseProxy(t, catalog.addr())
			first := storetest.NewKey(t)
			if r := serve(t, h, proxy, http.MethodPost, commitPath, first, commitBody); r.code() != http.StatusOK {
				t.Fatalf("first = %d %q", r.code(), r.body)
			}
			second := serve(t, h, proxy, http.MethodPost, commitPath, storetest.NewKey(t), commitBody)
			if second.code() != c.second || (c.second == http.StatusServiceUnavailable && second.header.Get("Retry-After") == "") {
				t.Fatalf("a new key on a full store = %d %q, want %d", second.code(), second.body, c.second)
			}
			retry := serve(t, h, proxy, http.MethodPost, commitPath, first, commitBody)
			if replayed := retry.header.Get(ReplayedHeader) == "true"; replayed != c.firstRetryReplays {
				t.Fatalf("retry of the stored key: %d, replayed %v, want %v (catalog executed %d)", retry.code(), replayed, c.firstRetryReplays, catalog.executed.Load())
			}
		})
	}
}

// A catalog that leaves every commit's outcome unknown (500 to
// updateTable) fills the memory store with records that may not be
// evicted: at max_entries of them, a new keyed request is answered 503 +
// Retry-After without reaching the catalog, as a full store under
// when_full refuse, and the unknown keys' retries still hear "unknown".
// Before, those records grew the store without a bound, outside max_bytes,
// until they expired (lifetime + grace + lease: 36.5 minutes by default).
//
// The refusal is its own outcome, unknown_full, warned of at most once a
// minute: the store is healthy, and until the build after f09fc92 every
// refused request was logged at error level as "store failed" and counted
// as store_unavailable, which sends whoever is paged to the store.
//
// fail_open does not pass them through: the store answers. Until the build
// after 5e84a5f it did, logged each as "store failed" and alerted as an
// outage, for the records' lifetime.
func TestMemoryStoreRefusesPastMaxEntriesUnknown(t *testing.T) {
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail_open=%v", failOpen), func(t *testing.T) { refusesPastMaxEntriesUnknown(t, failOpen) })
	}
}

func refusesPastMaxEntriesUnknown(t *testing.T, failOpen bool) {
	h := handlerOnMemoryStore(t, &MemoryStore{MaxEntries: 2})
	h.FailOpen = failOpen
	core, logs := observer.New(zap.WarnLevel)
	h.logger = zap.New(core)
	catalog := newCountingCatalog(t, answerStatus(http.StatusInternalServerError, "InternalServerError"))
	proxy := newReverseProxy(t, catalog.addr())
	var unknown []string
	for range 2 {
		key := storetest.NewKey(t)
		if r := serve(t, h, proxy, http.MethodPost, commitPath, key, commitBody); r.code() != http.StatusInternalServerError {
			t.Fatalf("commit the catalog failed = %d %q", r.code(), r.body)
		}
		unknown = append(unknown, key)
	}
	fullBefore := value(t, decisions, "operation", "updateTable", "outcome", outcomeUnknownFull)
	outageBefore := value(t, decisions, "operation", "updateTable", "outcome", outcomeStoreUnavailable)
	for range 3 {
		next := serve(t, h, proxy, http.MethodPost, commitPath, storetest.NewKey(t), commitBody)
		if next.code() != http.StatusServiceUnavailable || next.header.Get("Retry-After") == "" ||
			!strings.Contains(next.body, "ServiceUnavailableException") || !strings.Contains(next.body, "unknown outcome") {
			t.Fatalf("a new key with max_entries keys unknown = %d %q, want 503 ServiceUnavailableException with Retry-After", next.code(), next.body)
		}
	}
	if n := catalog.executed.Load(); n != 2 {
		t.Fatalf("catalog executed %d requests, want 2: the refused ones must not reach it", n)
	}
	if got := value(t, decisions, "operation", "updateTable", "outcome", outcomeUnknownFull) - fullBefore; got != 3 {
		t.Fatalf("requests_total{outcome=unknown_full} rose by %v, want 3", got)
	}
	if got := value(t, decisions, "operation", "updateTable", "outcome", outcomeStoreUnavailable) - outageBefore; got != 0 {
		t.Fatalf("requests_total{outcome=store_unavailable} rose by %v, want 0: the store is healthy", got)
	}
	if n := logs.FilterMessageSnippet("store failed").Len(); n != 0 {
		t.Fatalf("%d \"store failed\" lines, want none: %v", n, logs.All())
	}
	if n := logs.FilterMessageSnippet("records whose outcome is unknown").Len(); n != 1 {
		t.Fatalf("%d warnings for 3 refused requests, want 1: %v", n, logs.All())
	}
	retry := serve(t, h, proxy, http.MethodPost, commitPath, unknown[0], commitBody)
	if retry.code() != http.StatusInternalServerError || !strings.Contains(retry.body, "CommitStateUnknownException") {
		t.Fatalf("retry of an unknown key = %d %q, want 500 CommitStateUnknownException", retry.code(), retry.body)
	}
}

// A reload to a config without the directive, and back, keeps the memory
// store's records, final and in flight. Until the build after 56d321f the
// pool closed the store once no config used it and the config after the
// gap opened an empty one: an answered key executed again on retry, and a
// duplicate of one still executing ran beside it (an audit measured both
// through reloads of a real Caddy). The sweeps while no config uses it
// keep it, for it holds live records.
func TestMemoryStoreKeptAcrossAConfigWithoutIt(t *testing.T) {
	forgetKeptMemory(t)
	lingerFor(t, 0)
	sweepKeptEvery(t, time.Millisecond)
	_, first := acquireInNewConfig(t, &MemoryStore{})
	answered := finalize(t, first, 10)
	running := storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)
	if res, err := first.Reserve(t.Context(), running); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	// The config without the directive: its handler goes, and the pool
	// closes the store once it lingered.
	_ = (&Handler{storeKey: memoryStoreKey}).Cleanup()
	waitKeptUsers(t, 0)
	time.Sleep(50 * time.Millisecond) // some 50 sweeps

	_, second := acquireInNewConfig(t, &MemoryStore{})
	defer func() { _ = (&Handler{storeKey: memoryStoreKey}).Cleanup(); waitKeptUsers(t, 0) }()
	if unpooled(second) != unpooled(first) {
		t.Fatal("the config after the gap opened another store")
	}
	if rec, err := second.Load(t.Context(), answered); err != nil || rec == nil || rec.State != stores.StateFinal {
		t.Fatalf("answered key after the gap: %+v, %v; want its final record", rec, err)
	}
	if res, err := second.Reserve(t.Context(), storetest.Reservation(running.Key, time.Minute, time.Hour)); err != nil || res.Reserved {
		t.Fatalf("a duplicate of the key still executing reserved it after the gap: %+v, %v", res, err)
	}
}

// The config that takes a kept store up gets larger bounds at once, and
// smaller ones and its when_full only once in force, as its app purges: a
// reload Caddy refuses after it was provisioned evicts nothing.
func TestKeptMemoryStoreShrinksOnlyInForce(t *testing.T) {
	forgetKeptMemory(t)
	lingerFor(t, 0)
	_, first := acquireInNewConfig(t, &MemoryStore{MaxEntries: 1000})
	for range 100 {
		finalize(t, first, 10)
	}
	ms := unpooled(first).(*memoryStore)
	_ = (&Handler{storeKey: memoryStoreKey}).Cleanup()
	waitKeptUsers(t, 0)

	// Refused: provisioned with smaller bounds, then cleaned up.
	acquireInNewConfig(t, &MemoryStore{MaxEntries: 10, WhenFull: whenFullRefuse})
	if got, held := ms.Limits(), ms.Stats().Final; got.MaxEntries != 1000 || got.KeepUnexpired || held != 100 {
		t.Fatalf("a config not in force shrank the kept store: limits %+v, %d of 100 final records", got, held)
	}
	_ = (&Handler{storeKey: memoryStoreKey}).Cleanup()
	waitKeptUsers(t, 0)

	// Larger at once; smaller once in force.
	_, larger := acquireInNewConfig(t, &MemoryStore{MaxEntries: 2000})
	if got := ms.Limits().MaxEntries; got != 2000 {
		t.Fatalf("max_entries %d, want the larger 2000 at once", got)
	}
	_ = (&Handler{storeKey: memoryStoreKey}).Cleanup()
	_ = larger
	waitKeptUsers(t, 0)
	cfg, smaller := acquireInNewConfig(t, &MemoryStore{MaxEntries: 50, WhenFull: whenFullRefuse})
	defer func() { _ = (&Handler{storeKey: memoryStoreKey}).Cleanup(); waitKeptUsers(t, 0) }()
	if got := ms.Limits(); got.MaxEntries != 2000 || got.KeepUnexpired {
		t.Fatalf("limits %+v before the config is in force, want 2000 and evict", got)
	}
	app := startMemoryApp(t, cfg, smaller)
	defer func() { _ = app.Stop() }()
	app.PurgeOnce(t.Context())
	if got := ms.Limits(); got.MaxEntries != 50 || !got.KeepUnexpired {
		t.Fatalf("limits %+v once its app purged, want 50 and refuse", got)
	}
}

// A kept store that no config takes is let go once it holds no live
// record; the next config opens a new one.
func TestKeptMemoryStoreLetGoWhenEmpty(t *testing.T) {
	forgetKeptMemory(t)
	lingerFor(t, 0)
	sweepKeptEvery(t, 5*time.Millisecond)
	_, first := acquireInNewConfig(t, &MemoryStore{})
	kept := unpooled(first)
	_ = (&Handler{storeKey: memoryStoreKey}).Cleanup()
	for range 600 {
		keptMemory.Lock()
		gone := keptMemory.store == nil
		keptMemory.Unlock()
		if gone {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	_, second := acquireInNewConfig(t, &MemoryStore{})
	if unpooled(second) == kept {
		t.Fatal("an empty kept store was not let go")
	}
	_ = (&Handler{storeKey: memoryStoreKey}).Cleanup()
	waitKeptUsers(t, 0)
}

// sweepKeptEvery sets keptSweepInterval for the test. The pool's close
// reads it: a test that changes it waits for its stores' closes
// (waitKeptUsers) before it ends.
func sweepKeptEvery(t *testing.T, d time.Duration) {
	old := keptSweepInterval
	keptSweepInterval = d
	t.Cleanup(func() { keptSweepInterval = old })
}

// waitKeptUsers waits for the kept memory store to be held by n pool
// entries (the pool closes a dropped store asynchronously).
func waitKeptUsers(t *testing.T, n int) {
	t.Helper()
	for range 600 {
		keptMemory.Lock()
		users := keptMemory.users
		keptMemory.Unlock()
		if users == n {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("the kept memory store is not held by %d pool entries", n)
}

// forgetKeptMemory starts the test without a kept memory store, and ends
// it so, whatever earlier tests left.
func forgetKeptMemory(t *testing.T) {
	t.Helper()
	forget := func() {
		keptMemory.Lock()
		keptMemory.store, keptMemory.users, keptMemory.sweeping = nil, 0, false
		keptMemory.Unlock()
	}
	forget()
	t.Cleanup(forget)
}
