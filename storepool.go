package icebergidempotency

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// StoreProvider is implemented by the modules in the iceberg_idempotency.stores
// namespace: each opens one kind of store.
type StoreProvider interface {
	// StoreKey identifies the store the configuration opens. Handlers whose
	// providers return the same key share one store, across handlers and
	// across config reloads. It must not contain secrets in clear.
	StoreKey() string
	// OpenStore opens the store; called only when no handler holds it.
	OpenStore(ctx caddy.Context) (stores.Store, error)
}

// writeSettler is implemented by providers of stores whose writes may
// commit some time after a failed call returned (a database statement that
// was waiting for a lock): writeSettle bounds that time, and the handler
// keeps trying to undo a lost reservation for at least that long.
type writeSettler interface {
	writeSettle() time.Duration
}

// callBounder is implemented by providers whose store calls are each
// bounded by a timeout: the largest of the options callTimeouts returns,
// defaults applied. It needs no provisioning, so that the Caddyfile
// parser can check the lease too, with its line.
type callBounder interface {
	callTimeouts() []namedTimeout
}

// namedTimeout is a timeout and the option that sets it.
type namedTimeout struct {
	option  string
	timeout time.Duration
}

// minLeaseCalls is how many of the store's call timeouts a lease must last
// at least. A renewal is due a quarter of the lease after the last one
// began, or when its reply came back if that was later; one that takes its
// whole timeout and fails, and the retry that follows and takes its whole
// timeout too, must still land before the lease they renew runs out (see
// renewalInterval). With three, a renewal that succeeded but replied a
// whole timeout late (a commit waiting on a log flush) left the next one
// and its retry two timeouts and a pause in the last two thirds of the
// lease: 1.03 of it, and under abandoned reexecute another node executed
// the request again.
const minLeaseCalls = 4

// checkLease refuses a lease that a single slow renewal could let lapse:
// under abandoned reexecute another node would then execute the request
// again while its owner is still waiting on the catalog, and under
// abandoned unknown its retries would hear "unknown" for a request that
// is about to finish. A lease that is not positive is Validate's to refuse.
func checkLease(lease time.Duration, provider any) error {
	b, ok := provider.(callBounder)
	if !ok || lease <= 0 {
		return nil
	}
	var longest time.Duration
	var tooLong []string
	for _, t := range b.callTimeouts() {
		longest = max(longest, t.timeout)
		// Divided, not multiplied: three times a timeout over 97 years
		// wraps negative, and such a timeout passed the check.
		if t.timeout > lease/minLeaseCalls {
			tooLong = append(tooLong, fmt.Sprintf("%s (%v)", t.option, t.timeout))
		}
	}
	if len(tooLong) == 0 {
		return nil
	}
	raise := ""
	if longest <= time.Duration(maxDuration)/minLeaseCalls {
		raise = fmt.Sprintf("raise lease to at least %v, or ", minLeaseCalls*longest)
	}
	return fmt.Errorf("lease %v is shorter than %d times the store's call timeout %v: a renewal that takes the whole timeout would let the lease lapse; "+
		"%slower %s to at most %v",
		lease, minLeaseCalls, longest, raise, joinWords(tooLong, "and"), (lease / minLeaseCalls).Round(time.Millisecond))
}

// joinWords joins names for a message: "a", "a and b", "a, b and c" (or
// with "or").
func joinWords(names []string, last string) string {
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " " + last + " " + names[len(names)-1]
}

// settleWindowFor is the settle window of provider's store: at least
// defaultSettleWindow, longer when its writes may settle later.
func settleWindowFor(provider StoreProvider) time.Duration {
	if s, ok := provider.(writeSettler); ok {
		return max(defaultSettleWindow, s.writeSettle())
	}
	return defaultSettleWindow
}

// StoreReconfigurer is implemented by providers whose store can take new
// settings in place. When a handler acquires a store that is already open
// (a reload kept its StoreKey), Reconfigure is called with it, so that, for
// example, the memory store is resized rather than replaced by an empty one.
type StoreReconfigurer interface {
	Reconfigure(ctx caddy.Context, s stores.Store) error
}

// storePool shares stores across config reloads: a reload provisions the new
// handlers (taking a reference) before the old ones are cleaned up (dropping
// theirs), so records and connection pools survive an admin-API /load.
var storePool = caddy.NewUsagePool()

// drainReportInterval is how often a store no config uses any more, but
// that requests still use, says so while it waits for them. It waits
// without a bound: every request is bounded by its own execution_timeout
// (which has no upper limit) plus its store calls, and a store closed under
// one fails its lease renewals, so that another node takes the key over
// and, under abandoned reexecute, executes the request again.
var drainReportInterval = 5 * time.Minute

