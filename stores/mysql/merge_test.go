package mysql

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// batchOf returns a batch's statements in key order, as the Combiner hands
// them over: fresh reservations of keys, finalizations of finals, and a
// reservation overwriting an expired row of others.
func batchOf(q queries, fresh, finals, others []string) []sqlstore.Statement[write] {
	var sts []sqlstore.Statement[write]
	for _, k := range fresh {
		sts = append(sts, sqlstore.Statement[write]{Key: k, Stmt: write{sql: q.reserveFresh, merge: mergeInsert},
			Args: []any{k, "op", "/p", "principal", "fingerprint", nil, "owner-" + k, int64(1), int64(2)}})
	}
	for _, k := range finals {
		sts = append(sts, sqlstore.Statement[write]{Key: k, Stmt: write{sql: q.finalize, merge: mergeFinalize},
			Args: []any{200, "{}", []byte("body of " + k), nil, k, "owner-" + k}})
	}
	for _, k := range others {
		sts = append(sts, sqlstore.Statement[write]{Key: k, Stmt: write{sql: q.reserve},
			Args: []any{k, "op", "/p", "principal", "fingerprint", nil, "owner-" + k, int64(1), int64(2)}})
	}
	slices.SortStableFunc(sts, func(a, b sqlstore.Statement[write]) int { return strings.Compare(a.Key, b.Key) })
	return sts
}

// A batch sends each mergeable kind as one statement, and each statement
// of the batch gets its own outcome back from the server's results.
func TestBatchQueryMergesEachKind(t *testing.T) {
	q := newQueries("records")
	sts := batchOf(q, []string{"a1", "c1", "e1"}, []string{"b1", "d1", "f1"}, []string{"g1"})
	bq, err := newBatchQuery(q, sts, true)
	if err != nil {
		t.Fatal(err)
	}
	text := bq.text.String()
	for stmt, want := range map[string]int{"INSERT INTO records": 2, "UPDATE records": 1, "ROW_COUNT() <> 3": 1, "COMMIT": 1} {
		if n := strings.Count(text, stmt); n != want {
			t.Errorf("%d × %q in the batch, want %d:\n%s", n, stmt, want, text)
		}
	}
	if got, want := strings.Count(text, "?"), len(bq.args); got != want {
		t.Errorf("%d placeholders for %d arguments", got, want)
	}
	// START, the INSERT's bound, INSERT of 3, UPDATE of 3, its guard, the
	// other INSERT, COMMIT.
	out, err := bq.outcomes([]int64{0, 1, 3, 3, 0, 2, 0})
	if err != nil {
		t.Fatal(err)
	}
	if want := []int64{1, 1, 1, 1, 1, 1, 2}; !slices.Equal(out, want) {
		t.Errorf("outcomes %v, want %v", out, want)
	}
	for _, rows := range [][]int64{{0, 1, 2, 3, 0, 2, 0}, {0, 1, 3, 2, 0, 2, 0}, {0, 1, 3, 3, 0, 2}} {
		if _, err := bq.outcomes(rows); err == nil {
			t.Errorf("outcomes(%v) reported no error", rows)
		}
	}
}

// Statements of one kind on one key each need their own outcome, so they
// go unmerged; a kind with one statement goes as that statement.
func TestBatchQueryLeavesRepeatedKeysUnmerged(t *testing.T) {
	q := newQueries("records")
	bq, err := newBatchQuery(q, batchOf(q, []string{"a1", "a1", "b1"}, []string{"c1"}, nil), true)
	if err != nil {
		t.Fatal(err)
	}
	text := bq.text.String()
	if n := strings.Count(text, "ON DUPLICATE KEY UPDATE `key` = `key`"); n != 3 {
		t.Errorf("%d single reservations, want 3:\n%s", n, text)
	}
	if strings.Contains(text, "CASE") || strings.Contains(text, "ROW_COUNT()") {
		t.Errorf("a lone finalization was merged:\n%s", text)
	}
	out, err := bq.outcomes([]int64{0, 1, 0, 1, 1, 0})
	if err != nil || !slices.Equal(out, []int64{1, 0, 1, 1}) {
		t.Errorf("outcomes = %v, %v", out, err)
	}
}

