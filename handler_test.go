package icebergidempotency

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// The handler's behaviour, row by row of the README's "What it does" and
// "Finalize or release" tables, through ServeHTTP with the memory store and
// a counting caddyhttp.HandlerFunc in place of reverse_proxy (the pattern of
// Caddy's reverseproxy/retries_test.go). Faults that need the real
// reverse_proxy are in lifecycle_test.go.

// upstream is a stand-in for reverse_proxy and the catalog behind it: it
// counts the requests it executes and answers as told.
type upstream struct {
	calls  atomic.Int32
	answer func(w http.ResponseWriter, r *http.Request) error
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	u.calls.Add(1)
	return u.answer(w, r)
}

func answering(status int, body string, headers ...string) *upstream {
	return &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		_, _ = io.ReadAll(r.Body)
		for i := 0; i+1 < len(headers); i += 2 {
			w.Header().Set(headers[i], headers[i+1])
		}
		w.WriteHeader(status)
		_, _ = io.WriteString(w, body)
		return nil
	}}
}

// newClockedHandler is a handler on a memory store whose clock the test
// moves.
func newClockedHandler(t *testing.T) (*Handler, *storetest.FakeClock) {
	t.Helper()
	clock := storetest.NewFakeClock()
	s, err := memory.New(memory.Options{Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	return newTestHandler(t, s), clock
}

const nsBody = `{"namespace":["a"]}`

// "Finalize or release": which catalog answers are stored and replayed, and
// which release the key so that a retry executes again.
func TestFinalizeOrRelease(t *testing.T) {
	for _, tt := range []struct {
		status int
		stored bool
	}{
		{200, true}, {201, true}, {204, true},
		{400, true}, {404, true}, {409, true}, {422, true},
		{500, false}, {502, false}, {503, false}, {504, false},
		{401, false}, {403, false}, {408, false}, {419, false}, {421, false}, {425, false}, {429, false}, {499, false},
		{302, false}, // in neither list
	} {
		t.Run(fmt.Sprint(tt.status), func(t *testing.T) {
			h := newTestHandler(t, newMemoryStore(t))
			up := answering(tt.status, `{"status":`+fmt.Sprint(tt.status)+`}`, "Content-Type", "application/json")
			key := storetest.NewKey(t)
			first := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
			if first.code() != tt.status {
				t.Fatalf("first answer %d, want the catalog's %d", first.code(), tt.status)
			}
			retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
			replayed := retry.header.Get(ReplayedHeader) == "true"
			wantCalls := int32(2)
			if tt.stored {
				wantCalls = 1
			}
			if replayed != tt.stored || up.calls.Load() != wantCalls || retry.code() != tt.status {
				t.Fatalf("retry: %d replayed=%v, catalog called %d times; want %d replayed=%v, %d calls",
					retry.code(), replayed, up.calls.Load(), tt.status, tt.stored, wantCalls)
			}
			if tt.stored && retry.body != first.body {
				t.Fatalf("replayed body %q, want %q", retry.body, first.body)
			}
		})
	}
}

// A final answer larger than max_response_size is delivered untouched and
// not stored. The catalog executed: the key's outcome is unknown, and a
// retry (or a duplicate that waited) hears so instead of executing again
// (before, the key was released, and a retried commit ran twice and heard
// 409). An oversize answer that is not final (a 5xx) is released as any.
func TestOversizeResponseDeliveredNotStored(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.MaxResponseSize = 10
	big := strings.Repeat("x", 100)
	up := answering(200, big)
	key := storetest.NewKey(t)
	if first := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); first.body != big {
		t.Fatalf("oversize answer %d bytes, want %d delivered untouched", len(first.body), len(big))
	}
	retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
	if retry.code() != http.StatusInternalServerError || retry.errorType() != typeCommitStateUnknown || up.calls.Load() != 1 {
		t.Fatalf("retry after an oversize answer: %d %q calls=%d, want 500 %s, executed once", retry.code(), retry.body, up.calls.Load(), typeCommitStateUnknown)
	}

	failing := answering(503, big)
	key = storetest.NewKey(t)
	serve(t, h, failing, "POST", "/v1/namespaces", key, nsBody)
	if again := serve(t, h, failing, "POST", "/v1/namespaces", key, nsBody); again.code() != 503 || failing.calls.Load() != 2 {
		t.Fatalf("retry after an oversize 503: %d calls=%d, want executed again", again.code(), failing.calls.Load())
	}
}

// Replays carry the stored status and body, the allow-listed headers and
// Idempotent-Replayed, and nothing else.
func TestReplayHeaders(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	up := answering(201, `{"ok":true}`, "Content-Type", "application/json", "ETag", `"v1"`, "X-Secret", "no")
	key := storetest.NewKey(t)
	serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
	retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
	if retry.code() != 201 || retry.header.Get("ETag") != `"v1"` || retry.header.Get("Content-Type") != "application/json" ||
		retry.header.Get("X-Secret") != "" || retry.header.Get(ReplayedHeader) != "true" || retry.header.Get("Content-Length") != "11" {
		t.Fatalf("replay = %d %v", retry.code(), retry.header)
	}
}

// "Which requests" and "Key": what passes through, what is guarded, what is
// refused.
func TestAdmission(t *testing.T) {
	key := storetest.NewKey(t)
	for _, tt := range []struct {
		name         string
		requireKey   bool
		method, path string
		keys         []string
		body         string
		wantStatus   int
		wantType     string
		wantCalls    int32
	}{
		{"read passes", false, "GET", "/v1/namespaces", []string{key}, "", 200, "", 1},
		{"reportMetrics passes", false, "POST", "/v1/namespaces/ns/tables/t/metrics", []string{key}, "{}", 200, "", 1},
		{"no key passes", false, "POST", "/v1/namespaces", nil, nsBody, 200, "", 1},
		{"require_key", true, "POST", "/v1/namespaces", nil, nsBody, 400, typeBadRequest, 0},
		{"require_key ignores reads", true, "GET", "/v1/namespaces", nil, "", 200, "", 1},
		{"v4 key", false, "POST", "/v1/namespaces", []string{"9f1b3c2e-4a5d-4e6f-8a7b-1c2d3e4f5a6b"}, nsBody, 400, typeBadRequest, 0},
		{"short key", false, "POST", "/v1/namespaces", []string{"017f22e2-79b0"}, nsBody, 400, typeBadRequest, 0},
		{"two keys", false, "POST", "/v1/namespaces", []string{key, storetest.NewKey(t)}, nsBody, 400, typeBadRequest, 0},
		{"same key twice", false, "POST", "/v1/namespaces", []string{key, key}, nsBody, 200, "", 1},
		{"body too large", false, "POST", "/v1/namespaces", []string{storetest.NewKey(t)}, strings.Repeat("x", 65), 413, typeTooLarge, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newTestHandler(t, newMemoryStore(t))
			h.RequireKey = tt.requireKey
			h.MaxRequestSize = 64
			up := answering(200, "{}")
			req := newRequest(tt.method, tt.path, tt.body)
			for _, k := range tt.keys {
				req.Header.Add(IdempotencyKeyHeader, k)
			}
			res := serveRequest(h, up, req)
			if res.code() != tt.wantStatus || res.errorType() != tt.wantType || up.calls.Load() != tt.wantCalls {
				t.Fatalf("%s %s = %d %s, catalog called %d; want %d %s, %d", tt.method, tt.path, res.code(), res.body,
					up.calls.Load(), tt.wantStatus, tt.wantType, tt.wantCalls)
			}
		})
	}
}

