package icebergidempotency

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// Defaults of the app's options.
const (
	DefaultCleanupInterval = 5 * time.Minute
	DefaultCleanupBatch    = 1000
	// DefaultMaxBufferedBytes bounds the keyed request bodies held at once.
	DefaultMaxBufferedBytes = 1 << 30

	// minCleanupInterval is the shortest cleanup_interval.
	minCleanupInterval = time.Second
)

// App is the iceberg_idempotency Caddy app. It purges expired records from
// every store the handlers of its config use. Caddy creates it automatically
// when a handler needs it; configure it with the global option of the same
// name.
type App struct {
	// How often expired records are purged; each run is jittered by ±10%
	// so that nodes sharing a database spread out. At least 1s.
	// Default: 5m.
	CleanupInterval caddy.Duration `json:"cleanup_interval,omitempty"`

	// Most records deleted by one purge statement; a run repeats it until
	// fewer remain, so no statement holds long locks. A statement that
	// took over 50 ms halves the next one's limit, one under 12.5 ms
	// doubles it again (up to this), and after each full batch the run
	// pauses twice as long as the batch took, so that a backlog keeps the
	// database busy a third of the time at most. A statement that timed
	// out is retried with half its limit (see purgePacer). Default: 1000.
	CleanupBatch int `json:"cleanup_batch,omitempty"`

	// Most bytes of keyed request bodies held in memory at once, by all
	// the handlers of the config together: each body is held whole while
	// its request is executed or waits, to hash it and to send it on. A
	// keyed request whose body would take the total past it is answered
	// 503 + Retry-After before it is executed (nothing is reserved, so its
	// retry executes normally). Buffers count as they grow, so a client
	// that announces a large body and sends little takes only what it
	// sent. At most 1TiB. Default: 1GiB.
	MaxBufferedBytes int64 `json:"max_buffered_bytes,omitempty"`

	bodies bodyBudget

	// advertised is the shortest lifetime of the config's handlers, in
	// nanoseconds, which every handler advertises in GET /v1/config (see
	// noteLifetime); longestLifetime is the longest, under mu.
	advertised      atomic.Int64
	longestLifetime time.Duration

	mu     sync.Mutex
	stores map[string]stores.Store
	// selfExpiringNoted remembers the stores already reported as left
	// out of the purge rounds.
	selfExpiringNoted map[string]bool
	// paces keeps each store's purge limit from one run to the next, so
	// that a limit whose statement timed out is not tried again first.
	paces  map[string]*purgePacer
	logger *zap.Logger
	ctx    caddy.Context   // for the http app at Start (warnShadowedHandlers)
	config <-chan struct{} // the config's Done channel: which config's bounds the memory store holds
	cancel context.CancelFunc
	done   chan struct{}
	// prev is the app the admin API answered for before this one
	// started: it answers again if this one's config fails to start.
	// It is cleared once that app stops, so that a stopped app (and the
	// records of the stores it tracked) is not kept from one reload to
	// the next.
	prev    atomic.Pointer[App]
	stopped atomic.Bool
}

var (
	_ caddy.App         = (*App)(nil)
	_ caddy.Provisioner = (*App)(nil)
	_ caddy.Validator   = (*App)(nil)
)

// CaddyModule returns the Caddy module information.
func (*App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "iceberg_idempotency",
		New: func() caddy.Module { return new(App) },
	}
}

// Provision sets defaults.
func (a *App) Provision(ctx caddy.Context) error {
	a.ctx = ctx
	a.logger = ctx.Logger()
	a.config = ctx.Done()
	a.stores = make(map[string]stores.Store)
	if a.CleanupInterval == 0 {
		a.CleanupInterval = caddy.Duration(DefaultCleanupInterval)
	}
	if a.CleanupBatch == 0 {
		a.CleanupBatch = DefaultCleanupBatch
	}
	if a.MaxBufferedBytes == 0 {
		a.MaxBufferedBytes = DefaultMaxBufferedBytes
	}
	a.bodies.max = a.MaxBufferedBytes
	return nil
}

