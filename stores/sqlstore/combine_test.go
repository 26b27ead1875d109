package sqlstore

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// The queueing logic alone, with stand-ins for the database: the stores'
// own tests (stores/postgres, stores/mysql) run it against real servers.

// fakeDB records what a Combiner sends. Alone of statement "block" waits
// until unblock is closed, holding its flush slot.
type fakeDB struct {
	mu       sync.Mutex
	alone    []string
	together [][]string
	unblock  chan struct{}
	// result of Together
	rolledBack bool
	err        error
}

func (f *fakeDB) combiner(maxFlushes, maxBatch int) *Combiner[string] {
	return &Combiner[string]{
		MaxFlushes: maxFlushes,
		MaxBatch:   maxBatch,
		Alone: func(ctx context.Context, st Statement[string]) (int64, error) {
			if st.Stmt == "block" {
				<-f.unblock
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			f.alone = append(f.alone, st.Stmt)
			return int64(len(st.Stmt)), nil
		},
		Together: func(sts []Statement[string]) ([]int64, bool, error) {
			f.mu.Lock()
			defer f.mu.Unlock()
			var names []string
			var rows []int64
			for _, st := range sts {
				names = append(names, st.Stmt)
				rows = append(rows, int64(len(st.Stmt))*10)
			}
			f.together = append(f.together, names)
			if f.err != nil {
				return nil, f.rolledBack, f.err
			}
			return rows, false, nil
		},
	}
}

type outcome struct {
	rows int64
	err  error
}

// queueBehindBlock holds c's only slot with a blocked statement, queues
// stmts behind it, releases the slot and returns each one's outcome.
func queueBehindBlock(t *testing.T, f *fakeDB, c *Combiner[string], ctxs []context.Context, stmts []string) []outcome {
	t.Helper()
	return queueKeyedBehindBlock(t, f, c, ctxs, stmts, nil)
}

// holdSlot takes c's only flush slot with a blocked statement; release
// gives it back once the blocked statement is done.
func holdSlot(t *testing.T, f *fakeDB, c *Combiner[string]) (release func()) {
	t.Helper()
	f.unblock = make(chan struct{})
	blocked := make(chan struct{})
	go func() {
		defer close(blocked)
		if _, err := c.Exec(context.Background(), Statement[string]{Stmt: "block"}); err != nil {
			t.Error(err)
		}
	}()
	waitState(t, c, 0, 1)
	return func() {
		close(f.unblock)
		<-blocked
	}
}

// queueKeyedBehindBlock is queueBehindBlock with each statement's key.
func queueKeyedBehindBlock(t *testing.T, f *fakeDB, c *Combiner[string], ctxs []context.Context, stmts, keys []string) []outcome {
	t.Helper()
	release := holdSlot(t, f, c)
	out := make([]outcome, len(stmts))
	var wg sync.WaitGroup
	for i, s := range stmts {
		ctx := context.Background()
		if ctxs != nil {
			ctx = ctxs[i]
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			st := Statement[string]{Stmt: s}
			if keys != nil {
				st.Key = keys[i]
			}
			n, err := c.Exec(ctx, st)
			out[i] = outcome{n, err}
		}()
		waitState(t, c, i+1, 1) // queued in this order
	}
	release()
	wg.Wait()
	waitState(t, c, 0, 0)
	return out
}

func waitState(t *testing.T, c *Combiner[string], queued, flushing int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		q, fl := c.State()
		if q == queued && fl == flushing {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d queued, %d flushing; want %d, %d", q, fl, queued, flushing)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestCombinerAloneWhenASlotIsFree(t *testing.T) {
	f := &fakeDB{}
	c := f.combiner(2, 8)
	for _, s := range []string{"a", "bb"} {
		if n, err := c.Exec(context.Background(), Statement[string]{Stmt: s}); err != nil || n != int64(len(s)) {
			t.Fatalf("Exec(%s) = %d, %v", s, n, err)
		}
	}
	if !slices.Equal(f.alone, []string{"a", "bb"}) || len(f.together) != 0 {
		t.Fatalf("alone %v, together %v", f.alone, f.together)
	}
}

func TestCombinerBatchesWhatQueued(t *testing.T) {
	f := &fakeDB{}
	c := f.combiner(1, 3)
	out := queueBehindBlock(t, f, c, nil, []string{"a", "bb", "ccc", "dddd", "eeeee"})
	// In order, at most MaxBatch at a time; a batch of one runs alone.
	if want := [][]string{{"a", "bb", "ccc"}, {"dddd", "eeeee"}}; !slices.EqualFunc(f.together, want, slices.Equal) {
		t.Fatalf("together %v, want %v", f.together, want)
	}
	for i, o := range out {
		if o.err != nil || o.rows != int64(i+1)*10 {
			t.Fatalf("write %d = %+v, want its own rows from the batch", i, o)
		}
	}
}

// A batch runs its statements in the order of their keys, those of one
// key in arrival order, and each write still gets its own outcome: two
// nodes' batches then lock rows in one order and cannot deadlock.
func TestCombinerBatchRunsInKeyOrder(t *testing.T) {
	f := &fakeDB{}
	c := f.combiner(1, 8)
	stmts := []string{"c", "a1", "bb", "a22"}
	out := queueKeyedBehindBlock(t, f, c, nil, stmts, []string{"c", "a", "b", "a"})
	if want := [][]string{{"a1", "a22", "bb", "c"}}; !slices.EqualFunc(f.together, want, slices.Equal) {
		t.Fatalf("together %v, want %v", f.together, want)
	}
	for i, o := range out {
		if o.err != nil || o.rows != int64(len(stmts[i]))*10 {
			t.Fatalf("write %s = %+v, want its own rows from the batch", stmts[i], o)
		}
	}
}

func TestCombinerRolledBackRunsEachAlone(t *testing.T) {
	f := &fakeDB{rolledBack: true, err: errors.New("refused")}
	c := f.combiner(1, 8)
	out := queueBehindBlock(t, f, c, nil, []string{"a", "bb"})
	for i, o := range out {
		if o.err != nil || o.rows != int64(i+1) {
			t.Fatalf("write %d = %+v, want it run again alone", i, o)
		}
	}
	slices.Sort(f.alone)
	if !slices.Equal(f.alone, []string{"a", "bb", "block"}) {
		t.Fatalf("alone %v", f.alone)
	}
}

func TestCombinerUnknownCommitFailsEveryWrite(t *testing.T) {
	broken := errors.New("connection lost during commit")
	f := &fakeDB{err: broken}
	c := f.combiner(1, 8)
	out := queueBehindBlock(t, f, c, nil, []string{"a", "bb"})
	for i, o := range out {
		if !errors.Is(o.err, broken) {
			t.Fatalf("write %d = %+v, want the batch's error", i, o)
		}
		if stores.NotSent(o.err) {
			t.Fatalf("write %d of a batch whose commit may have happened is marked not sent: %v", i, o.err)
		}
	}
	if !slices.Equal(f.alone, []string{"block"}) {
		t.Fatalf("ran again alone after an unknown commit: %v", f.alone)
	}
}

func TestCombinerDropsWritesWhoseCallerLeft(t *testing.T) {
	f := &fakeDB{}
	c := f.combiner(1, 8)
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	out := queueBehindBlock(t, f, c, []context.Context{context.Background(), gone, context.Background()}, []string{"a", "gone", "ccc"})
	if !errors.Is(out[1].err, context.Canceled) || !stores.NotSent(out[1].err) {
		t.Fatalf("cancelled write = %+v, want context.Canceled marked not sent", out[1])
	}
	if want := [][]string{{"a", "ccc"}}; !slices.EqualFunc(f.together, want, slices.Equal) {
		t.Fatalf("together %v, want %v: the cancelled write must not be sent", f.together, want)
	}
}

// A write whose caller leaves while its batch commits hears that batch's
// outcome, not its own context's error: a reservation that committed must
// not be reported as failed, or nobody releases or executes it.
func TestCombinerSentWriteWaitsForItsBatch(t *testing.T) {
	f := &fakeDB{}
	c := f.combiner(1, 8)
	leaving, leave := context.WithCancel(context.Background())
	defer leave()
	together := c.Together
	c.Together = func(sts []Statement[string]) ([]int64, bool, error) {
		leave() // the caller of "leaving" gives up while the batch commits,
		// and the commit takes a while longer
		time.Sleep(50 * time.Millisecond)
		return together(sts)
	}
	out := queueBehindBlock(t, f, c, []context.Context{context.Background(), leaving}, []string{"a", "leaving"})
	if o := out[1]; o.err != nil || o.rows != int64(len("leaving"))*10 {
		t.Fatalf("write whose caller left during the commit = %+v, want the batch's rows", o)
	}
}

// A write whose caller leaves while it still waits for a slot returns at
// once, and its error says it was never sent: the handler then starts no
// background undo for it (in an outage, one per waiting request).
func TestCombinerWriteLeftInTheQueueIsNotSent(t *testing.T) {
	f := &fakeDB{}
	c := f.combiner(1, 8)
	release := holdSlot(t, f, c)
	leaving, leave := context.WithCancel(context.Background())
	done := make(chan outcome, 1)
	go func() {
		n, err := c.Exec(leaving, Statement[string]{Stmt: "leaving"})
		done <- outcome{n, err}
	}()
	waitState(t, c, 1, 1)
	leave()
	o := <-done // while the slot is still held
	if !errors.Is(o.err, context.Canceled) || !stores.NotSent(o.err) {
		t.Fatalf("write that left the queue = %+v, want context.Canceled marked not sent", o)
	}
	release()
	waitState(t, c, 0, 0)
	if !slices.Equal(f.alone, []string{"block"}) || len(f.together) != 0 {
		t.Fatalf("alone %v, together %v: the write that left must not be sent", f.alone, f.together)
	}
}

// A batch that rolled back after its callers' time ran out (it waited out
// the timeout on a database that does not answer) runs none of its writes
// again alone, and each one hears that it was not sent.
func TestCombinerRolledBackAfterCallersLeftIsNotSent(t *testing.T) {
	f := &fakeDB{rolledBack: true, err: errors.New("timed out dialling")}
	c := f.combiner(1, 8)
	leaving, leave := context.WithCancel(context.Background())
	defer leave()
	together := c.Together
	c.Together = func(sts []Statement[string]) ([]int64, bool, error) {
		leave() // the callers' time runs out while the batch fails
		return together(sts)
	}
	out := queueBehindBlock(t, f, c, []context.Context{leaving, leaving}, []string{"a", "bb"})
	for i, o := range out {
		if !errors.Is(o.err, context.Canceled) || !stores.NotSent(o.err) {
			t.Fatalf("write %d = %+v, want context.Canceled marked not sent", i, o)
		}
	}
	if !slices.Equal(f.alone, []string{"block"}) {
		t.Fatalf("alone %v: a write whose caller left must not run again alone", f.alone)
	}
}
