package icebergidempotency

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
)

// Defaults of the in-memory store's bounds; see package memory for why.
const (
	DefaultMaxEntries = memory.DefaultMaxEntries
	DefaultMaxBytes   = memory.DefaultMaxBytes
)

// memoryStoreKey is the one pool key of the in-memory store. It does not
// carry the bounds: a reload that changes them resizes the store in place
// (Reconfigure) instead of opening an empty one, whose keys would execute
// again on retry.
const memoryStoreKey = "memory"

// MemoryStore configures the embedded in-memory store: correct for a single
// Caddy node, lost on restart.
//
// Every handler on the memory store shares one store, across reloads. Within
// one config the largest bounds any handler asks for apply, so no handler
// gets less than its own setting whatever their order; a new config (a
// reload) sets them afresh, so bounds can also shrink.
type MemoryStore struct {
	// Most final (replayable) records kept; beyond it the least recently
	// used is evicted. In-flight records do not count and are never
	// evicted. Default: 250000.
	MaxEntries int `json:"max_entries,omitempty"`

	// Most bytes the final records may take, counting bodies, replayed
	// headers, keys and bindings plus a fixed per-record overhead (an
	// estimate of heap use). The least recently used records are evicted
	// to fit; a single response larger than this is delivered, not stored.
	// Default: 256 MiB.
	MaxBytes int64 `json:"max_bytes,omitempty"`

	// What a full store gives up: "evict" (the default) evicts the least
	// recently used final record even before it expires, and a retry of
	// its key executes again; "refuse" evicts only expired records, and
	// otherwise refuses new keyed requests (503 + Retry-After, nothing
	// reserved) and leaves an answer that finds no room unknown (its retry
	// gets the abandoned policy's answer: 500 CommitStateUnknownException
	// by default, a second execution under abandoned reexecute).
	// Handlers of one config that differ get "refuse".
	WhenFull string `json:"when_full,omitempty"`
}

var (
	_ StoreProvider         = (*MemoryStore)(nil)
	_ StoreReconfigurer     = (*MemoryStore)(nil)
	_ caddy.Provisioner     = (*MemoryStore)(nil)
	_ caddyfile.Unmarshaler = (*MemoryStore)(nil)
)

// CaddyModule returns the Caddy module information.
func (MemoryStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "iceberg_idempotency.stores.memory",
		New: func() caddy.Module { return new(MemoryStore) },
	}
}

// Provision applies the store's defaults and registers the eviction
// counter.
func (m *MemoryStore) Provision(ctx caddy.Context) error {
	limits, err := memory.Limits{MaxEntries: m.MaxEntries, MaxBytes: m.MaxBytes}.WithDefaults()
	if err != nil {
		return err
	}
	m.MaxEntries, m.MaxBytes = limits.MaxEntries, limits.MaxBytes
	switch m.WhenFull {
	case "", whenFullEvict, whenFullRefuse:
	default:
		return fmt.Errorf("memory store: when_full must be %q or %q, got %q", whenFullEvict, whenFullRefuse, m.WhenFull)
	}
	if m.MaxBytes > maxSize { // as the Caddyfile's sizes
		return fmt.Errorf("memory store: max_bytes must be at most 1TiB, got %d", m.MaxBytes)
	}
	if m.MaxBytes < minMemoryBytes {
		return fmt.Errorf("memory store: %s, got %d", minMemoryBytesRule, m.MaxBytes)
	}
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	return nil
}

// minMemoryBytes is the smallest max_bytes: a record takes about 1 KiB
// besides its answer, and a store that holds no answer stores none. Until
// the build after b35c62e any positive size loaded (max_bytes 256, a unit
// left out), and every keyed answer was delivered unstored, its key's
// outcome unknown, its retry answered 500.
const minMemoryBytes = 64 << 10

const minMemoryBytesRule = "max_bytes must be at least 64KiB: each record takes about 1KiB besides its answer"

// The values of MemoryStore.WhenFull.
const (
	whenFullEvict  = "evict"
	whenFullRefuse = "refuse"
)

func (m *MemoryStore) limits() memory.Limits {
	return memory.Limits{MaxEntries: m.MaxEntries, MaxBytes: m.MaxBytes, KeepUnexpired: m.WhenFull == whenFullRefuse}
}

// StoreKey implements StoreProvider.
func (m *MemoryStore) StoreKey() string { return memoryStoreKey }

// OpenStore implements StoreProvider. It takes the store the process
// keeps, if any (see keptMemory), with this handler's bounds.
func (m *MemoryStore) OpenStore(ctx caddy.Context) (stores.Store, error) {
	keptMemory.Lock()
	defer keptMemory.Unlock()
	if s := keptMemory.store; s != nil {
		keptMemory.users++
		if err := s.adopt(ctx.Done(), m.limits(), ctx.Logger()); err != nil {
			keptMemory.users--
			return nil, err
		}
		return s, nil
	}
	s, err := openMemoryStore(m.limits(), ctx.Done(), ctx.Logger(), nil, nil)
	if err != nil {
		return nil, err
	}
	keptMemory.store, keptMemory.users = s, 1
	return s, nil
}