// Reservations merged into one INSERT meet keys that exist: one final,
// one in flight for another reservation. The server refuses the INSERT,
// and the batch goes again unmerged, in one transaction still, where each
// reservation gets its own answer.
func TestMergedReservationsMeetExistingKeys(t *testing.T) {
	r, s, _ := combineRig(t)
	ctx := context.Background()
	final := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	inFlight := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	for _, res := range []stores.Reservation{final, inFlight} {
		if out, err := s.Reserve(ctx, res); err != nil || !out.Reserved {
			t.Fatalf("Reserve = %+v, %v", out, err)
		}
	}
	if err := s.Finalize(ctx, final.Key, final.Owner, stores.Response{Status: 200, Body: []byte("done")}); err != nil {
		t.Fatal(err)
	}
	var rs []stores.Reservation
	for range 5 {
		rs = append(rs, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
	}
	rs = append(rs,
		storetest.Reservation(final.Key, storetest.Long, storetest.Long),
		storetest.Reservation(inFlight.Key, storetest.Long, storetest.Long))
	results := make([]stores.ReserveResult, len(rs))
	var ops []func() error
	for i, res := range rs {
		ops = append(ops, func() (err error) {
			results[i], err = s.Reserve(ctx, res)
			return err
		})
	}
	r.Commits(t, nil)
	for i, err := range r.Concurrently(t, ops) {
		if err != nil {
			t.Fatalf("Reserve %d: %v", i, err)
		}
	}
	// The unmerged batch commits with a COMMIT statement; statements run
	// alone commit without one.
	if n, _ := r.Commits(t, nil); n < 1 {
		t.Errorf("the refused merged batch was not sent again as one batch (%d COMMIT statements)", n)
	}
	for i := range 5 {
		if !results[i].Reserved {
			t.Errorf("fresh key %d not reserved: %+v", i, results[i])
		}
		if rec, err := s.Load(ctx, rs[i].Key); err != nil || rec == nil || rec.Owner != rs[i].Owner {
			t.Errorf("fresh key %d reserved but Load = %+v, %v", i, rec, err)
		}
	}
	if ex := results[5].Existing; results[5].Reserved || ex == nil || ex.State != stores.StateFinal || string(ex.Response.Body) != "done" {
		t.Errorf("the final key: %+v, want its final record", results[5])
	}
	if ex := results[6].Existing; results[6].Reserved || ex == nil || ex.State != stores.StateInFlight || ex.Owner != inFlight.Owner {
		t.Errorf("the key in flight: %+v, want the other reservation's record", results[6])
	}
}

// Finalizations merged into one UPDATE, one of them on a record another
// node has taken over: that one must learn it no longer owns the record
// and leave it as it is; the others finalize, in one transaction still
// (the batch goes again unmerged). Without the guard the merged UPDATE
// would report every finalization done.
func TestMergedFinalizeLeavesAnotherOwnersRecord(t *testing.T) {
	r, s, cfg := combineRig(t)
	finalizeOneTakenOver(t, r, s, cfg)
}

// A DSN's sql_select_limit would apply to the guard's SELECT too, and must
// not let it pass. The store sets sql_select_limit=DEFAULT on its sessions
// whatever the DSN says (storeSessionVars); the guard's own LIMIT holds
// without that.
func TestMergedFinalizeGuardHoldsUnderSelectLimit(t *testing.T) {
	r, s, cfg := combineRig(t, func(c *Config) {
		sep := "?"
		if strings.Contains(c.DSN, "?") {
			sep = "&"
		}
		c.DSN += sep + "sql_select_limit=1"
	})
	finalizeOneTakenOver(t, r, s, cfg)
}

func finalizeOneTakenOver(t *testing.T, r sqltest.CombineRig, s *Store, cfg Config) {
	ctx := context.Background()
	var rs []stores.Reservation
	var keys []string
	for range 6 {
		res := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
		if out, err := s.Reserve(ctx, res); err != nil || !out.Reserved {
			t.Fatalf("Reserve = %+v, %v", out, err)
		}
		rs = append(rs, res)
		keys = append(keys, res.Key)
	}
	const taken = 2
	if _, err := admin(t).Exec(fmt.Sprintf("UPDATE %s SET owner = 'another node' WHERE `key` = ?", cfg.Table), rs[taken].Key); err != nil {
		t.Fatal(err)
	}
	var ops []func() error
	for i, res := range rs {
		ops = append(ops, func() error {
			return s.Finalize(ctx, res.Key, res.Owner, stores.Response{Status: 201, Body: []byte(fmt.Sprintf("answer %d", i))})
		})
	}
	r.Commits(t, keys)
	for i, err := range r.Concurrently(t, ops) {
		switch {
		case i == taken && !errors.Is(err, stores.ErrNotOwner):
			t.Errorf("Finalize of the record taken over = %v, want ErrNotOwner", err)
		case i != taken && err != nil:
			t.Errorf("Finalize %d: %v", i, err)
		}
	}
	for i, res := range rs {
		rec, err := s.Load(ctx, res.Key)
		switch {
		case err != nil || rec == nil:
			t.Errorf("Load %d = %+v, %v", i, rec, err)
		case i == taken && (rec.State != stores.StateInFlight || rec.Owner != "another node"):
			t.Errorf("the record taken over became %+v, want it in flight for its new owner", rec)
		case i != taken && (rec.State != stores.StateFinal || rec.Response.Status != 201 ||
			!bytes.Equal(rec.Response.Body, []byte(fmt.Sprintf("answer %d", i)))):
			t.Errorf("record %d = %+v, want its own final answer", i, rec)
		}
	}
	// The unmerged batch commits with a COMMIT statement; statements run
	// alone commit without one.
	if n, _ := r.Commits(t, keys); n < 1 {
		t.Errorf("the refused merged batch was not sent again as one batch (%d COMMIT statements)", n)
	}
}

// A committed batch with both merged statements and an upsert that
// overwrites an expired row: each statement's count comes back to it, the
// upsert's 2 among the merged statements' 1s.
func TestBatchWithUpsertOverExpiredRow(t *testing.T) {
	s, cfg := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
	ctx := context.Background()
	expired := insertExpired(t, admin(t), cfg.Table)
	reserveArgs := func(r stores.Reservation) []any {
		return []any{r.Key, r.Operation, r.Path, r.Principal, r.Fingerprint, sqlstore.SendDeadline, r.Owner, sqlstore.Micros(r.Lease), sqlstore.Micros(r.RecordTTL())}
	}
	var sts []sqlstore.Statement[write]
	var fresh, owned []stores.Reservation
	for range 2 {
		r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
		fresh = append(fresh, r)
		sts = append(sts, sqlstore.Statement[write]{Key: r.Key, Stmt: write{sql: s.q.reserveFresh, merge: mergeInsert}, Args: reserveArgs(r)})
		o := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
		if out, err := s.Reserve(ctx, o); err != nil || !out.Reserved {
			t.Fatalf("Reserve = %+v, %v", out, err)
		}
		owned = append(owned, o)
		sts = append(sts, sqlstore.Statement[write]{Key: o.Key, Stmt: write{sql: s.q.finalize, merge: mergeFinalize},
			Args: []any{nil, nil, []byte("sealed " + o.Key), "key-1", o.Key, o.Owner}})
	}
	over := storetest.Reservation(expired, storetest.Long, storetest.Long)
	sts = append(sts, sqlstore.Statement[write]{Key: expired, Stmt: write{sql: s.q.reserve}, Args: reserveArgs(over)})
	slices.SortStableFunc(sts, func(a, b sqlstore.Statement[write]) int { return strings.Compare(a.Key, b.Key) })

	rows, rolledBack, err := s.execTogether(sts)
	if err != nil {
		t.Fatalf("execTogether: rolled back %v, %v", rolledBack, err)
	}
	for i, st := range sts {
		want := int64(1)
		if st.Key == expired {
			want = 2
		}
		if rows[i] != want {
			t.Errorf("statement %d on %s changed %d rows, want %d", i, st.Key, rows[i], want)
		}
	}
	for _, r := range append(fresh, over) {
		if rec, err := s.Load(ctx, r.Key); err != nil || rec == nil || rec.State != stores.StateInFlight || rec.Owner != r.Owner {
			t.Errorf("reserved %s, then Load = %+v, %v", r.Key, rec, err)
		}
	}
	for _, o := range owned {
		rec, err := s.Load(ctx, o.Key)
		if err != nil || rec == nil || rec.State != stores.StateFinal || rec.Response.KeyID != "key-1" || string(rec.Response.Body) != "sealed "+o.Key {
			t.Errorf("finalized %s sealed, then Load = %+v, %v", o.Key, rec, err)
		}
	}
}

// insertExpired inserts a final row for a fresh key that expired an hour
// ago and was not purged, and returns its key.
func insertExpired(t *testing.T, db *sql.DB, table string) string {
	t.Helper()
	key := storetest.NewKey(t)
	if _, err := db.Exec(fmt.Sprintf("INSERT INTO %s (`key`, operation, path, principal, fingerprint, state, status, created_at, expires_at)"+
		" VALUES (?, 'op', '/p', 'p', 'f', 'final', 200, UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR)", table), key); err != nil {
		t.Fatal(err)
	}
	return key
}

// BenchmarkBatchQuery builds a batch of 8 fresh reservations and 8
// finalizations with 2 KB bodies, the shape of a busy node's batch.
func BenchmarkBatchQuery(b *testing.B) {
	q := newQueries("records")
	var fresh, finals []string
	for i := range 8 {
		fresh = append(fresh, fmt.Sprintf("a%02d", i))
		finals = append(finals, fmt.Sprintf("b%02d", i))
	}
	sts := batchOf(q, fresh, finals, nil)
	body := bytes.Repeat([]byte(`{"k":"v"}`), 228)
	for i := range sts {
		if sts[i].Stmt.merge == mergeFinalize {
			sts[i].Args[2] = body
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := newBatchQuery(q, sts, true); err != nil {
			b.Fatal(err)
		}
	}
}

// Random mixes of the writes a batch merges, each queued behind the busy
// slot so that they go as one batch, and each checked against the outcome
// it has alone: fresh keys reserve; a key whose record is final, in
// flight for someone else, reserved twice in the batch or expired gets
// what a lone Reserve gets; a finalization of a record the node owns
// finalizes it, of a record taken over or gone reports ErrNotOwner and
// changes nothing.
func TestMergedBatchesMatchStatementsAlone(t *testing.T) {
	r, s, cfg := combineRig(t)
	db := admin(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(11, uint64(time.Now().UnixNano())))
	long := func(key string) stores.Reservation { return storetest.Reservation(key, storetest.Long, storetest.Long) }
	reserve := func(res stores.Reservation) {
		t.Helper()
		if out, err := s.Reserve(ctx, res); err != nil || !out.Reserved {
			t.Fatalf("Reserve = %+v, %v", out, err)
		}
	}
	for round := range 6 {
		type check func(t *testing.T)
		var ops []func() error
		var checks []check

		// Reservations.
		for range 1 + rng.IntN(6) {
			res := long(storetest.NewKey(t))
			var out stores.ReserveResult
			ops = append(ops, func() (err error) { out, err = s.Reserve(ctx, res); return err })
			checks = append(checks, func(t *testing.T) {
				if rec, err := s.Load(ctx, res.Key); !out.Reserved || err != nil || rec == nil || rec.Owner != res.Owner {
					t.Errorf("round %d: fresh key: %+v, then Load = %+v, %v", round, out, rec, err)
				}
			})
		}
		for range rng.IntN(3) {
			first := long(storetest.NewKey(t))
			reserve(first)
			if err := s.Finalize(ctx, first.Key, first.Owner, stores.Response{Status: 204}); err != nil {
				t.Fatal(err)
			}
			res := long(first.Key)
			var out stores.ReserveResult
			ops = append(ops, func() (err error) { out, err = s.Reserve(ctx, res); return err })
			checks = append(checks, func(t *testing.T) {
				if out.Reserved || out.Existing == nil || out.Existing.State != stores.StateFinal || out.Existing.Response.Status != 204 {
					t.Errorf("round %d: final key: %+v", round, out)
				}
			})
		}
		for range rng.IntN(3) {
			first := long(storetest.NewKey(t))
			reserve(first)
			res := long(first.Key)
			var out stores.ReserveResult
			ops = append(ops, func() (err error) { out, err = s.Reserve(ctx, res); return err })
			checks = append(checks, func(t *testing.T) {
				if out.Reserved || out.Existing == nil || out.Existing.State != stores.StateInFlight || out.Existing.Owner != first.Owner {
					t.Errorf("round %d: key in flight elsewhere: %+v", round, out)
				}
			})
		}
		for range rng.IntN(3) {
			key := insertExpired(t, db, cfg.Table)
			res := long(key)
			var out stores.ReserveResult
			ops = append(ops, func() (err error) { out, err = s.Reserve(ctx, res); return err })
			checks = append(checks, func(t *testing.T) {
				if rec, err := s.Load(ctx, key); !out.Reserved || err != nil || rec == nil || rec.Owner != res.Owner || rec.State != stores.StateInFlight {
					t.Errorf("round %d: expired key: %+v, then Load = %+v, %v", round, out, rec, err)
				}
			})
		}
		if rng.IntN(2) == 0 {
			key := storetest.NewKey(t)
			a, b := long(key), long(key)
			var outA, outB stores.ReserveResult
			ops = append(ops,
				func() (err error) { outA, err = s.Reserve(ctx, a); return err },
				func() (err error) { outB, err = s.Reserve(ctx, b); return err })
			checks = append(checks, func(t *testing.T) {
				if outA.Reserved == outB.Reserved {
					t.Errorf("round %d: one key reserved twice in a batch: %+v and %+v", round, outA, outB)
				}
			})
		}

		// Finalizations.
		for i := range rng.IntN(7) {
			res := long(storetest.NewKey(t))
			reserve(res)
			body := []byte(fmt.Sprintf("round %d answer %d '\\\"", round, i))
			// Sealed answers (a key id, no status or headers) and clear
			// ones share the merged UPDATE's CASEs.
			resp := stores.Response{Status: 200, Header: http.Header{"Etag": {`"v'1\\"`}}, Body: body}
			if rng.IntN(2) == 0 {
				resp = stores.Response{KeyID: "key-1", Body: body}
			}
			var err error
			ops = append(ops, func() error {
				err = s.Finalize(ctx, res.Key, res.Owner, resp)
				return nil
			})
			checks = append(checks, func(t *testing.T) {
				rec, lerr := s.Load(ctx, res.Key)
				if err != nil || lerr != nil || rec == nil || rec.State != stores.StateFinal || rec.Response.Status != resp.Status ||
					rec.Response.KeyID != resp.KeyID || rec.Response.Header.Get("Etag") != resp.Header.Get("Etag") || !bytes.Equal(rec.Response.Body, body) {
					t.Errorf("round %d: owned record: Finalize = %v, then Load = %+v, %v; want %+v", round, err, rec, lerr, resp)
				}
			})
		}
		for range rng.IntN(3) {
			res := long(storetest.NewKey(t))
			reserve(res)
			if _, err := db.Exec(fmt.Sprintf("UPDATE %s SET owner = 'another node' WHERE `key` = ?", cfg.Table), res.Key); err != nil {
				t.Fatal(err)
			}
			var err error
			ops = append(ops, func() error {
				err = s.Finalize(ctx, res.Key, res.Owner, stores.Response{Status: 200, Body: []byte("late")})
				return nil
			})
			checks = append(checks, func(t *testing.T) {
				rec, lerr := s.Load(ctx, res.Key)
				if !errors.Is(err, stores.ErrNotOwner) || lerr != nil || rec == nil || rec.State != stores.StateInFlight || rec.Owner != "another node" {
					t.Errorf("round %d: record taken over: Finalize = %v, then Load = %+v, %v", round, err, rec, lerr)
				}
			})
		}
		if rng.IntN(2) == 0 {
			res := long(storetest.NewKey(t))
			var err error
			ops = append(ops, func() error {
				err = s.Finalize(ctx, res.Key, res.Owner, stores.Response{Status: 200})
				return nil
			})
			checks = append(checks, func(t *testing.T) {
				if rec, lerr := s.Load(ctx, res.Key); !errors.Is(err, stores.ErrNotOwner) || lerr != nil || rec != nil {
					t.Errorf("round %d: record gone: Finalize = %v, then Load = %+v, %v", round, err, rec, lerr)
				}
			})
		}

		rng.Shuffle(len(ops), func(i, j int) { ops[i], ops[j] = ops[j], ops[i] })
		for i, err := range r.Concurrently(t, ops) {
			if err != nil {
				t.Fatalf("round %d: op %d: %v", round, i, err)
			}
		}
		for _, c := range checks {
			c(t)
		}
	}
}
