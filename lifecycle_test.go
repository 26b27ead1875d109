package icebergidempotency

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/google/uuid"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// These tests put Caddy's real reverse_proxy handler behind the handler, in
// process, in front of an httptest catalog stand-in: the faults under test
// (a connection that breaks after the catalog executed, an execution that
// outlives execution_timeout, a refused dial) are what reverse_proxy itself
// reports, so they need the real reverse_proxy; the catalog is a stand-in
// because it must count executions and break connections on purpose.

// countingCatalog is a catalog stand-in that counts the requests it
// executes and then does what answer says.
type countingCatalog struct {
	srv      *httptest.Server
	executed atomic.Int32
}

func newCountingCatalog(t *testing.T, answer func(w http.ResponseWriter, r *http.Request)) *countingCatalog {
	t.Helper()
	return startCountingCatalog(t, (*httptest.Server).Start, answer)
}

// newCountingCatalogTLS is newCountingCatalog over HTTPS (a self-signed
// certificate: see overTLS).
func newCountingCatalogTLS(t *testing.T, answer func(w http.ResponseWriter, r *http.Request)) *countingCatalog {
	t.Helper()
	return startCountingCatalog(t, (*httptest.Server).StartTLS, answer)
}

func startCountingCatalog(t *testing.T, start func(*httptest.Server), answer func(w http.ResponseWriter, r *http.Request)) *countingCatalog {
	c := &countingCatalog{}
	c.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		c.executed.Add(1)
		answer(w, r)
	}))
	start(c.srv)
	t.Cleanup(c.srv.Close)
	return c
}

func (c *countingCatalog) addr() string {
	return strings.TrimPrefix(strings.TrimPrefix(c.srv.URL, "http://"), "https://")
}

// overTLS makes reverse_proxy speak HTTPS to a catalog with a self-signed
// certificate.
func overTLS(rp *reverseproxy.Handler) {
	withTLS(reverseproxy.TLSConfig{InsecureSkipVerify: true})(rp)
}

// withTLS makes reverse_proxy speak HTTPS configured as cfg.
func withTLS(cfg reverseproxy.TLSConfig) func(*reverseproxy.Handler) {
	return func(rp *reverseproxy.Handler) {
		rp.TransportRaw = caddyconfig.JSONModuleObject(&reverseproxy.HTTPTransport{TLS: &cfg}, "protocol", "http", nil)
	}
}

