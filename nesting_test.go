package icebergidempotency

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// nested is inner as the next handler of another one, with next after it:
// handlers on one request, in process. (The integration tests run such
// layouts in a real Caddy, from the Caddyfile.)
func nested(inner *Handler, next caddyhttp.Handler) caddyhttp.Handler {
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return inner.ServeHTTP(w, r, next) })
}

// wantOnceThenReplayed sends a keyed request to commitPath through first
// and its retry through retry (the same handler, or another node's), each
// with next after it, and fails t unless the first got want, the retry a
// replay, and up was called once.
func wantOnceThenReplayed(t *testing.T, first, retry *Handler, next caddyhttp.Handler, up *upstream, method, body string, want int) {
	t.Helper()
	key := storetest.NewKey(t)
	f := serve(t, first, next, method, commitPath, key, body)
	r := serve(t, retry, next, method, commitPath, key, body)
	if f.code() != want || r.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
		t.Errorf("first %d %s, retry %d replayed=%q, catalog called %d times; want %d, a replay, 1",
			f.code(), f.body, r.code(), r.header.Get(ReplayedHeader), up.calls.Load(), want)
	}
}

// otherWrapper is the same records behind another store value, as two
// store blocks on one table with different pool options are.
type otherWrapper struct{ stores.Store }

// The inner handler finds the key in flight under the owner token of the
// outer handler executing this very request, and hands the request on:
// whether the two reach the records through one store value or two. A
// retry is replayed. Before, two store values meant two guards on one
// record, the inner one waiting on the outer one's reservation: 503.
func TestNestedHandlersOnOneRecordExecuteOnce(t *testing.T) {
	for _, tt := range []struct {
		name  string
		inner func(stores.Store) stores.Store
	}{
		{"one store value", func(s stores.Store) stores.Store { return s }},
		{"two values, one table", func(s stores.Store) stores.Store { return otherWrapper{s} }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := newMemoryStore(t)
			outer, inner := newTestHandler(t, s), newTestHandler(t, tt.inner(s))
			inner.InFlightWait = 1
			up := answering(200, `{"ok":true}`)
			wantOnceThenReplayed(t, outer, outer, nested(inner, up), up, "POST", commitBody, 200)
		})
	}
}

// failFirstReserve fails the first Reserve before it reaches the store,
// then works.
type failFirstReserve struct {
	stores.Store
	n atomic.Int32
}

func (s *failFirstReserve) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	if s.n.Add(1) == 1 {
		return stores.ReserveResult{}, errors.New("connection reset")
	}
	return s.Store.Reserve(ctx, r)
}

// An outer fail_open handler whose Reserve failed passes the request on
// unguarded, holding nothing: the inner fail-closed handler guards it
// (its Reserve works), so the retry is replayed. Before, the mark was set
// before the outer one reserved anything, the inner one trusted it, and
// the retry executed the commit again.
func TestFailOpenOuterLeavesTheInnerToGuard(t *testing.T) {
	s := &failFirstReserve{Store: newMemoryStore(t)}
	outer, inner := newTestHandler(t, s), newTestHandler(t, s)
	outer.FailOpen = true
	up := answering(200, `{"ok":true}`)
	wantOnceThenReplayed(t, outer, outer, nested(inner, up), up, "POST", commitBody, 200)
}

// Three handlers, A and C on one store and B between them on another: C
// finds the key in flight under A's owner token, not B's, and must know
// it for its own request's. Before, the mark held the nearest guard only:
// C waited on A until in_flight_wait ran out, and every keyed request
// ended 503 (or, with in_flight_status 409, 409 stored and replayed for
// good by B and A, for a commit that never ran).
func TestThreeHandlersRecogniseTheOutermostGuard(t *testing.T) {
	for _, status := range []int{http.StatusServiceUnavailable, http.StatusConflict} {
		s1, s2 := newMemoryStore(t), newMemoryStore(t)
		a, b, c := newTestHandler(t, s1), newTestHandler(t, s2), newTestHandler(t, s1)
		c.InFlightWait, c.InFlightStatus = 1, status
		up := answering(200, `{"ok":true}`)
		t.Run(strconv.Itoa(status), func(t *testing.T) {
			wantOnceThenReplayed(t, a, a, nested(b, nested(c, up)), up, "POST", commitBody, 200)
		})
	}
}

