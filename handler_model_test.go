package icebergidempotency

// A randomized model of the handler's decisions, end to end in process:
// real HTTP clients → a net/http front server that calls the handler the way
// Caddy's server does → Caddy's real reverse_proxy → a scripted catalog on
// real TCP. Each round draws the handler's options, a few keys, several
// concurrent clients per key and, for every attempt, what the catalog does
// with it (a plan): answer a status (gzip or not, chunked or not, large or
// small, after a 1xx or not, at once or slower than a duplicate's
// in_flight_wait), or a fault (dial refused, connection closed before the
// request is read, reset after executing, mid-headers or mid-body, stalled
// past execution_timeout). Clients retry every answer that is not final and
// leave at random moments. The catalog "executes" a request the moment it
// has read its whole body, and records that explicitly.
//
// After each round the history is checked against the README's "Finalize or
// release" table and "The guarantee, and its limits":
//
//	C1 executions of a key are sequential; under abandoned unknown each one but
//	   the last had an answer the table releases (never one after a final or
//	   unknown outcome); under reexecute none follows a final one;
//	C2 every replay (and every first answer) is the catalog's answer of one
//	   execution of that key whose outcome was final, byte for byte (status,
//	   body, replayed headers);
//	C3 no client gets a 2xx or final 4xx that no execution of its key sent;
//	C4 every attempt is answered within in_flight_wait + execution_timeout +
//	   a margin, and its connection breaks only when the catalog broke the
//	   answer's body off or the client left;
//	C5 a key whose earlier attempts provably never reached the catalog
//	   (refused dial) executes on its next lone attempt;
//	C6 "outcome unknown" and "still in flight" answers only where some attempt
//	   of the key may have executed, or overlapped;
//	C7 after the round no record is left in flight;
//	C8 after the round the key's record is what its last execution's outcome
//	   makes it: final with that answer's status, absent (released, or never
//	   executed and nothing that may have executed), or abandoned (unknown).
//
// A round runs against one store (memory, postgres, mysql or redis) and one
// or two handler instances ("nodes"); with two, each node has its own store
// client on the same table or key prefix (the memory store: one store that
// both handlers share, as two handlers of one process do), and each client
// sends its attempts to the nodes in turn or to one picked at random. The
// SQL and Redis stores take their leases by heartbeat, as in production.
//
// Faults on the store links (_STORE_FAULTS, off by default): on the SQL
// and Redis stores each node's store client then reaches the database
// through a TCP proxy of its own (hmLink, which stands in for a network
// fault: CI cannot build network namespaces), and a round's plan draws up
// to three faults per node, at a moment of the round or as the node's next
// store call of one kind begins (Reserve, Finalize, Release, ExtendLease,
// Abandon, TakeOver, Load, Await): every connection reset; the bytes of
// one or both directions held for 20 ms to 7 s, then delivered (a
// partition that heals: what the kernel had accepted arrives, also from a
// connection its sender closed) or their connections reset (one that does
// not); every byte up to 300 ms late for a while. The checks then take
// what the README lets a store fault change, and no more: a 503 "store
// unavailable" only after some link had a fault ("What it does", item 10:
// store failures fail closed); a 503 "still in flight" without an
// overlapping attempt only after a fault (a lost write's undo, a Finalize
// retried in the background: "The guarantee, and its limits"); C5 is not
// asked of an attempt within a settle window (10 s) of a fault, since the
// key may be held by a lost Reserve until its undo lands; after a link held
// its bytes for half a lease or more, a lease may have lapsed: "unknown"
// where nothing executed (a reservation whose release had not landed:
// "The guarantee, and its limits"), and under abandoned reexecute a second
// execution (Runbook, "Lease renewals failing"). C2, C3, C7 and C8, and C1
// under abandoned unknown, are unchanged: once the round is over, the
// links healed and the nodes' background repairs done, no record is left
// in flight, and each record is what its last execution made it.
//
// Environment: ICEBERG_IDEMPOTENCY_HANDLER_MODEL_SEED (first round's seed;
// rounds use seed, seed+1, ...), _ROUNDS (exactly that many rounds),
// _DURATION (default 12s, 4s with -short, per store), _KEYS (keys per
// round), _STORES (comma-separated backends, default memory; "all" for
// memory,postgres,mysql,redis), _NODES (1 or 2, default 1),
// _STORE_FAULTS (the share of rounds with faults on the store links, from
// 0 to 1; the memory store has none), _LOG (the handlers' logs). The SQL and
// Redis stores are found as their own tests find them
// (ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN, _MYSQL_DSN, _REDIS_ADDR); under
// CI=true an unreachable one fails the test.

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/google/uuid"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis/redistest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

const (
	hmSeedEnv     = "ICEBERG_IDEMPOTENCY_HANDLER_MODEL_SEED"
	hmRoundsEnv   = "ICEBERG_IDEMPOTENCY_HANDLER_MODEL_ROUNDS"
	hmDurationEnv = "ICEBERG_IDEMPOTENCY_HANDLER_MODEL_DURATION"
	hmKeysEnv     = "ICEBERG_IDEMPOTENCY_HANDLER_MODEL_KEYS"
	hmStoresEnv   = "ICEBERG_IDEMPOTENCY_HANDLER_MODEL_STORES"
	hmNodesEnv    = "ICEBERG_IDEMPOTENCY_HANDLER_MODEL_NODES"

	hmStoreTimeoutEnv = "ICEBERG_IDEMPOTENCY_HANDLER_MODEL_STORE_TIMEOUT"
	hmStoreFaultsEnv  = "ICEBERG_IDEMPOTENCY_HANDLER_MODEL_STORE_FAULTS"

	hmPlanHeader = "X-Model-Plan"
	hmDialHeader = "X-Model-Dial"
)

// hmAction is what the catalog (or the network in front of it) does with one
// attempt.
type hmAction int

const (
	actAnswer           hmAction = iota // executes, answers plan.status
	actRefuse                           // the dial is refused: nothing reaches the catalog
	actCloseBeforeRead                  // accepted, closed before a byte is read: not executed
	actResetBeforeReply                 // executes, then resets the connection before any answer
	actResetMidHeaders                  // executes, sends part of the status line and headers, resets
	actResetMidBody                     // executes, sends status line, headers, part of the body, resets
	actStallPastTimeout                 // executes, answers only after execution_timeout
	actStallMidBody                     // executes, sends headers and part of the body, stalls past execution_timeout
)

func (a hmAction) String() string {
	return [...]string{"answer", "refuse", "close-before-read", "reset-before-reply", "reset-mid-headers",
		"reset-mid-body", "stall-past-timeout", "stall-mid-body"}[a]
}

// executes reports whether the catalog executes an attempt with this plan
// once it reaches it.
func (a hmAction) executes() bool { return a != actRefuse && a != actCloseBeforeRead }

// breaksBody reports whether the catalog cuts the answer's body off after its
// status line (reverse_proxy then panics and Caddy drops the client).
func (a hmAction) breaksBody() bool { return a == actResetMidBody || a == actStallMidBody }

type hmClass int

const (
	classNone     hmClass = iota
	classFinal            // stored: replayed to every retry
	classReleased         // released: a retry executes again
	classUnknown          // outcome unknown: abandoned
)

func (c hmClass) String() string { return [...]string{"-", "final", "released", "unknown"}[c] }

type hmPlan struct {
	id             int
	round          *hmRound
	key            *hmKey
	client, try    int
	action         hmAction
	status         int
	csu            bool // a CommitStateUnknownException body
	gzip, chunked  bool
	large, info1xx bool
	delay          time.Duration // before the answer
	acceptGzip     bool
	leaveAfter     time.Duration // the client leaves after this; 0: stays
	cutBody        bool          // the client sends half its body, then leaves
	midRaw         int           // how much of the raw answer a reset-mid-* plan sends
	node           int           // the handler instance it is sent to
	sentAt         time.Duration // when the client sent it (under key.mu)
}

