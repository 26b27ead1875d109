package sqltest

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// CombineRig runs the combined-writes tests against a SQL store whose
// sqlstore.Combiner has one flush slot. Block holds that slot busy (a
// Reserve waiting for the row lock of an uncommitted transaction), so the
// writes that arrive meanwhile queue up and go as one batch once release
// ends it.
type CombineRig struct {
	Store stores.Store
	// State is the combiner's (see sqlstore.Combiner.State).
	State func() (queued, flushing int)
	// Block takes the flush slot and returns what gives it back: it ends
	// the blocking transaction without its row and waits for the blocked
	// Reserve.
	Block func(t *testing.T) (release func())
	// Commits counts the transactions that last wrote the rows of keys
	// (exact), or, where the server cannot tell, the COMMIT statements it
	// ran since the previous call: only a combined batch sends one, and
	// a test running at the same time may add its own.
	Commits func(t *testing.T, keys []string) (n int, exact bool)
}

// WaitState waits until queued writes wait behind flushing batches.
func (r CombineRig) WaitState(t *testing.T, queued, flushing int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		q, fl := r.State()
		if q == queued && fl == flushing {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d writes queued and %d flushing, want %d and %d", q, fl, queued, flushing)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Concurrently blocks the slot, starts every op, waits until all of them
// queue behind it, releases it and returns their errors.
func (r CombineRig) Concurrently(t *testing.T, ops []func() error) []error {
	t.Helper()
	release := r.Block(t)
	r.WaitState(t, 0, 1)
	errs := make([]error, len(ops))
	var wg sync.WaitGroup
	for i, op := range ops {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = op()
		}()
	}
	r.WaitState(t, len(ops), 1)
	release()
	wg.Wait()
	r.WaitState(t, 0, 0)
	return errs
}

// reserveAll reserves each of rs behind the blocked slot and fails t unless
// exactly those at the indexes in refused failed.
func (r CombineRig) reserveAll(t *testing.T, rs []stores.Reservation, refused map[int]bool) {
	t.Helper()
	reserved := make([]bool, len(rs))
	var ops []func() error
	for i, res := range rs {
		ops = append(ops, func() error {
			out, err := r.Store.Reserve(context.Background(), res)
			reserved[i] = out.Reserved
			return err
		})
	}
	for i, err := range r.Concurrently(t, ops) {
		switch {
		case refused[i] && err == nil:
			t.Fatalf("Reserve %d: the refused reservation reported no error", i)
		case refused[i]:
		case err != nil || !reserved[i]:
			t.Fatalf("Reserve %d: reserved %v, %v", i, reserved[i], err)
		default:
			// Reported reserved: the row must be there, committed.
			rec, err := r.Store.Load(context.Background(), rs[i].Key)
			if err != nil || rec == nil || rec.Owner != rs[i].Owner {
				t.Fatalf("reserved %s but Load = %+v, %v", rs[i].Key, rec, err)
			}
		}
	}
}

func reservations(t *testing.T, n int) ([]stores.Reservation, []string) {
	var rs []stores.Reservation
	var keys []string
	for range n {
		r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
		rs = append(rs, r)
		keys = append(keys, r.Key)
	}
	return rs, keys
}

// checkOneCommit fails t unless the rows of keys were written by one
// transaction.
func (r CombineRig) checkOneCommit(t *testing.T, what string, keys []string) {
	t.Helper()
	n, exact := r.Commits(t, keys)
	if exact && n != 1 || !exact && (n < 1 || n >= len(keys)) {
		t.Fatalf("%d queued %s committed in %d transactions, want 1", len(keys), what, n)
	}
}

// RunCombined runs the combined-writes tests.
func RunCombined(t *testing.T, rig func(t *testing.T) CombineRig) {
	// Writes that queue behind a busy slot commit in one transaction,
	// and each learns its own outcome: reservations, then finalizations.
	t.Run("QueuedWritesShareOneCommit", func(t *testing.T) {
		r := rig(t)
		rs, keys := reservations(t, 8)
		r.Commits(t, keys)
		r.reserveAll(t, rs, nil)
		r.checkOneCommit(t, "reservations", keys)

		// Bodies come back byte for byte however a batch writes them:
		// every byte value (quotes, backslashes, NUL), and none at all.
		allBytes := make([]byte, 256)
		for i := range allBytes {
			allBytes[i] = byte(i)
		}
		bodies := make([][]byte, len(rs))
		var ops []func() error
		for i, res := range rs {
			bodies[i] = append([]byte(res.Key), allBytes...)
			if i == 0 {
				bodies[i] = []byte{}
			}
			ops = append(ops, func() error {
				return r.Store.Finalize(context.Background(), res.Key, res.Owner, stores.Response{Status: 200, Body: bodies[i]})
			})
		}
		for i, err := range r.Concurrently(t, ops) {
			if err != nil {
				t.Fatalf("Finalize %d: %v", i, err)
			}
		}
		r.checkOneCommit(t, "finalizations", keys)
		for i, res := range rs {
			rec, err := r.Store.Load(context.Background(), res.Key)
			if err != nil || rec == nil || rec.State != stores.StateFinal || !bytes.Equal(rec.Response.Body, bodies[i]) {
				t.Fatalf("Load(%s) = %+v, %v; want the body %q", res.Key, rec, err, bodies[i])
			}
		}
	})

	// When the server refuses one statement of a batch, nothing of the
	// batch committed: the other writes must not be reported done, and
	// each runs again alone. The rig's table refuses a reservation whose
	// path is /refused (a trigger: a real server error).
	t.Run("RefusedBatchRunsEachAlone", func(t *testing.T) {
		r := rig(t)
		rs, keys := reservations(t, 6)
		rs[3].Path = "/refused"
		r.Commits(t, keys)
		r.reserveAll(t, rs, map[int]bool{3: true})
		// The count is PostgreSQL's (the transactions that wrote the
		// rows); MySQL's is the server's Com_commit, which writes run
		// alone under autocommit do not move, and other tests do: there
		// the reservations' outcomes above are what is checked.
		if n, exact := r.Commits(t, keys); exact && n != 5 {
			t.Fatalf("5 reservations run again alone committed in %d transactions, want 5", n)
		}
	})

	// A write whose caller left while it waited for a slot is dropped
	// unsent: provably not executed, which its error says (stores.NotSent),
	// so that the handler does not undo it.
	t.Run("WriteLeftWhileQueuedIsNotSent", func(t *testing.T) {
		r := rig(t)
		release := r.Block(t)
		r.WaitState(t, 0, 1)
		res := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			_, err := r.Store.Reserve(ctx, res)
			done <- err
		}()
		r.WaitState(t, 1, 1)
		cancel()
		if err := <-done; err == nil || !stores.NotSent(err) {
			t.Fatalf("Reserve with its context cancelled while queued: err = %v, NotSent = %v; want an error marked not sent",
				err, stores.NotSent(err))
		}
		release()
		r.WaitState(t, 0, 0)
		if rec, err := r.Store.Load(context.Background(), res.Key); err != nil || rec != nil {
			t.Fatalf("the abandoned reservation was written: %+v, %v", rec, err)
		}
	})
}

