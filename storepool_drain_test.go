package icebergidempotency

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A reload drops the store while a keyed request of the old config is
// still uploading its body: the store stays open for it, which executes
// and is stored, and closes once it is done. Before, the request counted
// as using the store only once its body was read, so the drain saw nobody,
// closed the store, and the request got 503.
func TestStoreStaysOpenForARequestStillUploading(t *testing.T) {
	inner := &closeCounter{Store: newMemoryStore(t)}
	p := newPooledStore(inner)
	h := &Handler{store: p, pooled: p, logger: zap.NewNop()}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	lingerFor(t, 0)
	body, upload := io.Pipe()
	req := httptest.NewRequest("POST", commitPath, body)
	req.Header.Set(IdempotencyKeyHeader, storetest.NewKey(t))
	rec := httptest.NewRecorder()
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
	up := answering(200, `{"ok":true}`)
	done := make(chan error, 1)
	go func() { done <- h.ServeHTTP(rec, req, up) }()

	half := len(commitBody) / 2
	if _, err := upload.Write([]byte(commitBody[:half])); err != nil { // returns once the handler reads it
		t.Fatal(err)
	}
	_ = p.Destruct() // the reload drops the store mid-upload
	time.Sleep(50 * time.Millisecond)
	if inner.closed.Load() != 0 {
		t.Fatal("the store closed while a request was uploading its body")
	}
	_, _ = upload.Write([]byte(commitBody[half:]))
	_ = upload.Close()
	if err := <-done; err != nil || rec.Code != 200 || up.calls.Load() != 1 {
		t.Fatalf("request answered %d (error %v), catalog called %d times; want 200 once", rec.Code, err, up.calls.Load())
	}
	waitClosed(t, inner, 1) // after its last request
}

// A reload does not wait for the old config's requests: one still in a
// handler before this one (forward_auth, basic_auth hashing a password)
// reaches it after the store was dropped, and finds it open, executes and
// is stored; each such request keeps the store open for dropLinger more.
// Before, a store nobody was using when it was dropped closed at once, and
// such a request got 503 (under fail_open it passed through unguarded, and
// its retry executed the commit again).
func TestDroppedStoreStaysOpenForLateRequests(t *testing.T) {
	inner := &closeCounter{Store: newMemoryStore(t)}
	p := newPooledStore(inner)
	h := &Handler{store: p, pooled: p, logger: zap.NewNop()}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	lingerFor(t, time.Second)
	_ = p.Destruct() // the reload drops the store, which nobody uses
	time.Sleep(100 * time.Millisecond)
	up := answering(200, `{"ok":true}`)
	if r := serve(t, h, up, "POST", commitPath, storetest.NewKey(t), commitBody); r.code() != 200 || up.calls.Load() != 1 {
		t.Fatalf("late request of the old config answered %d (%s), catalog called %d times; want 200 once", r.code(), r.body, up.calls.Load())
	}
	// Past a linger from the drop, within one from the late request.
	time.Sleep(1200 * time.Millisecond)
	if inner.closed.Load() != 0 {
		t.Fatal("the store closed a linger after it was dropped, though a request used it since")
	}
	waitClosed(t, inner, 1)
}

// An exiting process waits for the store's background repairs before it
// closes the store: a Finalize that failed once is retried after the
// answer went out, and the exit lets it land. Before, Destruct returned at
// once and the process ended with the retry pending: the answered commit's
// key stayed in flight until its record expired, and every retry heard
// "unknown" for 36 minutes instead of the replay.
func TestExitWaitsForBackgroundRepairs(t *testing.T) {
	flaky := &flakyStore{Store: newMemoryStore(t)}
	flaky.finalizeFailures.Store(2)
	p := newPooledStore(&closeCounter{Store: flaky})
	h := &Handler{store: p, pooled: p, logger: zap.NewNop()}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if first := serve(t, h, proxy, "POST", commitPath, key, commitBody); first.code() != http.StatusOK {
		t.Fatalf("first answer = %d, want the catalog's 200 delivered", first.code())
	}
	exitNow(t)
	if err := p.Destruct(); err != nil {
		t.Fatal(err)
	}
	rec, err := flaky.Load(context.Background(), key)
	if err != nil || rec == nil || rec.State != stores.StateFinal {
		t.Fatalf("record when the exiting process closed its store = %+v, %v; want the answer stored", rec, err)
	}
}

// The exit waits too for a store that a reload dropped shortly before and
// that still runs a repair: before, only the stores of the running config
// were waited for.
func TestExitWaitsForAStoreAReloadDropped(t *testing.T) {
	current := newPooledStore(&closeCounter{Store: newMemoryStore(t)})
	repaired := droppedWithARepair(t)
	exitNow(t)
	if err := current.Destruct(); err != nil {
		t.Fatal(err)
	}
	if !repaired.Load() {
		t.Fatal("the exit did not wait for the dropped store's repair")
	}
}

// droppedWithARepair drops a store in a reload (it lingers, for an hour
// here) while a repair on it is under way, which ends 100 ms later and
// sets what it returns.
func droppedWithARepair(t *testing.T) *atomic.Bool {
	t.Helper()
	lingerFor(t, time.Hour)
	dropped := newPooledStore(&closeCounter{Store: newMemoryStore(t)})
	if err := dropped.Destruct(); err != nil { // the reload
		t.Fatal(err)
	}
	leave := dropped.enter() // a repair still under way
	repaired := new(atomic.Bool)
	go func() {
		time.Sleep(100 * time.Millisecond)
		repaired.Store(true)
		leave()
	}()
	return repaired
}

// exitNow makes the process read as exiting, with a fresh exit deadline
// as far off as a store's repairs may take, for the rest of t.
func exitNow(t *testing.T) {
	exiting := processExiting
	processExiting = func() bool { return true }
	noteRepairBound(repairBound(0))
	exitDeadline.Lock()
	exitDeadline.at = time.Time{}
	exitDeadline.Unlock()
	t.Cleanup(func() {
		processExiting = exiting
		exitDeadline.Lock()
		exitDeadline.at = time.Time{}
		exitDeadline.Unlock()
	})
}

// An exit whose running config has no handler of this module (a reload
// took it out) still waits for the repairs of a store that reload
// dropped: Caddy runs drainDroppedAtExit, registered with caddy.OnExit,
// after it stopped the config. Before, no pooled store of the running
// config was cleaned up, nothing waited, and the repair was cut off.
func TestExitWithoutTheModuleWaitsForADroppedStore(t *testing.T) {
	repaired := droppedWithARepair(t)
	exitNow(t)
	drainDroppedAtExit(context.Background())
	if !repaired.Load() {
		t.Fatal("the exit did not wait for the dropped store's repair")
	}
}

// idleCounter counts ReleaseIdle calls.
type idleCounter struct {
	closeCounter
	released atomic.Int32
}

func (c *idleCounter) ReleaseIdle() { c.released.Add(1) }

// A store a reload dropped lets its idle connections go at once, and
// stays open for late requests. Until the
// build after 88e6d4d it kept them for its linger, and reloads that
// changed a pool option piled them up: "too many clients" for every node.
func TestDroppedStoreReleasesIdleConnections(t *testing.T) {
	inner := &idleCounter{closeCounter: closeCounter{Store: newMemoryStore(t)}}
	p := newPooledStore(inner)
	lingerFor(t, time.Hour)
	_ = p.Destruct() // the reload
	if n := inner.released.Load(); n != 1 || inner.closed.Load() != 0 {
		t.Fatalf("dropped store: %d releases of idle connections, closed %d times; want 1 release, still open", n, inner.closed.Load())
	}
}
