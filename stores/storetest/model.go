package storetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// ModelHarness is what RunModel needs of a store: several nodes (store
// instances, each with its own pool) on one backend, as several Caddy
// nodes would have. A single-process store may list one instance twice.
type ModelHarness struct {
	Nodes []stores.Store
	// Slack is how far the store's clock (the database's) may disagree
	// with this process's, granularity included. Default 25ms.
	Slack time.Duration
	// WakeBound is the longest an Await may take to notice that a record
	// stopped being healthy in flight (its fallback poll). Default 1.5s.
	WakeBound time.Duration
}

// ModelOpen returns a fresh ModelHarness for one test.
type ModelOpen func(t *testing.T) ModelHarness

// Environment of RunModel.
const (
	// ModelDurationEnv sets how long RunModel runs rounds per store
	// (a Go duration). Default 10s, 3s with -short.
	ModelDurationEnv = "ICEBERG_IDEMPOTENCY_MODEL_DURATION"
	// ModelSeedEnv sets the first round's seed (the rounds use seed,
	// seed+1, ...). Default: drawn at random and logged.
	ModelSeedEnv = "ICEBERG_IDEMPOTENCY_MODEL_SEED"
	// ModelRoundsEnv runs exactly this many rounds, whatever the duration.
	ModelRoundsEnv = "ICEBERG_IDEMPOTENCY_MODEL_ROUNDS"
)

// Shape of a round.
const (
	modelRoundLen = 1500 * time.Millisecond
)

// Keys and workers per round: few keys, many workers make for more
// contention. ICEBERG_IDEMPOTENCY_MODEL_KEYS and _WORKERS override them.
var (
	modelKeys    = envInt("ICEBERG_IDEMPOTENCY_MODEL_KEYS", 3)
	modelWorkers = envInt("ICEBERG_IDEMPOTENCY_MODEL_WORKERS", 8)
)

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// The 5 s lease outlasts every WakeBound and Await timeout: a waiter of
// such a record is woken by its change or not at all, so a lost wake-up
// shows (with short leases alone, the lapse woke waiters within the bound).
var (
	modelLeases = []time.Duration{50 * time.Millisecond, 150 * time.Millisecond, 400 * time.Millisecond, time.Second, 5 * time.Second}
	modelTTLs   = []time.Duration{30 * time.Millisecond, 120 * time.Millisecond, 400 * time.Millisecond, 1500 * time.Millisecond}
	modelWaits  = []time.Duration{20 * time.Millisecond, 250 * time.Millisecond, 2500 * time.Millisecond}
)

type opKind int

const (
	kReserve opKind = iota
	kLoad
	kAwait
	kFinalize
	kRelease
	kExtend
	kAbandon
	kTakeOver
	kPurge
)

func (k opKind) String() string {
	return [...]string{"Reserve", "Load", "Await", "Finalize", "Release", "ExtendLease", "Abandon", "TakeOver", "PurgeExpired"}[k]
}

// mop is one store call and its outcome. Times are offsets from the
// round's start on this process's monotonic clock.
type mop struct {
	id, worker, node int
	kind             opKind
	key              string
	owner            string // Reserve's owner, a CAS op's owner, TakeOver's old owner
	newOwner         string // TakeOver
	lease, ttl       time.Duration
	binding          stores.Binding // Reserve
	resp             *stores.Response
	limit            int           // PurgeExpired
	wait             time.Duration // Await's timeout
	stale            bool          // issued with a token the worker does not hold (fencing probe)

	start, end time.Duration

	reserved bool
	ok       bool // CAS applied (TakeOver: took over)
	rec      *stores.Record
	n        int
	err      error
}

// certain reports a call whose effect is known: it returned without error.
func (o *mop) certain() bool { return o.err == nil }

// uncertain reports a write that failed with an error other than
// ErrNotOwner: it may have applied.
func (o *mop) uncertain() bool { return o.err != nil && !errors.Is(o.err, stores.ErrNotOwner) }

func (o *mop) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "#%d w%d n%d [%7.1fms..%7.1fms] %s", o.id, o.worker, o.node, ms(o.start), ms(o.end), o.kind)
	if o.stale {
		b.WriteString("(stale)")
	}
	if o.key != "" {
		fmt.Fprintf(&b, " key=%s", short(o.key))
	}
	if o.owner != "" {
		fmt.Fprintf(&b, " owner=%s", short(o.owner))
	}
	if o.newOwner != "" {
		fmt.Fprintf(&b, " new=%s", short(o.newOwner))
	}
	if o.lease != 0 || o.ttl != 0 {
		fmt.Fprintf(&b, " lease=%v ttl=%v", o.lease, o.ttl)
	}
	if o.kind == kAwait {
		fmt.Fprintf(&b, " timeout=%v", o.wait)
	}
	if o.kind == kPurge {
		fmt.Fprintf(&b, " limit=%d", o.limit)
	}
	b.WriteString(" -> ")
	switch {
	case o.err != nil:
		fmt.Fprintf(&b, "err=%v", o.err)
	case o.kind == kReserve && o.reserved:
		b.WriteString("reserved")
	case o.kind == kReserve || o.kind == kLoad || o.kind == kAwait:
		b.WriteString(recString(o.rec))
	case o.kind == kPurge:
		fmt.Fprintf(&b, "purged %d", o.n)
	default:
		fmt.Fprintf(&b, "ok=%v", o.ok)
	}
	return b.String()
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func short(s string) string {
	if len(s) > 8 {
		return s[len(s)-8:]
	}
	return s
}