// Validate checks the configuration.
func (a *App) Validate() error {
	if a.CleanupInterval < 0 {
		return fmt.Errorf("cleanup_interval must be positive, got %v", time.Duration(a.CleanupInterval))
	}
	// Below it, a run follows a run: one statement per store, over and
	// over, for nothing (1ns kept PostgreSQL at 15,000 commits/s).
	if a.CleanupInterval < caddy.Duration(minCleanupInterval) {
		return fmt.Errorf("cleanup_interval must be at least %v, got %v", minCleanupInterval, time.Duration(a.CleanupInterval))
	}
	// Past 265 years the ±10% jitter wraps the timer negative, and purges
	// ran back to back.
	if a.CleanupInterval > maxDuration {
		return fmt.Errorf("cleanup_interval must be at most %v (ten years), got %v", time.Duration(maxDuration), time.Duration(a.CleanupInterval))
	}
	if a.CleanupBatch < 0 {
		return fmt.Errorf("cleanup_batch must be positive, got %d", a.CleanupBatch)
	}
	if a.MaxBufferedBytes < 0 || a.MaxBufferedBytes > maxSize {
		return fmt.Errorf("max_buffered_bytes must be between 1 and 1TiB, got %d", a.MaxBufferedBytes)
	}
	return nil
}

// Warmer is implemented by stores that make their first contact with their
// backend lazily (the SQL stores: connect, check or migrate the schema).
// Warm starts trying in the background and returns at once; the attempts
// end when the store is ready or closed, and calling Warm again meanwhile
// does nothing.
//
// The app calls it from Start, never from Provision: `caddy validate`
// provisions a config without starting it, and must not write to the
// database (migrate). Handlers track their stores during Provision, before
// Start; a request arriving before the warm-up succeeded makes the first
// contact itself.
type Warmer interface {
	Warm()
}

// track adds a store to the purge rounds of this config.
func (a *App) track(key string, s stores.Store) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stores[key] = s
	if !selfExpiring(s) {
		// The series exists at zero before the first run, which may
		// fail: increase() over a series born at 1 reads 0, and the
		// alert would miss it.
		purgeFailures.WithLabelValues(backendOf(s))
	}
}

// noteLifetime counts a handler's lifetime among the config's. Every
// handler advertises the shortest: a client may read /v1/config through one
// handler and send its commits through another (nested directives on two
// stores, or a handle block for /v1/config beside one for the rest), and a
// handler advertising a lifetime longer than another's records are kept
// let a retry within it execute again (until the build after b35c62e, the
// outer of two nested handlers wrote its own over the inner's).
// Advertising less than a record is kept is what the spec allows.
func (a *App) noteLifetime(d time.Duration) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if cur := time.Duration(a.advertised.Load()); cur == 0 || d < cur {
		a.advertised.Store(int64(d))
	}
	a.longestLifetime = max(a.longestLifetime, d)
}

// warnLifetimes warns, at start, of a config whose handlers' lifetimes
// differ: each of them advertises the shortest.
func (a *App) warnLifetimes() {
	a.mu.Lock()
	shortest, longest := time.Duration(a.advertised.Load()), a.longestLifetime
	a.mu.Unlock()
	if shortest != longest {
		a.logger.Warn("the config's iceberg_idempotency handlers have different lifetimes: GET /v1/config advertises the shortest "+
			"through every one of them, since a client may send its commits through another handler than the one its config came through",
			zap.Duration("advertised", shortest), zap.Duration("longest", longest))
	}
}

