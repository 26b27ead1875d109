package postgres

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestConformanceCombinedWrites(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, func(c *Config) { c.ListenNotify = true; c.CombinedWrites = 1 })
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

func TestReserveRaceCombinedWrites(t *testing.T) {
	s, _ := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
	reserveRace(t, s)
}

// combineFixture is a store with one flush slot, which block holds busy:
// a Reserve waits for the row of an uncommitted transaction on its key, so
// the writes that arrive meanwhile queue up and go as one batch once the
// transaction ends.
type combineFixture struct {
	t     *testing.T
	s     *Store
	table string
}

func newCombineFixture(t *testing.T) *combineFixture {
	s, cfg := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
	return &combineFixture{t: t, s: s, table: cfg.Table}
}

// block takes the flush slot and returns what gives it back: it ends the
// blocking transaction without its row and waits for the blocked Reserve.
func (f *combineFixture) block() (release func()) {
	f.t.Helper()
	ctx := context.Background()
	key := storetest.NewKey(f.t)
	tx, err := admin(f.t).Begin(ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (key, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at)
VALUES ($1, 'op', '/p', 'p', 'f', 'in_flight', 'o', now() + interval '1 hour', now(), now() + interval '1 hour')`, f.table), key); err != nil {
		f.t.Fatal(err)
	}
	blocked := make(chan error, 1)
	go func() {
		_, err := f.s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
		blocked <- err
	}()
	f.waitQueued(0) // the blocked Reserve holds the slot
	return func() {
		f.t.Helper()
		if err := tx.Rollback(ctx); err != nil {
			f.t.Fatal(err)
		}
		if err := <-blocked; err != nil {
			f.t.Fatal(err)
		}
	}
}

// waitQueued waits until n writes wait behind the busy slot.
func (f *combineFixture) waitQueued(n int) {
	f.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		queued, flushing := f.s.combined.State()
		if flushing == 1 && queued == n {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("%d writes queued and %d flushing, want %d and 1", queued, flushing, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitIdle waits until no write is queued or flushing.
func (f *combineFixture) waitIdle() {
	f.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		queued, flushing := f.s.combined.State()
		if queued == 0 && flushing == 0 {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("%d writes queued and %d flushing, want none", queued, flushing)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// commits returns how many distinct transactions wrote keys' rows as they
// are now.
func (f *combineFixture) commits(keys []string) int {
	f.t.Helper()
	var n int
	if err := admin(f.t).QueryRow(context.Background(),
		fmt.Sprintf(`SELECT count(DISTINCT xmin::text) FROM %s WHERE key = ANY($1)`, f.table), keys).Scan(&n); err != nil {
		f.t.Fatal(err)
	}
	return n
}

// concurrently runs each op at once, waits until all of them queue behind
// the blocked slot, releases it and returns their errors.
func (f *combineFixture) concurrently(ops []func() error) []error {
	f.t.Helper()
	release := f.block()
	errs := make([]error, len(ops))
	var wg sync.WaitGroup
	for i, op := range ops {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = op()
		}()
	}
	f.waitQueued(len(ops))
	release()
	wg.Wait()
	return errs
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

// Writes that queue behind a busy slot commit in one transaction, and each
// learns its own outcome: reservations, then finalizations.
func TestCombinedWritesShareOneCommit(t *testing.T) {
	f := newCombineFixture(t)
	ctx := context.Background()
	rs, keys := reservations(t, 8)
	reserved := make([]bool, len(rs))
	var ops []func() error
	for i, r := range rs {
		ops = append(ops, func() error {
			res, err := f.s.Reserve(ctx, r)
			reserved[i] = res.Reserved
			return err
		})
	}
	for i, err := range f.concurrently(ops) {
		if err != nil || !reserved[i] {
			t.Fatalf("Reserve %d: reserved %v, %v", i, reserved[i], err)
		}
	}
	if n := f.commits(keys); n != 1 {
		t.Fatalf("8 queued reservations committed in %d transactions, want 1", n)
	}

	ops = ops[:0]
	for _, r := range rs {
		ops = append(ops, func() error {
			return f.s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: []byte(r.Key)})
		})
	}
	for i, err := range f.concurrently(ops) {
		if err != nil {
			t.Fatalf("Finalize %d: %v", i, err)
		}
	}
	if n := f.commits(keys); n != 1 {
		t.Fatalf("8 queued finalizations committed in %d transactions, want 1", n)
	}
	for _, r := range rs {
		rec, err := f.s.Load(ctx, r.Key)
		if err != nil || rec == nil || rec.State != stores.StateFinal || string(rec.Response.Body) != r.Key {
			t.Fatalf("Load(%s) = %+v, %v", r.Key, rec, err)
		}
	}
}

// When the server refuses one statement of a batch, the whole batch rolled
// back: the other writes must not be reported done, and each runs again
// alone. A trigger refuses one reservation, as a real server error.
func TestCombinedBatchRefusedRunsEachAlone(t *testing.T) {
	f := newCombineFixture(t)
	ctx := context.Background()
	conn := admin(t)
	if _, err := conn.Exec(ctx, fmt.Sprintf(`CREATE FUNCTION %[1]s_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.path = '/refused' THEN RAISE EXCEPTION 'refused by the test'; END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER refuse BEFORE INSERT ON %[1]s FOR EACH ROW EXECUTE FUNCTION %[1]s_refuse();`, f.table)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin(t).Exec(context.Background(), fmt.Sprintf("DROP FUNCTION IF EXISTS %s_refuse() CASCADE", f.table))
	})

	rs, keys := reservations(t, 6)
	rs[3].Path = "/refused"
	reserved := make([]bool, len(rs))
	var ops []func() error
	for i, r := range rs {
		ops = append(ops, func() error {
			res, err := f.s.Reserve(ctx, r)
			reserved[i] = res.Reserved
			return err
		})
	}
	errs := f.concurrently(ops)
	for i, err := range errs {
		if i == 3 {
			if err == nil {
				t.Fatal("the refused reservation reported no error")
			}
			continue
		}
		if err != nil || !reserved[i] {
			t.Fatalf("Reserve %d: reserved %v, %v", i, reserved[i], err)
		}
		rec, err := f.s.Load(ctx, rs[i].Key)
		if err != nil || rec == nil || rec.Owner != rs[i].Owner {
			t.Fatalf("reserved %s but Load = %+v, %v", rs[i].Key, rec, err)
		}
	}
	if n := f.commits(keys); n != 5 {
		t.Fatalf("5 reservations run again alone committed in %d transactions, want 5", n)
	}
}

// A write whose caller left while it waited is dropped unsent: provably
// not executed.
func TestCombinedWriteLeftWhileQueuedIsNotSent(t *testing.T) {
	f := newCombineFixture(t)
	release := f.block()
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := f.s.Reserve(ctx, r)
		done <- err
	}()
	f.waitQueued(1)
	cancel()
	if err := <-done; err == nil {
		t.Fatal("Reserve with its context cancelled while queued reported no error")
	}
	release()
	f.waitIdle()
	if rec, err := f.s.Load(context.Background(), r.Key); err != nil || rec != nil {
		t.Fatalf("the abandoned reservation was written: %+v, %v", rec, err)
	}
}