func (p *hmPlan) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "plan#%d c%d try%d", p.id, p.client, p.try)
	if len(p.round.nodes) > 1 {
		fmt.Fprintf(&b, " node%d", p.node)
	}
	fmt.Fprintf(&b, " %s", p.action)
	if p.action == actAnswer || p.action == actResetMidBody || p.action == actStallMidBody {
		fmt.Fprintf(&b, " %d", p.status)
	}
	if p.csu {
		b.WriteString(" csu")
	}
	if p.action == actAnswer {
		if p.gzip {
			b.WriteString(" gzip")
		}
		if p.chunked {
			b.WriteString(" chunked")
		}
		if p.large {
			b.WriteString(" large")
		}
		if p.info1xx {
			b.WriteString(" +103")
		}
		if p.delay > 0 {
			fmt.Fprintf(&b, " delay=%v", p.delay)
		}
	}
	if p.acceptGzip {
		b.WriteString(" AE:gzip")
	}
	if p.leaveAfter > 0 {
		fmt.Fprintf(&b, " leave@%v", p.leaveAfter)
	}
	if p.cutBody {
		b.WriteString(" cut-body")
	}
	return b.String()
}

// hmExec is one execution, as the catalog saw it.
type hmExec struct {
	plan       *hmPlan
	n          int // ordinal within the key, from 1
	start, end time.Duration
	class      hmClass
	status     int
	raw        []byte // as sent
	encoding   string // Content-Encoding sent
	plain      []byte // decoded
	header     http.Header
	broke      bool // the body was cut off
	answerDone bool // the whole answer was written
	// late is set when the answer was written so close to (or past) the
	// end of execution_timeout, counted from the client's send, that
	// reverse_proxy may have given up first: the outcome is then unknown
	// or as the table says, and the checks accept either.
	late bool
}

func (e *hmExec) String() string {
	late := ""
	if e.late {
		late = " (late: maybe unknown)"
	}
	return fmt.Sprintf("EXEC #%d by plan#%d [%7.1fms..%7.1fms] %s status=%d class=%s%s",
		e.n, e.plan.id, hmMs(e.start), hmMs(e.end), e.plan.action, e.status, e.class, late)
}

// hmAttempt is one client request and what it got.
type hmAttempt struct {
	plan       *hmPlan
	start, end time.Duration
	frontEnd   time.Duration // when the handler returned (or panicked)
	status     int
	header     http.Header
	raw, plain []byte
	err        error
	left, hung bool
	panicked   any
	handlerErr error
}

func (a *hmAttempt) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "ATTEMPT [%7.1fms..%7.1fms handler end %7.1fms] %s -> ", hmMs(a.start), hmMs(a.end), hmMs(a.frontEnd), a.plan)
	switch {
	case a.left:
		b.WriteString("client left")
		if a.status != 0 {
			fmt.Fprintf(&b, " (after %d)", a.status)
		}
	case a.hung:
		b.WriteString("HUNG")
	case a.err != nil:
		fmt.Fprintf(&b, "broken: %v", a.err)
	default:
		fmt.Fprintf(&b, "%d", a.status)
		if a.header.Get(ReplayedHeader) == "true" {
			b.WriteString(" replayed")
		}
		if et := a.header.Get("Etag"); et != "" {
			fmt.Fprintf(&b, " etag=%s", et)
		}
		if t := hmErrorType(a.plain); t != "" {
			fmt.Fprintf(&b, " %s", t)
		}
		if ce := a.header.Get("Content-Encoding"); ce != "" {
			fmt.Fprintf(&b, " ce=%s", ce)
		}
		fmt.Fprintf(&b, " %dB", len(a.plain))
	}
	if a.panicked != nil {
		fmt.Fprintf(&b, " [handler panicked: %v]", a.panicked)
	}
	if a.handlerErr != nil {
		fmt.Fprintf(&b, " [handler error: %v]", a.handlerErr)
	}
	return b.String()
}

type hmKey struct {
	idx          int
	key          string
	op           string
	method, path string
	body         string

	mu       sync.Mutex
	attempts []*hmAttempt
	execs    []*hmExec
	arrived  map[int]bool // plan ids that reached the catalog's handler
}

// hmOptions are the handler options a round draws.
type hmOptions struct {
	abandoned        string
	inFlightWait     time.Duration
	executionTimeout time.Duration
	maxResponseSize  int64
	finalize         []string
	release          []string
	leases           string // "in-process" (as Provision sets it for memory) or "heartbeat"
	lease            time.Duration
}

func (o hmOptions) String() string {
	return fmt.Sprintf("abandoned=%s in_flight_wait=%v execution_timeout=%v max_response_size=%d finalize=%v release=%v leases=%s lease=%v",
		o.abandoned, o.inFlightWait, o.executionTimeout, o.maxResponseSize, o.finalize, o.release, o.leases, o.lease)
}

// hmEnv is what the rounds of one test share: the catalog's listeners and
// reverse_proxy.
type hmEnv struct {
	t       *testing.T
	catalog *httptest.Server
	closer  net.Listener
	dead    string
	proxy   caddyhttp.Handler
	plans   sync.Map // id → *hmPlan
	nextID  atomic.Int64

	backend  string         // memory, postgres, mysql, redis
	nodes    int            // handler instances per round
	provider StoreProvider  // nil for memory
	clients  []*pooledStore // one store client per node, for every round; nil for memory
	// links are the nodes' store links, one per client, when rounds put
	// faults on them (linkShare of the rounds, _STORE_FAULTS).
	links       []*hmLink
	linkShare   float64
	checkStore  stores.Store                    // the checks' store client, on no faulted link
	linkTarget  string                          // the database's host:port
	providerVia func(addr string) StoreProvider // the provider, its database at addr
}

// hmNode is one handler instance of a round, behind its own front server.
type hmNode struct {
	idx     int
	h       *Handler
	store   stores.Store // the node's store client (unwrapped)
	pooled  *pooledStore
	front   *httptest.Server
	frontWG sync.WaitGroup
}

type hmRound struct {
	env   *hmEnv
	seed  uint64
	opts  hmOptions
	nodes []*hmNode
	store stores.Store // node 0's store client (with store-link faults, one of its own), for the checks
	keys  []*hmKey
	t0    time.Time
	stop  time.Duration // no new attempts after this

	catalogMu sync.Mutex
	catalogN  int // catalog handlers of this round still running

	finalizeSet, releaseSet statusSet
	cov                     map[string]int // what the rounds exercised, for the log

	linkMu        sync.Mutex
	linkEvents    []*hmLinkEvent // the faults on the nodes' store links, by moment
	linksDisarmed bool           // under linkMu: no more faults fire
}

func (m *hmRound) now() time.Duration { return time.Since(m.t0) }

// hmStoreTimeout is the SQL stores' statement_timeout and the Redis store's
// timeout in the model (_STORE_TIMEOUT, default 1s): a round's lease is
// minLeaseCalls (4) or 5 times it, so that renewals come every 1 or 5/4 of it.
var hmStoreTimeout = func() time.Duration {
	if d, err := time.ParseDuration(os.Getenv(hmStoreTimeoutEnv)); err == nil && d > 0 {
		return d
	}
	return time.Second
}()