// warnDroppedPlaces warns, at a reload, of each place where the config in
// force kept records (a memory store, a SQL table, a Redis prefix) that the
// new config does not use: the new config's handlers do not read those
// records, and a retry of a key answered, or still executing, under the old
// config executes again. The README says so ("a reload that changes where
// records live starts from an empty store"); until the build after b35c62e
// nothing at the reload did. A memory store's live records are counted.
func (a *App) warnDroppedPlaces(prev *App) {
	if prev == nil || prev == a {
		return
	}
	a.mu.Lock()
	kept := map[string]bool{}
	for key := range a.stores {
		kept[placeOf(key)] = true
	}
	a.mu.Unlock()
	prev.mu.Lock()
	dropped := map[string]stores.Store{}
	for key, s := range prev.stores {
		if place := placeOf(key); !kept[place] {
			dropped[place] = s
		}
	}
	prev.mu.Unlock()
	for place, s := range dropped {
		fields := []zap.Field{zap.String("place", place)}
		if c, ok := unpooled(s).(stores.Counter); ok && backendName(place) == "memory" {
			counts, err := c.Count(context.Background())
			if err != nil || counts == (stores.Counts{}) {
				continue
			}
			fields = append(fields, zap.Int("in_flight", counts.InFlight), zap.Int("abandoned", counts.Abandoned),
				zap.Int("final", counts.Final))
		}
		a.logger.Warn("the new config keeps records elsewhere than the one it replaces: the keys answered or executing "+
			"under the old one execute again on retry through the new one", fields...)
	}
}

// warmable returns the store under s's pool wrapper if it is a Warmer.
func warmable(s stores.Store) (Warmer, bool) {
	w, ok := unpooled(s).(Warmer)
	return w, ok
}

// running is the app of the running config, for the admin API (admin.go),
// which Caddy provisions apart from the apps and which must answer for the
// stores of the config in force. Start sets it; Stop gives it back to the
// app it replaced, if that one still runs (Caddy stops the apps of a new
// config that fails to start, and keeps the old one), or clears it.
var running atomic.Pointer[App]

// Start warms the tracked stores up, starts the purge loop and makes the
// app the admin API's.
func (a *App) Start() error {
	a.mu.Lock()
	for _, s := range a.stores {
		if w, ok := warmable(s); ok {
			w.Warm()
		}
	}
	a.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	a.done = make(chan struct{})
	go a.purgeLoop(ctx)
	prev := running.Swap(a)
	a.prev.Store(prev)
	a.warnLifetimes()
	a.warnDroppedPlaces(prev)
	// Every app of the config is provisioned by now, the http app's
	// routes with their handlers.
	if http, err := a.ctx.AppIfConfigured("http"); err == nil {
		if http, ok := http.(*caddyhttp.App); ok {
			warnShadowedHandlers(http, a.logger)
			warnBypassableHandlers(http, a.logger)
			warnAuthenticationAfterGuards(http, a.logger)
		}
	}
	return nil
}

// Stop ends the purge loop and waits for a running purge statement to end.
//
// Caddy stops a config's apps either once a newer config has started in
// full (a reload), or because its own start failed after this app started
// (a later app refused), or at shutdown. Only in the first case did a newer
// config ask the memory store for its bounds since this one did: the store
// takes them now (supersede), shrinking if they are smaller. Shrinking any
// sooner, when the new config merely started this app, would evict the
// final records of the config still in force if a later app then refused,
// and their retries would execute again.
func (a *App) Stop() error {
	a.stopped.Store(true)
	if p := a.prev.Swap(nil); p != nil && !p.stopped.Load() {
		running.CompareAndSwap(a, p)
	} else {
		running.CompareAndSwap(a, nil)
	}
	if next := running.Load(); next != nil {
		next.prev.CompareAndSwap(a, nil) // the config that replaced this one
	}
	a.mu.Lock()
	for _, s := range a.stores {
		if m, ok := unpooled(s).(*memoryStore); ok {
			if err := m.supersede(a.config, a.logger); err != nil {
				a.logger.Error("memory store keeps its former bounds", zap.Error(err))
			}
		}
	}
	a.mu.Unlock()
	if a.cancel != nil {
		a.cancel()
		<-a.done
	}
	return nil
}

func (a *App) purgeLoop(ctx context.Context) {
	defer close(a.done)
	for {
		interval := time.Duration(a.CleanupInterval)
		jittered := interval + time.Duration((rand.Float64()*0.2-0.1)*float64(interval))
		timer := time.NewTimer(jittered)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		}
		a.PurgeOnce(ctx)
	}
}

