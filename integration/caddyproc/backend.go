package caddyproc

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Backend is a fake upstream standing in for an Iceberg REST catalog. It is
// not a catalog: it exists for tests that must count how often a request
// really executed, hold a request in flight on purpose, and choose the
// status a mutation gets. Tests of real catalog behaviour use a real one.
//
// Unless scripted, every request gets 200 with a JSON body naming the
// method, path, a hash of the request body and the path's execution number,
// so a replayed response is told apart from a re-execution by its body. It
// also sets Content-Type, ETag, Location and Cache-Control (the headers an
// idempotency layer replays) and X-Backend-Execution (one it should not).
type Backend struct {
	srv *httptest.Server

	mu        sync.Mutex
	counts    map[string]int
	cancelled map[string]int
	sent      map[string][][]byte
	scripts   map[string][]Reply
	gates     map[string]*Gate
}

// Reply scripts one answer of the backend.
type Reply struct {
	Status int         // 0 means 200
	Header http.Header // set over the default headers
	// Body replaces the default JSON body; nil keeps it.
	Body []byte
	// Pad grows the default JSON body to at least this many bytes.
	Pad int
	// Delay holds the request this long after it was counted (executed)
	// and before it is answered: a catalog that commits slowly. A
	// cancelled request still counts as executed.
	Delay time.Duration
	// Drop executes (counts) the request and then closes the connection
	// with a TCP reset instead of answering: a catalog that committed and
	// whose answer never left it. Status, Header and Body are ignored.
	Drop bool
}

// ExecutionHeader carries the execution number; it is not one an
// idempotency layer should store.
const ExecutionHeader = "X-Backend-Execution"

// maxStall bounds a stalled request so a test that forgets to release its
// gate fails instead of hanging.
const maxStall = 30 * time.Second

// NewBackend starts a Backend, closed when the test ends.
func NewBackend(t testing.TB) *Backend {
	b := newBackend()
	b.srv = httptest.NewServer(http.HandlerFunc(b.serve))
	b.cleanup(t)
	return b
}

// NewBackendAt starts a Backend listening on addr (host:port), e.g. the
// address a proxy was already pointed at while nothing listened there.
func NewBackendAt(t testing.TB, addr string) *Backend {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("caddyproc: backend listening on %s: %v", addr, err)
	}
	b := newBackend()
	b.srv = httptest.NewUnstartedServer(http.HandlerFunc(b.serve))
	_ = b.srv.Listener.Close()
	b.srv.Listener = l
	b.srv.Start()
	b.cleanup(t)
	return b
}

func newBackend() *Backend {
	return &Backend{
		counts:    map[string]int{},
		cancelled: map[string]int{},
		sent:      map[string][][]byte{},
		scripts:   map[string][]Reply{},
		gates:     map[string]*Gate{},
	}
}

func (b *Backend) cleanup(t testing.TB) {
	t.Cleanup(func() {
		b.mu.Lock()
		for _, g := range b.gates {
			g.Release()
		}
		b.mu.Unlock()
		b.srv.Close()
	})
}

// URL is the backend's base URL.
func (b *Backend) URL() string { return b.srv.URL }

// Addr is host:port, as reverse_proxy takes it.
func (b *Backend) Addr() string { return strings.TrimPrefix(b.srv.URL, "http://") }

// Script sets the answers for path: the nth execution gets replies[n-1], and
// executions past the end get the last one.
func (b *Backend) Script(path string, replies ...Reply) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.scripts[path] = replies
}

// Stall holds every request to path, once counted, until the returned gate
// is released.
func (b *Backend) Stall(path string) *Gate {
	g := &Gate{arrivals: make(chan struct{}, 1024), release: make(chan struct{})}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.gates[path] = g
	return g
}

// Count is how many requests to path the backend received (executed).
func (b *Backend) Count(path string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.counts[path]
}