// dropLinger is how long a store no config uses any more stays open after
// the last request that used it. A reload does not wait for the old
// config's requests (Caddy shuts its server down in the background), and
// one that was still in a handler before this one when the reload came
// (forward_auth, basic_auth hashing a password) reaches the handler later,
// when nothing counted it yet; Caddy does not tell when the old server's
// last request ended. Each request that comes meanwhile starts the wait
// again.
var dropLinger = time.Minute

// pooledStore is a store in storePool. It counts the requests using it, so
// that a reload which drops the store closes it only after the old config's
// last request finished with it: closing a pool under a running request
// would fail that request's Finalize after the catalog had answered.
type pooledStore struct {
	stores.Store
	backend string // the provider's module name, for metric labels

	logger *zap.Logger

	active atomic.Int64 // requests using the store
	mu     sync.Mutex
	idle   *sync.Cond // signalled, under mu, when active drops to 0

	// dropped is set by Destruct; from then on each use also counts in
	// lateUses, which tells Destruct's linger that requests still come.
	dropped  atomic.Bool
	lateUses atomic.Int64
}

func newPooledStore(s stores.Store) *pooledStore {
	p := &pooledStore{Store: s, logger: zap.NewNop()}
	p.idle = sync.NewCond(&p.mu)
	return p
}

// use marks a request as using the store until it calls done, once: the
// keyed request's path, where a counter costs no allocation and no lock.
func (p *pooledStore) use() {
	p.active.Add(1)
	if p.dropped.Load() {
		p.lateUses.Add(1)
	}
}

// done ends a use. The last one wakes waitIdle; broadcasting under mu means
// a waiter that saw the store busy is already waiting.
func (p *pooledStore) done() {
	if p.active.Add(-1) == 0 {
		p.mu.Lock()
		p.idle.Broadcast()
		p.mu.Unlock()
	}
}

// enter marks a use that ends when the returned func is first called, for
// callers that hand the end on (background retries, admin requests).
func (p *pooledStore) enter() (leave func()) {
	p.use()
	var once sync.Once
	return func() { once.Do(p.done) }
}

// Destruct closes the store once no request has used it for dropLinger.
// It returns at once: Caddy calls it from the old config's Cleanup, which
// must not hold up a reload.
//
// When the process exits, it waits instead (until exitDeadline) for what
// still uses the store: the background repairs of failed store writes (a
// Finalize retried after the answer went out, the release of a reservation
// whose reply was lost) and requests past the server's grace period. The
// process ends when Cleanup returns, and a repair cut off there left its
// key in flight until its record expired, 36 minutes by default: a commit
// the catalog never received answered "unknown", or an answered one not
// replayed.
func (p *pooledStore) Destruct() error {
	if processExiting() {
		drainForExit(p)
		return p.Close()
	}
	p.dropped.Store(true)
	lingering.Store(p, struct{}{})
	if r, ok := p.Store.(idleReleaser); ok {
		r.ReleaseIdle()
	}
	// Read here: tests change them between tests, and this goroutine may
	// outlive its test.
	linger, report := dropLinger, drainReportInterval
	go func() {
		for {
			for !p.waitIdle(report) {
				p.logger.Warn("a store no config uses any more stays open for the requests still using it",
					zap.String("backend", p.backend), zap.Int64("requests", p.active.Load()))
			}
			late := p.lateUses.Load()
			time.Sleep(linger)
			if p.active.Load() == 0 && p.lateUses.Load() == late {
				break
			}
		}
		lingering.Delete(p)
		_ = p.Close()
	}()
	return nil
}

// idleReleaser is a store that can close the connections it holds idle,
// opening new ones as later calls need them. A store a reload dropped does
// so at once: it lingers for the old config's last requests, and each
// reload that changes a pool option drops one (an audit that alternated
// max_conns saw 27 PostgreSQL connections after 12 reloads, and "too many
// clients" for every node after about 50).
type idleReleaser interface{ ReleaseIdle() }

// lingering holds the stores a reload dropped that stay open for what
// still uses them (see Destruct): an exit waits for them too.
var lingering sync.Map // *pooledStore → struct{}

// longestRepair is the longest a store's background repairs may take, over
// every store opened (see repairBound), in nanoseconds.
var longestRepair atomic.Int64

