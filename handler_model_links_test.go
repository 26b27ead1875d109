package icebergidempotency

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// hmLink is the handler model's link between one node's store client and
// its database: a TCP proxy on which a round's plan sets faults. It stands
// in for a network fault on that link (a reset, a partition that holds the
// packets and delivers them when it heals, or whose connections die of it,
// a slow link), since CI cannot build network namespaces. What a partition
// does to bytes already accepted by the kernel is what it does here: they
// arrive when it heals, even from a connection their sender has closed.
type hmLink struct {
	target string
	ln     net.Listener

	mu    sync.Mutex
	conns map[*hmLinkConn]struct{}
	hold  [2]hmHold // per direction: 0 up (client → database), 1 down
	lat   time.Duration
	latTo time.Time
	wake  chan struct{} // closed and replaced whenever the faults change
	gone  bool
}

// hmHold holds a direction's bytes until until; drop: the connections that
// had bytes held die when it ends, their bytes undelivered.
type hmHold struct {
	until time.Time
	drop  bool
}

type hmLinkConn struct {
	link           *hmLink
	client, server *net.TCPConn
	once           sync.Once
	dead           chan struct{}
	halves         atomic.Int32 // directions whose sender closed and were passed on
}

type hmChunk struct {
	b   []byte
	due time.Time
	eof bool // the sender closed (or reset: rst) its side
	rst bool
}

func newHMLink(target string) (*hmLink, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	l := &hmLink{target: target, ln: ln, conns: map[*hmLinkConn]struct{}{}, wake: make(chan struct{})}
	go l.accept()
	return l, nil
}

func (l *hmLink) Addr() string { return l.ln.Addr().String() }

func (l *hmLink) accept() {
	for {
		c, err := l.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", l.target)
		if err != nil {
			hmRST(c.(*net.TCPConn))
			continue
		}
		lc := &hmLinkConn{link: l, client: c.(*net.TCPConn), server: s.(*net.TCPConn), dead: make(chan struct{})}
		l.mu.Lock()
		if l.gone {
			l.mu.Unlock()
			lc.kill()
			continue
		}
		l.conns[lc] = struct{}{}
		l.mu.Unlock()
		go lc.pipe(0, lc.client, lc.server)
		go lc.pipe(1, lc.server, lc.client)
	}
}

func hmRST(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}

// kill resets both sides of the connection.
func (c *hmLinkConn) kill() {
	c.once.Do(func() {
		close(c.dead)
		hmRST(c.client)
		hmRST(c.server)
		c.link.mu.Lock()
		delete(c.link.conns, c)
		c.link.mu.Unlock()
	})
}

// finish closes both sides, which have closed theirs, without a reset.
func (c *hmLinkConn) finish() {
	c.once.Do(func() {
		close(c.dead)
		_ = c.client.Close()
		_ = c.server.Close()
		c.link.mu.Lock()
		delete(c.link.conns, c)
		c.link.mu.Unlock()
	})
}

// pipe carries one direction: a reader queues what arrives, stamped with
// the latency of the moment; the writer sends it on once its direction is
// not held and its due time has come.
func (c *hmLinkConn) pipe(dir int, src, dst *net.TCPConn) {
	var mu sync.Mutex
	var q []hmChunk
	more := make(chan struct{}, 1)
	go func() {
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			ch := hmChunk{due: time.Now().Add(c.link.latency())}
			if n > 0 {
				ch.b = append([]byte(nil), buf[:n]...)
			}
			if err != nil {
				ch.eof = true
				ch.rst = !strings.Contains(err.Error(), "EOF")
			}
			if n > 0 || err != nil {
				mu.Lock()
				q = append(q, ch)
				mu.Unlock()
				select {
				case more <- struct{}{}:
				default:
				}
			}
			if err != nil {
				return
			}
		}
	}()
	for {
		mu.Lock()
		if len(q) == 0 {
			mu.Unlock()
			select {
			case <-more:
				continue
			case <-c.dead:
				return
			}
		}
		ch := q[0]
		q = q[1:]
		mu.Unlock()
		if d := time.Until(ch.due); d > 0 {
			select {
			case <-time.After(d):
			case <-c.dead:
				return
			}
		}
		if dropped := c.link.waitHeld(dir, c.dead); dropped {
			c.kill()
			return
		}
		select {
		case <-c.dead:
			return
		default:
		}
		if len(ch.b) > 0 {
			if _, err := dst.Write(ch.b); err != nil {
				c.kill()
				return
			}
		}
		if ch.rst {
			c.kill()
			return
		}
		if ch.eof {
			_ = dst.CloseWrite()
			if c.halves.Add(1) == 2 {
				c.finish()
			}
			return
		}
	}
}

