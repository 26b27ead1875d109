package icebergidempotency

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Collectors live at package level and are registered in each config's
// registry, so counts carry across reloads and two handlers in one config
// share them.
var (
	decisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "requests_total",
		Help:      "Keyed Iceberg mutations by operation and what the handler did with them.",
	}, []string{"operation", "outcome"})

	executions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "executions_total",
		Help:      "Mutations executed under a key, by operation and whether the response was stored (finalized), not (released), left the outcome unknown (unknown), or was refused by the store because the key was no longer the request's (refused).",
	}, []string{"operation", "result"})

	memoryEvictions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "memory_evictions_total",
		Help:      "Final records the memory store evicted before they expired, by the bound that pushed them out (entries: max_entries, bytes: max_bytes). Their keys execute again on retry.",
	}, []string{"reason"})

	// Await waits for another request by design (up to in_flight_wait),
	// so its series measures waiting, not the store; the buckets reach
	// past the default in_flight_wait for it.
	storeDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "store_duration_seconds",
		Help:      "Time spent in calls to the idempotency store, by store backend and operation, failed calls included.",
		Buckets:   []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
	}, []string{"store", "operation"})

	executing = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "executing",
		Help:      "Keyed mutations whose upstream call is running now, on this node.",
	})

	purged = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "purged_total",
		Help:      "Expired records the cleanup loop deleted, by store backend.",
	}, []string{"store"})

	purgeFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "purge_failures_total",
		Help:      "Cleanup runs that a store error ended before they purged every expired record, by store backend.",
	}, []string{"store"})

	leaseRenewalsFailed = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "caddy",
		Subsystem: "iceberg_idempotency",
		Name:      "lease_renewals_failed_total",
		Help:      "Lease renewals of executing requests that failed (store error, or the key is no longer this request's). Other nodes may then take the key for abandoned.",
	})
)

// pairCounters hands out the counters of a two-label vector, creating each
// series on first use as WithLabelValues does, but without hashing the
// labels and allocating on every keyed request: the pairs are few (an
// operation and an outcome) and, once made, only read.
type pairCounters struct {
	vec *prometheus.CounterVec
	mu  sync.RWMutex
	got map[[2]string]prometheus.Counter
}

func newPairCounters(vec *prometheus.CounterVec) *pairCounters {
	return &pairCounters{vec: vec, got: map[[2]string]prometheus.Counter{}}
}

// inc adds one to the series (a, b).
func (p *pairCounters) inc(a, b string) {
	k := [2]string{a, b}
	p.mu.RLock()
	c, ok := p.got[k]
	p.mu.RUnlock()
	if !ok {
		c = p.vec.WithLabelValues(a, b)
		p.mu.Lock()
		p.got[k] = c
		p.mu.Unlock()
	}
	c.Inc()
}

var (
	decisionCounters  = newPairCounters(decisions)
	executionCounters = newPairCounters(executions)
)

// The series the example alerts watch exist from the start, at zero: a
// series born at its first event has no sample before it, so increase()
// and rate() over it read 0, and the first unreadable record, abandoned
// key or store failure after a start would not alert.
func init() {
	memoryEvictions.WithLabelValues("entries")
	memoryEvictions.WithLabelValues("bytes")
	for _, op := range mutations {
		for _, outcome := range []string{outcomeAbandoned, outcomeUnreadable, outcomeStoreUnavailable, outcomeFailOpen, outcomeOverloaded, outcomeUnknownFull} {
			decisions.WithLabelValues(op.id, outcome)
		}
		executions.WithLabelValues(op.id, resultUnknown)
		executions.WithLabelValues(op.id, resultRefused)
	}
}

// Execution results, the "result" label of executions_total.
const (
	resultFinalized = "finalized"
	resultReleased  = "released"
	resultUnknown   = "unknown"
	// resultRefused: the store refused the final answer because the key
	// was no longer this request's (taken over under abandoned reexecute,
	// forgotten by force, or expired): the answer was delivered but not
	// stored, and another execution may have run or may run.
	resultRefused = "refused"
)

// Request outcomes, the "outcome" label of requests_total.
const (
	outcomeNoKey            = "no_key"
	outcomeMissingKey       = "missing_key" // no key, and require_key: 400
	outcomeInvalidKey       = "invalid_key"
	outcomeExecuted         = "executed"
	outcomeReplayed         = "replayed"
	outcomeMismatch         = "mismatch"
	outcomeInFlight         = "in_flight"
	outcomeAbandoned        = "abandoned"
	outcomeUnreadable       = "unreadable"
	outcomeStoreUnavailable = "store_unavailable"
	outcomeFailOpen         = "fail_open"
	outcomeNoPrincipal      = "no_principal"
	outcomeOverloaded       = "overloaded"
	outcomeUnknownFull      = "unknown_full"
	// outcomeRejected: the request itself was refused before anything was
	// reserved, its body larger than max_request_size (413) or not read
	// whole (400, 408), or its path too long to bind a key to (414).
	outcomeRejected = "rejected"
)