// A key in another letter case is the same key.
func TestKeyCaseInsensitive(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	up := answering(200, "{}")
	key := storetest.NewKey(t)
	serve(t, h, up, "POST", "/v1/namespaces", strings.ToUpper(key), nsBody)
	if retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); retry.header.Get(ReplayedHeader) != "true" {
		t.Fatal("the lower-case key did not replay the upper-case key's answer")
	}
}

// A key with whitespace around it is that key, over every protocol: Go's
// HTTP/1 server takes the spaces and tabs around a field value off (RFC
// 9110, 5.5: they are no part of it), its HTTP/2 and quic-go's HTTP/3
// server leave them on. Over HTTP/2 " <key> " got 400, where plain
// reverse_proxy executes it, and where the same header over HTTP/1 was
// guarded: a retry that came over the other protocol was refused (400, a
// failed commit to the client) instead of replayed.
func TestKeyWithSurroundingWhitespace(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	up := answering(200, "{}")
	key := storetest.NewKey(t)
	if first := serve(t, h, up, "POST", "/v1/namespaces", " "+key+"\t", nsBody); first.code() != 200 || up.calls.Load() != 1 {
		t.Fatalf("key with whitespace around it: %d %s, catalog called %d times; want 200, executed once", first.code(), first.body, up.calls.Load())
	}
	for _, spelling := range []string{key, "\t" + strings.ToUpper(key) + " "} {
		retry := serve(t, h, up, "POST", "/v1/namespaces", spelling, nsBody)
		if retry.code() != 200 || retry.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
			t.Fatalf("retry with %q: %d %s replayed=%q, catalog called %d times; want the replay, executed once",
				spelling, retry.code(), retry.body, retry.header.Get(ReplayedHeader), up.calls.Load())
		}
	}

	// Two fields that differ only in the whitespace around them carry one key.
	other := storetest.NewKey(t)
	req := httptest.NewRequest("POST", "/v1/namespaces", strings.NewReader(nsBody))
	req.Header[IdempotencyKeyHeader] = []string{other, " " + other}
	rec := httptest.NewRecorder()
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
	if err := h.ServeHTTP(rec, req, up); err != nil || rec.Code != 200 || up.calls.Load() != 2 {
		t.Fatalf("two fields of one key, one with a space before it: %d %s %v, catalog called %d times; want 200, executed",
			rec.Code, rec.Body.String(), err, up.calls.Load())
	}
}