func TestHandlerModel(t *testing.T) {
	backends := []string{"memory"}
	if s := os.Getenv(hmStoresEnv); s == "all" {
		backends = []string{"memory", "postgres", "mysql", "redis"}
	} else if s != "" {
		backends = strings.Split(s, ",")
	}
	nodes := 1
	if s := os.Getenv(hmNodesEnv); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 2 {
			t.Fatalf("%s: %q, want 1 or 2", hmNodesEnv, s)
		}
		nodes = n
	}
	for _, backend := range backends {
		t.Run(fmt.Sprintf("%s/nodes=%d", backend, nodes), func(t *testing.T) {
			testHandlerModel(t, backend, nodes)
		})
	}
}

func testHandlerModel(t *testing.T, backend string, nodes int) {
	env := newHMEnv(t)
	env.backend, env.nodes = backend, nodes
	env.openStores(t)
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv(hmSeedEnv); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("%s: %v", hmSeedEnv, err)
		}
		seed = n
	}
	duration := 12 * time.Second
	if testing.Short() {
		duration = 4 * time.Second
	}
	if d, err := time.ParseDuration(os.Getenv(hmDurationEnv)); err == nil && d > 0 {
		duration = d
	}
	rounds := -1
	if n, err := strconv.Atoi(os.Getenv(hmRoundsEnv)); err == nil && n > 0 {
		rounds = n
	}
	t.Logf("seed %d (%s=%d %s=%s %s=%d to repeat)", seed, hmSeedEnv, seed, hmStoresEnv, backend, hmNodesEnv, nodes)
	deadline := time.Now().Add(duration)
	var attempts, execs, played, faulted int
	cov := map[string]int{}
	defer func() { t.Logf("coverage: %v", cov) }()
	for i := 0; rounds < 0 && time.Now().Before(deadline) || i < rounds; i++ {
		m := env.round(seed + uint64(i))
		m.cov = cov
		a, e, failed := m.run(t)
		attempts += a
		execs += e
		played++
		if len(m.linkEvents) > 0 {
			faulted++
		}
		if failed {
			t.Logf("round seed %d failed; stopping", m.seed)
			break
		}
		if rounds < 0 && i > 10000 {
			break
		}
	}
	t.Logf("%d rounds (%d with store link faults), %d attempts, %d executions", played, faulted, attempts, execs)
}