func recString(r *stores.Record) string {
	if r == nil {
		return "nil"
	}
	if r.State == stores.StateFinal {
		if r.Response == nil {
			return "final(no response)"
		}
		return fmt.Sprintf("final(%d, body of %s)", r.Response.Status, bodyOwner(r.Response.Body))
	}
	return fmt.Sprintf("%s(owner=%s abandoned=%v)", r.State, short(r.Owner), r.Abandoned)
}

// bodyOwner reads back the owner token a model response body starts with.
func bodyOwner(body []byte) string {
	s := string(body)
	if i := strings.IndexByte(s, '|'); i > 0 {
		return short(s[:i])
	}
	return "?"
}

// modelRound is one round: its keys, its history and its clock.
type modelRound struct {
	h     ModelHarness
	seed  uint64
	keys  []string
	t0    time.Time
	stop  time.Time
	mu    sync.Mutex
	ops   []*mop
	owner map[string][]string // key -> every owner token issued for it
	seq   int
}

func (m *modelRound) now() time.Duration { return time.Since(m.t0) }

// do runs one call and records it.
func (m *modelRound) do(o *mop, call func(ctx context.Context, s stores.Store)) *mop {
	ctx := context.Background()
	s := m.h.Nodes[o.node]
	o.start = m.now()
	call(ctx, s)
	o.end = m.now()
	m.mu.Lock()
	m.seq++
	o.id = m.seq
	m.ops = append(m.ops, o)
	m.mu.Unlock()
	return o
}

func (m *modelRound) issue(key, owner string) {
	m.mu.Lock()
	m.owner[key] = append(m.owner[key], owner)
	m.mu.Unlock()
}

func (m *modelRound) someOwner(rng *rand.Rand, key string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if os := m.owner[key]; len(os) > 0 {
		return os[rng.IntN(len(os))]
	}
	return ""
}

func pick[T any](rng *rand.Rand, xs []T) T { return xs[rng.IntN(len(xs))] }

// newOwner returns a fresh owner token, reproducible from the round's rng.
func newOwner(rng *rand.Rand) string {
	return fmt.Sprintf("own-%016x%016x", rng.Uint64(), rng.Uint64())
}

// modelResponse is the answer owner would store: unique to it, with every
// byte value a body may hold, and random status and headers.
func modelResponse(rng *rand.Rand, owner string) *stores.Response {
	body := []byte(owner + "|")
	for range rng.IntN(64) {
		body = append(body, byte(rng.UintN(256)))
	}
	body = append(body, 0, 0xff)
	h := http.Header{"Content-Type": {"application/json"}}
	if rng.IntN(2) == 0 {
		h["Etag"] = []string{strconv.Quote(owner)}
	}
	if rng.IntN(3) == 0 {
		h["X-Multi"] = []string{"a", "b"}
	}
	return &stores.Response{Status: pick(rng, []int{200, 201, 204, 404, 409}), Header: h, Body: body}
}

func (m *modelRound) node(rng *rand.Rand) int { return rng.IntN(len(m.h.Nodes)) }

// worker plays a client whose requests land on random nodes, and the
// handler serving them: reserve, execute (heartbeats, stalls, crashes),
// finalize or release or abandon; duplicates wait, replay or take over;
// stray calls with stale tokens probe the fencing; purges run meanwhile.
func (m *modelRound) worker(w int, rng *rand.Rand) {
	for time.Now().Before(m.stop) {
		key := pick(rng, m.keys)
		switch p := rng.IntN(100); {
		case p < 55:
			m.request(w, rng, key)
		case p < 72:
			m.load(w, rng, key)
		case p < 80:
			o := &mop{worker: w, node: m.node(rng), kind: kPurge, limit: 1 + rng.IntN(5)}
			m.do(o, func(ctx context.Context, s stores.Store) { o.n, o.err = s.PurgeExpired(ctx, o.limit) })
		case p < 92:
			m.strayCall(w, rng, key)
		default:
			time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond)
		}
	}
}