// With in_flight_status 409, the 409 an inner handler answers for a key in
// flight elsewhere is not stored by the guard around it: the commit runs
// through a route with the inner handler only; its retry through a route
// with a handler on another store in front hears 409 while it runs, and
// the outcome once it is done. Before, the outer handler stored the 409,
// and every later retry on that route heard "conflict" for a commit that
// happened.
func TestInFlightConflictIsNotStoredByTheGuardAround(t *testing.T) {
	s1, s2 := newMemoryStore(t), newMemoryStore(t)
	front, shared := newTestHandler(t, s1), newTestHandler(t, s2)
	shared.InFlightWait, shared.InFlightStatus = 1, http.StatusConflict
	up, arrived, release := holdingUpstream()
	key := storetest.NewKey(t)
	done := make(chan result, 1)
	go func() { done <- serve(t, shared, up, "POST", commitPath, key, commitBody) }()
	<-arrived
	during := serve(t, front, nested(shared, up), "POST", commitPath, key, commitBody)
	close(release)
	if first := <-done; first.code() != 200 {
		t.Fatalf("the commit answered %d %s", first.code(), first.body)
	}
	after := serve(t, front, nested(shared, up), "POST", commitPath, key, commitBody)
	if during.code() != http.StatusConflict || after.code() != 200 || after.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
		t.Fatalf("retry while running %d, after %d %s replayed=%q, catalog called %d times; want 409, then the replay, 1",
			during.code(), after.code(), after.body, after.header.Get(ReplayedHeader), up.calls.Load())
	}
}

// When the catalog call panics (reverse_proxy does, when an answer breaks
// off), a handler around the directive that recovers and serves the
// request on through another iceberg_idempotency handler finds the record
// abandoned, not passed on as its own: the mark that lets a nested guard
// pass a request through rides only on the request the handlers after the
// directive were given, never on the one the handlers around it hold. In
// the build of 16bba05 the mark was the handler's own state, put back by a
// deferred call; with it left, the commit ran again. (A handler *after* the
// directive that recovers and serves the request on resends it, as
// lb_retry_match does: see "The guarantee, and its limits".)
func TestMarkPutBackWhenTheCallPanics(t *testing.T) {
	s := newMemoryStore(t)
	a, d := newTestHandler(t, s), newTestHandler(t, s)
	calls := 0
	panicky := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		calls++
		replacerOf(r).Set(upstreamVar, "catalog:8181") // it reached the catalog
		panic(http.ErrAbortHandler)
	})
	req := httptest.NewRequest("POST", commitPath, strings.NewReader(commitBody))
	req.Header.Set(IdempotencyKeyHeader, storetest.NewKey(t))
	rec := httptest.NewRecorder()
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
	func() {
		defer func() { _ = recover() }()
		_ = a.ServeHTTP(rec, req, panicky)
	}()
	if mark := activeGuardOf(req.Context()); mark != nil {
		t.Fatalf("mark left after the panic: %v", mark)
	}
	again := httptest.NewRecorder()
	_ = d.ServeHTTP(again, req, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		calls++
		w.WriteHeader(200)
		return nil
	}))
	if calls != 1 {
		t.Fatalf("the catalog was called %d times, want 1 (the record is abandoned: outcome unknown)", calls)
	}
}