// openStores opens the SQL or Redis store the test's rounds share: one
// client per node, on one fresh table or key prefix, as the handler's
// Provision opens them (the provider's defaults and options), outside the
// process-wide pool so that each node has its own client.
func (env *hmEnv) openStores(t *testing.T) {
	ctx := newCaddyContext(t)
	switch env.backend {
	case "memory":
		return
	case "postgres", "mysql":
		var b sqlBackend
		for _, x := range sqlBackends {
			if x.name == env.backend {
				b = x
			}
		}
		dsn := b.dsn(t)
		table := sqltest.TableName(t)
		t.Cleanup(func() { b.drop(t, dsn, table) })
		sqlProvider := func(dsn string) StoreProvider {
			cfg := SQLStoreConfig{DSN: dsn, Table: table, StatementTimeout: caddy.Duration(hmStoreTimeout)}
			if env.backend == "postgres" {
				return &PostgresStore{SQLStoreConfig: cfg}
			}
			return &MySQLStore{SQLStoreConfig: cfg}
		}
		env.provider = sqlProvider(dsn)
		_, env.linkTarget = b.viaProxy(t, dsn, "127.0.0.1:1")
		env.providerVia = func(addr string) StoreProvider {
			proxied, _ := b.viaProxy(t, dsn, addr)
			return sqlProvider(proxied)
		}
	case "redis":
		addr, prefix := redistest.Addr(t), redistest.Prefix(t)
		redisProvider := func(addr string) StoreProvider {
			return &RedisStore{Addresses: []string{addr}, KeyPrefix: prefix,
				DialTimeout: caddy.Duration(hmStoreTimeout), ReadTimeout: caddy.Duration(hmStoreTimeout), WriteTimeout: caddy.Duration(hmStoreTimeout)}
		}
		env.provider = redisProvider(addr)
		env.linkTarget, env.providerVia = addr, redisProvider
	default:
		t.Fatalf("%s: unknown store %q", hmStoresEnv, env.backend)
	}
	if err := env.provider.(caddy.Provisioner).Provision(ctx); err != nil {
		t.Fatal(err)
	}
	env.linkShare = hmStoreFaultShare(t)
	if env.linkShare > 0 {
		s, err := env.provider.OpenStore(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		env.checkStore = s
	}
	for i := 0; i < env.nodes; i++ {
		provider := env.provider
		if env.linkShare > 0 {
			provider = env.linkedProvider(t, ctx)
		}
		s, err := provider.OpenStore(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ps := newPooledStore(s)
		ps.backend = env.backend
		t.Cleanup(func() { _ = s.Close() })
		env.clients = append(env.clients, ps)
	}
	// The first contact (and the migration) before the first round.
	if _, err := env.clients[0].Load(context.Background(), uuid.Must(uuid.NewV7()).String()); err != nil {
		t.Fatal(err)
	}
}

func newHMEnv(t *testing.T) *hmEnv {
	env := &hmEnv{t: t}
	env.catalog = httptest.NewServer(http.HandlerFunc(env.serveCatalog))
	t.Cleanup(env.catalog.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	env.closer = ln
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for i := 0; ; i++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if tc, ok := c.(*net.TCPConn); ok && i%2 == 0 {
				_ = tc.SetLinger(0) // a reset; every other one a plain close
			}
			_ = c.Close()
		}
	}()
	env.dead = deadAddr(t)
	env.proxy = newReverseProxy(t, "{http.request.header."+hmDialHeader+"}")
	return env
}

// round draws a round's options and keys from seed.
func (env *hmEnv) round(seed uint64) *hmRound {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	m := &hmRound{env: env, seed: seed}
	o := &m.opts
	o.abandoned = abandonedUnknown
	if rng.IntN(4) == 0 {
		o.abandoned = abandonedReexecute
	}
	o.inFlightWait = []time.Duration{20 * time.Millisecond, 150 * time.Millisecond, 500 * time.Millisecond, 1500 * time.Millisecond}[rng.IntN(4)]
	o.executionTimeout = []time.Duration{800 * time.Millisecond, 1200 * time.Millisecond, 1600 * time.Millisecond}[rng.IntN(3)]
	o.maxResponseSize = 0
	if rng.IntN(3) == 0 {
		o.maxResponseSize = 64 << 10
	}
	switch rng.IntN(4) {
	case 1:
		o.finalize = []string{"2xx", "400", "404", "409", "422"} // 410, 401, ... in neither list: released
	case 2:
		o.release = []string{"5xx", "401", "403", "408", "419", "421", "425", "429", "499", "404"}
	}
	o.leases = "in-process"
	if rng.IntN(4) == 0 {
		o.leases = "heartbeat"
		// Renewed every quarter of it: under -race on a busy machine a
		// renewal can come 100ms late, and a lapsed lease reads as
		// abandoned (documented), which is not what this model tests.
		o.lease = []time.Duration{800 * time.Millisecond, 2 * time.Second}[rng.IntN(2)]
	}
	if env.backend != "memory" {
		// A store outside the process takes leases by heartbeat, at least
		// minLeaseCalls times its call timeout (checkLease). A separate
		// stream, so that the memory store's rounds draw what they always
		// drew.
		xrng := rand.New(rand.NewPCG(seed, 0x5eed))
		o.leases = "heartbeat"
		o.lease = []time.Duration{minLeaseCalls * hmStoreTimeout, 5 * hmStoreTimeout}[xrng.IntN(2)]
	}
	nkeys := 4 + rng.IntN(4)
	if n, err := strconv.Atoi(os.Getenv(hmKeysEnv)); err == nil && n > 0 {
		nkeys = n
	}
	for i := 0; i < nkeys; i++ {
		k := &hmKey{idx: i, key: uuid.Must(uuid.NewV7()).String(), arrived: map[int]bool{}}
		switch rng.IntN(3) {
		case 0:
			k.op, k.method, k.path = "createNamespace", http.MethodPost, "/v1/namespaces"
			k.body = fmt.Sprintf(`{"namespace":["n%d_%d"]}`, seed%100000, i)
		case 1:
			k.op, k.method, k.path = "updateTable", http.MethodPost, fmt.Sprintf("/v1/wh/namespaces/ns/tables/t%d", i)
			k.body = fmt.Sprintf(`{"requirements":[{"type":"assert-ref-snapshot-id","ref":"main","snapshot-id":%d}],"updates":[]}`, i)
		default:
			k.op, k.method, k.path = "dropTable", http.MethodDelete, fmt.Sprintf("/v1/wh/namespaces/ns/tables/d%d", i)
		}
		m.keys = append(m.keys, k)
	}
	m.stop = 1500 * time.Millisecond
	if env.linkShare > 0 {
		// From a stream of its own, so that the rounds without them
		// draw what they always drew.
		lrng := rand.New(rand.NewPCG(seed, 0x11d5))
		if lrng.Float64() < env.linkShare {
			m.linkEvents = drawLinkEvents(lrng, env.nodes, hmStoreTimeout, m.stop)
		}
	}
	return m
}

// newPlan draws what happens to one attempt.
func (m *hmRound) newPlan(rng *rand.Rand, k *hmKey, client, try int) *hmPlan {
	p := &hmPlan{id: int(m.env.nextID.Add(1)), round: m, key: k, client: client, try: try}
	w := rng.IntN(100)
	switch {
	case w < 62:
		p.action = actAnswer
	case w < 74:
		p.action = actRefuse
	case w < 78:
		p.action = actCloseBeforeRead
	case w < 83:
		p.action = actResetBeforeReply
	case w < 87:
		p.action = actResetMidHeaders
	case w < 92:
		p.action = actResetMidBody
	case w < 96:
		p.action = actStallPastTimeout
	default:
		p.action = actStallMidBody
	}
	statuses := []int{200, 200, 201, 204, 400, 404, 409, 409, 410, 422, 401, 403, 429, 500, 502, 503, 503, 504}
	p.status = statuses[rng.IntN(len(statuses))]
	if p.status == http.StatusNoContent && p.action.breaksBody() {
		p.status = http.StatusOK // a 204 has no body to break off
	}
	p.csu = p.status >= 500 && rng.IntN(3) == 0
	p.gzip = rng.IntN(2) == 0 && p.status != 204
	p.chunked = rng.IntN(2) == 0
	p.large = rng.IntN(5) == 0 && p.status != 204 && !p.csu
	p.info1xx = rng.IntN(6) == 0
	switch r := rng.IntN(10); {
	case r < 6:
	case r < 8:
		p.delay = time.Duration(rng.IntN(30)) * time.Millisecond
	case p.large:
	default:
		// Slower than a duplicate's in_flight_wait, well within
		// execution_timeout: the duplicate hears "still in flight".
		lo, hi := m.opts.inFlightWait+30*time.Millisecond, m.opts.executionTimeout/3
		if lo < hi {
			p.delay = lo + time.Duration(rng.Int64N(int64(hi-lo)))
		}
	}
	p.acceptGzip = rng.IntN(2) == 0
	if rng.IntN(7) == 0 {
		p.leaveAfter = time.Duration(1+rng.IntN(int(m.opts.executionTimeout/time.Millisecond))) * time.Millisecond
		p.cutBody = k.body != "" && rng.IntN(3) == 0
	}
	p.midRaw = rng.IntN(1000)
	m.env.plans.Store(p.id, p)
	return p
}

// run plays the round and checks it: attempts and executions made, and
// whether a violation was found.
func (m *hmRound) run(t *testing.T) (int, int, bool) {
	t.Helper()
	var memStore stores.Store
	if m.env.backend == "memory" {
		memStore = newMemoryStore(t) // both nodes' handlers share it
	}
	for i := 0; i < max(1, m.env.nodes); i++ {
		n := &hmNode{idx: i}
		if memStore != nil {
			n.store = memStore
			n.pooled = newPooledStore(memStore)
			n.pooled.backend = "memory"
		} else {
			n.pooled = m.env.clients[i]
			n.store = n.pooled.Store
		}
		logger := zap.NewNop()
		if os.Getenv("ICEBERG_IDEMPOTENCY_HANDLER_MODEL_LOG") != "" {
			logger = zap.Must(zap.NewDevelopment()).Named(fmt.Sprintf("node%d", i))
		}
		h := &Handler{logger: logger,
			Abandoned:        m.opts.abandoned,
			InFlightWait:     caddy.Duration(m.opts.inFlightWait),
			ExecutionTimeout: caddy.Duration(m.opts.executionTimeout),
			MaxResponseSize:  m.opts.maxResponseSize,
			FinalizeStatuses: m.opts.finalize,
			ReleaseStatuses:  m.opts.release,
			Lease:            caddy.Duration(m.opts.lease),
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("options %s: %v", m.opts, err)
		}
		if err := h.prepare(); err != nil {
			t.Fatalf("options %s: %v", m.opts, err)
		}
		// As Provision does with the store's provider.
		if m.env.provider != nil {
			if err := checkLease(time.Duration(h.Lease), m.env.provider); err != nil {
				t.Fatalf("options %s: %v", m.opts, err)
			}
			h.settleWindow = settleWindowFor(m.env.provider)
		}
		h.pooled = n.pooled
		h.store = instrumentStore(n.pooled, n.pooled.backend)
		if len(m.linkEvents) > 0 {
			h.store = instrumentStore(&hmLinkedStore{Store: n.pooled, m: m, node: i}, n.pooled.backend)
		}
		h.inProcessLeases = m.opts.leases == "in-process"
		n.h = h
		n.front = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serveFront(n, w, r) }))
		defer n.front.Close()
		m.nodes = append(m.nodes, n)
	}
	m.store = m.nodes[0].store
	if m.env.checkStore != nil {
		m.store = m.env.checkStore
	}
	var err error
	if m.finalizeSet, err = parseStatusSet(m.nodes[0].h.FinalizeStatuses); err != nil {
		t.Fatal(err)
	}
	if m.releaseSet, err = parseStatusSet(m.nodes[0].h.ReleaseStatuses); err != nil {
		t.Fatal(err)
	}
	m.t0 = time.Now()
	clientsDone := make(chan struct{})
	go m.playLinkEvents(clientsDone)

	var wg sync.WaitGroup
	for _, k := range m.keys {
		rng := rand.New(rand.NewPCG(m.seed, uint64(k.idx)<<8|0xff))
		clients := 1 + rng.IntN(4)
		for c := 0; c < clients; c++ {
			crng := rand.New(rand.NewPCG(m.seed, uint64(k.idx)<<8|uint64(c)))
			wg.Add(1)
			go func() {
				defer wg.Done()
				m.client(crng, k, c)
			}()
		}
	}
	wg.Wait()
	for _, n := range m.nodes {
		n.frontWG.Wait()
	}
	close(clientsDone)
	if len(m.linkEvents) > 0 {
		m.healLinks()
	}
	// Catalog handlers this round's proxy calls started (a stall outlives
	// the call that gave up on it).
	for quiet := 0; quiet < 3; {
		m.catalogMu.Lock()
		n := m.catalogN
		m.catalogMu.Unlock()
		if n == 0 {
			quiet++
		} else {
			quiet = 0
		}
		time.Sleep(40 * time.Millisecond)
	}
	// Background store writes (a Finalize retried after the answer went
	// out, the undo of a lost reply) end before the checks read the store.
	for _, n := range m.nodes {
		if !n.pooled.waitIdle(time.Minute) {
			t.Errorf("seed %d: node %d's background store writes still run a minute after the round", m.seed, n.idx)
		}
	}
	var attempts, execs int
	for _, k := range m.keys {
		attempts += len(k.attempts)
		execs += len(k.execs)
	}
	return attempts, execs, m.check(t)
}