// Total is how many requests the backend received on any path.
func (b *Backend) Total() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, c := range b.counts {
		n += c
	}
	return n
}

// Cancelled is how many requests to path had their context cancelled (the
// proxy gave up on them) by the time the backend answered.
func (b *Backend) Cancelled(path string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cancelled[path]
}

// Sent returns the response bodies written for path, in execution order.
func (b *Backend) Sent(path string) [][]byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([][]byte(nil), b.sent[path]...)
}

func (b *Backend) serve(w http.ResponseWriter, r *http.Request) {
	reqBody, _ := io.ReadAll(r.Body)
	path := r.URL.EscapedPath()

	b.mu.Lock()
	b.counts[path]++
	n := b.counts[path]
	reply := Reply{}
	if s := b.scripts[path]; len(s) > 0 {
		reply = s[min(n, len(s))-1]
	}
	gate := b.gates[path]
	b.mu.Unlock()

	if gate != nil {
		select {
		case gate.arrivals <- struct{}{}:
		default: // nobody is counting this many arrivals
		}
		select {
		case <-gate.release:
		case <-time.After(maxStall):
		}
	}
	if reply.Delay > 0 {
		// The execution is counted already; a proxy giving up early only
		// shortens the wait, as a catalog would carry on with the commit.
		select {
		case <-time.After(min(reply.Delay, maxStall)):
		case <-r.Context().Done():
		}
	}
	if reply.Drop {
		drop(w)
		return
	}

	body := reply.Body
	if body == nil {
		body = defaultBody(r.Method, path, reqBody, n, reply.Pad)
	}
	hdr := w.Header()
	hdr.Set("Content-Type", "application/json")
	hdr.Set("ETag", `"`+strconv.Itoa(n)+`"`)
	hdr.Set("Location", path+"?execution="+strconv.Itoa(n))
	hdr.Set("Cache-Control", "no-store")
	hdr.Set(ExecutionHeader, strconv.Itoa(n))
	for name, vals := range reply.Header {
		hdr[http.CanonicalHeaderKey(name)] = vals
	}
	hdr.Set("Content-Length", strconv.Itoa(len(body)))

	b.mu.Lock()
	if r.Context().Err() != nil {
		b.cancelled[path]++
	}
	b.sent[path] = append(b.sent[path], body)
	b.mu.Unlock()

	status := reply.Status
	if status == 0 {
		status = http.StatusOK
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// drop closes the request's connection without a word: SO_LINGER 0 makes
// the close a TCP reset, as when a catalog process or a middlebox dies after
// the commit.
func drop(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler) // no hijacking: abort the response instead
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = conn.Close()
}

func defaultBody(method, path string, reqBody []byte, n, pad int) []byte {
	sum := sha256.Sum256(reqBody)
	doc := struct {
		Method        string `json:"method"`
		Path          string `json:"path"`
		RequestSHA256 string `json:"request-sha256"`
		Execution     int    `json:"execution"`
		Pad           string `json:"pad,omitempty"`
	}{method, path, hex.EncodeToString(sum[:]), n, ""}
	out, _ := json.Marshal(doc)
	if len(out) < pad {
		doc.Pad = strings.Repeat("x", pad-len(out)-len(`,"pad":""`))
		out, _ = json.Marshal(doc)
	}
	return out
}

// Gate holds stalled requests of a Backend.
type Gate struct {
	arrivals chan struct{}
	release  chan struct{}
	once     sync.Once
}

// WaitArrived waits until n more stalled requests have reached the backend,
// failing the test if they do not within timeout.
func (g *Gate) WaitArrived(t testing.TB, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for i := 0; i < n; i++ {
		select {
		case <-g.arrivals:
		case <-deadline:
			t.Fatalf("caddyproc: %d of %d stalled requests arrived within %v", i, n, timeout)
		}
	}
}

// Release lets every held request, and every later one, proceed.
func (g *Gate) Release() { g.once.Do(func() { close(g.release) }) }