// waitHeld waits while dir is held; it reports whether a hold that
// held it ended by dropping.
func (l *hmLink) waitHeld(dir int, dead chan struct{}) (dropped bool) {
	for {
		l.mu.Lock()
		h, wake := l.hold[dir], l.wake
		l.mu.Unlock()
		d := time.Until(h.until)
		if d <= 0 {
			return dropped
		}
		dropped = dropped || h.drop
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-wake:
		case <-dead:
			t.Stop()
			return false
		}
		t.Stop()
	}
}

func (l *hmLink) latency() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	if time.Now().Before(l.latTo) {
		return l.lat
	}
	return 0
}

func (l *hmLink) changed() {
	close(l.wake)
	l.wake = make(chan struct{})
}

// reset resets every connection of the link now.
func (l *hmLink) reset() {
	l.mu.Lock()
	cs := make([]*hmLinkConn, 0, len(l.conns))
	for c := range l.conns {
		cs = append(cs, c)
	}
	l.mu.Unlock()
	for _, c := range cs {
		c.kill()
	}
}

// holdFor holds the directions in dirs (bit 0 up, bit 1 down) for d.
func (l *hmLink) holdFor(dirs int, d time.Duration, drop bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	until := time.Now().Add(d)
	for dir := 0; dir < 2; dir++ {
		if dirs&(1<<dir) == 0 {
			continue
		}
		h := &l.hold[dir]
		if until.After(h.until) {
			h.until = until
		}
		h.drop = h.drop && time.Now().Before(h.until) || drop
	}
	l.changed()
}

func (l *hmLink) slow(lat, d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lat, l.latTo = lat, time.Now().Add(d)
	l.changed()
}

// heal ends every fault of the link.
func (l *hmLink) heal() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.hold = [2]hmHold{}
	l.latTo = time.Time{}
	l.changed()
}

func (l *hmLink) close() {
	_ = l.ln.Close()
	l.mu.Lock()
	l.gone = true
	l.mu.Unlock()
	l.heal()
	l.reset()
}

// hmLinkKind is one kind of fault on a store link.
type hmLinkKind int

const (
	linkReset    hmLinkKind = iota // every connection reset now
	linkHold                       // bytes held for d, then delivered
	linkHoldDrop                   // bytes held for d, then their connections die
	linkSlow                       // every byte d late... for a while
	linkKindCount
)

// hmLinkEvent is one fault a round's plan puts on a node's store link, at
// a moment of the round or, armed at that moment, as the node's next store
// call of one kind begins (on), a few milliseconds into it (delay): so that
// the faults meet each kind of call, a Finalize whose reply is lost, say.
type hmLinkEvent struct {
	node  int
	at    time.Duration
	on    string        // "" at the moment; else a store call: reserve, finalize, release, extend, abandon, takeover, load, await
	delay time.Duration // after the call began
	kind  hmLinkKind
	dirs  int           // linkHold, linkHoldDrop: 1 up, 2 down, 3 both
	d     time.Duration // how long it lasts
	lat   time.Duration // linkSlow

	fired   bool          // under the round's linkMu
	firedAt time.Duration // when it began
}

func (e *hmLinkEvent) String() string {
	dirs := [...]string{"", "up", "down", "both"}
	var what string
	switch e.kind {
	case linkReset:
		what = "reset"
	case linkHold:
		what = fmt.Sprintf("hold %s %v then deliver", dirs[e.dirs], e.d)
	case linkHoldDrop:
		what = fmt.Sprintf("hold %s %v then drop", dirs[e.dirs], e.d)
	default:
		what = fmt.Sprintf("slow +%v for %v", e.lat, e.d)
	}
	when := fmt.Sprintf("@%v", e.at)
	if e.on != "" {
		when = fmt.Sprintf("on the next %s after %v: not fired", e.on, e.at)
		if e.fired {
			when = fmt.Sprintf("%v into a %s @%v", e.delay, e.on, e.firedAt)
		}
	}
	return fmt.Sprintf("node%d link %s %s", e.node, what, when)
}

// end is when the fault of a fired event is over.
func (e *hmLinkEvent) end() time.Duration {
	if e.kind == linkReset {
		return e.firedAt
	}
	return e.firedAt + e.d
}

var hmLinkOps = []string{"reserve", "reserve", "finalize", "finalize", "release", "extend", "extend", "abandon", "abandon", "takeover", "load", "await"}