// client sends one key's request with retries after every answer that is not
// final, as an Iceberg client does.
func (m *hmRound) client(rng *rand.Rand, k *hmKey, c int) {
	// Which node each attempt goes to, from a stream of its own: a client
	// alternates between the nodes from a random one, or picks one at
	// random each time.
	nrng := rand.New(rand.NewPCG(m.seed, uint64(k.idx)<<8|uint64(c)|1<<20))
	alternate, node := nrng.IntN(2) == 0, nrng.IntN(len(m.nodes))
	time.Sleep(time.Duration(rng.IntN(300)) * time.Millisecond)
	for try := 0; try < 4 && m.now() < m.stop; try++ {
		p := m.newPlan(rng, k, c, try)
		p.node = node
		if alternate {
			node = (node + 1) % len(m.nodes)
		} else {
			node = nrng.IntN(len(m.nodes))
		}
		a := m.send(p)
		if a.err == nil && !a.left && hmFinal(a.status) {
			return
		}
		time.Sleep(time.Duration(rng.IntN(120)) * time.Millisecond)
	}
}

// hmFinal reports an answer a client does not retry.
func hmFinal(status int) bool {
	switch status {
	case 408, 425, 429, 499:
		return false
	}
	return status >= 200 && status < 500
}

// bound is how long an attempt may take before it counts as hung.
func (m *hmRound) bound() time.Duration {
	return m.opts.inFlightWait + m.opts.executionTimeout + 3*time.Second
}

// blockingBody sends half of body, then waits for the client to leave.
type blockingBody struct {
	half []byte
	ctx  context.Context
}

func (b *blockingBody) Read(p []byte) (int, error) {
	if len(b.half) > 0 {
		n := copy(p, b.half)
		b.half = b.half[n:]
		return n, nil
	}
	<-b.ctx.Done()
	return 0, b.ctx.Err()
}

func (m *hmRound) send(p *hmPlan) *hmAttempt {
	k := p.key
	a := &hmAttempt{plan: p}
	ctx, cancel := context.WithTimeout(context.Background(), m.bound())
	defer cancel()
	leaveCtx, leave := context.WithCancel(ctx)
	defer leave()
	var left atomic.Bool
	if p.leaveAfter > 0 {
		timer := time.AfterFunc(p.leaveAfter, func() { left.Store(true); leave() })
		defer timer.Stop()
	}
	var body io.Reader
	if k.body != "" {
		body = strings.NewReader(k.body)
		if p.cutBody {
			body = &blockingBody{half: []byte(k.body[:len(k.body)/2]), ctx: leaveCtx}
		}
	}
	req, err := http.NewRequestWithContext(leaveCtx, k.method, m.nodes[p.node].front.URL+k.path, body)
	if err != nil {
		panic(err)
	}
	if p.cutBody {
		req.ContentLength = int64(len(k.body))
	}
	req.Header.Set(IdempotencyKeyHeader, k.key)
	req.Header.Set(hmPlanHeader, strconv.Itoa(p.id))
	switch p.action {
	case actRefuse:
		req.Header.Set(hmDialHeader, m.env.dead)
	case actCloseBeforeRead:
		req.Header.Set(hmDialHeader, m.env.closer.Addr().String())
	default:
		req.Header.Set(hmDialHeader, m.env.catalog.Listener.Addr().String())
	}
	if k.body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if p.acceptGzip {
		req.Header.Set("Accept-Encoding", "gzip")
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true, DisableCompression: true}}
	k.mu.Lock()
	a.start = m.now()
	p.sentAt = a.start
	k.attempts = append(k.attempts, a)
	k.mu.Unlock()
	res, err := client.Do(req)
	if err == nil {
		a.status, a.header = res.StatusCode, res.Header
		a.raw, err = io.ReadAll(res.Body)
		_ = res.Body.Close()
	}
	end := m.now()
	k.mu.Lock()
	defer k.mu.Unlock()
	a.end = end
	switch {
	case left.Load():
		a.left = true
	case err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded):
		a.hung = true
	case err != nil:
		a.err = err
	default:
		a.plain = a.raw
		if a.header.Get("Content-Encoding") == "gzip" {
			plain, derr := hmGunzip(a.raw)
			if derr != nil {
				a.err = fmt.Errorf("undecodable gzip body: %w", derr)
			}
			a.plain = plain
		}
	}
	return a
}

func hmGunzip(b []byte) ([]byte, error) {
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	return io.ReadAll(zr)
}

// serveFront is Caddy's server for the handler: the request prepared as
// Caddy prepares it, a returned error answered with its status, a panic
// (http.ErrAbortHandler) left to net/http, which drops the connection.
func (m *hmRound) serveFront(n *hmNode, w http.ResponseWriter, r *http.Request) {
	n.frontWG.Add(1)
	defer n.frontWG.Done()
	id, _ := strconv.Atoi(r.Header.Get(hmPlanHeader))
	v, _ := m.env.plans.Load(id)
	p, _ := v.(*hmPlan)
	var a *hmAttempt
	if p != nil {
		p.key.mu.Lock()
		for _, x := range p.key.attempts {
			if x.plan == p {
				a = x
			}
		}
		p.key.mu.Unlock()
	}
	defer func() {
		v := recover()
		if a != nil {
			p.key.mu.Lock()
			a.frontEnd = m.now()
			if v != nil {
				a.panicked = v
			}
			p.key.mu.Unlock()
		}
		if v != nil {
			panic(v)
		}
	}()
	req := caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, &caddyhttp.Server{})
	if err := n.h.ServeHTTP(w, req, m.env.proxy); err != nil {
		if a != nil {
			p.key.mu.Lock()
			a.handlerErr = err
			p.key.mu.Unlock()
		}
		code := http.StatusInternalServerError
		var herr caddyhttp.HandlerError
		if errors.As(err, &herr) && herr.StatusCode != 0 {
			code = herr.StatusCode
		}
		w.WriteHeader(code)
	}
}