// "Binding": a key reused for another body, path, operation or principal
// is refused with 422, and never executes or replays.
func TestBindingMismatch(t *testing.T) {
	for _, tt := range []struct {
		name, method, path, body, auth, want string
	}{
		{"other body", "POST", "/v1/namespaces", `{"namespace":["b"]}`, "", "different request body"},
		{"other path", "POST", "/v1/wh/namespaces", nsBody, "", "path"},
		{"other operation", "POST", "/v1/namespaces/a/tables", nsBody, "", "operation"},
		{"other principal", "POST", "/v1/namespaces", nsBody, "Bearer other", "another principal"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newTestHandler(t, newMemoryStore(t))
			up := answering(200, "{}")
			key := storetest.NewKey(t)
			serve(t, h, up, "POST", "/v1/namespaces", key, nsBody, "Authorization", "Bearer me")
			auth := "Bearer me"
			if tt.auth != "" {
				auth = tt.auth
			}
			res := serve(t, h, up, tt.method, tt.path, key, tt.body, "Authorization", auth)
			if res.code() != 422 || !strings.Contains(res.body, tt.want) || up.calls.Load() != 1 || res.header.Get(ReplayedHeader) != "" {
				t.Fatalf("reuse = %d %s (calls %d), want 422 naming %q", res.code(), res.body, up.calls.Load(), tt.want)
			}
		})
	}
}

// holdingUpstream answers only when released, so that duplicates arrive
// while the first request is in flight.
func holdingUpstream() (*upstream, chan struct{}, chan struct{}) {
	arrived, release := make(chan struct{}, 16), make(chan struct{})
	return &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		arrived <- struct{}{}
		<-release
		w.WriteHeader(200)
		_, _ = io.WriteString(w, `{"done":true}`)
		return nil
	}}, arrived, release
}

// "In-flight duplicates": a duplicate waits for the first request and gets
// its answer; past in_flight_wait it gets 503 + Retry-After, or 409.
func TestInFlightDuplicates(t *testing.T) {
	t.Run("waits and replays", func(t *testing.T) {
		h := newTestHandler(t, newMemoryStore(t))
		up, arrived, release := holdingUpstream()
		key := storetest.NewKey(t)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); serve(t, h, up, "POST", "/v1/namespaces", key, nsBody) }()
		<-arrived
		dup := make(chan result, 1)
		go func() { dup <- serve(t, h, up, "POST", "/v1/namespaces", key, nsBody) }()
		time.Sleep(20 * time.Millisecond)
		close(release)
		wg.Wait()
		if res := <-dup; res.code() != 200 || res.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
			t.Fatalf("duplicate = %d replayed=%q, calls %d; want the first request's answer", res.code(), res.header.Get(ReplayedHeader), up.calls.Load())
		}
	})
	for _, status := range []int{503, 409} {
		t.Run(fmt.Sprintf("still running: %d", status), func(t *testing.T) {
			h := newTestHandler(t, newMemoryStore(t))
			h.InFlightWait = caddy.Duration(30 * time.Millisecond)
			h.InFlightStatus = status
			up, arrived, release := holdingUpstream()
			defer close(release)
			key := storetest.NewKey(t)
			go serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
			<-arrived
			res := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
			wantRetryAfter := map[int]string{503: "1", 409: ""}[status]
			if res.code() != status || res.header.Get("Retry-After") != wantRetryAfter || up.calls.Load() != 1 {
				t.Fatalf("duplicate = %d Retry-After %q, calls %d; want %d %q", res.code(), res.header.Get("Retry-After"), up.calls.Load(), status, wantRetryAfter)
			}
		})
	}
}

// A duplicate whose client leaves while it waits for the request that
// holds the key ends with the connection broken off, nothing written:
// returning without an answer let Go's HTTP/1 server send an empty 200 to a
// client that had only half-closed its connection, for a commit still
// running (or failing) under the first request.
func TestWaitingClientLeavingGetsNoAnswer(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	up, arrived, release := holdingUpstream()
	key := storetest.NewKey(t)
	first := make(chan result, 1)
	go func() { first <- serve(t, h, up, "POST", "/v1/namespaces", key, nsBody) }()
	<-arrived
	ctx, cancel := context.WithCancel(context.Background())
	req := newRequest("POST", "/v1/namespaces", nsBody).WithContext(ctx)
	req.Header.Set(IdempotencyKeyHeader, key)
	rec := httptest.NewRecorder()
	ended := make(chan any, 1)
	go func() {
		defer func() { ended <- recover() }()
		req := caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
		_ = h.ServeHTTP(rec, req, up)
	}()
	time.Sleep(20 * time.Millisecond) // waiting for the first
	cancel()
	if v := <-ended; v != http.ErrAbortHandler || rec.Flushed || rec.Body.Len() > 0 || len(rec.Header()) > 0 {
		t.Fatalf("a waiting duplicate whose client left ended with %v, headers %v, body %q; want it broken off with nothing written",
			v, rec.Header(), rec.Body.String())
	}
	close(release)
	if res := <-first; res.code() != 200 || up.calls.Load() != 1 {
		t.Fatalf("first = %d, calls %d", res.code(), up.calls.Load())
	}
}