// BatchGivenUpDoesNotCommitLater checks s, a store with one batch slot
// (state is its combiner's State) and a one-second statement timeout:
// a combined batch whose statements each wait for a row lock for less than
// the timeout, but together longer than its call's timeout, must not
// commit after its callers were told it failed. The driver gives up at the
// call's timeout; a server left running the rest of the batch would commit
// reservations nobody executes, each holding its key. hold takes a key's
// row lock in a transaction of its own (an uncommitted row) until rollback.
func BatchGivenUpDoesNotCommitLater(t *testing.T, s stores.Store, state func() (queued, flushing int),
	hold func(t *testing.T) (key string, rollback func())) {
	t.Helper()
	r := CombineRig{State: state}
	ctx := context.Background()
	slotKey, freeSlot := hold(t)
	go func() { _, _ = s.Reserve(ctx, storetest.Reservation(slotKey, storetest.Long, storetest.Long)) }()
	r.WaitState(t, 0, 1)
	a, freeA := hold(t)
	b, freeB := hold(t)
	late := storetest.NewKey(t) // UUIDv7: after a and b in the batch's key order
	errs := make(chan error, 3)
	for i, key := range []string{a, b, late} {
		go func() {
			_, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
			errs <- err
		}()
		r.WaitState(t, i+1, 1)
	}
	freeSlot() // the batch [a, b, late] starts
	// Each lock is freed before the statement timeout; the two waits
	// together outlast the call's.
	time.Sleep(800 * time.Millisecond)
	freeA()
	time.Sleep(800 * time.Millisecond)
	freeB()
	for range 3 {
		if err := <-errs; err == nil {
			t.Fatal("a Reserve of the batch succeeded; want the batch to outlast its call")
		}
	}
	time.Sleep(time.Second) // where the batch, left running, committed
	if rec, err := s.Load(ctx, late); err != nil || rec != nil {
		t.Fatalf("the last reservation of a batch whose call failed = %+v, %v; want none: it committed after its caller gave up", rec, err)
	}
}
