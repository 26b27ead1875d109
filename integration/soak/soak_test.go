package soak

// TestSoak is a randomized, seeded soak at process level: two built Caddy
// nodes (one for the memory store) share one store in front of the real
// test catalog, which counts executions per key; clients retry as the next
// Iceberg Java client does, while a seeded schedule kills and restarts the
// nodes, reloads them with a changed config, and crashes or freezes a
// private database server. At the end every key's history is checked
// against the README. It runs only when ICEBERG_IDEMPOTENCY_SOAK names a
// store; see the README's Tests section.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/catalog"
	"github.com/google/uuid"
)

func itoa(i int) string { return strconv.Itoa(i) }

func envInt(name string, def int) int {
	if v := os.Getenv(name); v != "" {
		if n, err := strconv.Atoi(v); err == nil {
			return n
		}
	}
	return def
}

func envDur(name string, def time.Duration) time.Duration {
	if v := os.Getenv(name); v != "" {
		if d, err := time.ParseDuration(v); err == nil {
			return d
		}
	}
	return def
}

const (
	execTimeout = 3 * time.Second
	tables      = 4
	maxRetries  = 5 // the Java client's
)

// attempt is one HTTP exchange of a client.
type attempt struct {
	at, end time.Duration // sent, answered
	node    int
	status  int // 0: no answer
	errType string
	body    []byte
	err     string
	retryAf string
}

// keyRun is one logical request: a key and every attempt made with it.
type keyRun struct {
	key      string
	idx      int
	op       string
	path     string
	body     []byte
	attempts []attempt
}

// event is one process-level fault the schedule fired.
type event struct {
	at, end time.Duration
	kind    string
	node    int
}

type soak struct {
	t       *testing.T
	store   string
	seed    uint64
	start   time.Time
	cat     *countingCatalog
	db      *privateDB
	catPort int
	ports   [2][2]int
	nodes   []*caddyproc.Instance
	nodeMu  []sync.RWMutex
	variant []int

	keyMu   sync.Mutex
	keyIdx  map[string]int
	runs    []*keyRun
	nextIdx atomic.Int64

	evMu   sync.Mutex
	events []event

	gaveUpNotes []string
	allNodes    []*caddyproc.Instance // every process started, for their logs

	// reexecute runs the nodes with `abandoned reexecute`: a retry of an
	// abandoned key executes it again, which check allows only where the
	// README says a key is abandoned.
	reexecute bool
}

func (s *soak) since() time.Duration { return time.Since(s.start) }

func (s *soak) site(variant int) string {
	store := "store memory"
	if s.db != nil {
		store = s.db.storeBlock(variant)
	}
	if s.reexecute {
		store += "\nabandoned reexecute"
	}
	// The reload changes in_flight_wait and the store's pool size (a new
	// pool on the same records).
	return caddyproc.Caddyfile("",
		"iceberg_idempotency {\n"+store+"\n"+
			"execution_timeout "+execTimeout.String()+"\n"+
			"lease 8s\n"+
			"in_flight_wait "+strconv.Itoa(4+variant)+"s\n"+
			"}\nreverse_proxy 127.0.0.1:"+strconv.Itoa(s.catPort)+" {\ntransport http {\nkeepalive 50ms\n}\n}")
}

func (s *soak) nodeURL(i int) string { return "http://127.0.0.1:" + strconv.Itoa(s.ports[i][0]) }

func (s *soak) startNode(i int) {
	var last string
	for try := 0; try < 20; try++ {
		inst, err := tryStart(s.t, s.site(s.variant[i]), caddyproc.Options{Port: s.ports[i][0], AdminPort: s.ports[i][1]})
		if err == nil {
			s.nodes[i] = inst
			s.allNodes = append(s.allNodes, inst)
			return
		}
		last = err.Error()
		time.Sleep(500 * time.Millisecond)
	}
	s.t.Fatalf("node %d did not restart: %s", i, last)
}

// tryStart is caddyproc.StartWith without failing the test from another
// goroutine.
func tryStart(t *testing.T, cfg string, opts caddyproc.Options) (inst *caddyproc.Instance, err error) {
	ft := &softT{T: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			if r := recover(); r != nil && r != errSoftFatal {
				panic(r)
			}
		}()
		inst = caddyproc.StartWith(ft, cfg, opts)
	}()
	<-done
	if ft.failed != "" {
		return nil, errors.New(ft.failed)
	}
	return inst, nil
}

var errSoftFatal = errors.New("soft fatal")

// softT turns caddyproc's Fatalf into an error, so a node's restart can be
// tried again (its port may still be held for a moment after a kill).
type softT struct {
	*testing.T
	failed string
}

func (s *softT) Fatalf(format string, args ...any) {
	s.failed = fmt.Sprintf(format, args...)
	panic(errSoftFatal)
}

func (s *softT) Helper() {}