// "Client disconnects": once the key is reserved, a client that goes away
// does not cancel the catalog call; its result is stored for the retry.
func TestClientDisconnectDoesNotCancel(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	sawCancel := make(chan bool, 1)
	up := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		time.Sleep(50 * time.Millisecond)
		sawCancel <- r.Context().Err() != nil
		w.WriteHeader(200)
		_, _ = io.WriteString(w, "{}")
		return nil
	}}
	key := storetest.NewKey(t)
	ctx, cancel := context.WithCancel(context.Background())
	req := newRequest("POST", "/v1/namespaces", nsBody).WithContext(ctx)
	req.Header.Set(IdempotencyKeyHeader, key)
	time.AfterFunc(10*time.Millisecond, cancel)
	serveRequest(h, up, req)
	if <-sawCancel {
		t.Fatal("the catalog call was cancelled with the client")
	}
	if retry := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); retry.header.Get(ReplayedHeader) != "true" {
		t.Fatalf("retry after the disconnect = %d, want the stored answer", retry.code())
	}
}

// "Expiry": a record lives lifetime + grace past the latest moment its
// execution could run (execution_timeout after it started; this handler
// renews leases as on a shared store), then the key executes afresh.
func TestExpiry(t *testing.T) {
	h, clock := newClockedHandler(t)
	up := answering(200, "{}")
	key := storetest.NewKey(t)
	serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
	clock.Advance(DefaultExecutionTimeout + DefaultLifetime + DefaultGrace - time.Second)
	if res := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); res.header.Get(ReplayedHeader) != "true" {
		t.Fatal("record gone before lifetime + grace")
	}
	clock.Advance(2 * time.Second)
	if res := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); res.header.Get(ReplayedHeader) != "" || up.calls.Load() != 2 {
		t.Fatalf("after lifetime + grace: replayed=%q calls=%d, want executed afresh", res.header.Get(ReplayedHeader), up.calls.Load())
	}
}

// "Abandoned requests": an owner whose lease lapsed (its node died) leaves
// the key abandoned; duplicates get 500 unknown, or execute under
// reexecute.
func TestAbandonedPolicies(t *testing.T) {
	for _, policy := range []string{abandonedUnknown, abandonedReexecute} {
		t.Run(policy, func(t *testing.T) {
			h, clock := newClockedHandler(t)
			h.Abandoned = policy
			key := storetest.NewKey(t)
			reserveAsDeadNode(t, h.store, clock, key)
			up := answering(200, "{}")
			res := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
			switch policy {
			case abandonedUnknown:
				if res.code() != 500 || res.errorType() != typeCommitStateUnknown || up.calls.Load() != 0 {
					t.Fatalf("unknown: %d %s calls %d", res.code(), res.body, up.calls.Load())
				}
			case abandonedReexecute:
				if res.code() != 200 || up.calls.Load() != 1 {
					t.Fatalf("reexecute: %d calls %d", res.code(), up.calls.Load())
				}
				if again := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); again.header.Get(ReplayedHeader) != "true" {
					t.Fatal("the re-executed answer was not stored")
				}
			}
		})
	}
}

// reserveAsDeadNode leaves key reserved for createNamespace of nsBody by an
// owner that never renews its lease, and moves clock past the lease: the
// record of a node that died mid-request.
func reserveAsDeadNode(t *testing.T, s stores.Store, clock *storetest.FakeClock, key string) {
	t.Helper()
	if _, err := s.Reserve(context.Background(), stores.Reservation{
		Key: key, Owner: "dead-node", Lease: time.Second, TTL: time.Hour,
		Binding: stores.Binding{Operation: "createNamespace", Path: "/v1/namespaces", Principal: sha256Hex(nil),
			Fingerprint: requestFingerprint("POST", "/v1/namespaces", "", []byte(nsBody))},
	}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(2 * time.Second)
}

// failingStore fails every call, like an unreachable database.
type failingStore struct{ stores.Store }

func (failingStore) Reserve(context.Context, stores.Reservation) (stores.ReserveResult, error) {
	return stores.ReserveResult{}, errors.New("store down")
}

func (failingStore) Release(context.Context, string, string) error { return errors.New("store down") }

func (failingStore) Load(context.Context, string) (*stores.Record, error) {
	return nil, errors.New("store down")
}

// "Store failures" fail closed with 503 + Retry-After, or pass through
// unguarded with fail_open.
func TestStoreFailure(t *testing.T) {
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprint("fail_open=", failOpen), func(t *testing.T) {
			h := newTestHandler(t, failingStore{})
			h.FailOpen = failOpen
			core, logs := observer.New(zap.ErrorLevel)
			h.logger = zap.New(core)
			h.storeLabel = "postgres/iceberg_idempotency_records/3f9c0d1e2a4b5c6d"
			up := answering(200, "{}")
			res := serve(t, h, up, "POST", "/v1/namespaces", storetest.NewKey(t), nsBody)
			// The line names the store: with a handler per store, the
			// error text alone did not always tell which one failed
			// (until the build after a95b973).
			if lines := logs.FilterMessageSnippet("store failed:").FilterField(zap.String("store", h.storeLabel)).All(); len(lines) != 1 {
				t.Errorf("store failure logged %d times naming the store, want once; logs: %v", len(lines), logs.All())
			}
			if failOpen {
				if res.code() != 200 || up.calls.Load() != 1 {
					t.Fatalf("fail_open: %d, calls %d; want passed through", res.code(), up.calls.Load())
				}
				return
			}
			if res.code() != 503 || res.header.Get("Retry-After") != "1" || res.errorType() != typeUnavailable || up.calls.Load() != 0 {
				t.Fatalf("fail closed: %d %v %s, calls %d", res.code(), res.header, res.body, up.calls.Load())
			}
		})
	}
}