// serveCatalog is the catalog: it executes a request once it has read all of
// it, records the execution, then does what the attempt's plan says.
func (env *hmEnv) serveCatalog(w http.ResponseWriter, r *http.Request) {
	id, _ := strconv.Atoi(r.Header.Get(hmPlanHeader))
	v, ok := env.plans.Load(id)
	if !ok {
		w.WriteHeader(http.StatusTeapot)
		return
	}
	p := v.(*hmPlan)
	m, k := p.round, p.key
	m.catalogMu.Lock()
	m.catalogN++
	m.catalogMu.Unlock()
	defer func() {
		m.catalogMu.Lock()
		m.catalogN--
		m.catalogMu.Unlock()
	}()
	k.mu.Lock()
	k.arrived[p.id] = true
	k.mu.Unlock()
	if _, err := io.ReadAll(r.Body); err != nil {
		return // not executed: the request never arrived whole
	}
	k.mu.Lock()
	e := &hmExec{plan: p, n: len(k.execs) + 1, start: m.now()}
	k.execs = append(k.execs, e)
	k.mu.Unlock()
	defer func() {
		k.mu.Lock()
		e.end = m.now()
		k.mu.Unlock()
	}()

	// The answer this execution gives (or starts to give).
	e.status = p.status
	if p.action == actStallPastTimeout || p.action == actResetBeforeReply || p.action == actResetMidHeaders {
		e.status = 200
		if p.action == actStallPastTimeout && p.id%2 == 0 {
			e.status = p.status
		}
	}
	e.plain = hmCatalogBody(k, e, p)
	e.header = http.Header{}
	e.header.Set("Content-Type", "application/json")
	e.header.Set("Etag", fmt.Sprintf(`"k%d-%s-e%d"`, k.idx, k.key[len(k.key)-6:], e.n))
	if p.id%3 == 0 {
		e.header.Set("Location", fmt.Sprintf("/v1/x/%d", e.n))
	}
	if p.id%4 == 0 {
		e.header.Set("Cache-Control", "no-store")
	}
	e.raw = e.plain
	if p.gzip && strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") && len(e.plain) > 0 {
		var b bytes.Buffer
		level := gzip.BestSpeed
		if len(e.plain) > 64<<10 {
			level = gzip.NoCompression // compressing under -race would outlast execution_timeout
		}
		zw, _ := gzip.NewWriterLevel(&b, level)
		_, _ = zw.Write(e.plain)
		_ = zw.Close()
		e.raw, e.encoding = b.Bytes(), "gzip"
	}
	e.class = m.classify(p, e)

	switch p.action {
	case actResetBeforeReply:
		hmReset(w, nil)
	case actResetMidHeaders:
		head := []byte("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nEtag: \"partial\"\r\nContent-Le")
		hmReset(w, head[:1+p.midRaw%(len(head)-1)])
	case actResetMidBody:
		head := fmt.Sprintf("HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", e.status, len(e.plain)+100)
		e.broke = true
		hmReset(w, append([]byte(head), e.plain[:p.midRaw%(len(e.plain)+1)]...))
	case actStallMidBody:
		e.broke = true
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(e.plain)+100))
		w.WriteHeader(e.status)
		_, _ = w.Write(e.plain[:len(e.plain)/2])
		_ = http.NewResponseController(w).Flush()
		time.Sleep(m.opts.executionTimeout + 300*time.Millisecond)
		hmReset(w, nil)
	case actStallPastTimeout:
		time.Sleep(m.opts.executionTimeout + 300*time.Millisecond)
		m.writeAnswer(w, p, e)
	default:
		time.Sleep(p.delay)
		m.writeAnswer(w, p, e)
		e.answerDone = true
		k.mu.Lock()
		// A large answer is read by reverse_proxy well after the catalog
		// handed it to the socket (slowly under -race).
		// The machine may be shared: margins of a few hundred ms.
		margin := 300 * time.Millisecond
		if len(e.raw) > 64<<10 {
			margin = 600 * time.Millisecond
		}
		e.late = m.now() > p.sentAt+m.opts.executionTimeout-margin
		k.mu.Unlock()
	}
}

// hmCatalogBody is the answer's body: the key and execution in it, padded
// with incompressible bytes when large.
func hmCatalogBody(k *hmKey, e *hmExec, p *hmPlan) []byte {
	if e.status == http.StatusNoContent {
		return nil
	}
	pad := ""
	if p.large {
		n := 200<<10 + p.id*7919%(200<<10)
		pad = hmPad[:n]
	}
	tag := fmt.Sprintf("model-exec:%s:%d:plan%d", k.key, e.n, p.id)
	switch {
	case e.status < 400:
		b, _ := json.Marshal(map[string]any{"metadata-location": "s3://w/" + tag, "pad": pad})
		return b
	case p.csu:
		return []byte(fmt.Sprintf(`{"error":{"message":"%s","type":"CommitStateUnknownException","code":%d}}`, tag, e.status))
	default:
		typ := map[int]string{400: "BadRequestException", 401: "NotAuthorizedException", 403: "ForbiddenException",
			404: "NoSuchTableException", 409: "CommitFailedException", 410: "GoneException", 422: "UnprocessableEntityException",
			429: "TooManyRequestsException", 500: "InternalServerError", 502: "BadGateway", 503: "ServiceUnavailableException",
			504: "GatewayTimeout"}[e.status]
		return []byte(fmt.Sprintf(`{"error":{"message":"%s %s","type":"%s","code":%d}}`, tag, pad, typ, e.status))
	}
}