func (s *soak) record(ev event) {
	s.evMu.Lock()
	s.events = append(s.events, ev)
	s.evMu.Unlock()
	s.t.Logf("%8.1fs  %-22s node=%d  %.1fs", ev.at.Seconds(), ev.kind, ev.node, (ev.end - ev.at).Seconds())
}

// faults runs the seeded schedule until ctx ends; one fault at a time.
func (s *soak) faults(ctx context.Context) {
	rng := rand.New(rand.NewPCG(s.seed, 1))
	pause := func(lo, hi time.Duration) time.Duration {
		return lo + time.Duration(rng.Int64N(int64(hi-lo)))
	}
	sleep := func(d time.Duration) bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(d):
			return true
		}
	}
	for {
		if !sleep(pause(2*time.Second, 9*time.Second)) {
			return
		}
		v := rng.IntN(100)
		node := rng.IntN(len(s.nodes))
		hold := pause(300*time.Millisecond, 6*time.Second)
		kind := ""
		switch {
		case s.db == nil && v < 50, s.db != nil && v < 30:
			kind = "kill -9 node"
		case s.db == nil, v < 45:
			kind = "reload node"
		case v < 65:
			kind = "kill -9 database"
		case v < 85:
			kind = "SIGSTOP database"
		case v < 93:
			kind = "SIGSTOP database + kill -9 node"
		default:
			kind = "kill -9 database + kill -9 node"
		}
		at := s.since()
		switch kind {
		case "kill -9 node":
			s.nodeMu[node].Lock()
			s.nodes[node].Kill()
			time.Sleep(hold)
			s.startNode(node)
			s.nodeMu[node].Unlock()
		case "reload node":
			s.variant[node] = 1 - s.variant[node]
			s.nodeMu[node].Lock()
			if err := s.nodes[node].Load(s.site(s.variant[node])); err != nil {
				s.t.Errorf("reload of node %d: %v", node, err)
			}
			s.nodeMu[node].Unlock()
			hold = 0
		case "kill -9 database":
			s.db.crash()
			time.Sleep(hold)
			if err := s.db.start(); err != nil {
				s.t.Errorf("database restart: %v", err)
				return
			}
		case "SIGSTOP database":
			s.db.freeze(true)
			time.Sleep(hold)
			s.db.freeze(false)
		case "SIGSTOP database + kill -9 node", "kill -9 database + kill -9 node":
			// The node dies while the database is away, with whatever
			// repairs (releases, finalize retries) it still had queued.
			frozen := strings.HasPrefix(kind, "SIGSTOP")
			if frozen {
				s.db.freeze(true)
			} else {
				s.db.crash()
			}
			time.Sleep(hold / 2)
			s.nodes[node].Kill()
			time.Sleep(hold / 2)
			if frozen {
				s.db.freeze(false)
			} else if err := s.db.start(); err != nil {
				s.t.Errorf("database restart: %v", err)
				return
			}
			s.startNode(node)
		}
		s.record(event{at: at, end: s.since(), kind: kind, node: node})
	}
}

func retryable(status int) bool {
	switch status {
	case 0, 408, 429, 500, 502, 503, 504:
		return true
	}
	return false
}