func (m *modelRound) load(w int, rng *rand.Rand, key string) {
	o := &mop{worker: w, node: m.node(rng), kind: kLoad, key: key}
	m.do(o, func(ctx context.Context, s stores.Store) { o.rec, o.err = s.Load(ctx, key) })
}

// strayCall is a call with a token the caller does not hold (an earlier
// owner of the key, maybe fenced, maybe finalized, maybe live).
func (m *modelRound) strayCall(w int, rng *rand.Rand, key string) {
	owner := m.someOwner(rng, key)
	if owner == "" {
		m.load(w, rng, key)
		return
	}
	o := &mop{worker: w, node: m.node(rng), key: key, owner: owner, stale: true}
	switch rng.IntN(5) {
	case 0:
		o.kind, o.resp = kFinalize, modelResponse(rng, owner)
		m.do(o, func(ctx context.Context, s stores.Store) {
			o.err = s.Finalize(ctx, key, owner, *o.resp)
			o.ok = o.err == nil
		})
	case 1:
		o.kind = kRelease
		m.do(o, func(ctx context.Context, s stores.Store) { o.err = s.Release(ctx, key, owner); o.ok = o.err == nil })
	case 2:
		o.kind, o.lease, o.ttl = kExtend, pick(rng, modelLeases), pick(rng, modelTTLs)
		m.do(o, func(ctx context.Context, s stores.Store) {
			o.err = s.ExtendLease(ctx, key, owner, o.lease, o.ttl)
			o.ok = o.err == nil
		})
	case 3:
		o.kind = kAbandon
		m.do(o, func(ctx context.Context, s stores.Store) { o.err = s.Abandon(ctx, key, owner); o.ok = o.err == nil })
	default:
		o.kind, o.newOwner, o.lease, o.ttl = kTakeOver, newOwner(rng), pick(rng, modelLeases), pick(rng, modelTTLs)
		m.issue(key, o.newOwner)
		m.do(o, func(ctx context.Context, s stores.Store) {
			o.ok, o.err = s.TakeOver(ctx, key, owner, o.newOwner, o.lease, o.ttl)
		})
		if o.ok && rng.IntN(2) == 0 {
			m.hold(w, rng, key, o.newOwner, o.lease)
		}
	}
}

// request is one keyed request as the handler runs it.
func (m *modelRound) request(w int, rng *rand.Rand, key string) {
	owner := newOwner(rng)
	m.issue(key, owner)
	o := &mop{worker: w, node: m.node(rng), kind: kReserve, key: key, owner: owner,
		lease: pick(rng, modelLeases), ttl: pick(rng, modelTTLs),
		binding: stores.Binding{Operation: "updateTable", Path: "/v1/namespaces/ns/tables/" + short(key), Principal: "p", Fingerprint: "fp-" + short(owner)}}
	m.do(o, func(ctx context.Context, s stores.Store) {
		var res stores.ReserveResult
		res, o.err = s.Reserve(ctx, stores.Reservation{Key: key, Binding: o.binding, Owner: owner, Lease: o.lease, TTL: o.ttl})
		o.reserved, o.rec = res.Reserved, res.Existing
	})
	if o.err != nil {
		return
	}
	if o.reserved {
		m.hold(w, rng, key, owner, o.lease)
		return
	}
	rec := o.rec
	if rec == nil || rec.State != stores.StateInFlight {
		return // replayed (checked later)
	}
	if !rec.Abandoned && rng.IntN(3) > 0 {
		a := &mop{worker: w, node: m.node(rng), kind: kAwait, key: key, wait: pick(rng, modelWaits)}
		m.do(a, func(ctx context.Context, s stores.Store) {
			ctx, cancel := context.WithTimeout(ctx, a.wait)
			defer cancel()
			a.rec, a.err = s.Await(ctx, key)
		})
		if a.err != nil || a.rec == nil || a.rec.State != stores.StateInFlight {
			return
		}
		rec = a.rec
	}
	if rec.Abandoned && rng.IntN(2) == 0 {
		// abandoned retry: take the record over and execute again
		to := &mop{worker: w, node: m.node(rng), kind: kTakeOver, key: key, owner: rec.Owner, newOwner: owner,
			lease: pick(rng, modelLeases), ttl: pick(rng, modelTTLs)}
		m.do(to, func(ctx context.Context, s stores.Store) {
			to.ok, to.err = s.TakeOver(ctx, key, rec.Owner, owner, to.lease, to.ttl)
		})
		if to.ok {
			m.hold(w, rng, key, owner, to.lease)
		}
	}
}