// answerOK answers like a catalog that committed.
func answerOK(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"metadata-location":"s3://w/t/metadata/00001.json"}`)
}

// answerNothing commits, then drops the connection before any answer: the
// response is lost on the way back.
func answerNothing(w http.ResponseWriter, _ *http.Request) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		_ = conn.Close()
	}
}

var loadCaddyOnce sync.Once

// runningCaddyContext returns the context of a running (empty) Caddy
// config: reverse_proxy's Provision looks up other apps, which only a loaded
// config has.
func runningCaddyContext(t *testing.T) caddy.Context {
	t.Helper()
	loadCaddyOnce.Do(func() {
		if err := caddy.Load([]byte(`{"admin":{"disabled":true}}`), true); err != nil {
			t.Fatalf("loading an empty Caddy config: %v", err)
		}
	})
	ctx, cancel := caddy.NewContext(caddy.ActiveContext())
	t.Cleanup(cancel)
	return ctx
}

// newReverseProxy provisions Caddy's reverse_proxy handler for one upstream.
func newReverseProxy(t *testing.T, upstream string, configure ...func(*reverseproxy.Handler)) caddyhttp.Handler {
	t.Helper()
	ctx := runningCaddyContext(t)
	rp := &reverseproxy.Handler{Upstreams: reverseproxy.UpstreamPool{{Dial: upstream}}}
	for _, c := range configure {
		c(rp)
	}
	if err := rp.Provision(ctx); err != nil {
		t.Fatalf("provisioning reverse_proxy: %v", err)
	}
	t.Cleanup(func() { _ = rp.Cleanup() })
	end := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		return rp.ServeHTTP(w, r, end)
	})
}

// deadAddr is an address that refuses connections.
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// result is what one request through the handler produced: the response
// written, or the error returned for Caddy to answer with.
type result struct {
	status int
	header http.Header
	body   string
	err    error
}

// code is the status the client sees: Caddy answers a returned handler
// error with its status.
func (r result) code() int {
	var herr caddyhttp.HandlerError
	if errors.As(r.err, &herr) {
		return herr.StatusCode
	}
	if r.err != nil {
		return http.StatusInternalServerError
	}
	return r.status
}

func (r result) errorType() string {
	var body icebergError
	_ = json.Unmarshal([]byte(r.body), &body)
	return body.Error.Type
}

// serve sends one request through h the way Caddy's server does.
func serve(t *testing.T, h *Handler, next caddyhttp.Handler, method, target, key, body string, headers ...string) result {
	t.Helper()
	req := httptest.NewRequest(method, target, strings.NewReader(body))
	if key != "" {
		req.Header.Set(IdempotencyKeyHeader, key)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	rec := httptest.NewRecorder()
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
	err := h.ServeHTTP(rec, req, next)
	return result{status: rec.Code, header: rec.Header(), body: rec.Body.String(), err: err}
}

const commitPath = "/v1/wh/namespaces/ns/tables/t"
const commitBody = `{"requirements":[],"updates":[]}`

// A commit whose answer is lost after the catalog executed it is "outcome
// unknown": the first client gets Caddy's 502, and a retry with the key gets
// 500 CommitStateUnknownException at once, without executing again. Before,
// the key was released on any reverse_proxy error, the retry executed the
// commit a second time and the client heard 409 CommitFailed for a commit
// that was in the table.
func TestResponseLostAfterCommitIsUnknown(t *testing.T) {
	catalog := newCountingCatalog(t, answerNothing)
	h := newTestHandler(t, newMemoryStore(t))
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)

	first := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if first.code() != http.StatusBadGateway || first.errorType() != typeCommitStateUnknown {
		t.Fatalf("first answer = %d %q %v, want 502 %s", first.code(), first.body, first.err, typeCommitStateUnknown)
	}
	for range 3 {
		retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
		if retry.code() != http.StatusInternalServerError || retry.errorType() != typeCommitStateUnknown {
			t.Fatalf("retry = %d %s %v, want 500 %s", retry.code(), retry.body, retry.err, typeCommitStateUnknown)
		}
	}
	if n := catalog.executed.Load(); n != 1 {
		t.Fatalf("catalog executed the commit %d times, want 1", n)
	}
}

// With `abandoned reexecute`, the operator's choice, the retry executes.
func TestResponseLostAfterCommitReexecutes(t *testing.T) {
	catalog := newCountingCatalog(t, answerNothing)
	h := newTestHandler(t, newMemoryStore(t))
	h.Abandoned = abandonedReexecute
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	serve(t, h, proxy, "POST", commitPath, key, commitBody)
	ok := newReverseProxy(t, newCountingCatalog(t, answerOK).addr())
	if retry := serve(t, h, ok, "POST", commitPath, key, commitBody); retry.code() != http.StatusOK {
		t.Fatalf("retry under reexecute = %d %v, want 200", retry.code(), retry.err)
	}
}

// execution_timeout firing while the catalog is still committing is
// "outcome unknown" too: 504 first, then 500 unknown at once. The retry does
// not wait out the 30 s lease.
func TestExecutionTimeoutIsUnknown(t *testing.T) {
	release := make(chan struct{})
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		<-release // still committing when the proxy gives up
		answerOK(w, r)
	})
	t.Cleanup(func() { close(release) })
	h := newTestHandler(t, newMemoryStore(t))
	h.ExecutionTimeout = caddy.Duration(200 * time.Millisecond)
	h.InFlightWait = caddy.Duration(5 * time.Second)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)

	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusGatewayTimeout || first.errorType() != typeCommitStateUnknown {
		t.Fatalf("first answer = %d %q %v, want 504 %s", first.code(), first.body, first.err, typeCommitStateUnknown)
	}
	retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if retry.code() != http.StatusInternalServerError || retry.errorType() != typeCommitStateUnknown {
		t.Fatalf("retry = %d %s %v, want 500 %s", retry.code(), retry.body, retry.err, typeCommitStateUnknown)
	}
	if n := catalog.executed.Load(); n != 1 {
		t.Fatalf("catalog executed %d times, want 1", n)
	}
}

// Nothing reached the catalog when reverse_proxy could not dial it: the key
// is released and the retry executes.
func TestDialFailureReleases(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	key := storetest.NewKey(t)
	first := serve(t, h, newReverseProxy(t, deadAddr(t)), "POST", commitPath, key, commitBody)
	if first.code() != http.StatusBadGateway || first.errorType() != typeServiceFailure {
		t.Fatalf("first answer = %d %q %v, want 502 %s", first.code(), first.body, first.err, typeServiceFailure)
	}
	catalog := newCountingCatalog(t, answerOK)
	retry := serve(t, h, newReverseProxy(t, catalog.addr()), "POST", commitPath, key, commitBody)
	if retry.code() != http.StatusOK || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %v, executed %d; want 200, executed once", retry.code(), retry.err, catalog.executed.Load())
	}
}

// An error from a handler that ran before any upstream was chosen (here one
// that rejects the request itself) proves nothing was sent: released.
func TestErrorBeforeProxyingReleases(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	key := storetest.NewKey(t)
	reject := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		return caddyhttp.Error(http.StatusForbidden, errors.New("denied by a handler before reverse_proxy"))
	})
	if first := serve(t, h, reject, "POST", commitPath, key, commitBody); first.code() != http.StatusForbidden {
		t.Fatalf("first answer = %d, want 403", first.code())
	}
	catalog := newCountingCatalog(t, answerOK)
	if retry := serve(t, h, newReverseProxy(t, catalog.addr()), "POST", commitPath, key, commitBody); retry.code() != http.StatusOK {
		t.Fatalf("retry = %d %v, want 200", retry.code(), retry.err)
	}
}

// A chain that writes nothing (no reverse_proxy after the directive) is not
// a final response: the client gets a 502 ErrorModel and the key is
// released, so that once the config is fixed the retry executes. Before, an
// empty 200 was stored and replayed, telling the client that a namespace
// exists that was never created.
func TestNoResponseIsNotFinal(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	key := storetest.NewKey(t)
	nothing := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	first := serve(t, h, nothing, "POST", "/v1/namespaces", key, `{"namespace":["a"]}`)
	if first.code() != http.StatusBadGateway || first.errorType() != typeServiceFailure {
		t.Fatalf("first answer = %d %q, want 502 %s", first.code(), first.body, typeServiceFailure)
	}
	catalog := newCountingCatalog(t, answerOK)
	retry := serve(t, h, newReverseProxy(t, catalog.addr()), "POST", "/v1/namespaces", key, `{"namespace":["a"]}`)
	if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "" || catalog.executed.Load() != 1 {
		t.Fatalf("retry after the fix = %d replayed=%q executed=%d; want a fresh 200", retry.code(),
			retry.header.Get(ReplayedHeader), catalog.executed.Load())
	}
}

// A handle_response route that writes nothing lets reverse_proxy return
// with nothing written after the catalog answered: the catalog may have
// executed, so the key is unknown, not released. Before, it was released
// as if no reverse_proxy followed, the client was told to retry with the
// same key, and the retry executed the commit a second time.
func TestNothingWrittenAfterTheCatalogAnsweredIsUnknown(t *testing.T) {
	catalog := newCountingCatalog(t, answerOK)
	h := newTestHandler(t, newMemoryStore(t))
	writesNothing := func(rp *reverseproxy.Handler) {
		rp.HandleResponse = []caddyhttp.ResponseHandler{{Match: &caddyhttp.ResponseMatcher{StatusCode: []int{2}}}}
	}
	proxy := newReverseProxy(t, catalog.addr(), writesNothing)
	key := storetest.NewKey(t)
	first := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if first.code() != http.StatusBadGateway || first.errorType() != typeCommitStateUnknown {
		t.Fatalf("first answer = %d %q, want 502 %s", first.code(), first.body, typeCommitStateUnknown)
	}
	retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if n := catalog.executed.Load(); n != 1 || retry.errorType() != typeCommitStateUnknown {
		t.Fatalf("catalog executed %d times, retry %d %q; want once, and the retry told the outcome is unknown", n, retry.code(), retry.body)
	}
}

// flakyStore injects store failures that a real database produces only
// under rare timing.
type flakyStore struct {
	stores.Store
	reserveLostReplies atomic.Int32 // Reserve commits, then reports an error
	finalizeFailures   atomic.Int32 // Finalize fails before writing
	finalizeLostReply  atomic.Int32 // Finalize writes, then reports an error
	finalizeTooLarge   bool
}

var errInjected = errors.New("injected: connection reset by peer")

func (s *flakyStore) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	res, err := s.Store.Reserve(ctx, r)
	if err == nil && s.reserveLostReplies.Add(-1) >= 0 {
		return stores.ReserveResult{}, errInjected
	}
	return res, err
}

func (s *flakyStore) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	if s.finalizeTooLarge {
		return stores.ErrResponseTooLarge
	}
	if s.finalizeFailures.Add(-1) >= 0 {
		return errInjected
	}
	err := s.Store.Finalize(ctx, key, owner, resp)
	if err == nil && s.finalizeLostReply.Add(-1) >= 0 {
		return errInjected
	}
	return err
}

// A Reserve that committed but whose reply was lost leaves no stranded
// record: the client hears 503 "retry with the same key", and the retry
// executes. Before, the retry found the record in flight, unrenewed, and
// heard 503 and then "outcome unknown" for a request never sent.
func TestLostReserveReplyIsReleased(t *testing.T) {
	s := &flakyStore{Store: newMemoryStore(t)}
	s.reserveLostReplies.Store(1)
	h := newTestHandler(t, s)
	h.InFlightWait = caddy.Duration(5 * time.Second)
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusServiceUnavailable {
		t.Fatalf("first answer = %d %s, want 503", first.code(), first.body)
	}
	retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if retry.code() != http.StatusOK || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %s, executed %d; want 200, executed once", retry.code(), retry.body, catalog.executed.Load())
	}
}

// A Finalize that fails (the store is briefly away) is tried again in the
// background with the lease renewed: the client gets its answer at once, and
// a retry waits for the record and replays it. Before, three quick tries
// over 0.3 s left the key "unknown" when the store was away a little longer.
func TestFinalizeRetriedThroughOutage(t *testing.T) {
	finalizeThroughOutage(t, 6, 0)
}

// While Finalize is retried in the background, the lease is renewed: with a
// lease far shorter than the retries take, a duplicate still waits for the
// record and replays it instead of finding it abandoned ("unknown"). The
// lease leaves room for a loaded machine's scheduling delays (60ms failed
// a CI run under -race with the other core busy).
func TestFinalizeRetriesKeepTheLease(t *testing.T) {
	finalizeThroughOutage(t, 4, 400*time.Millisecond) // retried after 0.1, 0.2, 0.4 and 0.8 s: 1.5 s in all
}

// finalizeThroughOutage commits through a store whose Finalize fails
// failures times (lease 0: the default) and checks that the client got its
// answer and that a retry replays it, executed once.
func finalizeThroughOutage(t *testing.T, failures int32, lease time.Duration) {
	t.Helper()
	s := &flakyStore{Store: newMemoryStore(t)}
	s.finalizeFailures.Store(failures)
	h := newTestHandler(t, s)
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	if lease > 0 {
		h.Lease = caddy.Duration(lease)
	}
	h.InFlightWait = caddy.Duration(30 * time.Second)
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusOK {
		t.Fatalf("first answer = %d, want 200", first.code())
	}
	retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "true" || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %s replayed=%q executed=%d; want the stored 200", retry.code(), retry.body, retry.header.Get(ReplayedHeader), catalog.executed.Load())
	}
	// One warning for the request, not one a try (until the build after
	// 408cb36, one for each of the failures).
	if n := logs.FilterMessage("finalize failed: will retry").Len(); n != 1 {
		t.Errorf("%d Finalize failures logged %d warnings, want 1", failures, n)
	}
}

// A Finalize that committed but whose reply was lost is recognised when the
// retried Finalize finds the record final: the response is stored, and a
// retry replays it.
func TestFinalizeLostReply(t *testing.T) {
	s := &flakyStore{Store: newMemoryStore(t)}
	s.finalizeLostReply.Store(1)
	h := newTestHandler(t, s)
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	serve(t, h, proxy, "POST", commitPath, key, commitBody)
	retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "true" || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d replayed=%q executed=%d; want the stored 200", retry.code(), retry.header.Get(ReplayedHeader), catalog.executed.Load())
	}
}

// A Finalize that keeps failing for the finalize window leaves the key
// "unknown": the catalog did execute.
func TestFinalizeFailureIsUnknown(t *testing.T) {
	s := &flakyStore{Store: newMemoryStore(t)}
	s.finalizeFailures.Store(1 << 30)
	h := newTestHandler(t, s)
	h.finalizeWindow = 300 * time.Millisecond
	h.InFlightWait = caddy.Duration(10 * time.Second)
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusOK {
		t.Fatalf("first answer = %d, want the catalog's 200 delivered", first.code())
	}
	retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if retry.code() != http.StatusInternalServerError || retry.errorType() != typeCommitStateUnknown || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %s executed=%d; want 500 unknown, executed once", retry.code(), retry.body, catalog.executed.Load())
	}
}

// A response the store cannot hold (MySQL's max_allowed_packet) is handled
// like one over max_response_size: delivered, not stored, outcome unknown.
func TestResponseTooLargeForStoreIsUnknown(t *testing.T) {
	s := &flakyStore{Store: newMemoryStore(t), finalizeTooLarge: true}
	h := newTestHandler(t, s)
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusOK {
		t.Fatalf("first answer = %d, want 200", first.code())
	}
	if rec, _ := s.Load(context.Background(), key); rec == nil || rec.State != stores.StateInFlight || !rec.Abandoned {
		t.Fatalf("record after a too-large response = %+v, want it abandoned (outcome unknown)", rec)
	}
	retry := serve(t, h, proxy, "POST", commitPath, key, commitBody)
	if retry.code() != http.StatusInternalServerError || retry.errorType() != typeCommitStateUnknown || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %s executed=%d; want 500 unknown, executed once", retry.code(), retry.body, catalog.executed.Load())
	}
}

func newMemoryStore(t testing.TB) *memory.Store {
	t.Helper()
	s, err := memory.New(memory.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// grace 0 is a valid choice (records live exactly the lifetime); before, it
// was rejected as not positive.
func TestGraceZero(t *testing.T) {
	h := new(Handler)
	d := caddyfile.NewTestDispenser("iceberg_idempotency {\n\tlifetime 10m\n\tgrace 0\n}")
	if err := h.UnmarshalCaddyfile(d); err != nil {
		t.Fatalf("grace 0: %v", err)
	}
	s := newMemoryStore(t)
	h.store = s
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	if err := h.Validate(); err != nil {
		t.Fatal(err)
	}
	key := storetest.NewKey(t)
	catalog := newCountingCatalog(t, answerOK)
	if res := serve(t, h, newReverseProxy(t, catalog.addr()), "POST", commitPath, key, commitBody); res.code() != http.StatusOK {
		t.Fatalf("commit = %d %v", res.code(), res.err)
	}
	rec, err := s.Load(context.Background(), key)
	if err != nil || rec == nil {
		t.Fatalf("Load = %v, %v", rec, err)
	}
	// Counted from when the execution could end at the latest (this
	// handler renews leases as on a shared store).
	if life := rec.ExpiresAt.Sub(rec.CreatedAt); life <= DefaultExecutionTimeout+10*time.Minute-time.Second || life > DefaultExecutionTimeout+10*time.Minute {
		t.Fatalf("record lives %v, want exactly the 10m lifetime past the execution_timeout", life)
	}
}

// A lifetime shorter than the execution: the record must outlive it while
// its owner still runs. Before, the memory store's record (whose lease,
// execution_timeout + lease, is never renewed) expired at lifetime + grace,
// the retry reserved the key as absent and the catalog executed twice. The
// stand-in upstream stalls on purpose, which a real catalog cannot be made
// to do on cue.
func TestShortLifetimeRecordOutlivesTheExecution(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.inProcessLeases = true // as Provision sets it for the memory store
	h.Lifetime = caddy.Duration(200 * time.Millisecond)
	zero := caddy.Duration(0)
	h.Grace = &zero
	up := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		_, _ = io.ReadAll(r.Body)
		time.Sleep(600 * time.Millisecond) // a slow commit, well within execution_timeout
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{"ok":true}`)
		return nil
	}}
	key := storetest.NewKey(t)
	first := make(chan result, 1)
	go func() { first <- serve(t, h, up, "POST", "/v1/namespaces", key, nsBody) }()
	time.Sleep(300 * time.Millisecond) // past lifetime + grace, while the first still executes
	retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
	if res := <-first; res.code() != http.StatusOK {
		t.Fatalf("first request = %d %v", res.code(), res.err)
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("the catalog executed one key's mutation %d times", n)
	}
	if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "true" {
		t.Fatalf("retry = %d, replayed %q; want the first answer replayed", retry.code(), retry.header.Get(ReplayedHeader))
	}
}

// Owner tokens tell two requests' holds on a key apart, across nodes: each
// must be a fresh random UUID, never a repeat.
func TestOwnerTokensAreRandomUUIDs(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		tok := newOwnerToken()
		u, err := uuid.Parse(tok)
		if err != nil || u.Version() != 4 || u.Variant() != uuid.RFC4122 || u.String() != tok {
			t.Fatalf("owner token %q: not a canonical version 4 UUID (err %v)", tok, err)
		}
		if seen[tok] {
			t.Fatalf("owner token %q repeated", tok)
		}
		seen[tok] = true
	}
}
