package icebergidempotency

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/requestbody"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestParseKey(t *testing.T) {
	tests := []struct {
		name, in, want string
		ok             bool
	}{
		{"spec example, upper case", "017F22E2-79B0-7CC3-98C4-DC0C0C07398F", "017f22e2-79b0-7cc3-98c4-dc0c0c07398f", true},
		{"lower case v7", "019386a4-1b2c-7d3e-8f40-123456789abc", "019386a4-1b2c-7d3e-8f40-123456789abc", true},
		{"mixed case v7, variant b", "019386A4-1b2c-7D3e-bF40-123456789abc", "019386a4-1b2c-7d3e-bf40-123456789abc", true},
		{"variant 9", "019386a4-1b2c-7d3e-9f40-123456789abc", "019386a4-1b2c-7d3e-9f40-123456789abc", true},
		{"v4", "f47ac10b-58cc-4372-a567-0e02b2c3d479", "", false},
		{"v1", "6ba7b810-9dad-11d1-80b4-00c04fd430c8", "", false},
		{"v8", "019386a4-1b2c-8d3e-8f40-123456789abc", "", false},
		{"variant 0 (NCS)", "019386a4-1b2c-7d3e-0f40-123456789abc", "", false},
		{"variant c (Microsoft)", "019386a4-1b2c-7d3e-cf40-123456789abc", "", false},
		{"35 chars", "019386a4-1b2c-7d3e-8f40-123456789ab", "", false},
		{"37 chars", "019386a4-1b2c-7d3e-8f40-123456789abcd", "", false},
		{"braces", "{019386a4-1b2c-7d3e-8f40-123456789abc}", "", false},
		{"urn", "urn:uuid:019386a4-1b2c-7d3e-8f40-123456789abc", "", false},
		{"no hyphens, padded to 36", "019386a41b2c7d3e8f40123456789abc----", "", false},
		{"non-hex", "019386a4-1b2c-7d3e-8f40-123456789abg", "", false},
		{"empty", "", "", false},
		{"spaces", " 019386a4-1b2c-7d3e-8f40-123456789a ", "", false},
	}
	// The count alone hid the mistake (error-response audit).
	v7 := "019386a4-1b2c-7d3e-8f40-123456789abc"
	for in, want := range map[string]string{
		`"` + v7 + `"`:     "must be the UUID itself, without quotes",
		v7 + ", " + v7:     "must be one UUID, got several values separated by commas",
		v7[:35] + "\u00e9": "must be a UUID of 36 characters in its hyphenated form, got 37 bytes",
	} {
		if _, err := parseKey(in, keyVersionsSpec); err == nil || err.Error() != want {
			t.Errorf("parseKey(%q) = %v, want %q", in, err, want)
		}
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseKey(tt.in, keyVersionsSpec)
			if tt.ok && (err != nil || got != tt.want) {
				t.Fatalf("parseKey(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
			}
			if !tt.ok && err == nil {
				t.Fatalf("parseKey(%q) = %q, want an error", tt.in, got)
			}
		})
	}
}