// A request that meets a store failure while its handler is cleaned up (a
// reload, whose draining requests outlive Cleanup) names the store without
// racing Cleanup: storeName read storeKey, which Cleanup clears, until the
// build after c348b03 (go test -race reported it).
func TestStoreNameDuringCleanup(t *testing.T) {
	const label = "postgres/iceberg_idempotency_records/3f9c0d1e2a4b5c6d"
	h := newTestHandler(t, failingStore{})
	h.storeKey, h.storeLabel = label, label
	core, logs := observer.New(zap.ErrorLevel)
	h.logger = zap.New(core)
	up := answering(200, "{}")
	cleaned := make(chan error)
	go func() { cleaned <- h.Cleanup() }()
	res := serve(t, h, up, "POST", "/v1/namespaces", storetest.NewKey(t), nsBody)
	if err := <-cleaned; err != nil {
		t.Fatal(err)
	}
	if res.code() != http.StatusServiceUnavailable {
		t.Fatalf("store down = %d %s, want 503", res.code(), res.body)
	}
	if n := logs.FilterMessage("store failed: rejecting request").FilterField(zap.String("store", label)).Len(); n != 1 {
		t.Fatalf("store failure logged %d times naming %s, want once; logs: %v", n, label, logs.All())
	}
}

// Validate names the option whose value is wrong.
func TestValidateNamesTheOption(t *testing.T) {
	for _, tt := range []struct {
		set  func(h *Handler)
		want string
	}{
		{func(h *Handler) { h.Lifetime = -1 }, "lifetime must not be negative"},
		// JSON's bare number is nanoseconds: 1800 was 1.8µs, and every
		// retry executed again.
		{func(h *Handler) { h.Lifetime = 1800 }, `lifetime must be at least 1s, got 1.8µs`},
		{func(h *Handler) { h.Lifetime = caddy.Duration(999 * time.Millisecond) }, `lifetime must be at least 1s, got 999ms`},
		// 60 was 60ns: every catalog call was cut off before it went out,
		// and each keyed commit answered 504, its key unknown for good
		// (until the build after 299dffb).
		{func(h *Handler) { h.ExecutionTimeout = 60 }, `execution_timeout must be at least 100ms, got 60ns`},
		{func(h *Handler) { h.ExecutionTimeout = 60000 }, `execution_timeout must be at least 100ms, got 60µs`},
		{func(h *Handler) { h.Lease = caddy.Duration(time.Millisecond) }, "lease must be at least 3ms"},
		{func(h *Handler) { h.InFlightStatus = 429 }, "in_flight_status must be 503 or 409"},
		{func(h *Handler) { h.Abandoned = "retry" }, "abandoned must be"},
		{func(h *Handler) { h.MaxResponseSize = -1 }, "max_response_size must be positive"},
		// "No limit" in JSON: one byte beyond it is read, which overflowed,
		// and a chunked body reached the catalog empty.
		{func(h *Handler) { h.MaxRequestSize = math.MaxInt64 }, "max_request_size must be positive and at most 1TiB"},
		{func(h *Handler) { h.MaxResponseSize = math.MaxInt64 }, "max_response_size must be positive and at most 1TiB"},
		{func(h *Handler) { h.BasePath = "api/" }, "base_path must start with /"},
		// Below either, no path starts with /v1/: every mutation passed
		// unguarded.
		{func(h *Handler) { h.BasePath = "/api/catalog/v1" }, `base_path is the part of the path before /v1, got "/api/catalog/v1": leave /v1 out`},
		// Paths are matched to the base without case: "/api/v1/…" was
		// below "/api/V1", and its mutations passed unguarded.
		{func(h *Handler) { h.BasePath = "/api/V1" }, `base_path is the part of the path before /v1, got "/api/V1": leave /v1 out`},
		{func(h *Handler) { h.BasePath = "/." }, `base_path "/." names no prefix: for a catalog at /v1, leave base_path out`},
		{func(h *Handler) { h.BasePath = "/" }, `base_path "/" names no prefix`},
		// Written as a path matcher or with a query, it was below no
		// request path: a keyed commit sent twice ran twice.
		{func(h *Handler) { h.BasePath = "/api/catalog/*" }, `base_path is a path prefix, not a matcher, got "/api/catalog/*": leave out the *`},
		{func(h *Handler) { h.BasePath = "/api*" }, `leave out the *`},
		{func(h *Handler) { h.BasePath = "/api?x=1" }, `base_path is a path prefix, got "/api?x=1": a query or fragment (from "?" on) is not part of a path`},
		{func(h *Handler) { h.BasePath = "/api#top" }, `(from "#" on)`},
		{func(h *Handler) { h.BasePath = "/api\tx" }, `base_path holds a control character at byte 4`},
		// Not a header name, it was kept, and the header it was meant
		// for went missing from every replay.
		{func(h *Handler) { h.ReplayHeaders = []string{"Content-Type,", "ETag"} }, `replay_headers[0] "Content-Type," is not a header name: separate the names with spaces, not commas`},
		{func(h *Handler) { h.ReplayHeaders = []string{"ETag", "Content Type"} }, `replay_headers[1] "Content Type" is not a header name (a token`},
		{func(h *Handler) { h.ReplayHeaders = []string{"Content-Type:"} }, `replay_headers[0] "Content-Type:" is not a header name`},
		{func(h *Handler) { h.ReplayHeaders = []string{"{env.H}"} }, `replay_headers[0] "{env.H}" is not a header name`},
		// Taken literally, a placeholder matched no path: the mutations
		// under the prefix meant passed unguarded.
		{func(h *Handler) { h.BasePath = "/{env.PREFIX}" }, `base_path is compared with request paths as written and takes no placeholders, got "/{env.PREFIX}"`},
		{func(h *Handler) { h.ReleaseStatuses = []string{"7xx"} }, "release_statuses: invalid status"},
		// JSON can give what the Caddyfile cannot: an empty list.
		{func(h *Handler) { h.FinalizeStatuses = []string{} }, "finalize_statuses: empty list: every success would be executed again on retry"},
		{func(h *Handler) { h.FinalizeStatuses = []string{"2xx", "500"} }, "finalize_statuses: has 500"},
		{func(h *Handler) { h.ReleaseStatuses = []string{"5xx", "204"} }, "release_statuses: has 204"},
		{func(h *Handler) { h.KeyVersions = []int{7, 9} }, "key_versions[1] must be a UUID version from 1 to 8, got 9"},
		{func(h *Handler) { h.KeyVersions = []int{0} }, "key_versions[0] must be a UUID version from 1 to 8, got 0"},
		{func(h *Handler) { h.KeyVersions = []int{4, 7, 4} }, "key_versions[2] repeats key_versions[0]"},
	} {
		h := new(Handler)
		tt.set(h)
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Validate = %v, want %q", err, tt.want)
		}
	}
	h := newTestHandler(t, newMemoryStore(t))
	if err := h.Validate(); err != nil {
		t.Fatalf("defaults do not validate: %v", err)
	}
	if err := (&Handler{ReplayHeaders: []string{"Content-Type", "ETag", "X-Iceberg-Access-Delegation", "x_custom", "A!#$%&'*+.^`|~"}}).Validate(); err != nil {
		t.Errorf("header names refused: %v", err)
	}
	// Spellings of a base path that normalize to it, as request paths do.
	for _, base := range []string{"/api/catalog", "/api%2fcatalog", "/%61pi/catalog", "/api/./catalog", "/v1x", "/my%20catalog", "/a-b_c.d~e/f!$&'()+,;=:@g",
		// Compared decoded, so they meet their escapes (path_test.go).
		"/my catalog", "/caf\u00e9", "/a[b]", "/a|b"} {
		if err := (&Handler{BasePath: base}).Validate(); err != nil {
			t.Errorf("base_path %q: %v", base, err)
		}
	}
}