// hold executes a reserved key: heartbeats at random intervals, sometimes
// too late (the lease lapses and another node may take over), then ends
// as the handler does or crashes (stops, and leaves the record to lapse).
func (m *modelRound) hold(w int, rng *rand.Rand, key, owner string, lease time.Duration) {
	node := m.node(rng) // a request runs on one node
	for step := 0; ; step++ {
		// mostly within the lease, sometimes past it; no further than the
		// round's end (a long lease ends there)
		time.Sleep(min(time.Duration(rng.Int64N(int64(lease)*13/10+1)), max(time.Until(m.stop), 0)))
		if time.Now().After(m.stop) || step >= 6 {
			if rng.IntN(4) == 0 {
				return // crash
			}
			m.end(w, rng, node, key, owner, rng.IntN(10))
			return
		}
		switch p := rng.IntN(100); {
		case p < 50:
			e := &mop{worker: w, node: node, kind: kExtend, key: key, owner: owner, lease: pick(rng, modelLeases), ttl: pick(rng, modelTTLs)}
			m.do(e, func(ctx context.Context, s stores.Store) {
				e.err = s.ExtendLease(ctx, key, owner, e.lease, e.ttl)
				e.ok = e.err == nil
			})
			if e.err != nil {
				// lost the lease: the handler goes on to deliver; a late
				// finalize or release must be fenced
				if rng.IntN(2) == 0 {
					m.end(w, rng, node, key, owner, rng.IntN(10))
				}
				return
			}
			lease = e.lease
		case p < 92:
			m.end(w, rng, node, key, owner, rng.IntN(10))
			return
		default:
			return // crash: no more heartbeats, nothing stored
		}
	}
}

// end finishes an execution: finalize (0-5), release (6-7), abandon (8-9).
func (m *modelRound) end(w int, rng *rand.Rand, node int, key, owner string, how int) {
	o := &mop{worker: w, node: node, key: key, owner: owner}
	switch {
	case how < 6:
		o.kind, o.resp = kFinalize, modelResponse(rng, owner)
		m.do(o, func(ctx context.Context, s stores.Store) {
			o.err = s.Finalize(ctx, key, owner, *o.resp)
			o.ok = o.err == nil
		})
	case how < 8:
		o.kind = kRelease
		m.do(o, func(ctx context.Context, s stores.Store) { o.err = s.Release(ctx, key, owner); o.ok = o.err == nil })
	default:
		o.kind = kAbandon
		m.do(o, func(ctx context.Context, s stores.Store) { o.err = s.Abandon(ctx, key, owner); o.ok = o.err == nil })
	}
}

// RunModel runs rounds of random concurrent interleavings of the store's
// calls from several nodes on a few keys, with short leases and TTLs,
// stalls, crashes, stale tokens and purges, and checks every round's
// history against the contract of stores.Store (see checkRound).
// Timing is real, so a seed fixes the choices, not the interleaving.
func RunModel(t *testing.T, open ModelOpen) {
	h := open(t)
	if h.Slack == 0 {
		h.Slack = 25 * time.Millisecond
	}
	if h.WakeBound == 0 {
		h.WakeBound = 1500 * time.Millisecond
	}
	budget := 10 * time.Second
	if testing.Short() {
		budget = 3 * time.Second
	}
	if v := os.Getenv(ModelDurationEnv); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("%s: %v", ModelDurationEnv, err)
		}
		budget = d
	}
	rounds := -1
	if v := os.Getenv(ModelRoundsEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("%s: %v", ModelRoundsEnv, err)
		}
		rounds = n
	}
	seed := rand.Uint64() >> 20
	if v := os.Getenv(ModelSeedEnv); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("%s: %v", ModelSeedEnv, err)
		}
		seed = n
	}
	t.Logf("model: first seed %d (%s=%d to start there), %d nodes", seed, ModelSeedEnv, seed, len(h.Nodes))
	begin := time.Now()
	var total, failed, ran int
	counts := map[opKind]int{}
	for r := 0; ; r++ {
		if rounds >= 0 && r >= rounds || rounds < 0 && time.Since(begin)+modelRoundLen > budget && r > 0 {
			break
		}
		s := seed + uint64(r)
		ran++
		m := runRound(h, s)
		for _, o := range m.ops {
			counts[o.kind]++
		}
		total += len(m.ops)
		if v := checkRound(m); len(v) > 0 {
			failed++
			t.Errorf("seed %d: %d violation(s):\n%s", s, len(v), strings.Join(v, "\n"))
		}
	}
	var parts []string
	for k := kReserve; k <= kPurge; k++ {
		parts = append(parts, fmt.Sprintf("%s %d", k, counts[k]))
	}
	t.Logf("model: %d calls in %d rounds, %v, %d round(s) with violations; %s", total, ran, time.Since(begin).Round(time.Millisecond), failed, strings.Join(parts, ", "))
}