// key_versions widens the versions accepted, and only the version: the
// form and the RFC 9562 variant are checked whatever it allows.
func TestParseKeyVersions(t *testing.T) {
	v1 := "6ba7b810-9dad-11d1-80b4-00c04fd430c8"
	v4 := "F47AC10B-58CC-4372-A567-0E02B2C3D479"
	v7 := "019386a4-1b2c-7d3e-8f40-123456789abc"
	v8 := "019386a4-1b2c-8d3e-8f40-123456789abc"
	v0 := "019386a4-1b2c-0d3e-8f40-123456789abc"
	v9 := "019386a4-1b2c-9d3e-8f40-123456789abc"
	v4ms := "f47ac10b-58cc-4372-c567-0e02b2c3d479" // Microsoft variant
	anyVersion := newKeyVersionSet([]int{1, 2, 3, 4, 5, 6, 7, 8})
	fourSeven := newKeyVersionSet([]int{4, 7})
	for _, tt := range []struct {
		name    string
		in      string
		allowed keyVersionSet
		wantErr string // "" when accepted
	}{
		{"v4 by default", v4, keyVersionsSpec, "must be a version 7 UUID, got version 4"},
		{"v4 with 4 7", v4, fourSeven, ""},
		{"v7 with 4 7", v7, fourSeven, ""},
		{"v1 with 4 7", v1, fourSeven, "must be a version 4 or 7 UUID, got version 1"},
		{"v1 with any", v1, anyVersion, ""},
		{"v8 with any", v8, anyVersion, ""},
		{"v0 with any", v0, anyVersion, "must be a version 1, 2, 3, 4, 5, 6, 7 or 8 UUID, got version 0"},
		{"v9 with any", v9, anyVersion, "got version 9"},
		{"variant checked with any", v4ms, anyVersion, "RFC 9562 variant"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseKey(tt.in, tt.allowed)
			if tt.wantErr == "" {
				if err != nil || got != strings.ToLower(tt.in) {
					t.Fatalf("parseKey(%q, %s) = %q, %v; want it accepted in lower case", tt.in, tt.allowed, got, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("parseKey(%q, %s) = %q, %v; want an error containing %q", tt.in, tt.allowed, got, err, tt.wantErr)
			}
		})
	}
}

// The fingerprint's input is "<length>:<part>" for the method, the path, the
// query and the body, in that order. Records in a shared store outlive an
// upgrade, so this layout must never change: a retry would stop matching
// its own record (422).
func TestRequestFingerprintLayout(t *testing.T) {
	body := `{"namespace":["a"]}`
	want := sha256Hex([]byte("4:POST" + "14:/v1/namespaces" + "3:a=1" + "19:" + body))
	if got := requestFingerprint("POST", "/v1/namespaces", "a=1", []byte(body)); got != want {
		t.Fatalf("fingerprint %s, want %s", got, want)
	}
	long := strings.Repeat("p", 300) // past the small parts' stack buffer
	want = sha256Hex([]byte("6:DELETE300:" + long + "0:0:"))
	if got := requestFingerprint("DELETE", long, "", nil); got != want {
		t.Fatalf("fingerprint of a long path %s, want %s", got, want)
	}
	big := strings.Repeat("b", fingerprintStack) // hashed in pieces, not from the stack
	want = sha256Hex([]byte("4:POST14:/v1/namespaces0:" + strconv.Itoa(len(big)) + ":" + big))
	if got := requestFingerprint("POST", "/v1/namespaces", "", []byte(big)); got != want {
		t.Fatalf("fingerprint of a large body %s, want %s", got, want)
	}
}

// readBody reads a body of announced length in one buffer of that size, an
// unannounced (chunked) one as it comes, at most limit+1 bytes of either, and
// fails a body that ends before its announced length.
func TestReadBody(t *testing.T) {
	req := func(body string, length int64) *http.Request {
		r := httptest.NewRequest("POST", "/v1/namespaces", io.NopCloser(strings.NewReader(body)))
		r.ContentLength = length
		return r
	}
	for _, tt := range []struct {
		name    string
		r       *http.Request
		want    string
		wantCap int // 0: not checked
		wantErr bool
	}{
		{"announced", req("abcdef", 6), "abcdef", 6, false},
		{"empty", req("", 0), "", 0, false},
		{"chunked", req("abcdef", -1), "abcdef", 0, false},
		{"announced past the limit", req("abcdefghijkl", 12), "", 0, true},
		{"chunked past the limit", req("abcdefghijkl", -1), "", 0, true},
		{"chunked one past the limit", req("abcdefghijk", -1), "", 0, true},
		{"chunked at the limit", req("abcdefghij", -1), "abcdefghij", 10, false},
		{"shorter than announced", req("abc", 6), "", 0, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := readBody(tt.r, 10, &bodyHold{})
			if (err != nil) != tt.wantErr {
				t.Fatalf("error %v, want error %v", err, tt.wantErr)
			}
			if err == nil && string(got) != tt.want {
				t.Fatalf("read %q, want %q", got, tt.want)
			}
			if tt.wantCap != 0 && cap(got) != tt.wantCap {
				t.Fatalf("buffer capacity %d, want exactly %d", cap(got), tt.wantCap)
			}
		})
	}
}