// drawLinkEvents draws the store-link faults of a round: up to three per
// node, at moments while the clients send or at the start of a store call,
// most of them shorter than a store call's timeout, some as long as a
// lease or longer.
func drawLinkEvents(rng *rand.Rand, nodes int, storeTimeout, stop time.Duration) []*hmLinkEvent {
	var evs []*hmLinkEvent
	for n := 0; n < nodes; n++ {
		for i, k := 0, rng.IntN(4); i < k; i++ {
			// Most while the keys' first attempts run: many keys have
			// their answer within half a second.
			window := stop + 300*time.Millisecond
			if rng.IntN(3) > 0 {
				window = 700 * time.Millisecond
			}
			e := &hmLinkEvent{node: n, at: time.Duration(rng.Int64N(int64(window)))}
			e.kind = hmLinkKind(rng.IntN(int(linkKindCount)))
			e.dirs = 1 + rng.IntN(3)
			switch r := rng.IntN(10); {
			case r < 5:
				e.d = time.Duration(20+rng.IntN(int(storeTimeout/time.Millisecond))) * time.Millisecond
			case r < 8:
				e.d = storeTimeout + time.Duration(rng.Int64N(int64(2*storeTimeout)))
			default:
				e.d = 3*storeTimeout + time.Duration(rng.Int64N(int64(4*storeTimeout)))
			}
			e.lat = time.Duration(2+rng.IntN(300)) * time.Millisecond
			if rng.IntN(2) == 0 {
				e.on = hmLinkOps[rng.IntN(len(hmLinkOps))]
				e.delay = time.Duration(rng.IntN(4)) * time.Millisecond
			}
			evs = append(evs, e)
		}
	}
	sort.Slice(evs, func(i, j int) bool { return evs[i].at < evs[j].at })
	return evs
}

// fireLink applies e now (caller holds m.linkMu).
func (m *hmRound) fireLink(e *hmLinkEvent) {
	e.fired, e.firedAt = true, m.now()
	l := m.env.links[e.node]
	switch e.kind {
	case linkReset:
		l.reset()
	case linkHold:
		l.holdFor(e.dirs, e.d, false)
	case linkHoldDrop:
		l.holdFor(e.dirs, e.d, true)
	case linkSlow:
		l.slow(e.lat, e.d)
	}
}

// playLinkEvents applies the round's timed events at their moments, until
// the round's clients are done (done).
func (m *hmRound) playLinkEvents(done <-chan struct{}) {
	for _, e := range m.linkEvents {
		if e.on != "" {
			continue
		}
		select {
		case <-time.After(time.Until(m.t0.Add(e.at))):
		case <-done:
			return
		}
		m.linkMu.Lock()
		if !m.linksDisarmed {
			m.fireLink(e)
		}
		m.linkMu.Unlock()
	}
}

// storeCall fires the armed events on node's next call of kind op.
func (m *hmRound) storeCall(node int, op string) {
	if len(m.linkEvents) == 0 {
		return
	}
	now := m.now()
	m.linkMu.Lock()
	defer m.linkMu.Unlock()
	for _, e := range m.linkEvents {
		if e.node != node || e.on != op || e.fired || e.at > now || m.linksDisarmed {
			continue
		}
		e.fired, e.firedAt = true, now // claimed; fireLink sets the moment
		go func() {
			time.Sleep(e.delay)
			m.linkMu.Lock()
			defer m.linkMu.Unlock()
			m.fireLink(e)
		}()
	}
}

// healLinks disarms the events not fired yet, waits until the fired ones
// are over, and heals every link.
func (m *hmRound) healLinks() {
	m.linkMu.Lock()
	m.linksDisarmed = true
	m.linkMu.Unlock()
	time.Sleep(10 * time.Millisecond) // a claimed event's delay
	m.linkMu.Lock()
	var last time.Duration
	kinds := [...]string{"reset", "hold", "hold-drop", "slow"}
	for _, e := range m.linkEvents {
		if e.fired {
			last = max(last, e.end())
			on := "at a moment"
			if e.on != "" {
				on = "on " + e.on
			}
			m.cov["link "+kinds[e.kind]+" "+on]++
		}
	}
	m.linkMu.Unlock()
	time.Sleep(time.Until(m.t0.Add(last)))
	for _, l := range m.env.links {
		l.heal()
	}
}

// hmLinkedStore is a node's store as its handler calls it: each call may
// fire a fault on the node's store link as it begins.
type hmLinkedStore struct {
	stores.Store
	m    *hmRound
	node int
}

func (s *hmLinkedStore) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	s.m.storeCall(s.node, "reserve")
	return s.Store.Reserve(ctx, r)
}

func (s *hmLinkedStore) Load(ctx context.Context, key string) (*stores.Record, error) {
	s.m.storeCall(s.node, "load")
	return s.Store.Load(ctx, key)
}

func (s *hmLinkedStore) Await(ctx context.Context, key string) (*stores.Record, error) {
	s.m.storeCall(s.node, "await")
	return s.Store.Await(ctx, key)
}

