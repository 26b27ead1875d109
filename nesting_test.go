package icebergidempotency

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// Two handlers on one request, in process: outer's next runs inner, whose
// next is the catalog. (The integration tests run the same layouts in a
// real Caddy, from the Caddyfile.)
func nested(outer, inner *Handler, catalog caddyhttp.Handler) caddyhttp.Handler {
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return inner.ServeHTTP(w, r, catalog) })
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
			key := storetest.NewKey(t)
			first := serve(t, outer, nested(outer, inner, up), "POST", commitPath, key, commitBody)
			retry := serve(t, outer, nested(outer, inner, up), "POST", commitPath, key, commitBody)
			if first.code() != 200 || retry.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
				t.Fatalf("first %d %s, retry %d replayed=%q, catalog called %d times; want 200, a replay, 1",
					first.code(), first.body, retry.code(), retry.header.Get(ReplayedHeader), up.calls.Load())
			}
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
	key := storetest.NewKey(t)
	first := serve(t, outer, nested(outer, inner, up), "POST", commitPath, key, commitBody)
	retry := serve(t, outer, nested(outer, inner, up), "POST", commitPath, key, commitBody)
	if first.code() != 200 || retry.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
		t.Fatalf("first %d, retry %d replayed=%q, catalog called %d times; want 200, a replay, 1",
			first.code(), retry.code(), retry.header.Get(ReplayedHeader), up.calls.Load())
	}
}