// collectors are the collectors registerMetrics registers.
var collectors = []prometheus.Collector{
	decisions, executions, memoryEvictions, storeDuration, executing, purged, purgeFailures, leaseRenewalsFailed,
}

func registerMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	for _, c := range collectors {
		var already prometheus.AlreadyRegisteredError
		if err := reg.Register(c); err != nil && !errors.As(err, &already) {
			return err
		}
	}
	return nil
}

// Store operations, the "operation" label of store_duration_seconds.
const (
	opReserve     = "reserve"
	opLoad        = "load"
	opAwait       = "await"
	opFinalize    = "finalize"
	opRelease     = "release"
	opExtendLease = "extend_lease"
	opAbandon     = "abandon"
	opTakeOver    = "take_over"
	opPurge       = "purge"
)

// storeBackend names a provider's backend (memory, postgres, mysql, ...)
// for the "store" label: its module name, never its StoreKey, which holds
// a DSN hash and would make one series per database.
func storeBackend(p StoreProvider) string {
	if m, ok := p.(caddy.Module); ok {
		return m.CaddyModule().ID.Name()
	}
	return "other"
}

// backendOf returns the backend name of a pooled store, for callers that
// hold only the stores.Store.
func backendOf(s stores.Store) string {
	if p, ok := s.(*pooledStore); ok && p.backend != "" {
		return p.backend
	}
	return "other"
}

// instrumentedStore times every call to the store it wraps. It lists each
// method rather than embedding the store, so that a method added to
// stores.Store does not bypass the timing unnoticed: it fails to compile.
type instrumentedStore struct {
	inner   stores.Store
	backend string
	// One histogram per operation, looked up once: WithLabelValues hashes
	// its labels on every call, and this is every keyed request's path.
	reserve, load, await, finalize, release, extendLease, abandon, takeOver, purge prometheus.Observer
}

var _ stores.Store = (*instrumentedStore)(nil)

func instrumentStore(s stores.Store, backend string) *instrumentedStore {
	op := func(name string) prometheus.Observer { return storeDuration.WithLabelValues(backend, name) }
	return &instrumentedStore{
		inner: s, backend: backend,
		reserve: op(opReserve), load: op(opLoad), await: op(opAwait), finalize: op(opFinalize),
		release: op(opRelease), extendLease: op(opExtendLease), abandon: op(opAbandon),
		takeOver: op(opTakeOver), purge: op(opPurge),
	}
}

// observe records the time since start in o.
func observe(o prometheus.Observer, start time.Time) {
	o.Observe(time.Since(start).Seconds())
}

func (s *instrumentedStore) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	defer observe(s.reserve, time.Now())
	return s.inner.Reserve(ctx, r)
}

func (s *instrumentedStore) Load(ctx context.Context, key string) (*stores.Record, error) {
	defer observe(s.load, time.Now())
	return s.inner.Load(ctx, key)
}

func (s *instrumentedStore) Await(ctx context.Context, key string) (*stores.Record, error) {
	defer observe(s.await, time.Now())
	return s.inner.Await(ctx, key)
}

func (s *instrumentedStore) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	defer observe(s.finalize, time.Now())
	return s.inner.Finalize(ctx, key, owner, resp)
}

func (s *instrumentedStore) Release(ctx context.Context, key, owner string) error {
	defer observe(s.release, time.Now())
	return s.inner.Release(ctx, key, owner)
}

func (s *instrumentedStore) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	defer observe(s.extendLease, time.Now())
	return s.inner.ExtendLease(ctx, key, owner, lease, ttl)
}

func (s *instrumentedStore) Abandon(ctx context.Context, key, owner string) error {
	defer observe(s.abandon, time.Now())
	return s.inner.Abandon(ctx, key, owner)
}

func (s *instrumentedStore) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	defer observe(s.takeOver, time.Now())
	return s.inner.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
}

func (s *instrumentedStore) PurgeExpired(ctx context.Context, limit int) (int, error) {
	defer observe(s.purge, time.Now())
	return s.inner.PurgeExpired(ctx, limit)
}

// Close is not timed: it happens once, at shutdown or after a reload.
func (s *instrumentedStore) Close() error { return s.inner.Close() }

// Unwrap returns the store being timed, for code that looks for optional
// interfaces on the store itself.
func (s *instrumentedStore) Unwrap() stores.Store { return s.inner }
