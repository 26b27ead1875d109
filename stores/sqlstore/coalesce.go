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
}

type awaitCall struct {
	done    chan struct{}
	rec     *stores.Record
	err     error
	waiters int                // Awaits still waiting for done
	cancel  context.CancelFunc // ends the shared wait once no Await waits
	// loads counts the shared wait's loads as they start; last is the
	// count when it ended, the number of the load its result came from.
	loads atomic.Uint64
	last  uint64
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
// Await loads again, in a shared wait of its own or one begun after it.
func (g *AwaitGroup) Do(ctx context.Context, key string, load LoadFunc, await func(context.Context, LoadFunc) (*stores.Record, error)) (*stores.Record, error) {
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		rec, fresh, err := g.join(ctx, key, load, await)
		if fresh || err != nil {
			return rec, err
		}
	}
}

// join runs or joins key's shared wait once. fresh is false when the
// result came from a load that began before this Await joined.
func (g *AwaitGroup) join(ctx context.Context, key string, load LoadFunc, await func(context.Context, LoadFunc) (*stores.Record, error)) (rec *stores.Record, fresh bool, err error) {
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
		counted := func(ctx context.Context) (*stores.Record, time.Duration, error) {
			c.loads.Add(1)
			return load(ctx)
		}
		go func() {
			rec, err := await(runCtx, counted)
			g.mu.Lock()
			if g.calls[key] == c {
				delete(g.calls, key)
			}
			c.rec, c.err, c.last = rec, err, c.loads.Load()
			g.mu.Unlock()
			close(c.done)
			cancel()
		}()
	}
	c.waiters++
	joined := c.loads.Load()
	g.mu.Unlock()

	select {
	case <-c.done:
		if c.err != nil {
			return nil, true, c.err
		}
		if joined > 0 && c.last == joined {
			// The load that gave the result was under way when this Await
			// joined (a wait that loaded nothing cannot be stale).
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