func (s *hmLinkedStore) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	s.m.storeCall(s.node, "finalize")
	return s.Store.Finalize(ctx, key, owner, resp)
}

func (s *hmLinkedStore) Release(ctx context.Context, key, owner string) error {
	s.m.storeCall(s.node, "release")
	return s.Store.Release(ctx, key, owner)
}

func (s *hmLinkedStore) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	s.m.storeCall(s.node, "extend")
	return s.Store.ExtendLease(ctx, key, owner, lease, ttl)
}

func (s *hmLinkedStore) Abandon(ctx context.Context, key, owner string) error {
	s.m.storeCall(s.node, "abandon")
	return s.Store.Abandon(ctx, key, owner)
}

func (s *hmLinkedStore) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	s.m.storeCall(s.node, "takeover")
	return s.Store.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
}

// hmStoreFaultShare is the share of rounds that put faults on the store
// links (_STORE_FAULTS: "1" every round, a fraction such as 0.2 that share,
// unset or 0 none).
func hmStoreFaultShare(t *testing.T) float64 {
	s := os.Getenv(hmStoreFaultsEnv)
	if s == "" {
		return 0
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f < 0 || f > 1 {
		t.Fatalf("%s: %q, want a share of the rounds from 0 to 1", hmStoreFaultsEnv, s)
	}
	return f
}

// linkedProvider opens a store link for one more node, and returns the
// store's provider (provisioned) with its database behind that link.
func (env *hmEnv) linkedProvider(t *testing.T, ctx caddy.Context) StoreProvider {
	l, err := newHMLink(env.linkTarget)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.close)
	env.links = append(env.links, l)
	p := env.providerVia(l.Addr())
	if err := p.(caddy.Provisioner).Provision(ctx); err != nil {
		t.Fatal(err)
	}
	return p
}

// hmStoreUnavailable tells the module's answer to a failed store call
// from its answer for a key still in flight (both 503
// ServiceUnavailableException).
func hmStoreUnavailable(body []byte) bool {
	return strings.Contains(string(body), "store is unavailable")
}

// linkFaultBefore reports whether a fault began on a store link before at.
func (m *hmRound) linkFaultBefore(at time.Duration) bool {
	m.linkMu.Lock()
	defer m.linkMu.Unlock()
	for _, e := range m.linkEvents {
		if e.fired && e.firedAt < at {
			return true
		}
	}
	return false
}

// linkFaultNear reports whether a store link fault may still shape a's
// answer: one began before a ended and was over less than a settle window
// (the longest a lost write may take to land, and to be undone) before a
// began.
func (m *hmRound) linkFaultNear(a *hmAttempt) bool {
	settle := m.nodes[0].h.settleWindow
	m.linkMu.Lock()
	defer m.linkMu.Unlock()
	for _, e := range m.linkEvents {
		if e.fired && e.firedAt < a.end && e.end()+settle > a.start {
			return true
		}
	}
	return false
}

// leaseMayHaveLapsed reports whether the lease of prev's request may have
// lapsed before e executed, its renewals failing (see heldLong).
func (m *hmRound) leaseMayHaveLapsed(prev, e *hmExec) bool {
	return m.heldLong(prev.plan.sentAt, e.start)
}

// heldLong reports whether some link held its bytes for half a lease or
// more (one hold, or several that overlap) at some time between from and
// to: long enough for a lease to lapse, its renewals (or the undo of a
// lost write) not arriving. On the node that holds the lease they do not
// arrive: held on their way, or, when only the answers are held, a store
// client that gave up on a connection opens a new one whose handshake never
// completes (Redis's HELLO, a SQL login), so the statement is never sent.
// On another node, a transaction held open there can keep them waiting on
// a row lock. A renewal lands at the latest a quarter of a lease after the
// one before, so a lapse takes a hold of about three quarters of it; half
// leaves room for a busy machine.
func (m *hmRound) heldLong(from, to time.Duration) bool {
	lease := m.opts.lease
	m.linkMu.Lock()
	defer m.linkMu.Unlock()
	type span struct{ from, to time.Duration }
	byNode := map[int][]span{}
	for _, f := range m.linkEvents {
		if f.fired && (f.kind == linkHold || f.kind == linkHoldDrop) {
			byNode[f.node] = append(byNode[f.node], span{f.firedAt, f.end()})
		}
	}
	for _, spans := range byNode {
		sort.Slice(spans, func(i, j int) bool { return spans[i].from < spans[j].from })
		for i := 0; i < len(spans); {
			u := spans[i]
			for i++; i < len(spans) && spans[i].from <= u.to; i++ {
				u.to = max(u.to, spans[i].to)
			}
			if u.to-u.from >= lease/2 && u.from < to && u.to > from {
				return true
			}
		}
	}
	return false
}