// A body of unknown length is read up to the limit and no further into its
// buffer, so that max_buffered_bytes of twice max_request_size (the least
// the config takes) holds one at the limit while it grows. Before, a
// chunked body of exactly a 128 KiB limit (64 KiB times a power of two, as
// the 16 MiB default is) grew its full buffer to limit+1 and needed
// 2×limit+1: it, and every larger one, got 503 for ever instead of being
// executed or refused with 413.
func TestReadBodyOfUnknownLengthFitsTwiceTheLimit(t *testing.T) {
	const limit = 128 << 10
	for _, c := range []struct {
		n       int
		wantErr error
	}{{limit - 1, nil}, {limit, nil}, {limit + 1, errBodyOverLimit}, {3 * limit, errBodyOverLimit}} {
		budget := &bodyBudget{max: 2 * limit}
		req := httptest.NewRequest("POST", "/v1/namespaces", io.NopCloser(strings.NewReader(strings.Repeat("b", c.n))))
		req.ContentLength = -1
		hold := &bodyHold{budget: budget}
		got, err := readBody(req, limit, hold)
		hold.release()
		if err != c.wantErr || (err == nil && len(got) != c.n) {
			t.Errorf("a chunked body of %d bytes under a %d limit: read %d (%v), want %d (%v)", c.n, limit, len(got), err, c.n, c.wantErr)
		}
	}
}

// A large body of announced length is held in a buffer no larger than it:
// read as it comes, doubling up to the length and not past it. Before, a
// 1 MiB + 3 byte body sat in a 2 MiB buffer for the whole request.
func TestReadBodyHoldsNoMoreThanAnnounced(t *testing.T) {
	for _, n := range []int{1<<20 + 3, 70000} {
		// One byte at a time: a body arrives in pieces.
		body := iotest.OneByteReader(strings.NewReader(strings.Repeat("b", n)))
		req := httptest.NewRequest("POST", "/v1/namespaces", io.NopCloser(body))
		req.ContentLength = int64(n)
		got, err := readBody(req, 16<<20, &bodyHold{})
		if err != nil || len(got) != n || cap(got) != n {
			t.Fatalf("read %d bytes into %d (%v), want %d into %d", len(got), cap(got), err, n, n)
		}
	}
}

// Each growth of a body's buffer is taken from the budget, so that what a
// request holds is its buffer's capacity; a budget that cannot cover the
// next growth stops the read.
func TestReadBodyTakesFromTheBudget(t *testing.T) {
	const n = 300 << 10
	body := strings.Repeat("b", n)
	read := func(budget *bodyBudget) ([]byte, *bodyHold, error) {
		req := httptest.NewRequest("POST", "/v1/namespaces", io.NopCloser(strings.NewReader(body)))
		req.ContentLength = n
		hold := &bodyHold{budget: budget}
		got, err := readBody(req, 16<<20, hold)
		return got, hold, err
	}
	// Room for one body and, while it grows, the copy of its last
	// buffer; not for a second body.
	budget := &bodyBudget{max: 2 * n}
	got, hold, err := read(budget)
	if err != nil || int64(cap(got)) != hold.n || budget.held.Load() != n {
		t.Fatalf("read %d into %d (%v); held %d, budget %d; want all of it held", len(got), cap(got), err, hold.n, budget.held.Load())
	}
	_, refused, err := read(budget)
	if err != errBodyBudget {
		t.Fatalf("a second body with the budget spent: %v, want errBodyBudget", err)
	}
	hold.release()
	refused.release() // as admit does, whatever readBody returned
	if budget.held.Load() != 0 {
		t.Fatalf("budget still holds %d after the release", budget.held.Load())
	}
}

