package sqlstore

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// AwaitGroup lets the Awaits of one key on one node share a single wait:
// the first runs it, later ones join it, and each gets its result. A
// thousand duplicates of one key then cost one poll loop (and one mark and
// reload on a notification) per node instead of a thousand. The zero value
// is ready to use.
type AwaitGroup struct {
	mu    sync.Mutex
	calls map[string]*awaitCall
	// seq orders the beginnings of Awaits and loads: an Await takes a
	// ticket as it begins, a load reads seq as it begins, and a load that
	// read at least an Await's ticket began after that Await.
	seq atomic.Uint64
}

type awaitCall struct {
	done    chan struct{}
	rec     *stores.Record
	err     error
	waiters int                // Awaits still waiting for done
	cancel  context.CancelFunc // ends the shared wait once no Await waits
	// loaded is g.seq as the shared wait's latest load began; last is
	// its value when the wait ended, that of the load its result came
	// from (0: it loaded nothing).
	loaded atomic.Uint64
	last   uint64
}

// Do runs await for key with load, or joins the one running. The shared
// wait runs until it ends or every Await that joined it has left (its own
// context ended); each Await returns its own context's error when it
// leaves. The record each gets is its own copy.
//
// An Await gets only a record loaded after it began: one that joins while
// the shared wait's last load is already under way could otherwise get
// what that load read before the Await was called, a state another node
// may have changed since (a takeover of the abandoned record, say). Such an
// Await loads again, in a shared wait begun after the one it left: once,
// since every load of that wait begins after the Await did, and together
// with the others that left it, since they share that wait.
func (g *AwaitGroup) Do(ctx context.Context, key string, load LoadFunc, await func(context.Context, LoadFunc) (*stores.Record, error)) (*stores.Record, error) {
	ticket := g.seq.Add(1)
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		rec, fresh, err := g.join(ctx, key, ticket, load, await)
		if fresh || err != nil {
			return rec, err
		}
	}
}

// join runs or joins key's shared wait once. fresh is false when the
// result came from a load that began before the Await holding ticket.
func (g *AwaitGroup) join(ctx context.Context, key string, ticket uint64, load LoadFunc, await func(context.Context, LoadFunc) (*stores.Record, error)) (rec *stores.Record, fresh bool, err error) {
	g.mu.Lock()
	if g.calls == nil {
		g.calls = make(map[string]*awaitCall)
	}
	c := g.calls[key]
	if c == nil {
		// Detached from the first Await, which may leave before others.
		runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		c = &awaitCall{done: make(chan struct{}), cancel: cancel}
		g.calls[key] = c
		stamped := func(ctx context.Context) (*stores.Record, time.Duration, error) {
			c.loaded.Store(g.seq.Load())
			return load(ctx)
		}
		go func() {
			rec, err := await(runCtx, stamped)
			g.mu.Lock()
			if g.calls[key] == c {
				delete(g.calls, key)
			}
			c.rec, c.err, c.last = rec, err, c.loaded.Load()
			g.mu.Unlock()
			close(c.done)
			cancel()
		}()
	}
	c.waiters++
	g.mu.Unlock()

	select {
	case <-c.done:
		if c.err != nil {
			return nil, true, c.err
		}
		if c.last != 0 && c.last < ticket {
			return nil, false, nil
		}
		return copyRecord(c.rec), true, nil
	case <-ctx.Done():
		g.mu.Lock()
		c.waiters--
		if c.waiters == 0 {
			// Nobody left to answer: stop, and let the next Await of
			// the key start afresh instead of joining a cancelled wait.
			c.cancel()
			if g.calls[key] == c {
				delete(g.calls, key)
			}
		}
		g.mu.Unlock()
		return nil, true, ctx.Err()
	}
}

// copyRecord gives an Await a record of its own: the callers may change
// what they got, and they must not change one another's.
func copyRecord(rec *stores.Record) *stores.Record {
	if rec == nil {
		return nil
	}
	out := *rec
	if rec.Response != nil {
		resp := *rec.Response
		resp.Header = rec.Response.Header.Clone()
		out.Response = &resp
	}
	return &out
}

// Waiting reports how many Awaits wait on key's shared wait.
func (g *AwaitGroup) Waiting(key string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	if c := g.calls[key]; c != nil {
		return c.waiters
	}
	return 0
}