func newRequest(method, target, body string) *http.Request {
	req, _ := http.NewRequest(method, target, strings.NewReader(body))
	return req
}

// serveRequest sends a prepared request through h the way Caddy's server
// does.
func serveRequest(h *Handler, next caddyhttp.Handler, req *http.Request) result {
	rec := httptest.NewRecorder()
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
	err := h.ServeHTTP(rec, req, next)
	return result{status: rec.Code, header: rec.Header(), body: rec.Body.String(), err: err}
}

// key_versions: a version 4 key (DuckDB sends them) is refused with 400 by
// default, saying which versions are allowed, and executes and replays once
// key_versions allows it; any allows every RFC 9562 version.
func TestKeyVersions(t *testing.T) {
	const v1 = "6ba7b810-9dad-11d1-80b4-00c04fd430c8"
	const v4 = "f47ac10b-58cc-4372-a567-0e02b2c3d479"
	const v8 = "019386a4-1b2c-8d3e-8f40-123456789abc"
	for _, tt := range []struct {
		name     string
		versions []int
		key      string
		wantErr  string // in the 400's message; "" when the key is accepted
	}{
		{"v4 by default", nil, v4, "must be a version 7 UUID, got version 4"},
		{"v4 with 4 7", []int{4, 7}, v4, ""},
		{"v7 with 4 7", []int{4, 7}, storetest.NewKey(t), ""},
		{"v1 with 4 7", []int{4, 7}, v1, "must be a version 4 or 7 UUID, got version 1"},
		{"v1 with any", []int{1, 2, 3, 4, 5, 6, 7, 8}, v1, ""},
		{"v8 with any", []int{1, 2, 3, 4, 5, 6, 7, 8}, v8, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := &Handler{store: newMemoryStore(t), logger: zap.NewNop(), KeyVersions: tt.versions}
			if err := h.Validate(); err != nil {
				t.Fatal(err)
			}
			if err := h.prepare(); err != nil {
				t.Fatal(err)
			}
			up := answering(200, "{}")
			res := serve(t, h, up, "POST", "/v1/namespaces", tt.key, nsBody)
			if tt.wantErr != "" {
				if res.code() != 400 || res.errorType() != typeBadRequest || !strings.Contains(res.body, tt.wantErr) || up.calls.Load() != 0 {
					t.Fatalf("%d %s, catalog called %d; want 400 naming %q", res.code(), res.body, up.calls.Load(), tt.wantErr)
				}
				return
			}
			again := serve(t, h, up, "POST", "/v1/namespaces", strings.ToUpper(tt.key), nsBody)
			if res.code() != 200 || again.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
				t.Fatalf("first %d, retry %d replayed=%q, catalog called %d; want executed once and replayed",
					res.code(), again.code(), again.header.Get(ReplayedHeader), up.calls.Load())
			}
		})
	}
}