func errorType(body []byte) string {
	var e struct {
		Error struct {
			Type string `json:"type"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil {
		return e.Error.Type
	}
	return ""
}

func (s *soak) newRun(rng *rand.Rand) *keyRun {
	k, err := uuid.NewV7()
	if err != nil {
		panic(err)
	}
	idx := int(s.nextIdx.Add(1))
	r := &keyRun{key: k.String(), idx: idx}
	if rng.IntN(2) == 0 {
		r.op, r.path = "createNamespace", "/v1/namespaces"
		r.body = []byte(`{"namespace":["k` + strings.ReplaceAll(r.key, "-", "") + `"],"properties":{"by":"soak"}}`)
	} else {
		r.op, r.path = "updateTable", "/v1/namespaces/soak/tables/t"+itoa(rng.IntN(tables))
		r.body = []byte(`{"requirements":[],"updates":[{"action":"set-properties","updates":{"soak-key":"` + r.key + `"}}]}`)
	}
	s.keyMu.Lock()
	s.keyIdx[r.key] = idx
	s.runs = append(s.runs, r)
	s.keyMu.Unlock()
	return r
}

// client sends keyed requests until ctx ends, retrying each like the next
// Iceberg Java client: the same key and bytes on 408/429/500/502/503/504 and
// on connection errors, up to 5 retries, backoff from 100 ms doubling with
// jitter, or the Retry-After if longer.
func (s *soak) client(ctx context.Context, id int, hc *http.Client) {
	rng := rand.New(rand.NewPCG(s.seed, uint64(100+id)))
	for ctx.Err() == nil {
		r := s.newRun(rng)
		// One key in five also goes, with every attempt, to the other
		// node at once: a duplicate in flight, as a client's retry after
		// its own socket timeout makes while the first is still running.
		twin := len(s.nodes) > 1 && rng.IntN(5) == 0
		backoff := 100 * time.Millisecond
		for try := 0; try <= maxRetries; try++ {
			node := rng.IntN(len(s.nodes))
			var other attempt
			var wg sync.WaitGroup
			if twin {
				wg.Go(func() { other = s.send(hc, r, 1-node) })
			}
			a := s.send(hc, r, node)
			wg.Wait()
			if twin {
				r.attempts = append(r.attempts, other)
			}
			r.attempts = append(r.attempts, a)
			if !retryable(a.status) || try == maxRetries {
				break
			}
			wait := backoff/2 + time.Duration(rng.Int64N(int64(backoff)))
			if ra, err := strconv.Atoi(a.retryAf); err == nil && time.Duration(ra)*time.Second > wait {
				wait = time.Duration(ra) * time.Second
			}
			time.Sleep(wait)
			backoff *= 2
		}
	}
}

func (s *soak) send(hc *http.Client, r *keyRun, node int) attempt {
	a := attempt{at: s.since(), node: node}
	req, err := http.NewRequest(http.MethodPost, s.nodeURL(node)+r.path, bytes.NewReader(r.body))
	if err != nil {
		panic(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", r.key)
	resp, err := hc.Do(req)
	if err != nil {
		a.end = s.since()
		a.err = shortErr(err)
		return a
	}
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	a.end = s.since()
	if err != nil {
		a.err = "body: " + shortErr(err)
		return a
	}
	a.status, a.body, a.retryAf = resp.StatusCode, body, resp.Header.Get("Retry-After")
	a.errType = errorType(body)
	return a
}

func shortErr(err error) string {
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case strings.Contains(err.Error(), "connection refused"):
		return "refused"
	case strings.Contains(err.Error(), "reset"):
		return "reset"
	case strings.Contains(err.Error(), "EOF"):
		return "EOF"
	}
	return err.Error()
}

func TestSoak(t *testing.T) {
	store := os.Getenv("ICEBERG_IDEMPOTENCY_SOAK")
	if store == "" {
		t.Skip("set ICEBERG_IDEMPOTENCY_SOAK=postgres|mysql|redis|memory to run the soak")
	}
	seed := uint64(envInt("ICEBERG_IDEMPOTENCY_SOAK_SEED", 1))
	dur := envDur("ICEBERG_IDEMPOTENCY_SOAK_DURATION", 2*time.Minute)
	clients := envInt("ICEBERG_IDEMPOTENCY_SOAK_CLIENTS", 8)
	base := envInt("ICEBERG_IDEMPOTENCY_SOAK_PORT", 25600)
	var reexecute bool
	switch policy := os.Getenv("ICEBERG_IDEMPOTENCY_SOAK_ABANDONED"); policy {
	case "", "unknown":
	case "reexecute":
		reexecute = true
	default:
		t.Fatalf("ICEBERG_IDEMPOTENCY_SOAK_ABANDONED=%q: want unknown (the default) or reexecute", policy)
	}

	dir, err := os.MkdirTemp("", "iceberg-soak-"+store+"-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	// PostgreSQL runs as user postgres, which must reach its data dir.
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}

	s := &soak{t: t, store: store, seed: seed, reexecute: reexecute, keyIdx: map[string]int{}}
	s.catPort = base
	s.ports = [2][2]int{{base + 1, base + 2}, {base + 3, base + 4}}
	if store != "memory" {
		db, err := newPrivateDB(store, filepath.Join(dir, "db"), base+5)
		if err != nil {
			t.Fatal(err)
		}
		s.db = db
		defer db.close()
	}

	cat, err := catalog.New(catalog.Options{WarehouseDir: filepath.Join(dir, "warehouse")})
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	if err := setupCatalog(context.Background(), cat, tables); err != nil {
		t.Fatal(err)
	}
	s.start = time.Now()
	s.cat = &countingCatalog{
		cat: cat, seed: seed, start: s.start, execTO: execTimeout,
		arrived: map[string]int{}, resetAt: map[string][]time.Duration{}, execs: map[string][]execution{}, faults: map[catalogFault]int{},
		index: func(key string) (int, bool) {
			s.keyMu.Lock()
			defer s.keyMu.Unlock()
			i, ok := s.keyIdx[key]
			return i, ok
		},
	}
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(s.catPort))
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: s.cat, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = hs.Serve(ln) }()
	defer hs.Close()

	n := 2
	if store == "memory" {
		n = 1
	}
	s.nodes = make([]*caddyproc.Instance, n)
	s.nodeMu = make([]sync.RWMutex, n)
	s.variant = make([]int, n)
	for i := range n {
		s.startNode(i)
	}

	ctx, cancel := context.WithTimeout(context.Background(), dur)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() { s.faults(ctx) })
	hc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	for id := range clients {
		wg.Go(func() { s.client(ctx, id, hc) })
	}
	wg.Wait()
	t.Logf("load ended at %.1fs; checking", s.since().Seconds())
	s.check()
}
