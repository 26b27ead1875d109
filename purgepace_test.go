package icebergidempotency

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// The limit follows how long each statement took: halved after a slow one
// (never below 1), doubled after a fast one (never above cleanup_batch),
// kept in between; the pause is twice the statement's time.
func TestPurgePacerFollowsStatementTime(t *testing.T) {
	p := newPurgePacer(1000)
	steps := []struct {
		took      time.Duration
		wantLimit int
	}{
		{200 * time.Millisecond, 500},
		{120 * time.Millisecond, 250},
		{30 * time.Millisecond, 250}, // within the target: kept
		{60 * time.Millisecond, 125},
		{5 * time.Millisecond, 250},
		{5 * time.Millisecond, 500},
		{5 * time.Millisecond, 1000},
		{5 * time.Millisecond, 1000}, // never above cleanup_batch
	}
	for i, st := range steps {
		if pause := p.next(st.took); pause != 2*st.took {
			t.Fatalf("step %d: pause %v after a statement of %v, want %v", i, pause, st.took, 2*st.took)
		}
		if p.limit != st.wantLimit {
			t.Fatalf("step %d: limit %d after a statement of %v, want %d", i, p.limit, st.took, st.wantLimit)
		}
	}
	p = newPurgePacer(3)
	for range 5 {
		p.next(time.Second)
	}
	if p.limit != 1 {
		t.Fatalf("limit %d after slow statements, want 1 (never 0)", p.limit)
	}
}

// rowCostPurger is a store whose purge statement takes perRecord for each
// record it deletes (a store of large answers); it records each limit.
type rowCostPurger struct {
	stores.Store
	left      int
	perRecord time.Duration
	limits    []int
}

func (s *rowCostPurger) PurgeExpired(_ context.Context, limit int) (int, error) {
	s.limits = append(s.limits, limit)
	n := min(limit, s.left)
	time.Sleep(time.Duration(n) * s.perRecord)
	s.left -= n
	return n, nil
}

// Records so heavy that a full cleanup_batch takes well over the target
// make the run delete fewer per statement, and the run still ends with
// none left: a statement that deletes fewer than its own limit (not
// cleanup_batch) ends it.
func TestPurgeShrinksHeavyBatches(t *testing.T) {
	s := &rowCostPurger{Store: newMemoryStore(t), left: 40, perRecord: 10 * time.Millisecond}
	app := &App{CleanupBatch: 16}
	if err := app.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	app.track("heavy/test", s)
	app.PurgeOnce(t.Context())
	if s.left != 0 {
		t.Fatalf("%d records left after the run (limits %v)", s.left, s.limits)
	}
	// Each statement of at least 6 records took at least 60 ms, over
	// the target, so every limit after the first is below the one
	// before until the statements get cheap.
	if len(s.limits) < 3 || s.limits[1] >= s.limits[0] || s.limits[2] >= s.limits[1] {
		t.Fatalf("limits %v: want each slow statement's limit halved", s.limits)
	}
}

// timingOutPurger stands in for a SQL store whose purge statement runs
// past statement_timeout when it deletes more than fits (a real server's
// timeout depends on the machine's speed, which a test cannot fix): such a
// statement takes slow, fails with a transient error and deletes nothing,
// as the real one is rolled back. A refusing one fails at once.
type timingOutPurger struct {
	stores.Store
	left, fits int
	slow       time.Duration
	refusing   bool
	unready    bool // fails slowly: its first contact with the database hangs
	unplugged  bool // fails slowly: a ready store whose connect hangs
	limits     []int
}

func (s *timingOutPurger) PurgeExpired(_ context.Context, limit int) (int, error) {
	s.limits = append(s.limits, limit)
	if s.unready {
		time.Sleep(s.slow)
		return 0, sqlstore.MarkTransient(fmt.Errorf("postgres %w: postgres connect: %w", sqlstore.ErrNotReady, context.DeadlineExceeded))
	}
	if s.unplugged {
		time.Sleep(s.slow)
		return 0, sqlstore.MarkTransient(sqlstore.MarkNoConnection(fmt.Errorf("postgres purge: %w", context.DeadlineExceeded)))
	}
	if s.refusing {
		return 0, sqlstore.MarkTransient(errors.New("postgres purge: dial tcp 127.0.0.1:5432: connection refused"))
	}
	if limit > s.fits {
		time.Sleep(s.slow)
		return 0, sqlstore.MarkTransient(errors.New("postgres purge: timeout: context deadline exceeded"))
	}
	n := min(limit, s.left)
	s.left -= n
	return n, nil
}