// A node whose key_versions leaves out a key's version answers its retry
// from the record another node (or this one, before a reload) made for it:
// during a rolling change to key_versions 4 7, a v4 key executed on an
// upgraded node got 400 from an old one, which tells a commit client it
// failed. A key of that version with no record is refused as before, and
// the store down answers 503, not a 400 it cannot be sure of.
func TestKeyOfAnotherVersionAcceptedElsewhere(t *testing.T) {
	const v4 = "f47ac10b-58cc-4372-a567-0e02b2c3d479"
	s := newMemoryStore(t)
	node := func(versions []int) *Handler {
		h := &Handler{store: s, logger: zap.NewNop(), KeyVersions: versions}
		if err := h.Validate(); err != nil {
			t.Fatal(err)
		}
		if err := h.prepare(); err != nil {
			t.Fatal(err)
		}
		return h
	}
	upgraded, old := node([]int{4, 7}), node(nil)
	up := answering(200, "{}")
	if first := serve(t, upgraded, up, "POST", "/v1/namespaces", v4, nsBody); first.code() != 200 {
		t.Fatalf("first = %d %s", first.code(), first.body)
	}
	retry := serve(t, old, up, "POST", "/v1/namespaces", v4, nsBody)
	if retry.code() != 200 || retry.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
		t.Fatalf("retry on a node without version 4 = %d %s replayed=%q, catalog called %d; want the stored answer",
			retry.code(), retry.body, retry.header.Get(ReplayedHeader), up.calls.Load())
	}
	other := "0f47ac10-58cc-4372-a567-0e02b2c3d479"
	if fresh := serve(t, old, up, "POST", "/v1/namespaces", other, nsBody); fresh.code() != 400 || !strings.Contains(fresh.body, "got version 4") {
		t.Fatalf("unrecorded v4 key = %d %s; want 400", fresh.code(), fresh.body)
	}
	core, logs := observer.New(zap.ErrorLevel)
	down := &Handler{store: failingStore{s}, logger: zap.New(core)}
	if err := down.prepare(); err != nil {
		t.Fatal(err)
	}
	if res := serve(t, down, up, "POST", "/v1/namespaces", other, nsBody); res.code() != 503 || up.calls.Load() != 1 {
		t.Fatalf("v4 key with the store down = %d %s, catalog called %d; want 503", res.code(), res.body, up.calls.Load())
	}
	// Logged as any store failure, with the key and the store: until the
	// build after a95b973 it was counted and alerted on, and logged
	// nowhere.
	if lines := logs.FilterMessage("store failed: rejecting request").FilterField(zap.String("key", other)).FilterField(zap.String("store", "other")).All(); len(lines) != 1 {
		t.Fatalf("store failure on a key of another version logged %d times with its key and store, want once; logs: %v", len(lines), logs.All())
	}
}