// PurgeOnce purges every tracked store until no expired record remains, or
// ctx ends. A memory store the config adopted takes its bounds first (see
// memoryStore.settle): the app purges only once the config is in force.
func (a *App) PurgeOnce(ctx context.Context) {
	a.mu.Lock()
	tracked := make(map[string]stores.Store, len(a.stores))
	for k, s := range a.stores {
		tracked[k] = s
	}
	a.mu.Unlock()

	for key, s := range tracked {
		if selfExpiring(s) {
			a.noteSelfExpiring(key)
			continue
		}
		if m, ok := unpooled(s).(*memoryStore); ok && !a.stopped.Load() {
			if err := m.settle(a.config, a.logger); err != nil {
				a.logger.Error("memory store keeps its former bounds", zap.Error(err))
			}
		}
		backend := backendOf(s)
		s := instrumentStore(s, backend)
		failed := purgeFailures.WithLabelValues(backend)
		total, inARow, failures := 0, 0, 0
		pace := a.pacer(key)
		for ctx.Err() == nil {
			start := time.Now()
			limit := pace.limit
			n, err := s.PurgeExpired(ctx, limit)
			total += n
			if err != nil {
				if ctx.Err() != nil {
					break
				}
				// A statement that timed out deleted nothing (it was
				// rolled back); with the same limit it would time out
				// again at every run, and the table would only grow. (A
				// transient error that came at once, such as a refused
				// connection, says nothing about the limit, nor does a
				// call that got no connection, or a store not ready: no
				// statement ran, however long the connect hung.)
				took := time.Since(start)
				if sqlstore.IsTransient(err) && !sqlstore.NoConnection(err) && took > purgeTarget && limit > 1 && inARow < maxPurgeFailures {
					inARow++
					failures++
					a.logger.Warn("purging expired records: retrying with a smaller batch",
						zap.String("store", key), zap.Int("batch", limit), zap.Duration("took", took), zap.Error(err))
					if !sleepCtx(ctx, pace.failed(took)) {
						break
					}
					continue
				}
				// Expired records answer no request, so nothing is
				// lost; but while runs keep failing (a user without
				// DELETE, a statement_timeout too short for one row) the
				// table only grows.
				failed.Inc()
				a.logger.Error("purging expired records failed: they stay in the table, answering no request, until a run succeeds",
					zap.String("store", key), zap.Int("purged", total), zap.Duration("cleanup_interval", time.Duration(a.CleanupInterval)), zap.Error(err))
				break
			}
			inARow = 0
			if n < limit {
				break
			}
			// More may be left: the requests get the database for a
			// while first (see purgePacer).
			sleepCtx(ctx, pace.next(time.Since(start)))
		}
		pace.ended(failures)
		purged.WithLabelValues(backend).Add(float64(total))
		if total > 0 {
			a.logger.Info("purged expired records", zap.String("store", key), zap.Int("records", total))
		}
	}
}

// maxPurgeFailures is how many statements in a row one purge run may see
// fail slowly with a transient error (a timeout), each retried with half
// the limit, before the run gives up until the next.
const maxPurgeFailures = 8

// pacer returns the store's purge pacer, kept from run to run.
func (a *App) pacer(key string) *purgePacer {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.paces == nil {
		a.paces = make(map[string]*purgePacer)
	}
	p := a.paces[key]
	if p == nil || p.max != a.CleanupBatch {
		p = newPurgePacer(a.CleanupBatch)
		a.paces[key] = p
	}
	return p
}

// sleepCtx waits d, or until ctx ends; it reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// selfExpiring reports whether the store under s's pool wrapper deletes
// expired records itself (stores.SelfExpiring).
func selfExpiring(s stores.Store) bool {
	se, ok := unpooled(s).(stores.SelfExpiring)
	return ok && se.SelfExpiring()
}

// noteSelfExpiring says once per store, not every interval, that a store
// is left out of the purge rounds.
func (a *App) noteSelfExpiring(key string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.selfExpiringNoted == nil {
		a.selfExpiringNoted = make(map[string]bool)
	}
	if a.selfExpiringNoted[key] {
		return
	}
	a.selfExpiringNoted[key] = true
	a.logger.Info("store expires records itself (key TTL): not purging it", zap.String("store", key))
}
