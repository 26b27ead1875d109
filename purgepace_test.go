package icebergidempotency

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
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
