package icebergidempotency

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// scriptedStore answers Reserve and Await from fixed records, to reach
// interleavings that a real store produces only under rare timing: here, a
// duplicate waits on an owner that releases, and before the duplicate looks
// again another request (with another body) has taken the key and finished.
type scriptedStore struct {
	stores.Store
	reserveExisting *stores.Record
	awaited         *stores.Record
}

func (s *scriptedStore) Reserve(context.Context, stores.Reservation) (stores.ReserveResult, error) {
	return stores.ReserveResult{Existing: s.reserveExisting}, nil
}

func (s *scriptedStore) Await(context.Context, string) (*stores.Record, error) {
	return s.awaited, nil
}

func newTestHandler(t testing.TB, s stores.Store) *Handler {
	t.Helper()
	h := &Handler{store: s, logger: zap.NewNop()}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	return h
}

func TestWaiterRechecksBindingAfterAwait(t *testing.T) {
	const key = "019386a4-1b2c-7d3e-8f40-123456789abc"
	const body = `{"namespace":["a"]}`
	principal := sha256Hex(nil) // no Authorization header
	mine := stores.Binding{
		Operation:   "createNamespace",
		Path:        "/v1/namespaces",
		Principal:   principal,
		Fingerprint: requestFingerprint("POST", "/v1/namespaces", "", []byte(body)),
	}
	other := mine
	other.Fingerprint = requestFingerprint("POST", "/v1/namespaces", "", []byte(`{"namespace":["b"]}`))
	s := &scriptedStore{
		reserveExisting: &stores.Record{Key: key, Binding: mine, State: stores.StateInFlight, Owner: "owner-1"},
		awaited: &stores.Record{Key: key, Binding: other, State: stores.StateFinal,
			Response: &stores.Response{Status: 200, Header: http.Header{}, Body: []byte(`{"namespace":["b"]}`)}},
	}
	rec := createNamespaceWithoutCatalog(t, s, key, body)
	if rec.Code != http.StatusUnprocessableEntity || rec.Header().Get(ReplayedHeader) != "" {
		t.Fatalf("got %d (replayed %q) %s; want 422, not another request's replay", rec.Code, rec.Header().Get(ReplayedHeader), rec.Body)
	}
}

// staleAwaitStore answers every Reserve with a healthy in-flight record of
// another owner, and its first Await with an older, abandoned reservation
// of the key: what a shared wait that another waiter on the node began
// before this request's Reserve can hand back.
type staleAwaitStore struct {
	stores.Store
	current, stale, final *stores.Record
	awaits                int
}

func (s *staleAwaitStore) Reserve(context.Context, stores.Reservation) (stores.ReserveResult, error) {
	return stores.ReserveResult{Existing: s.current}, nil
}

func (s *staleAwaitStore) Await(context.Context, string) (*stores.Record, error) {
	s.awaits++
	if s.awaits == 1 {
		return s.stale, nil
	}
	return s.final, nil
}

// A waiter that Await hands a stale, abandoned record of an earlier owner
// reads the key again instead of answering "unknown": the reservation it
// waits on is healthy, and its answer is replayed once it finishes.
func TestWaiterHandedAStaleAbandonedRecordWaitsOn(t *testing.T) {
	const key = "019386a4-1b2c-7d3e-8f40-123456789abc"
	const body = `{"namespace":["a"]}`
	mine := stores.Binding{
		Operation:   "createNamespace",
		Path:        "/v1/namespaces",
		Principal:   sha256Hex(nil), // no Authorization header
		Fingerprint: requestFingerprint("POST", "/v1/namespaces", "", []byte(body)),
	}
	s := &staleAwaitStore{
		current: &stores.Record{Key: key, Binding: mine, State: stores.StateInFlight, Owner: "owner-2"},
		stale:   &stores.Record{Key: key, Binding: mine, State: stores.StateInFlight, Owner: "owner-1", Abandoned: true},
		final: &stores.Record{Key: key, Binding: mine, State: stores.StateFinal,
			Response: &stores.Response{Status: 200, Header: http.Header{}, Body: []byte(body)}},
	}
	rec := createNamespaceWithoutCatalog(t, s, key, body)
	if rec.Code != http.StatusOK || rec.Header().Get(ReplayedHeader) != "true" {
		t.Fatalf("got %d (replayed %q) %s; want the replay of the reservation it waited on", rec.Code, rec.Header().Get(ReplayedHeader), rec.Body)
	}
}

// createNamespaceWithoutCatalog sends a keyed createNamespace with body
// through a handler on s that waits up to a second for a key in flight; the
// test fails if the request reaches the catalog.
func createNamespaceWithoutCatalog(t *testing.T, s stores.Store, key, body string) *httptest.ResponseRecorder {
	t.Helper()
	h := newTestHandler(t, s)
	h.InFlightWait = caddy.Duration(time.Second)
	req := httptest.NewRequest("POST", "/v1/namespaces", strings.NewReader(body))
	req.Header.Set(IdempotencyKeyHeader, key)
	req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
	rec := httptest.NewRecorder()
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		t.Error("the catalog was called")
		return nil
	})
	if err := h.admit(rec, req, next, "createNamespace", "/v1/namespaces"); err != nil {
		t.Fatal(err)
	}
	return rec
}