func runRound(h ModelHarness, seed uint64) *modelRound {
	rng := rand.New(rand.NewPCG(seed, 0x1ce))
	m := &modelRound{h: h, seed: seed, owner: map[string][]string{}}
	for range modelKeys {
		// a fresh UUID-shaped key per round, from the seed and the clock
		m.keys = append(m.keys, fmt.Sprintf("%08x-%04x-7%03x-8%03x-%012x", uint32(time.Now().UnixNano()), rng.UintN(1<<16), rng.UintN(1<<12), rng.UintN(1<<12), rng.Uint64()&(1<<48-1)))
	}
	m.t0 = time.Now()
	m.stop = m.t0.Add(modelRoundLen)
	var wg sync.WaitGroup
	for w := range modelWorkers {
		wg.Add(1)
		wrng := rand.New(rand.NewPCG(seed, uint64(w)+1))
		go func() {
			defer wg.Done()
			m.worker(w, wrng)
		}()
	}
	wg.Wait()
	// final look at every key from every node
	for _, key := range m.keys {
		for n := range h.Nodes {
			o := &mop{worker: -1, node: n, kind: kLoad, key: key}
			m.do(o, func(ctx context.Context, s stores.Store) { o.rec, o.err = s.Load(ctx, key) })
		}
	}
	return m
}

// incarnation is one life of a key's record: from the Reserve that created
// it to its release or expiry, through its owners (takeovers).
type incarnation struct {
	res       *mop
	owners    []string
	grants    []*mop // Reserve, ExtendLease and TakeOver that set a lease (or may have)
	terminals []*mop // Finalize and Release that applied (or may have)
}

func (m *modelRound) grantOwner(g *mop) string {
	if g.kind == kTakeOver {
		return g.newOwner
	}
	return g.owner
}

// expLo is the earliest the record can expire: every lease granted for sure
// keeps it RecordTTL past the grant's start at least.
func (in *incarnation) expLo() time.Duration {
	var lo time.Duration
	for _, g := range in.grants {
		if g.certain() {
			lo = max(lo, g.start+g.lease+g.ttl)
		}
	}
	return lo
}

// expHi is the latest it can expire.
func (in *incarnation) expHi() time.Duration {
	var hi time.Duration
	for _, g := range in.grants {
		hi = max(hi, g.end+g.lease+g.ttl)
	}
	return hi
}

// deathLo is the earliest the record can be gone; deathHi the latest.
func (in *incarnation) deathLo() time.Duration {
	d := in.expLo()
	for _, x := range in.terminals {
		if x.kind == kRelease {
			d = min(d, x.start)
		}
	}
	return d
}

func (in *incarnation) deathHi() time.Duration {
	d := in.expHi()
	for _, x := range in.terminals {
		if x.kind == kRelease && x.certain() {
			d = min(d, x.end)
		}
	}
	return d
}

// checkRound checks a round's history and returns its violations, each with
// the history of its key.
func checkRound(m *modelRound) []string {
	var out []string
	for _, key := range m.keys {
		var ops []*mop
		for _, o := range m.ops {
			if o.key == key {
				ops = append(ops, o)
			}
		}
		sort.Slice(ops, func(i, j int) bool { return ops[i].start < ops[j].start })
		if v := checkKey(m, key, ops); len(v) > 0 {
			var b strings.Builder
			fmt.Fprintf(&b, "key %s:\n", key)
			for _, s := range v {
				fmt.Fprintf(&b, "  VIOLATION: %s\n", s)
			}
			b.WriteString("  history of the key (and purges):\n")
			all := append([]*mop(nil), ops...)
			for _, o := range m.ops {
				if o.kind == kPurge && o.n > 0 {
					all = append(all, o)
				}
			}
			sort.Slice(all, func(i, j int) bool { return all[i].start < all[j].start })
			for _, o := range all {
				fmt.Fprintf(&b, "    %s\n", o)
			}
			out = append(out, b.String())
		}
	}
	for _, o := range m.ops {
		if o.kind == kPurge && (o.err != nil || o.n < 0 || o.n > o.limit) {
			out = append(out, fmt.Sprintf("purge: %s", o))
		}
	}
	return out
}