func (m *hmRound) writeAnswer(w http.ResponseWriter, p *hmPlan, e *hmExec) {
	h := w.Header()
	if p.info1xx {
		h.Set("Link", "</v1/config>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		h.Del("Link")
	}
	for name, v := range e.header {
		h[name] = v
	}
	if e.encoding != "" {
		h.Set("Content-Encoding", e.encoding)
	}
	if !p.chunked {
		h.Set("Content-Length", strconv.Itoa(len(e.raw)))
	}
	w.WriteHeader(e.status)
	half := len(e.raw) / 2
	_, _ = w.Write(e.raw[:half])
	if p.chunked {
		_ = http.NewResponseController(w).Flush()
	}
	_, _ = w.Write(e.raw[half:])
}

// hmReset hijacks the connection, writes raw, and resets it.
func hmReset(w http.ResponseWriter, raw []byte) {
	conn, buf, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	_ = buf.Flush()
	if len(raw) > 0 {
		_, _ = conn.Write(raw)
		time.Sleep(10 * time.Millisecond)
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = conn.Close()
}

// classify is the README's "Finalize or release" table for the execution's
// answer.
func (m *hmRound) classify(p *hmPlan, e *hmExec) hmClass {
	if p.action != actAnswer {
		return classUnknown
	}
	s := e.status
	commit := p.key.op == "updateTable"
	if s >= 500 && (p.csu || commit && (s == 500 || s == 502 || s == 504)) {
		return classUnknown
	}
	if m.releaseSet.has(s) {
		return classReleased
	}
	if m.finalizeSet.has(s) {
		if m.opts.maxResponseSize > 0 && int64(len(e.raw)) > m.opts.maxResponseSize {
			return classUnknown // executed, answer too large to keep
		}
		return classFinal
	}
	return classReleased
}

// hmPad is incompressible padding for large answers, made once.
var hmPad = func() string {
	r := rand.New(rand.NewPCG(1, 2))
	raw := make([]byte, 320<<10)
	for i := range raw {
		raw[i] = byte(r.Uint32())
	}
	return base64.StdEncoding.EncodeToString(raw)
}()

var hmTagRe = regexp.MustCompile(`model-exec:([0-9a-f-]{36}):(\d+):plan(\d+)`)

func hmErrorType(body []byte) string {
	var e icebergError
	if json.Unmarshal(body, &e) != nil {
		return ""
	}
	return e.Error.Type
}

// check verifies the round's history; it reports whether a violation was
// found.
func (m *hmRound) check(t *testing.T) bool {
	t.Helper()
	failed := false
	for _, k := range m.keys {
		k.mu.Lock()
		vs := m.checkKey(k)
		k.mu.Unlock()
		if len(vs) == 0 {
			continue
		}
		failed = true
		t.Errorf("seed %d (%s=%d %s=1), options %s\nkey %d %s %s %s:\n  %s\nhistory of the key:\n%s",
			m.seed, hmSeedEnv, m.seed, hmRoundsEnv, m.opts, k.idx, k.key, k.method, k.path,
			strings.Join(vs, "\n  "), m.history(k))
	}
	return failed
}

func (m *hmRound) history(k *hmKey) string {
	type line struct {
		at time.Duration
		s  string
	}
	var lines []line
	for _, a := range k.attempts {
		lines = append(lines, line{a.start, a.String()})
	}
	for _, e := range k.execs {
		lines = append(lines, line{e.start, "  " + e.String()})
	}
	m.linkMu.Lock()
	for _, e := range m.linkEvents {
		at := e.at
		if e.fired {
			at = e.firedAt
		}
		lines = append(lines, line{at, "  ~ " + e.String()})
	}
	m.linkMu.Unlock()
	sort.SliceStable(lines, func(i, j int) bool { return lines[i].at < lines[j].at })
	var b strings.Builder
	for _, l := range lines {
		b.WriteString("    ")
		b.WriteString(l.s)
		b.WriteByte('\n')
	}
	rec, err := m.store.Load(context.Background(), k.key)
	fmt.Fprintf(&b, "    store at the end: %s %v", hmRecString(rec), err)
	return b.String()
}

func hmRecString(r *stores.Record) string {
	if r == nil {
		return "absent"
	}
	if r.State == stores.StateFinal {
		return fmt.Sprintf("final(%d)", r.Response.Status)
	}
	return fmt.Sprintf("%s(abandoned=%v)", r.State, r.Abandoned)
}

func (m *hmRound) execOf(k *hmKey, n int) *hmExec {
	for _, e := range k.execs {
		if e.n == n {
			return e
		}
	}
	return nil
}

func (m *hmRound) checkKey(k *hmKey) []string {
	var vs []string
	bad := func(format string, args ...any) { vs = append(vs, fmt.Sprintf(format, args...)) }
	execs := append([]*hmExec(nil), k.execs...)
	sort.Slice(execs, func(i, j int) bool { return execs[i].start < execs[j].start })

	for _, a := range k.attempts {
		switch {
		case a.left:
			m.cov["client left"]++
		case a.err != nil:
			m.cov["broken"]++
		case a.header.Get(ReplayedHeader) == "true":
			m.cov["replay"]++
		case a.header.Get("Etag") != "":
			m.cov[fmt.Sprintf("catalog %dxx", a.status/100)]++
		default:
			m.cov[fmt.Sprintf("module %d %s", a.status, hmErrorType(a.plain))]++
		}
	}
	for _, e := range k.execs {
		m.cov["exec "+e.class.String()]++
	}
	if len(k.execs) > 1 {
		m.cov["keys executed more than once"]++
	}

	// C1: executions.
	seenPlan := map[int]bool{}
	for i, e := range execs {
		if seenPlan[e.plan.id] {
			bad("C1: plan#%d executed twice: one attempt reached the catalog twice (a resend)", e.plan.id)
		}
		seenPlan[e.plan.id] = true
		if i == 0 {
			continue
		}
		prev := execs[i-1]
		// README, Runbook, "Lease renewals failing": "If renewals keep
		// failing until the lease runs out, other nodes see the record
		// as abandoned while it still runs. They answer its retries
		// "unknown", or execute it a second time under abandoned
		// reexecute."
		lapsed := func() bool {
			if m.opts.abandoned == abandonedReexecute && m.leaseMayHaveLapsed(prev, e) {
				m.cov["C1 executed again after a lease lapsed in a store link fault"]++
				return true
			}
			return false
		}
		switch {
		case m.opts.abandoned == abandonedUnknown && prev.class != classReleased:
			bad("C1: execution #%d after execution #%d whose outcome was %s (abandoned unknown: never again)", e.n, prev.n, prev.class)
		case prev.class == classFinal && !prev.late && !lapsed():
			bad("C1: execution #%d after execution #%d whose answer was final (stored)", e.n, prev.n)
		case prev.class == classReleased && e.start < prev.end && (!prev.late || m.opts.abandoned == abandonedUnknown) && !lapsed():
			bad("C1: execution #%d began at %.1fms, before execution #%d's released answer was sent (%.1fms): concurrent executions",
				e.n, hmMs(e.start), prev.n, hmMs(prev.end))
		case prev.class == classUnknown && !prev.late:
			// Under abandoned reexecute the record is another's to take
			// only once its owner marked it unknown, which the owner's
			// handler does before it returns, or its lease lapsed (a
			// link fault). Until the build after 28dfe25 nothing checked
			// it: a heartbeat that never renewed, whose lease lapsed in
			// the middle of a stall, passed.
			end, ok := k.handlerEnd(prev.plan)
			if ok && m.opts.leases == "heartbeat" {
				m.cov["C1 execution after an unknown one, on heartbeat leases"]++
			}
			if ok && e.start+hmTakeOverSlack < end && !lapsed() {
				bad("C1: execution #%d began at %.1fms, while execution #%d's handler, whose outcome is unknown, still ran (until %.1fms): its lease was taken under it",
					e.n, hmMs(e.start), prev.n, hmMs(end))
			}
		}
	}

	// C2, C3: answers carrying a catalog execution's tag.
	var replayedExec *hmExec
	for _, a := range k.attempts {
		if a.left || a.hung || a.err != nil {
			continue
		}
		replayed := a.header.Get(ReplayedHeader) == "true"
		tag := hmTagRe.FindSubmatch(a.plain)
		etag := a.header.Get("Etag")
		if tag == nil && etag == "" {
			// The module's own answer.
			typ := hmErrorType(a.plain)
			switch {
			case replayed:
				bad("C2: %s: a replay that no execution sent", a)
			case a.status >= 200 && a.status < 500 && a.status != 499:
				bad("C3: %s: a %d (%q) that no execution of this key sent", a, a.status, typ)
			case typ == typeCommitStateUnknown:
				// README, "The guarantee, and its limits": a store away
				// for about the lease or longer lets a reservation's
				// lease lapse before its release lands, "and a retry
				// that meets the lapsed record before the release lands
				// hears "unknown" too".
				if !m.mayHaveExecuted(k, a) {
					if m.heldLong(0, a.end) {
						m.cov["unknown after a lease lapsed in a store link fault"]++
						continue
					}
					bad("C6: %s: outcome unknown, but no attempt of the key could have executed before it", a)
				}
			case a.status == http.StatusServiceUnavailable && typ == typeUnavailable && hmStoreUnavailable(a.plain):
				// README, "What it does" item 10: "Store failures fail
				// closed: 503 + Retry-After". Only after a fault on a
				// store link (any node's: a held transaction's locks
				// stall the others' statements too); a broken
				// connection stays in the pool until it is next used.
				if !m.linkFaultBefore(a.end) {
					bad("C6: %s: store unavailable, but no store link had a fault", a)
				}
				m.cov["store unavailable"]++
			case a.status == http.StatusServiceUnavailable && typ == typeUnavailable:
				if !m.overlapped(k, a) && !m.linkFaultBefore(a.end) {
					bad("C6: %s: still in flight, but no other attempt of the key overlapped it", a)
				}
				for _, b := range k.attempts {
					if b.plan.node != a.plan.node && b.start < a.end && max(b.end, b.frontEnd) > a.start {
						m.cov["in flight on another node"]++
						break
					}
				}
			case a.status == http.StatusBadGateway && typ == typeServiceFailure:
				// A refused dial, or a write that sent nothing on a
				// connection the catalog had closed.
				if a.plan.action != actRefuse && a.plan.action != actCloseBeforeRead {
					bad("C6: %s: 'not sent' answered to an attempt whose dial was not refused", a)
				}
			default:
				bad("C6: %s: unexpected answer of the module (%q)", a, typ)
			}
			continue
		}
		var e *hmExec
		if tag != nil {
			n, _ := strconv.Atoi(string(tag[2]))
			if string(tag[1]) != k.key {
				bad("C3: %s: carries the answer of another key (%s)", a, tag[1])
				continue
			}
			e = m.execOf(k, n)
		} else {
			for _, x := range execs {
				if x.header.Get("Etag") == etag {
					e = x
				}
			}
		}
		if e == nil {
			bad("C3: %s: carries an execution's tag that no execution of this key had", a)
			continue
		}
		if a.status != e.status || !bytes.Equal(a.plain, e.plain) {
			bad("C2: %s: status/body differ from execution #%d's answer (%d, %d bytes)", a, e.n, e.status, len(e.plain))
		}
		for _, name := range []string{"Content-Type", "Etag", "Location", "Cache-Control"} {
			if a.header.Get(name) != e.header.Get(name) {
				bad("C2: %s: header %s %q, execution #%d sent %q", a, name, a.header.Get(name), e.n, e.header.Get(name))
			}
		}
		if a.header.Get("Content-Encoding") == e.encoding && !bytes.Equal(a.raw, e.raw) {
			bad("C2: %s: raw body (%s) differs from execution #%d's bytes", a, e.encoding, e.n)
		}
		if replayed {
			if e.class != classFinal {
				bad("C2: %s: replays execution #%d, whose outcome was %s, not final", a, e.n, e.class)
			} else if replayedExec != nil && e != replayedExec {
				bad("C2: %s: replays execution #%d, another replay replayed #%d", a, e.n, replayedExec.n)
			}
			replayedExec = e
			if e.plan.node != a.plan.node {
				m.cov["replay of another node's execution"]++
			}
		} else if e.plan != a.plan {
			bad("C2: %s: got execution #%d's answer (plan#%d) without Idempotent-Replayed", a, e.n, e.plan.id)
		}
	}

	// C4: answers, in time, on whole connections.
	for _, a := range k.attempts {
		switch {
		case a.hung:
			bad("C4: %s: no answer within %v", a, m.bound())
		case a.panicked != nil && a.panicked != http.ErrAbortHandler:
			bad("C4: %s: the handler panicked", a)
		case a.err != nil && !a.left:
			if !m.catalogBrokeBody(k, a) {
				bad("C4: %s: connection broken although the catalog did not break the answer off and the client stayed", a)
			}
		case a.handlerErr != nil && !a.left:
			bad("C4: %s: the handler returned an error (Caddy answers it with an empty body)", a)
		}
	}

	// C5: a key whose earlier attempts provably never reached the catalog
	// executes on its next lone attempt.
	for _, a := range k.attempts {
		if a.left || a.hung || a.plan.action == actRefuse || a.plan.action == actCloseBeforeRead || a.plan.cutBody {
			continue
		}
		clean, lone := true, true
		for _, b := range k.attempts {
			if b == a {
				continue
			}
			bEnd := max(b.end, b.frontEnd)
			if bEnd < a.start {
				if !(b.plan.action == actRefuse || b.plan.action != actCloseBeforeRead && !k.arrived[b.plan.id]) {
					clean = false
				}
			} else if b.start < a.end {
				lone = false
			}
		}
		if !clean || !lone {
			continue
		}
		if m.linkFaultNear(a) {
			// README, "The guarantee, and its limits": after a store
			// write whose reply was lost the key stays in flight until
			// its undo lands (unknown, should the lease lapse first),
			// and a failed store call is answered 503 (What it does,
			// item 10). C7 and C8 still hold the record to what the
			// executions made of it once the round is over.
			m.cov["C5 skipped after a store link fault"]++
			continue
		}
		if len(k.attempts) > 1 {
			m.cov["C5 checked after refusals"]++
		}
		if !k.arrived[a.plan.id] || !seenPlan[a.plan.id] {
			bad("C5: %s: every earlier attempt of the key provably never reached the catalog, yet this lone attempt did not execute", a)
		}
	}

	// C7: nothing left in flight.
	if rec, err := m.store.Load(context.Background(), k.key); err != nil {
		bad("C7: store: %v", err)
	} else if rec != nil && rec.State == stores.StateInFlight && !rec.Abandoned {
		bad("C7: the record is left in flight after every request ended")
	} else {
		m.checkEndState(k, execs, rec, bad)
	}
	return vs
}

// checkEndState is C8: the key's record after the round is what its last
// execution's outcome made it. Attempts that may have executed without an
// execution the catalog recorded (closed before it was read, cut off while
// it was read) may leave it abandoned; a late execution leaves it open.
func (m *hmRound) checkEndState(k *hmKey, execs []*hmExec, rec *stores.Record, bad func(string, ...any)) {
	var last *hmExec
	if len(execs) > 0 {
		last = execs[len(execs)-1]
		if last.late {
			return
		}
	}
	executed := map[*hmPlan]bool{}
	for _, e := range execs {
		executed[e.plan] = true
	}
	maybeAfter := false // an attempt after the last execution that may have executed
	for _, a := range k.attempts {
		if executed[a.plan] || last != nil && max(a.end, a.frontEnd) < last.start {
			continue
		}
		if a.plan.action == actCloseBeforeRead || k.arrived[a.plan.id] {
			maybeAfter = true
		}
	}
	state := "absent"
	switch {
	case rec == nil:
	case rec.State == stores.StateFinal:
		state = fmt.Sprintf("final(%d)", rec.Response.Status)
	case rec.Abandoned:
		state = "abandoned"
	default:
		state = "in flight"
	}
	allowed := map[string]bool{}
	switch {
	case last == nil:
		allowed["absent"] = true
		allowed["abandoned"] = maybeAfter
	case last.class == classFinal:
		allowed[fmt.Sprintf("final(%d)", last.status)] = true
	case last.class == classReleased:
		allowed["absent"] = true
		allowed["abandoned"] = maybeAfter
	case last.class == classUnknown:
		allowed["abandoned"] = true
		// Under reexecute a retry takes the record over; one whose dial
		// was refused may release it.
		allowed["absent"] = m.opts.abandoned == abandonedReexecute
	}
	m.cov["C8 end state "+state]++
	if !allowed[state] {
		what := "no execution"
		if last != nil {
			what = fmt.Sprintf("last execution #%d %s (%d)", last.n, last.class, last.status)
		}
		bad("C8: the record is %s after the round; %s allows %v", state, what, allowed)
	}
}

// hmTakeOverSlack is how much earlier than the owner's handler returned a
// takeover's execution may begin: the owner marks the record unknown, then
// writes its answer and returns, and a busy machine may hold it between.
const hmTakeOverSlack = 250 * time.Millisecond

// handlerEnd is when the handler of the attempt that sent p returned.
func (k *hmKey) handlerEnd(p *hmPlan) (time.Duration, bool) {
	for _, a := range k.attempts {
		if a.plan == p && a.frontEnd > 0 {
			return a.frontEnd, true
		}
	}
	return 0, false
}

// mayHaveExecuted reports whether some attempt of the key that began before
// a ended could have left the outcome unknown: one that reached the catalog
// whose outcome is unknown, or one closed before it was read.
func (m *hmRound) mayHaveExecuted(k *hmKey, a *hmAttempt) bool {
	for _, b := range k.attempts {
		if b.start >= a.end {
			continue
		}
		if b.plan.action == actCloseBeforeRead {
			return true
		}
		if !k.arrived[b.plan.id] {
			continue
		}
		executed := false
		for _, e := range k.execs {
			if e.plan == b.plan {
				executed = true
				if e.class == classUnknown || e.late {
					return true
				}
			}
		}
		if !executed {
			return true // it arrived and was cut off while it was read
		}
	}
	return false
}

// overlapped reports whether another attempt's handler ran while a's did.
func (m *hmRound) overlapped(k *hmKey, a *hmAttempt) bool {
	for _, b := range k.attempts {
		if b != a && b.start < a.end && max(b.end, b.frontEnd) > a.start {
			return true
		}
	}
	return false
}

// catalogBrokeBody reports whether a's own execution had its answer broken
// off after the status line.
func (m *hmRound) catalogBrokeBody(k *hmKey, a *hmAttempt) bool {
	for _, e := range k.execs {
		// Broken off by the catalog, or by execution_timeout while its
		// body was still on its way.
		if e.plan == a.plan && (e.broke || e.late) {
			return true
		}
	}
	return false
}

func hmMs(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