// A purge statement that times out is retried with half its limit, and
// the next run starts below the limit that failed. Before, the run gave up
// at the first timeout and the next run tried the same limit again: with
// cleanup_batch over what fits in statement_timeout, nothing was ever
// purged and the table only grew.
func TestPurgeShrinksATimedOutBatch(t *testing.T) {
	s := &timingOutPurger{Store: newMemoryStore(t), left: 1000, fits: 100, slow: 2 * purgeTarget}
	app := &App{CleanupBatch: 1000}
	if err := app.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	app.track("timeout/test", s)
	app.PurgeOnce(t.Context())
	if s.left != 0 {
		t.Fatalf("%d records left after the run (limits %v)", s.left, s.limits)
	}
	if want := []int{1000, 500, 250, 125, 62}; !slices.Equal(s.limits[:5], want) {
		t.Fatalf("limits %v: want %v first, each timed-out limit halved", s.limits, want)
	}
	if m := slices.Max(s.limits[4:]); m > 62 {
		t.Fatalf("limits %v: grew back to %d, past half the last limit that timed out", s.limits, m)
	}

	s.left, s.limits = 300, nil
	app.PurgeOnce(t.Context())
	if s.left != 0 || slices.Max(s.limits) > s.fits {
		t.Fatalf("second run: %d left, limits %v: want it to start below the limit that timed out", s.left, s.limits)
	}
	// A run without failures lets the limit grow again, up to where it
	// times out once more.
	s.left, s.limits = 1000, nil
	app.PurgeOnce(t.Context())
	if s.left != 0 || slices.Max(s.limits) != 124 {
		t.Fatalf("third run: %d left, limits %v: want it to try 124 after a clean run", s.left, s.limits)
	}
}

// A transient error that comes at once (a refused connection) says
// nothing about the batch: it is logged, not retried smaller.
func TestPurgeDoesNotShrinkOnARefusal(t *testing.T) {
	s := &timingOutPurger{Store: newMemoryStore(t), left: 10, fits: 100, refusing: true}
	app := &App{CleanupBatch: 50}
	if err := app.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	app.track("refusing/test", s)
	app.PurgeOnce(t.Context())
	if !slices.Equal(s.limits, []int{50}) {
		t.Fatalf("limits %v: want one statement of cleanup_batch", s.limits)
	}
}

// Nor does a call that got no connection (a server that accepts
// connections and never answers), before the store's first contact or
// after it: its error comes slowly, but no statement ran. Until the build
// after d4fe47c it was taken for a timed-out statement: each run halved
// its batch, logging "retrying with a smaller batch" (which the runbook
// reads as a purge too heavy for statement_timeout), and the smaller limit
// held back the purges after the database came back. (The stores' marks:
// TestCallWithoutAConnectionIsMarked.)
func TestPurgeDoesNotShrinkWithoutAConnection(t *testing.T) {
	for _, c := range []struct {
		name string
		set  func(*timingOutPurger, bool)
	}{
		{"not ready", func(s *timingOutPurger, on bool) { s.unready = on }},
		{"no connection", func(s *timingOutPurger, on bool) { s.unplugged = on }},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &timingOutPurger{Store: newMemoryStore(t), left: 10, fits: 100, slow: 2 * purgeTarget}
			c.set(s, true)
			app := &App{CleanupBatch: 50}
			if err := app.Provision(newCaddyContext(t)); err != nil {
				t.Fatal(err)
			}
			app.track("unplugged/test", s)
			app.PurgeOnce(t.Context())
			if !slices.Equal(s.limits, []int{50}) {
				t.Fatalf("limits %v: want one statement of cleanup_batch", s.limits)
			}
			c.set(s, false)
			app.PurgeOnce(t.Context())
			if s.left != 0 || !slices.Equal(s.limits, []int{50, 50}) {
				t.Fatalf("once connected: %d left, limits %v: want cleanup_batch again", s.left, s.limits)
			}
		})
	}
}

// A run that a store error ends is counted, so that purges failing run
// after run can alert before the table has grown for days; the log line
// says what it means. The refusing purger stands in for a store whose
// DELETE fails (a user without the privilege, a server down).
func TestPurgeFailureIsCounted(t *testing.T) {
	s := &timingOutPurger{Store: newMemoryStore(t), left: 10, fits: 100, refusing: true}
	app := &App{CleanupBatch: 50}
	if err := app.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.ErrorLevel)
	app.logger = zap.New(core)
	// A backend of its own: no other test makes its series.
	ps := newPooledStore(s)
	ps.backend = "purge_failure_test"
	app.track("refusing/test", ps)
	if !slices.ContainsFunc(gather(t, purgeFailures), func(l map[string]string) bool { return l["store"] == ps.backend }) {
		t.Fatal("no purge_failures_total series for the store before its first run")
	}
	app.PurgeOnce(t.Context())
	app.PurgeOnce(t.Context())
	if n := purgeFailureCount(t, ps.backend); n != 2 {
		t.Fatalf("purge_failures_total rose by %v over two failed runs, want 2", n)
	}
	entries := logs.FilterMessageSnippet("they stay in the table, answering no request, until a run succeeds").AllUntimed()
	if len(entries) != 2 || entries[0].ContextMap()["store"] != "refusing/test" || entries[0].ContextMap()["cleanup_interval"] == nil {
		t.Fatalf("log lines %v: want one per failed run naming the store and when the next run is", entries)
	}
}

func purgeFailureCount(t *testing.T, backend string) float64 {
	t.Helper()
	for _, labels := range gather(t, purgeFailures) {
		if labels["store"] == backend {
			v, err := strconv.ParseFloat(labels["__value"], 64)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
	}
	return 0
}