// A keyed DELETE (dropTable: no body) through two handlers. The outer one
// takes the key off the header for its catalog call (or its fail_open
// pass), so that Go's transport never resends the request by itself; the
// inner one still reads it, and guards or hands on as for any request.
// Before, it saw no key: with require_key it answered 400, which the outer
// one stored for good; on another store it did not guard, and a retry on
// another node dropped the table again; behind a fail_open outer handler
// whose store failed, the retry dropped it again too.
func TestNestedHandlersSeeTheKeyOfABodylessRequest(t *testing.T) {
	for _, tt := range []struct {
		name         string
		outer, retry func(s stores.Store) *Handler // the first request's outer handler, the retry's
		inner        func(s stores.Store) *Handler
		outerStore   func() stores.Store // nil: the inner one's
	}{
		{"one store, inner require_key", nil, nil, func(s stores.Store) *Handler {
			h := newTestHandler(t, s)
			h.RequireKey = true
			return h
		}, nil},
		{"memory of each node outside, a shared store inside", nil, nil, nil, func() stores.Store { return newMemoryStore(t) }},
		{"fail_open outside, its store failing once", func(s stores.Store) *Handler {
			h := newTestHandler(t, &failFirstReserve{Store: s})
			h.FailOpen = true
			return h
		}, nil, nil, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			shared := newMemoryStore(t)
			handler := func(make func(stores.Store) *Handler, s stores.Store) *Handler {
				if make != nil {
					return make(s)
				}
				return newTestHandler(t, s)
			}
			outerStore := func() stores.Store {
				if tt.outerStore != nil {
					return tt.outerStore() // each node its own
				}
				return shared
			}
			inner := handler(tt.inner, shared)
			firstOuter := handler(tt.outer, outerStore())
			retryOuter := firstOuter
			if tt.outerStore != nil {
				retryOuter = handler(tt.outer, outerStore()) // the other node
			}
			var sawKey atomic.Bool
			up := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
				sawKey.Store(sawKey.Load() || r.Header.Get(IdempotencyKeyHeader) != "")
				w.WriteHeader(http.StatusNoContent)
				return nil
			}}
			wantOnceThenReplayed(t, firstOuter, retryOuter, nested(inner, up), up, "DELETE", "", 204)
			if sawKey.Load() {
				t.Fatal("the catalog got the Idempotency-Key of a request without a body")
			}
		})
	}
}

// setBody gives the request a body, as request_body's set does, before
// next.
func setBody(body string, next caddyhttp.Handler) caddyhttp.Handler {
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		r.Body = io.NopCloser(strings.NewReader(body))
		r.ContentLength = int64(len(body))
		return next.ServeHTTP(w, r)
	})
}

// The hidden key is read however the request changed in between: a
// handler between the two gives the body-less DELETE a body (request_body
// set), and the inner handler on the shared store still guards it, so the
// retry on another node is replayed. Before, the fallback was for
// body-less requests only: the retry dropped the table again.
func TestInnerHandlerReadsTheHiddenKeyAfterABodyWasSet(t *testing.T) {
	shared := newMemoryStore(t)
	inner := newTestHandler(t, shared)
	inner.RequireKey = true
	up := answering(204, "")
	wantOnceThenReplayed(t, newTestHandler(t, newMemoryStore(t)), newTestHandler(t, newMemoryStore(t)),
		setBody("{}", nested(inner, up)), up, "DELETE", "", 204)
}

// A nested directive waiting for a duplicate on its own store, whose wait
// the outer directive's execution_timeout ends, answers 503 + Retry-After,
// which the outer one releases: the client is still there. (Taken for a
// client that left, the request was broken off with no answer.)
func TestNestedWaitEndedByTheOuterExecutionTimeout(t *testing.T) {
	inner := newTestHandler(t, newMemoryStore(t))
	inner.InFlightWait = caddy.Duration(10 * time.Second)
	outer := newTestHandler(t, newMemoryStore(t))
	outer.ExecutionTimeout = caddy.Duration(300 * time.Millisecond)
	up, arrived, release := holdingUpstream()
	defer close(release)
	key := storetest.NewKey(t)
	go serve(t, inner, up, "POST", "/v1/namespaces", key, nsBody) // another node, executing the key
	<-arrived
	res := serve(t, outer, nested(inner, up), "POST", "/v1/namespaces", key, nsBody)
	if res.code() != http.StatusServiceUnavailable || res.header.Get("Retry-After") == "" || up.calls.Load() != 1 {
		t.Fatalf("nested wait past the outer execution_timeout = %d %s, calls %d; want 503 + Retry-After", res.code(), res.body, up.calls.Load())
	}
	if rec, err := outer.store.Load(context.Background(), key); err != nil || rec != nil {
		t.Fatalf("outer record = %+v, %v; want the key released", rec, err)
	}
}
