package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestConformanceCombinedWrites(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

// combineFixture is a store with one flush slot, which block holds busy:
// a Reserve waits for the row lock of an uncommitted transaction on its
// key, so the writes that arrive meanwhile queue up and go as one batch
// once the transaction ends.
type combineFixture struct {
	t     *testing.T
	s     *Store
	table string
	admin *sql.DB
}

func newCombineFixture(t *testing.T) *combineFixture {
	s, cfg := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
	return &combineFixture{t: t, s: s, table: cfg.Table, admin: admin(t)}
}

// block takes the flush slot and returns what gives it back: it ends the
// blocking transaction without its row and waits for the blocked Reserve.
func (f *combineFixture) block() (release func()) {
	f.t.Helper()
	ctx := context.Background()
	key := storetest.NewKey(f.t)
	tx, err := f.admin.BeginTx(ctx, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { _ = tx.Rollback() })
	if _, err := tx.ExecContext(ctx, fmt.Sprintf("INSERT INTO %s (`key`, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at)"+
		" VALUES (?, 'op', '/p', 'p', 'f', 'in_flight', 'o', UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)", f.table), key); err != nil {
		f.t.Fatal(err)
	}
	blocked := make(chan error, 1)
	go func() {
		_, err := f.s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
		blocked <- err
	}()
	f.waitState(0, 1) // the blocked Reserve holds the slot
	return func() {
		f.t.Helper()
		if err := tx.Rollback(); err != nil {
			f.t.Fatal(err)
		}
		if err := <-blocked; err != nil {
			f.t.Fatal(err)
		}
	}
}

// waitState waits until queued writes wait behind flushing batches.
func (f *combineFixture) waitState(queued, flushing int) {
	f.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		q, fl := f.s.combined.State()
		if q == queued && fl == flushing {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("%d writes queued and %d flushing, want %d and %d", q, fl, queued, flushing)
		}
		time.Sleep(5 * time.Millisecond)
	}
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
	f.waitState(len(ops), 1)
	release()
	wg.Wait()
	f.waitState(0, 0)
	return errs
}

// commits reads the server's count of COMMIT statements: only a combined
// batch sends one (a statement alone commits by autocommit).
func (f *combineFixture) commits() int {
	f.t.Helper()
	var name string
	var n int
	if err := f.admin.QueryRow("SHOW GLOBAL STATUS LIKE 'Com_commit'").Scan(&name, &n); err != nil {
		f.t.Fatal(err)
	}
	return n
}

func reserveOps(f *combineFixture, rs []stores.Reservation, reserved []bool) []func() error {
	var ops []func() error
	for i, r := range rs {
		ops = append(ops, func() error {
			res, err := f.s.Reserve(context.Background(), r)
			reserved[i] = res.Reserved
			return err
		})
	}
	return ops
}

// Writes that queue behind a busy slot go as one transaction, and each
// learns its own outcome: reservations, then finalizations.
func TestCombinedWritesShareOneCommit(t *testing.T) {
	f := newCombineFixture(t)
	ctx := context.Background()
	var rs []stores.Reservation
	for range 8 {
		rs = append(rs, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
	}
	reserved := make([]bool, len(rs))
	before := f.commits()
	for i, err := range f.concurrently(reserveOps(f, rs, reserved)) {
		if err != nil || !reserved[i] {
			t.Fatalf("Reserve %d: reserved %v, %v", i, reserved[i], err)
		}
	}
	// The counter is the server's: a test of another package running at
	// the same time may add to it, but 8 writes alone would add nothing.
	if n := f.commits() - before; n < 1 || n >= len(rs) {
		t.Fatalf("8 queued reservations sent %d COMMITs, want the 1 of their batch", n)
	}

	var ops []func() error
	for _, r := range rs {
		ops = append(ops, func() error {
			return f.s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: []byte(r.Key)})
		})
	}
	before = f.commits()
	for i, err := range f.concurrently(ops) {
		if err != nil {
			t.Fatalf("Finalize %d: %v", i, err)
		}
	}
	if n := f.commits() - before; n < 1 || n >= len(rs) {
		t.Fatalf("8 queued finalizations sent %d COMMITs, want the 1 of their batch", n)
	}
	for _, r := range rs {
		rec, err := f.s.Load(ctx, r.Key)
		if err != nil || rec == nil || rec.State != stores.StateFinal || string(rec.Response.Body) != r.Key {
			t.Fatalf("Load(%s) = %+v, %v", r.Key, rec, err)
		}
	}
}

// When the server refuses one statement of a batch, the batch is rolled
// back: the other writes must not be reported done, and each runs again
// alone. A trigger refuses one reservation, as a real server error.
func TestCombinedBatchRefusedRunsEachAlone(t *testing.T) {
	f := newCombineFixture(t)
	ctx := context.Background()
	trigger := f.table + "_refuse"
	if _, err := f.admin.Exec(fmt.Sprintf("CREATE TRIGGER %s BEFORE INSERT ON %s FOR EACH ROW BEGIN\n"+
		"IF NEW.path = '/refused' THEN SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'; END IF;\nEND", trigger, f.table)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = f.admin.Exec("DROP TRIGGER IF EXISTS " + trigger) })

	var rs []stores.Reservation
	for range 6 {
		rs = append(rs, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
	}
	rs[3].Path = "/refused"
	reserved := make([]bool, len(rs))
	for i, err := range f.concurrently(reserveOps(f, rs, reserved)) {
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
}