// A keyed mutation whose path is longer than a key can be bound to (MySQL's
// TEXT column) gets 414 before anything is reserved or sent. Before, a
// non-strict sql_mode cut the stored path short, and the retry of the
// executed commit got 422; a strict one refused every reservation (503).
func TestPathLongerThanABindingIsRefused(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	up := answering(200, "{}")
	prefix := "/v1/wh/namespaces/ns/tables/"
	for _, tt := range []struct {
		length int
		want   int
	}{{maxBoundPath, 200}, {maxBoundPath + 1, http.StatusRequestURITooLong}} {
		path := prefix + strings.Repeat("t", tt.length-len(prefix))
		res := serve(t, h, up, "POST", path, storetest.NewKey(t), commitBody)
		if res.code() != tt.want {
			t.Errorf("keyed commit with a %d-byte path = %d %s, want %d", len(path), res.code(), res.body, tt.want)
		}
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("the catalog was called %d times, want 1 (the path at the limit)", n)
	}
}

// reserveFails is a store whose reads work and whose every Reserve fails,
// as a store does that breaks between two calls.
type reserveFails struct{ stores.Store }

func (reserveFails) Reserve(context.Context, stores.Reservation) (stores.ReserveResult, error) {
	return stores.ReserveResult{}, errInjected
}

// A key of another version gets past admission only on a record the store
// showed: a Reserve that fails after it must not pass the request through
// under fail_open, neither beside the request executing it nor after the
// answer was stored. Before, it did: the catalog executed the key again.
func TestFailOpenAfterTheRecordOfAnotherVersionWasShown(t *testing.T) {
	const v4 = "f47ac10b-58cc-4372-a567-0e02b2c3d479"
	for _, final := range []bool{false, true} {
		s := newMemoryStore(t)
		up := answering(200, "{}")
		upgraded := newTestHandler(t, s)
		upgraded.KeyVersions = []int{4, 7}
		if err := upgraded.prepare(); err != nil {
			t.Fatal(err)
		}
		if final {
			if first := serve(t, upgraded, up, "POST", "/v1/namespaces", v4, nsBody); first.code() != 200 {
				t.Fatalf("first = %d %s", first.code(), first.body)
			}
		} else if res, err := s.Reserve(t.Context(), stores.Reservation{Key: v4, Binding: stores.Binding{Operation: "createNamespace", Path: "/v1/namespaces"},
			Owner: "another-node", Lease: time.Minute, TTL: time.Hour}); err != nil || !res.Reserved {
			t.Fatal(res, err)
		}
		calls := up.calls.Load()
		old := newTestHandler(t, reserveFails{s}) // key_versions 7
		old.FailOpen = true
		res := serve(t, old, up, "POST", "/v1/namespaces", v4, nsBody)
		if up.calls.Load() != calls || res.code() != http.StatusServiceUnavailable {
			t.Errorf("record final %v: a Reserve failing after the lookup = %d %s, catalog called %d more times; want 503 and none",
				final, res.code(), res.body, up.calls.Load()-calls)
		}
	}
}

// A duplicate waits no longer than the server's write_timeout allows: it is
// answered 503 + Retry-After with time left to write it, not broken off by
// the server when in_flight_wait is longer than write_timeout.
func TestInFlightWaitEndsBeforeTheWriteTimeout(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.InFlightWait = caddy.Duration(time.Minute)
	up, arrived, release := holdingUpstream()
	defer close(release)
	key := storetest.NewKey(t)
	go serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
	<-arrived
	dup := make(chan result, 1)
	go func() {
		req := newRequest("POST", "/v1/namespaces", nsBody)
		req.Header.Set(IdempotencyKeyHeader, key)
		rec := httptest.NewRecorder()
		req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{WriteTimeout: caddy.Duration(time.Second)})
		err := h.ServeHTTP(rec, req, up)
		dup <- result{status: rec.Code, header: rec.Header(), body: rec.Body.String(), err: err}
	}()
	select {
	case res := <-dup:
		if res.code() != http.StatusServiceUnavailable || res.header.Get("Retry-After") == "" || up.calls.Load() != 1 {
			t.Fatalf("duplicate = %d Retry-After %q, calls %d; want 503 + Retry-After", res.code(), res.header.Get("Retry-After"), up.calls.Load())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the duplicate still waits 20s on, past a write_timeout of 1s (in_flight_wait is a minute)")
	}
}

// Content-Type is replayed whatever replay_headers lists, as
// Content-Encoding is: left out (replay_headers ETag, or JSON's []), a
// replay of a JSON answer went out typed by Go's server from its bytes,
// text/plain, until the build after b35c62e.
func TestReplayKeepsContentType(t *testing.T) {
	for _, list := range [][]string{{"ETag"}, {}} {
		h := newTestHandler(t, newMemoryStore(t))
		h.ReplayHeaders = list
		if err := h.prepare(); err != nil {
			t.Fatal(err)
		}
		up := answering(200, `{"namespace":["ns"]}`, "Content-Type", "application/json", "ETag", `"e1"`)
		key := storetest.NewKey(t)
		serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
		res := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
		if res.header.Get(ReplayedHeader) != "true" || res.header.Get("Content-Type") != "application/json" {
			t.Fatalf("replay_headers %q: replay Content-Type %q (replayed %q), want application/json", list, res.header.Get("Content-Type"), res.header.Get(ReplayedHeader))
		}
	}
}