// keptMemory is the memory store the process keeps, with the number of
// pool entries holding it. The pool closes a store once no config uses it,
// but the memory store's records are the answers that clients may still
// retry for: a reload to a config without the directive and back (a
// maintenance page for a while) opened an empty store, and every key
// answered before it executed again on retry, one still running as well.
// So the last entry's Close keeps the store, and the next OpenStore takes
// it again, records and all; a store no one took is let go once it holds
// no live record (see sweepKept).
var keptMemory struct {
	sync.Mutex
	store    *memoryStore
	users    int
	sweeping bool // a sweepKept runs
}

// keptSweepInterval is how often a kept store that no config uses is
// purged of expired records, and let go once it holds none.
var keptSweepInterval = time.Minute

// release is a pool entry's Close of a store OpenStore gave it: the store
// is kept while records live, swept by a goroutine of its own.
func (s *memoryStore) release() (kept bool) {
	keptMemory.Lock()
	defer keptMemory.Unlock()
	if keptMemory.store != s {
		return false
	}
	keptMemory.users--
	s.evictions.Flush() // an exit ends with this Close
	if keptMemory.users == 0 && !keptMemory.sweeping {
		keptMemory.sweeping = true
		go s.sweepKept(keptSweepInterval)
	}
	return true
}

// sweepKept purges the kept store s every interval while no config takes
// it, and lets it go once it holds no live record.
func (s *memoryStore) sweepKept(interval time.Duration) {
	for {
		time.Sleep(interval)
		keptMemory.Lock()
		if keptMemory.store != s { // not this sweep's business any more
			keptMemory.Unlock()
			return
		}
		if keptMemory.users > 0 {
			keptMemory.sweeping = false
			keptMemory.Unlock()
			return
		}
		_, _ = s.PurgeExpired(context.Background(), math.MaxInt)
		if c, _ := s.Count(context.Background()); c.InFlight+c.Abandoned+c.Final == 0 {
			keptMemory.store, keptMemory.sweeping = nil, false
			keptMemory.Unlock()
			s.evictions.Close()
			return
		}
		keptMemory.Unlock()
	}
}

// Reconfigure implements StoreReconfigurer: the shared store takes this
// handler's bounds in place, keeping its records. Larger bounds apply at
// once; smaller ones (shrinking evicts least recently used final records)
// only when the config starts, see configure.
func (m *MemoryStore) Reconfigure(ctx caddy.Context, s stores.Store) error {
	ms, ok := s.(*memoryStore)
	if !ok {
		return fmt.Errorf("store under key %q is a %T, not the memory store", memoryStoreKey, s)
	}
	return ms.configure(ctx.Done(), m.limits(), ctx.Logger())
}

// memoryStore is the pooled in-memory store with what reloads need: which
// config asked for its bounds, and where its evictions are reported.
type memoryStore struct {
	*memory.Store
	evictions *memory.EvictionLog

	mu     sync.Mutex
	config <-chan struct{} // Done channel of the config whose handlers last asked for bounds
	wanted memory.Limits   // what that config's handlers ask for: the largest of each
	// inForce is the config whose when_full the store keeps: the one
	// that opened it, then each that superseded it.
	inForce <-chan struct{}
}

// openMemoryStore opens a store; now and after are for tests (nil: real time).
func openMemoryStore(l memory.Limits, config <-chan struct{}, logger *zap.Logger,
	now func() time.Time, after func(time.Duration, func()) (stop func() bool)) (*memoryStore, error) {
	ev := memory.NewEvictionLog(logger, now, after)
	onEvict := func(e memory.Eviction) {
		memoryEvictions.WithLabelValues(string(e.Reason)).Inc()
		ev.Record(e)
	}
	s, err := memory.New(memory.Options{MaxEntries: l.MaxEntries, MaxBytes: l.MaxBytes, KeepUnexpired: l.KeepUnexpired, Now: now, OnEvict: onEvict})
	if err != nil {
		return nil, err
	}
	return &memoryStore{Store: s, evictions: ev, config: config, wanted: s.Limits(), inForce: config}, nil
}

// configure takes a handler's bounds. Handlers of one config share its
// context, hence its Done channel: within a config the larger bounds win,
// and the first handler of a new config replaces the old config's wish.
// The store grows at once but shrinks only once the config is in force
// (supersede): a reload that fails after this handler was provisioned, or
// while its apps start, leaves the running config in force, and a shrink
// would have evicted its final records, whose retries would then execute
// again. A new config's when_full waits for that too: its refuse, taken
// at once, stayed on after a reload Caddy refused, and the running config
// (evict) answered 503 to every new key on a full store (with one handler
// in the new config until the build after 1ccf432 fixed it, with two
// after it).
func (s *memoryStore) configure(config <-chan struct{}, want memory.Limits, logger *zap.Logger) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.Limits()
	grow := larger(want, now)
	if config != s.inForce {
		grow.KeepUnexpired = now.KeepUnexpired
	}
	if config == s.config {
		want = larger(want, s.wanted)
	}
	s.config, s.wanted = config, want
	s.evictions.SetLogger(logger)
	return s.resize(grow, logger)
}