// repairBound is how long the background repairs of a store whose writes
// may settle for settle go on: the longest of their windows, each call
// within bounded too.
func repairBound(settle time.Duration) time.Duration {
	return max(lostReplyWindow, defaultFinalizeWindow, settle) + storeOpTimeout
}

// noteRepairBound raises longestRepair to d.
func noteRepairBound(d time.Duration) {
	for {
		cur := longestRepair.Load()
		if int64(d) <= cur || longestRepair.CompareAndSwap(cur, int64(d)) {
			return
		}
	}
}

// exitDeadline is when an exiting process stops waiting for its stores:
// set by the first store drained, so that several stores wait together,
// not one after the other.
var exitDeadline struct {
	sync.Mutex
	at time.Time
}

// processExiting reports whether the process is exiting (a variable so
// that a test can say it is).
var processExiting = caddy.Exiting

// drainForExit waits, until exitDeadline, for p and every store a reload
// dropped to be idle.
func drainForExit(p *pooledStore) {
	at := exitDeadlineAt()
	p.drainUntil(at)
	drainDropped(at)
}

// exitDeadlineAt returns exitDeadline, setting it on the first call.
func exitDeadlineAt() time.Time {
	exitDeadline.Lock()
	defer exitDeadline.Unlock()
	if exitDeadline.at.IsZero() {
		exitDeadline.at = time.Now().Add(time.Duration(longestRepair.Load()))
	}
	return exitDeadline.at
}

// drainDropped waits, until at, for every store a reload dropped to be
// idle.
func drainDropped(at time.Time) {
	lingering.Range(func(k, _ any) bool {
		k.(*pooledStore).drainUntil(at)
		return true
	})
}

// drainDroppedAtExit is registered with caddy.OnExit, which Caddy runs
// once it has stopped the running config (whose stores drainForExit
// drained). A running config without this module's handlers (a reload took
// them out, or moved them to another store) cleans up no pooled store, and
// the stores a reload dropped were cut off with their repairs: a lost
// reservation's release left its key in flight, then "unknown", for a
// commit the catalog never received.
func drainDroppedAtExit(context.Context) {
	drainDropped(exitDeadlineAt())
}

func init() { caddy.OnExit(drainDroppedAtExit) }

// drainUntil waits, until at, for nothing to use the store, and says what
// it waits for and what it leaves.
func (p *pooledStore) drainUntil(at time.Time) {
	n := p.active.Load()
	if n == 0 {
		return
	}
	p.logger.Info("exiting: waiting for the store writes still under way (background repairs, requests past the grace period)",
		zap.String("backend", p.backend), zap.Int64("uses", n), zap.Time("at_most_until", at))
	if !p.waitIdle(time.Until(at)) {
		p.logger.Error("exiting with store writes still under way: their keys stay in flight until their leases lapse, and then answer as abandoned",
			zap.String("backend", p.backend), zap.Int64("uses", p.active.Load()))
	}
}

// waitIdle blocks until no request uses the store, or timeout passes; it
// reports whether the store is idle.
func (p *pooledStore) waitIdle(timeout time.Duration) bool {
	timer := time.AfterFunc(timeout, func() {
		p.mu.Lock()
		p.idle.Broadcast()
		p.mu.Unlock()
	})
	defer timer.Stop()
	deadline := time.Now().Add(timeout)
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.active.Load() > 0 && time.Now().Before(deadline) {
		p.idle.Wait()
	}
	return p.active.Load() == 0
}

// unpooled returns the store under s's pool wrapper, where optional
// interfaces (Warmer, stores.SelfExpiring) are found.
func unpooled(s stores.Store) stores.Store {
	if p, ok := s.(*pooledStore); ok {
		return p.Store
	}
	return s
}

func acquireStore(ctx caddy.Context, p StoreProvider) (*pooledStore, error) {
	val, loaded, err := storePool.LoadOrNew(p.StoreKey(), func() (caddy.Destructor, error) {
		s, err := p.OpenStore(ctx)
		if err != nil {
			return nil, err
		}
		ps := newPooledStore(s)
		noteRepairBound(repairBound(settleWindowFor(p)))
		ps.backend = storeBackend(p)
		ps.logger = ctx.Logger()
		return ps, nil
	})
	if err != nil {
		return nil, fmt.Errorf("opening store: %w", err)
	}
	ps := val.(*pooledStore)
	if r, ok := p.(StoreReconfigurer); ok && loaded {
		if err := r.Reconfigure(ctx, ps.Store); err != nil {
			_, _ = storePool.Delete(p.StoreKey())
			return nil, fmt.Errorf("reconfiguring store: %w", err)
		}
	}
	return ps, nil
}
