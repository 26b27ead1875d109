package sqlstore

import (
	"context"
	"slices"
	"strings"
	"sync"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Statement is one write a Combiner runs: a statement of the store's kind
// (SQL text, a prepared statement) and its arguments, on the record of Key.
type Statement[S any] struct {
	Stmt S
	Args []any
	// Key is the record the statement writes. A batch runs its statements
	// in the order of their keys (those of one key in arrival order), so
	// that the batches of two nodes take their row locks in the same order
	// and cannot deadlock: on PostgreSQL a deadlock costs both batches
	// deadlock_timeout (1 s by default) before one is rolled back, and
	// with one flush slot a node's every write waits behind its batch.
	// (The MySQL store merges a batch's statements by kind, which gives up
	// the interleaved order; InnoDB detects the deadlocks that allows at
	// once: see stores/mysql's mergeKind.)
	Key string
}

// Combiner runs the hot path's writes (Reserve's INSERT, Finalize's UPDATE)
// of concurrent requests together: the writes that arrive while MaxFlushes
// batches are already in flight wait, and then go as one transaction, one
// commit for all of them.
//
// Why: a fresh key costs two commits, and on a busy database each commit
// costs a log flush and a round trip on both sides. Driven through Caddy,
// the statements cost the database more CPU and more log flushes per
// request than the same statements in a tight loop, because fewer of them
// commit together. Under light load nothing waits: a write that finds a
// free slot runs at once, alone, as a plain statement.
//
// A write learns its outcome only once its batch's commit is confirmed.
// When nothing of a failed batch committed, each of its writes runs again
// alone, so one write's failure (a deadlock between batches, a row the
// server refuses) stays its own; when the commit's fate is unknown (the
// connection broke during it), every write of the batch gets the error,
// as a single statement would.
type Combiner[S any] struct {
	// MaxFlushes bounds the batches in flight at once; MaxBatch the writes
	// in one.
	MaxFlushes, MaxBatch int
	// Alone runs one statement in a transaction of its own and returns the
	// rows it changed.
	Alone func(ctx context.Context, st Statement[S]) (int64, error)
	// Together runs the statements (two or more) in one transaction and,
	// once its commit is confirmed, returns the rows each changed. On
	// failure, rolledBack reports that nothing of the batch committed.
	Together func(sts []Statement[S]) (rows []int64, rolledBack bool, err error)

	mu       sync.Mutex
	queue    []*pendingWrite[S]
	flushing int
}

// pendingWrite is one statement waiting in a Combiner.
type pendingWrite[S any] struct {
	ctx  context.Context
	st   Statement[S]
	done chan struct{}
	// Set before done is closed.
	rows  int64
	err   error
	alone bool // its batch rolled back: run it again, alone
	// sent is set, with the Combiner's mu held, once the write is taken
	// into a batch: from then on only that batch's outcome says whether
	// it committed.
	sent bool
}

// Exec runs st and returns the rows it changed. The statement may share
// its transaction with other writes. A write whose ctx ends while it still
// waits for a slot is never sent, and Exec returns ctx's error, marked so
// (stores.MarkNotSent): the caller has nothing to undo. Once it is
// sent, Exec waits for its batch's outcome even if ctx ends meanwhile: the
// batch runs under a timeout of its own, and returning early would leave
// the caller unable to tell a write that will never commit from one that
// commits a moment later (a reservation nobody executes, holding its key).
func (c *Combiner[S]) Exec(ctx context.Context, st Statement[S]) (int64, error) {
	w := &pendingWrite[S]{ctx: ctx, st: st, done: make(chan struct{})}
	c.mu.Lock()
	c.queue = append(c.queue, w)
	if c.flushing < c.MaxFlushes {
		c.flushing++
		batch := c.take()
		c.mu.Unlock()
		c.flush(batch)
		c.next()
	} else {
		c.mu.Unlock()
	}
	select {
	case <-w.done:
	case <-ctx.Done():
		c.mu.Lock()
		sent := w.sent
		c.mu.Unlock()
		if !sent {
			// Still queued: take drops it unsent, since ctx has ended.
			return 0, stores.MarkNotSent(ctx.Err())
		}
		<-w.done
	}
	if w.alone {
		return c.runAlone(ctx, st)
	}
	return w.rows, w.err
}

// runAlone runs st in a transaction of its own. A ctx that has ended by
// then sends nothing, and the error says so whatever the driver would
// answer (database/sql answers a bare ctx.Err()): after a batch that
// waited out the timeout and rolled back, every write of it comes here
// with its caller's time spent, and none of them is on the server.
func (c *Combiner[S]) runAlone(ctx context.Context, st Statement[S]) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, stores.MarkNotSent(err)
	}
	return c.Alone(ctx, st)
}

// State reports how many writes wait for a slot and how many batches run;
// tests use it.
func (c *Combiner[S]) State() (queued, flushing int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.queue), c.flushing
}

// take removes the next batch from the queue; c.mu is held. Writes whose
// caller already left are dropped unsent.
func (c *Combiner[S]) take() []*pendingWrite[S] {
	batch := make([]*pendingWrite[S], 0, min(len(c.queue), c.MaxBatch))
	taken := 0
	for _, w := range c.queue {
		if len(batch) == cap(batch) {
			break
		}
		taken++
		if err := w.ctx.Err(); err != nil {
			w.err = stores.MarkNotSent(err)
			close(w.done)
			continue
		}
		w.sent = true
		batch = append(batch, w)
	}
	rest := copy(c.queue, c.queue[taken:])
	clear(c.queue[rest:])
	c.queue = c.queue[:rest]
	slices.SortStableFunc(batch, func(a, b *pendingWrite[S]) int { return strings.Compare(a.st.Key, b.st.Key) })
	return batch
}

// next gives up a flush slot or, when writes queued meanwhile, keeps it
// for a goroutine that flushes them: the caller's own write is done, and
// it must not wait for others'.
func (c *Combiner[S]) next() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.queue) == 0 {
		c.flushing--
		return
	}
	go c.drain()
}

func (c *Combiner[S]) drain() {
	for {
		c.mu.Lock()
		if len(c.queue) == 0 {
			c.flushing--
			c.mu.Unlock()
			return
		}
		batch := c.take()
		c.mu.Unlock()
		c.flush(batch)
	}
}

// flush runs batch and hands each write its outcome.
func (c *Combiner[S]) flush(batch []*pendingWrite[S]) {
	defer func() {
		for _, w := range batch {
			close(w.done)
		}
	}()
	switch len(batch) {
	case 0:
		return
	case 1:
		w := batch[0]
		w.rows, w.err = c.runAlone(w.ctx, w.st)
		return
	}
	sts := make([]Statement[S], len(batch))
	for i, w := range batch {
		sts[i] = w.st
	}
	rows, rolledBack, err := c.Together(sts)
	for i, w := range batch {
		switch {
		case err == nil:
			w.rows = rows[i]
		case rolledBack:
			w.alone = true
		default:
			w.err = err
		}
	}
}