// adopt takes the bounds of config, the first to open a kept store that no
// config uses, as configure does a new config's: larger ones at once, and
// smaller ones and its when_full only once config is in force (settle). A
// reload Caddy refuses would otherwise have shrunk the store, evicting
// records of the configs before the gap for good.
func (s *memoryStore) adopt(config <-chan struct{}, want memory.Limits, logger *zap.Logger) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.Limits()
	grow := larger(want, now)
	grow.KeepUnexpired = now.KeepUnexpired
	s.config, s.wanted, s.inForce = config, want, nil
	s.evictions.SetLogger(logger)
	return s.resize(grow, logger)
}

// settle is called by the app of config as it purges, which it does only
// in force: a store config adopted (no older config's app will supersede
// it, since none used the store) takes that config's bounds now.
func (s *memoryStore) settle(config <-chan struct{}, logger *zap.Logger) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inForce != nil || s.config != config {
		return nil
	}
	s.inForce = config
	return s.resize(s.wanted, logger)
}

// supersede is called as the app of config stops. If a newer config has
// asked for bounds since config did, that one has started in full (Caddy
// stops the old config's apps only then) and the store takes its bounds,
// shrinking if they are smaller. If config asked last, it is stopping
// because its own start failed, or at shutdown: nothing changes.
func (s *memoryStore) supersede(config <-chan struct{}, logger *zap.Logger) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if config == s.config {
		return nil
	}
	s.inForce = s.config
	return s.resize(s.wanted, logger)
}

// resize sets the bounds to want. Caller holds s.mu.
func (s *memoryStore) resize(want memory.Limits, logger *zap.Logger) error {
	old := s.Limits()
	if want == old {
		return nil
	}
	evicted, err := s.Resize(want)
	if err != nil {
		return err
	}
	logger.Info("memory store resized in place, records kept",
		zap.Int("max_entries", want.MaxEntries), zap.Int64("max_bytes", want.MaxBytes),
		zap.Int("old_max_entries", old.MaxEntries), zap.Int64("old_max_bytes", old.MaxBytes),
		zap.Bool("keep_unexpired", want.KeepUnexpired), zap.Int("evicted", evicted))
	return nil
}

// larger is the bounds that give each of a and b at least what it asks
// for; a store that keeps unexpired records if either asks it to.
func larger(a, b memory.Limits) memory.Limits {
	return memory.Limits{MaxEntries: max(a.MaxEntries, b.MaxEntries), MaxBytes: max(a.MaxBytes, b.MaxBytes),
		KeepUnexpired: a.KeepUnexpired || b.KeepUnexpired}
}

// Close reports evictions not logged yet. The store OpenStore gave is
// kept instead (see keptMemory).
func (s *memoryStore) Close() error {
	if s.release() {
		return nil
	}
	s.evictions.Close()
	return s.Store.Close()
}

// UnmarshalCaddyfile parses
//
//	store memory [{
//	    max_entries <n>
//	    max_bytes   <size>
//	    when_full   evict|refuse
//	}]
func (m *MemoryStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // store type name
	if d.NextArg() {
		return d.ArgErr()
	}
	given := givenOptions{}
	for d.NextBlock(0) {
		if err := given.once(d, d.Val()); err != nil {
			return err
		}
		switch d.Val() {
		case "max_entries":
			arg, err := singleArg(d)
			if err != nil {
				return err
			}
			// The adapter carries a store's numbers as JSON floats,
			// exact only to 2^53: 9223372036854775807 came out as a
			// number the handler then refused, without a line.
			n, err := strconv.Atoi(arg)
			if err != nil || n <= 0 || n > maxExactJSONInt {
				return d.Errf("max_entries must be a positive integer up to %d, got %q", maxExactJSONInt, arg)
			}
			m.MaxEntries = n
		case "max_bytes":
			if err := parseSize(d, &m.MaxBytes); err != nil {
				return err
			}
			if m.MaxBytes < minMemoryBytes {
				return d.Errf("%s, got %d bytes (a unit left out?)", minMemoryBytesRule, m.MaxBytes)
			}
		case "when_full":
			arg, err := singleArg(d)
			if err != nil {
				return err
			}
			if arg != whenFullEvict && arg != whenFullRefuse {
				return d.Errf("when_full must be %s or %s, got %q", whenFullEvict, whenFullRefuse, arg)
			}
			m.WhenFull = arg
		default:
			return d.Errf("unknown memory store option %q", d.Val())
		}
	}
	return nil
}