// Keyed requests whose bodies would hold more than max_buffered_bytes
// together are answered 503 + Retry-After before anything is reserved:
// the catalog is not called, and the retry, once the budget is free again,
// executes. Before, every keyed body was held whatever their number: 60
// concurrent 16 MiB bodies held 1.3 GiB, which plain reverse_proxy streams.
func TestBodiesPastTheBudgetAreRefused(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.bodies = &bodyBudget{max: 200 << 10} // one 80 KiB body and its last copy, not two
	body := `{"pad":"` + strings.Repeat("x", 80<<10) + `"}`
	arrived, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	up := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		_, _ = io.ReadAll(r.Body)
		if calls.Add(1) == 1 {
			close(arrived)
			<-release
		}
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{}`)
		return nil
	}}
	first := make(chan result, 1)
	go func() { first <- serve(t, h, up, http.MethodPost, commitPath, storetest.NewKey(t), body) }()
	<-arrived
	key := storetest.NewKey(t)
	refused := serve(t, h, up, http.MethodPost, commitPath, key, body)
	if refused.code() != http.StatusServiceUnavailable || refused.header.Get("Retry-After") == "" || calls.Load() != 1 {
		t.Fatalf("second body past the budget = %d %q, calls %d; want 503 + Retry-After, not executed", refused.code(), refused.body, calls.Load())
	}
	close(release)
	if r := <-first; r.code() != http.StatusOK {
		t.Fatalf("first = %d %q", r.code(), r.body)
	}
	if retry := serve(t, h, up, http.MethodPost, commitPath, key, body); retry.code() != http.StatusOK || calls.Load() != 2 {
		t.Fatalf("retry = %d %q, calls %d; want it executed", retry.code(), retry.body, calls.Load())
	}
	if held := h.bodies.held.Load(); held != 0 {
		t.Fatalf("budget holds %d after every request ended", held)
	}
}

// A keyed body that request_body's max_size cuts off (a chunked or HTTP/2
// body, with no Content-Length to refuse it by), or whose framing breaks,
// is answered with an Iceberg error, and nothing reaches the catalog.
func TestUnreadableBodyGetsAnIcebergError(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	for _, c := range []struct {
		name   string
		body   io.Reader
		limit  int64
		status int
		typ    string
	}{
		{"over request_body max_size", strings.NewReader(nsBody), 8, http.StatusRequestEntityTooLarge, typeTooLarge},
		{"broken framing", io.MultiReader(strings.NewReader(`{"namespace"`), iotest.ErrReader(errors.New("malformed chunked encoding"))), 0, http.StatusBadRequest, typeBadRequest},
	} {
		t.Run(c.name, func(t *testing.T) {
			up := answering(http.StatusOK, `{}`)
			req := httptest.NewRequest(http.MethodPost, "/v1/namespaces", c.body)
			req.ContentLength = -1 // chunked, as HTTP/2 and Transfer-Encoding: chunked bodies come
			req.Header.Set(IdempotencyKeyHeader, storetest.NewKey(t))
			rec := httptest.NewRecorder()
			req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
			var next caddyhttp.Handler = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				return h.ServeHTTP(w, r, up)
			})
			if c.limit > 0 {
				inner := next
				rb := &requestbody.RequestBody{MaxSize: c.limit}
				next = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return rb.ServeHTTP(w, r, inner) })
			}
			before := value(t, decisions, "operation", "createNamespace", "outcome", outcomeRejected)
			err := next.ServeHTTP(rec, req)
			res := result{status: rec.Code, header: rec.Header(), body: rec.Body.String(), err: err}
			if err != nil || res.code() != c.status || res.errorType() != c.typ || up.calls.Load() != 0 {
				t.Fatalf("%d %q (error %v), %d executions; want %d %s and none", res.code(), res.body, err, up.calls.Load(), c.status, c.typ)
			}
			if got := value(t, decisions, "operation", "createNamespace", "outcome", outcomeRejected) - before; got != 1 {
				t.Fatalf("requests_total{outcome=rejected} rose by %v, want 1", got)
			}
		})
	}
}

// A body announced far larger than what arrives holds only what arrived:
// the buffer grows with the bytes, past the first 64 KiB. Before, the
// whole announced length (up to max_request_size) was allocated at once,
// and a large max_request_size let one request exhaust the process's
// memory, where reverse_proxy alone streams the body.
func TestAnnouncedLengthIsNotAllocatedUpFront(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.MaxRequestSize = 1 << 30 // an operator allowing large commits
	catalog := newCountingCatalog(t, answerOK)
	req := httptest.NewRequest(http.MethodPost, "/v1/namespaces", io.NopCloser(strings.NewReader(`{"x":1}`)))
	req.ContentLength = 1 << 30 // announced, never sent
	req.Header.Set(IdempotencyKeyHeader, storetest.NewKey(t))
	rec := httptest.NewRecorder()
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_ = h.ServeHTTP(rec, req, newReverseProxy(t, catalog.addr()))
	runtime.ReadMemStats(&after)
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 64<<20 {
		t.Fatalf("a 7-byte body announced as 1 GiB allocated %d MiB", alloc>>20)
	}
	if rec.Code != http.StatusBadRequest || catalog.executed.Load() != 0 {
		t.Fatalf("answer %d, catalog executed %d; want 400 for a body cut short, nothing sent", rec.Code, catalog.executed.Load())
	}
}

// A body larger than presizedBody reaches the catalog whole, and one cut
// short of its Content-Length is refused as before.
func TestLargeAnnouncedBodyIsReadWhole(t *testing.T) {
	body := `{"updates":[` + strings.Repeat(`{"action":"set-properties","updates":{"k":"v"}},`, 4000) + `{}]}`
	var got atomic.Value
	got.Store("")
	catalog := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got.Store(string(b))
		answerOK(w, r)
	}))
	t.Cleanup(catalog.Close)
	h := newTestHandler(t, newMemoryStore(t))
	if res := serve(t, h, newReverseProxy(t, strings.TrimPrefix(catalog.URL, "http://")), http.MethodPost, commitPath, storetest.NewKey(t), body); res.code() != http.StatusOK || got.Load() != body {
		t.Fatalf("answer %d; catalog got %d bytes, want the %d sent", res.code(), len(got.Load().(string)), len(body))
	}
	short := httptest.NewRequest(http.MethodPost, commitPath, io.NopCloser(strings.NewReader(body[:100<<10])))
	short.ContentLength = int64(len(body))
	if _, err := readBody(short, h.MaxRequestSize, &bodyHold{}); err != io.ErrUnexpectedEOF {
		t.Fatalf("a body cut short of its length: %v, want io.ErrUnexpectedEOF", err)
	}
}

// A keyed request that announces a body over max_request_size and asks
// Expect: 100-continue is refused before it uploads anything: Go's server
// sends "100 Continue" only once a handler reads the body, and before, the
// handler read up to the limit first (16 MiB by default) only to answer 413.
func TestBodyAnnouncedTooLargeIsRefusedBeforeTheUpload(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.MaxRequestSize = 1 << 10
	up := answering(http.StatusOK, `{}`)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r = caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, &caddyhttp.Server{})
		if err := h.ServeHTTP(w, r, up); err != nil {
			t.Error(err)
		}
	}))
	defer srv.Close()
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintf(conn, "POST /v1/namespaces HTTP/1.1\r\nHost: catalog\r\nIdempotency-Key: %s\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n", storetest.NewKey(t), 1<<20); err != nil {
		t.Fatal(err)
	}
	res, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(body), typeTooLarge) || up.calls.Load() != 0 {
		t.Fatalf("first answer %d %s, %d executions; want 413 %s at once (no 100 Continue) and none", res.StatusCode, body, up.calls.Load(), typeTooLarge)
	}
}

// A nested guard (a second iceberg_idempotency on the same request) takes
// the body the first one read as it is: no copy, and nothing taken from
// the budget a second time. Before, a 100 KiB body under a 150 KiB budget
// was refused on every try, the one request counted twice.
func TestNestedGuardTakesTheBodyAsRead(t *testing.T) {
	var outer requestBody
	outer.reset([]byte(`{"namespace":["a"]}`))
	r := httptest.NewRequest("POST", "/v1/namespaces", nil)
	r.Body, r.ContentLength = &outer, int64(len(outer.all))
	budget := &bodyBudget{max: 1} // could hold no copy
	got, err := readBody(r, 1<<20, &bodyHold{budget: budget})
	if err != nil || string(got) != `{"namespace":["a"]}` || &got[0] != &outer.all[0] || budget.held.Load() != 0 {
		t.Fatalf("read %q (%v), budget %d; want the outer body itself, nothing taken", got, err, budget.held.Load())
	}
}

// A max_request_size that max_buffered_bytes cannot hold twice (a body's
// buffer and its copy as it grows) would refuse such a body with 503 for
// ever: the config is refused instead.
func TestMaxRequestSizeFitsTheBodyBudget(t *testing.T) {
	for _, c := range []struct {
		budget string
		ok     bool
	}{{`1048576`, false}, {`3145728`, false}, {`4194304`, true}} {
		cfg := `{"apps": {"iceberg_idempotency": {"max_buffered_bytes": ` + c.budget + `},
			"http": {"servers": {"s": {"listen": ["127.0.0.1:0"],
			"routes": [{"handle": [{"handler": "iceberg_idempotency", "max_request_size": 2097152}]}]}}}}}`
		var conf caddy.Config
		if err := json.Unmarshal([]byte(cfg), &conf); err != nil {
			t.Fatal(err)
		}
		err := caddy.Validate(&conf)
		if (err == nil) != c.ok || (err != nil && !strings.Contains(err.Error(), "max_buffered_bytes must be at least twice max_request_size")) {
			t.Fatalf("max_buffered_bytes %s: %v, want ok %v", c.budget, err, c.ok)
		}
	}
}

// stalledWriter is a client that reads nothing of its answer: its first
// Write blocks until released.
type stalledWriter struct {
	*httptest.ResponseRecorder
	writing, release chan struct{}
	once             sync.Once
}

func (w *stalledWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.writing); <-w.release })
	return w.ResponseRecorder.Write(p)
}

// A client that reads its answer slowly (a full receive window, a stalled
// HTTP/2 stream) does not keep its body's share of max_buffered_bytes while
// its answer is written, executed or replayed: before, a few such clients
// held the budget until Caddy's write timeout, and every other keyed
// request was refused with 503.
func TestSlowReaderGivesItsBodyBack(t *testing.T) {
	for _, replay := range []bool{false, true} {
		t.Run(fmt.Sprintf("replay=%v", replay), func(t *testing.T) {
			h := newTestHandler(t, newMemoryStore(t))
			h.bodies = &bodyBudget{max: 200 << 10} // one 80 KiB body and its last copy, not two
			body := `{"pad":"` + strings.Repeat("x", 80<<10) + `"}`
			up := answering(200, `{"answer":"`+strings.Repeat("y", 64<<10)+`"}`)
			key := storetest.NewKey(t)
			if replay {
				if r := serve(t, h, up, http.MethodPost, commitPath, key, body); r.code() != http.StatusOK {
					t.Fatalf("first = %d", r.code())
				}
			}
			slow := &stalledWriter{ResponseRecorder: httptest.NewRecorder(), writing: make(chan struct{}), release: make(chan struct{})}
			req := httptest.NewRequest(http.MethodPost, commitPath, strings.NewReader(body))
			req.Header.Set(IdempotencyKeyHeader, key)
			req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), slow, &caddyhttp.Server{})
			done := make(chan error, 1)
			go func() { done <- h.ServeHTTP(slow, req, up) }()
			<-slow.writing
			other := serve(t, h, up, http.MethodPost, commitPath, storetest.NewKey(t), body)
			close(slow.release)
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if other.code() != http.StatusOK {
				t.Fatalf("a keyed request beside a slow reader = %d %q; want it admitted and executed", other.code(), other.body)
			}
			if held := h.bodies.held.Load(); held != 0 {
				t.Fatalf("budget holds %d after every request ended", held)
			}
		})
	}
}

// Keyed requests refused for what they are, before anything is reserved,
// are counted: until the build after a95b973 a 413 or 414 left
// requests_total unchanged, and such refusals showed nowhere in the
// module's metrics.
func TestRejectedRequestsAreCounted(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.MaxRequestSize = 16
	up := answering(http.StatusOK, `{}`)
	longPath := "/v1/namespaces/ns/tables/" + strings.Repeat("t", maxBoundPath)
	for _, c := range []struct {
		name, op, path, body string
		length               int64
		status               int
	}{
		{"announced too large", "createNamespace", "/v1/namespaces", nsBody, int64(len(nsBody)), http.StatusRequestEntityTooLarge},
		{"read past max_request_size", "createNamespace", "/v1/namespaces", nsBody, -1, http.StatusRequestEntityTooLarge},
		{"path too long to bind", "updateTable", longPath, "{}", 2, http.StatusRequestURITooLong},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := value(t, decisions, "operation", c.op, "outcome", outcomeRejected)
			req := httptest.NewRequest(http.MethodPost, c.path, strings.NewReader(c.body))
			req.ContentLength = c.length
			req.Header.Set(IdempotencyKeyHeader, storetest.NewKey(t))
			if res := serveRequest(h, up, req); res.code() != c.status || up.calls.Load() != 0 {
				t.Fatalf("%d %q, %d executions; want %d and none", res.code(), res.body, up.calls.Load(), c.status)
			}
			if got := value(t, decisions, "operation", c.op, "outcome", outcomeRejected) - before; got != 1 {
				t.Fatalf("requests_total{operation=%q,outcome=rejected} rose by %v, want 1", c.op, got)
			}
		})
	}
}

// A mutation without a key that require_key refuses is counted: until the
// build after 068a81b its 400 left requests_total unchanged, so an
// operator who turned require_key on could not see which clients sent no
// key.
func TestMissingKeyIsCounted(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.RequireKey = true
	up := answering(http.StatusOK, `{}`)
	before := value(t, decisions, "operation", "createNamespace", "outcome", outcomeMissingKey)
	req := httptest.NewRequest(http.MethodPost, "/v1/namespaces", strings.NewReader(nsBody))
	if res := serveRequest(h, up, req); res.code() != http.StatusBadRequest || up.calls.Load() != 0 {
		t.Fatalf("%d %q, %d executions; want 400 and none", res.code(), res.body, up.calls.Load())
	}
	if got := value(t, decisions, "operation", "createNamespace", "outcome", outcomeMissingKey) - before; got != 1 {
		t.Fatalf("requests_total{outcome=missing_key} rose by %v, want 1", got)
	}
}

// A body refused for max_request_size is logged once per handler, naming
// the limit: plain reverse_proxy would have passed it on, and the 413
// alone, in an access log, reads as the catalog's.
func TestBodyTooLargeIsWarnedOfOnce(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.MaxRequestSize = 64
	core, logs := observer.New(zap.WarnLevel)
	h.logger = zap.New(core)
	up := answering(http.StatusOK, `{}`)
	for range 3 {
		if res := serve(t, h, up, "POST", "/v1/namespaces", storetest.NewKey(t), strings.Repeat("x", 65)); res.code() != http.StatusRequestEntityTooLarge {
			t.Fatalf("body over max_request_size = %d %s, want 413", res.code(), res.body)
		}
	}
	lines := logs.FilterMessageSnippet("exceeds max_request_size").FilterField(zap.Int64("max_request_size", 64)).All()
	if len(lines) != 1 {
		t.Fatalf("413 logged %d times naming the limit, want once; logs: %v", len(lines), logs.All())
	}
	if up.calls.Load() != 0 {
		t.Fatalf("catalog called %d times, want 0", up.calls.Load())
	}
}