func checkKey(m *modelRound, key string, ops []*mop) []string {
	slack := m.h.Slack
	var v []string
	bad := func(o *mop, format string, args ...any) {
		v = append(v, fmt.Sprintf("#%d %s: ", o.id, o.kind)+fmt.Sprintf(format, args...))
	}

	// Build the incarnations and map every owner token to its own.
	var incs []*incarnation
	byOwner := map[string]*incarnation{}
	for _, o := range ops {
		if o.kind == kReserve && o.reserved {
			in := &incarnation{res: o, owners: []string{o.owner}, grants: []*mop{o}}
			incs = append(incs, in)
			byOwner[o.owner] = in
		}
	}
	// takeovers, in start order (a token is taken over from its holder)
	takeovers := map[string][]*mop{} // old owner -> takeovers from it (applied or maybe)
	var pending []*mop
	for _, o := range ops {
		if o.kind == kTakeOver && (o.ok || o.uncertain()) {
			takeovers[o.owner] = append(takeovers[o.owner], o)
			pending = append(pending, o)
		}
	}
	// a chain of takeovers, linked until nothing changes (start order
	// need not be the order in which they applied)
	for changed := true; changed; {
		changed = false
		rest := pending[:0]
		for _, o := range pending {
			in := byOwner[o.owner]
			if in == nil {
				rest = append(rest, o)
				continue
			}
			in.owners = append(in.owners, o.newOwner)
			byOwner[o.newOwner] = in
			in.grants = append(in.grants, o)
			changed = true
		}
		pending = rest
	}
	for _, o := range pending {
		if o.ok {
			bad(o, "took over from %s, which never owned the key", short(o.owner))
		}
	}
	abandons := map[string][]*mop{}
	for _, o := range ops {
		switch o.kind {
		case kExtend:
			if in := byOwner[o.owner]; in != nil && (o.ok || o.uncertain()) {
				in.grants = append(in.grants, o)
			}
		case kFinalize, kRelease:
			if in := byOwner[o.owner]; in != nil && (o.ok || o.uncertain()) {
				in.terminals = append(in.terminals, o)
			}
		case kAbandon:
			if o.ok || o.uncertain() {
				abandons[o.owner] = append(abandons[o.owner], o)
			}
		}
	}

	// errors: only ErrNotOwner (CAS calls) and the context's (Await)
	for _, o := range ops {
		switch {
		case o.err == nil:
		case errors.Is(o.err, stores.ErrNotOwner) && (o.kind == kFinalize || o.kind == kRelease || o.kind == kExtend || o.kind == kAbandon):
		case o.kind == kAwait && errors.Is(o.err, context.DeadlineExceeded):
		default:
			bad(o, "unexpected error: %v", o.err)
		}
	}

	// grantsOf returns the leases granted to owner.
	grantsOf := func(owner string) []*mop {
		in := byOwner[owner]
		if in == nil {
			return nil
		}
		var gs []*mop
		for _, g := range in.grants {
			if m.grantOwner(g) == owner {
				gs = append(gs, g)
			}
		}
		return gs
	}
	// candidates returns the grants of owner that may set its lease at
	// some point of [from, to]: begun before to, and not certainly
	// followed, before from, by another grant.
	candidates := func(owner string, from, to time.Duration) []*mop {
		gs := grantsOf(owner)
		var out []*mop
		for _, x := range gs {
			if x.start >= to {
				continue
			}
			superseded := false
			for _, y := range gs {
				if y.certain() && y.start > x.end && y.end < from {
					superseded = true
				}
			}
			if !superseded {
				out = append(out, x)
			}
		}
		return out
	}
	// leaseSure returns a grant proving that owner's lease is certainly
	// valid at every point of [from, to], or nil: a grant that applied
	// before from, every grant that may have come after it lasts past to,
	// and no abandon may have come after it.
	leaseSure := func(owner string, from, to time.Duration) *mop {
		cs := candidates(owner, from, to)
		var proof *mop
		for _, x := range cs {
			if x.start+x.lease <= to+slack {
				return nil
			}
			if x.certain() && x.end < from {
				proof = x
			}
		}
		if proof == nil {
			return nil
		}
		for _, a := range abandons[owner] {
			if a.start >= to {
				continue
			}
			superseded := false
			for _, y := range grantsOf(owner) {
				if y.certain() && y.start > a.end && y.end < from {
					superseded = true
				}
			}
			if !superseded {
				return nil
			}
		}
		return proof
	}
	// leaseLapsed: owner's lease is certainly lapsed at every point of
	// [from, to]: every grant that may set it then ended before from, or
	// an abandon came after every one of them.
	leaseLapsed := func(owner string, from, to time.Duration) bool {
		cs := candidates(owner, from, to)
		lapsed := true
		for _, x := range cs {
			if x.end+x.lease+slack >= from {
				lapsed = false
			}
		}
		if lapsed {
			return true
		}
		for _, a := range abandons[owner] {
			if !a.ok || a.end >= from {
				continue
			}
			after := true
			for _, x := range cs {
				if x.end > a.start {
					after = false
				}
			}
			if after {
				return true
			}
		}
		return false
	}
	// current: owner certainly holds its record at every point of [from,
	// to] (not taken over, not ended, not expired); except is the call
	// under judgement.
	current := func(owner string, from, to time.Duration, except *mop) bool {
		in := byOwner[owner]
		if in == nil {
			return false
		}
		// owner got the record (reserved it, or took it over) before from
		got := false
		for _, g := range grantsOf(owner) {
			if g.kind != kExtend && g.certain() && g.end < from {
				got = true
			}
		}
		if !got {
			return false
		}
		for _, x := range takeovers[owner] {
			if x != except && x.start < to {
				return false
			}
		}
		for _, x := range in.terminals {
			if x != except && x.start < to {
				return false
			}
		}
		// abandons do not end ownership; grants after 'to' prove life too
		return to+slack < in.expLo()
	}

	// 1. Of the key's records, at most one lives at a time: a Reserve that
	// succeeded while another record lived lets a retry execute again.
	for i, a := range incs {
		for _, b := range incs[i+1:] {
			aFirst := a.res.start < b.res.end && a.deathLo() <= b.res.end+slack
			bFirst := b.res.start < a.res.end && b.deathLo() <= a.res.end+slack
			if !aFirst && !bFirst {
				bad(b.res, "reserved the key while the record of #%d (owner %s) lived (it lives until %.1fms at least)",
					a.res.id, short(a.res.owner), ms(a.deathLo()))
			}
		}
	}

	// 2. At most one ending per record; nothing applies to a record after
	// its ending, nor by a fenced owner, nor after its expiry.
	for _, in := range incs {
		var applied []*mop
		for _, x := range in.terminals {
			if x.ok {
				applied = append(applied, x)
			}
		}
		if len(applied) > 1 {
			bad(applied[1], "record of #%d ended twice: %s and %s", in.res.id, applied[0], applied[1])
		}
	}
	for _, o := range ops {
		if !o.ok || !(o.kind == kFinalize || o.kind == kRelease || o.kind == kExtend || o.kind == kAbandon || o.kind == kTakeOver) {
			continue
		}
		in := byOwner[o.owner]
		if in == nil {
			bad(o, "applied for %s, which never owned the key", short(o.owner))
			continue
		}
		for _, x := range takeovers[o.owner] {
			if x != o && x.ok && x.end < o.start {
				bad(o, "applied for %s, fenced by the takeover #%d", short(o.owner), x.id)
			}
		}
		for _, x := range in.terminals {
			if x != o && x.ok && x.end < o.start {
				bad(o, "applied after the record ended by #%d", x.id)
			}
		}
		if o.start > in.expHi()+slack {
			bad(o, "applied to a record expired at %.1fms at the latest", ms(in.expHi()))
		}
		if o.kind == kTakeOver {
			if g := leaseSure(o.owner, o.start, o.end); g != nil {
				bad(o, "took over while %s's lease from #%d ran (until %.1fms at least)", short(o.owner), g.id, ms(g.start+g.lease))
			}
		}
	}

	// 3. The current owner is never told it is not the owner, and an
	// abandoned record can be taken over.
	for _, o := range ops {
		if o.stale && byOwner[o.owner] == nil {
			continue
		}
		switch {
		case errors.Is(o.err, stores.ErrNotOwner):
			if current(o.owner, o.start, o.end, o) {
				bad(o, "ErrNotOwner for %s, which held the record throughout", short(o.owner))
			}
		case o.kind == kTakeOver && o.err == nil && !o.ok:
			if current(o.owner, o.start, o.end, o) && leaseLapsed(o.owner, o.start, o.end) {
				bad(o, "refused to take over from %s, whose lease had lapsed", short(o.owner))
			}
		}
	}

	// 4. What a call reads is a state the record can be in.
	for _, o := range ops {
		if o.err != nil {
			continue
		}
		var rec *stores.Record
		switch {
		case o.kind == kReserve && !o.reserved:
			if o.rec == nil {
				bad(o, "neither reserved nor returned a record")
				continue
			}
			rec = o.rec
		case o.kind == kLoad || o.kind == kAwait:
			rec = o.rec
		default:
			continue
		}
		if rec == nil {
			for _, in := range incs {
				if in.res.end < o.start && in.deathLo() > o.end+slack {
					bad(o, "found no record while that of #%d lived (until %.1fms at least)", in.res.id, ms(in.deathLo()))
				}
			}
			continue
		}
		if rec.Key != key {
			bad(o, "record of key %q", rec.Key)
		}
		var in *incarnation
		switch rec.State {
		case stores.StateFinal:
			if rec.Response == nil {
				bad(o, "final record without a response")
				continue
			}
			var f *mop
			for _, x := range ops {
				if x.kind == kFinalize && x.resp != nil && (x.ok || x.uncertain()) && string(x.resp.Body) == string(rec.Response.Body) {
					f = x
				}
			}
			if f == nil {
				bad(o, "replayed a body no Finalize stored (%q)", rec.Response.Body)
				continue
			}
			if f.start > o.end {
				bad(o, "replayed #%d's answer before it was given", f.id)
			}
			if !reflect.DeepEqual(*rec.Response, *f.resp) && !(len(rec.Response.Header) == 0 && len(f.resp.Header) == 0 && rec.Response.Status == f.resp.Status) {
				bad(o, "replay differs from what #%d stored: got %d %v, stored %d %v", f.id, rec.Response.Status, rec.Response.Header, f.resp.Status, f.resp.Header)
			}
			in = byOwner[f.owner]
			if in == nil {
				bad(o, "replayed #%d's answer, whose owner never owned the key", f.id)
				continue
			}
			if rec.Owner != "" {
				bad(o, "final record with owner %q", rec.Owner)
			}
		case stores.StateInFlight:
			in = byOwner[rec.Owner]
			if in == nil {
				bad(o, "in flight under %s, which never owned the key", short(rec.Owner))
				continue
			}
			for _, x := range takeovers[rec.Owner] {
				if x.ok && x.end < o.start {
					bad(o, "in flight under %s, taken over by #%d before", short(rec.Owner), x.id)
				}
			}
			for _, x := range in.terminals {
				if x.ok && x.end < o.start {
					bad(o, "in flight after #%d ended the record", x.id)
				}
			}
			if rec.Abandoned {
				if g := leaseSure(rec.Owner, o.start, o.end); g != nil {
					bad(o, "reads abandoned while the lease of #%d ran (until %.1fms at least)", g.id, ms(g.start+g.lease))
				}
			} else {
				if leaseLapsed(rec.Owner, o.start, o.end) {
					bad(o, "reads healthy after %s's lease lapsed", short(rec.Owner))
				}
				if o.kind == kAwait {
					bad(o, "Await returned a healthy in-flight record")
				}
			}
			if rec.Response != nil {
				bad(o, "in-flight record with a response")
			}
		default:
			bad(o, "unknown state %q", rec.State)
			continue
		}
		if rec.Binding != in.res.binding {
			bad(o, "binding %+v, reserved with %+v by #%d", rec.Binding, in.res.binding, in.res.id)
		}
		if in.deathHi()+slack < o.start {
			bad(o, "read the record of #%d, gone by %.1fms", in.res.id, ms(in.deathHi()))
		}
		for _, other := range incs {
			if other != in && other.res.start > in.res.end && other.res.end < o.start {
				bad(o, "read the record of #%d after #%d replaced it", in.res.id, other.res.id)
			}
		}
	}

	// 5. A waiter is woken: an Await must not return (or time out) much
	// later than its key's only record certainly stopped being healthy in
	// flight (finalized, released, lapsed or expired).
	for _, o := range ops {
		if o.kind != kAwait || o.err != nil && !errors.Is(o.err, context.DeadlineExceeded) {
			continue
		}
		deadline := o.end // returned late, or ...
		if o.err != nil {
			deadline = o.start + o.wait // ... timed out
		}
		var live []*incarnation
		for _, in := range incs {
			if in.res.start < o.end {
				live = append(live, in)
			}
		}
		if len(live) == 0 {
			continue
		}
		in := live[len(live)-1]
		if in.res.end >= o.start {
			continue
		}
		if len(live) > 1 {
			prev := live[len(live)-2]
			if prev.deathHi()+slack >= o.start {
				continue
			}
		}
		// when did in certainly stop being healthy in flight?
		stop := time.Duration(1<<62 - 1)
		for _, x := range in.terminals {
			if x.ok {
				stop = min(stop, x.end)
			}
		}
		stop = min(stop, in.deathHi())
		// its owner during the wait: the reserver, or the last owner it was
		// taken over to before the wait; no lapse is judged when a
		// takeover may fall into the wait, nor after a renewal that
		// shortened the lease: a waiter may sleep until the end of the
		// lease it read, and the handler renews with the lease it took
		// (a renewal with a shorter one is this model's, not production's)
		cur, changing := in.res.owner, false
		var latest, longest time.Duration
		for _, g := range in.grants {
			if g.kind == kExtend && g.start < deadline && g.lease < longest {
				changing = true
			}
			longest = max(longest, g.lease)
			if g.kind != kTakeOver {
				continue
			}
			switch {
			case g.end < o.start && g.end > latest:
				cur, latest = g.newOwner, g.end
			case g.start < deadline:
				changing = true
			}
		}
		if !changing {
			for at := o.start; at < deadline; at += 10 * time.Millisecond {
				if leaseLapsed(cur, at, deadline) {
					stop = min(stop, at)
					break
				}
			}
		}
		if max(stop, o.start)+m.h.WakeBound < deadline {
			what := "returned"
			if o.err != nil {
				what = "timed out"
			}
			bad(o, "%s at %.1fms although the record stopped being healthy in flight by %.1fms", what, ms(deadline), ms(stop))
		}
	}
	return v
}
