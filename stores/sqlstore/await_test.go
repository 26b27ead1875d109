package sqlstore

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

func TestBackoff(t *testing.T) {
	b := Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}
	want := []time.Duration{10, 20, 40, 80, 160, 200, 200}
	for i, w := range want {
		if got := b.Next(); got != w*time.Millisecond {
			t.Fatalf("step %d: %v, want %v", i, got, w*time.Millisecond)
		}
	}
}

func TestAwaitWakesOnChange(t *testing.T) {
	var final atomic.Bool
	ch := make(chan struct{})
	load := func(context.Context) (*stores.Record, time.Duration, error) {
		if final.Load() {
			return &stores.Record{State: stores.StateFinal}, 0, nil
		}
		return &stores.Record{State: stores.StateInFlight}, time.Hour, nil
	}
	sub := func() (<-chan struct{}, func()) { return ch, func() {} }
	go func() {
		time.Sleep(20 * time.Millisecond)
		final.Store(true)
		close(ch)
	}()
	start := time.Now()
	rec, err := Await(context.Background(), Backoff{Min: time.Hour, Max: time.Hour}, load, sub, nil)
	if err != nil || rec.State != stores.StateFinal {
		t.Fatalf("Await = %+v, %v", rec, err)
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("Await took %v despite the notification", el)
	}
}

func TestAwaitStopsAtLeaseAndContext(t *testing.T) {
	calls := 0
	load := func(context.Context) (*stores.Record, time.Duration, error) {
		calls++
		if calls > 1 {
			return &stores.Record{State: stores.StateInFlight, Abandoned: true}, 0, nil
		}
		return &stores.Record{State: stores.StateInFlight}, 30 * time.Millisecond, nil
	}
	start := time.Now()
	rec, err := Await(context.Background(), Backoff{Min: time.Hour, Max: time.Hour}, load, nil, nil)
	if err != nil || !rec.Abandoned || time.Since(start) > time.Second {
		t.Fatalf("Await = %+v, %v after %v", rec, err, time.Since(start))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	healthy := func(context.Context) (*stores.Record, time.Duration, error) {
		return &stores.Record{State: stores.StateInFlight}, time.Hour, nil
	}
	if _, err := Await(ctx, Backoff{Min: 10 * time.Millisecond, Max: 20 * time.Millisecond}, healthy, nil, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Await = %v, want DeadlineExceeded", err)
	}
}

// The first load of an in-flight record is followed by one mark and an
// immediate reload (the backoff is an hour here); a mark that fails does
// not fail Await; a finished record is never marked.
func TestAwaitMarksThenReloads(t *testing.T) {
	for _, markErr := range []error{nil, errors.New("mark failed")} {
		var loads, marks int
		load := func(context.Context) (*stores.Record, time.Duration, error) {
			loads++
			if marks > 0 && loads > 2 {
				return &stores.Record{State: stores.StateFinal}, 0, nil
			}
			return &stores.Record{State: stores.StateInFlight}, time.Hour, nil
		}
		mark := func(context.Context) error {
			marks++
			if loads != 1 {
				t.Errorf("mark after %d loads, want 1", loads)
			}
			return markErr
		}
		ch := make(chan struct{})
		sub := func() (<-chan struct{}, func()) { return ch, func() {} }
		go func() {
			time.Sleep(20 * time.Millisecond)
			close(ch)
		}()
		rec, err := Await(context.Background(), Backoff{Min: time.Hour, Max: time.Hour}, load, sub, mark)
		if err != nil || rec.State != stores.StateFinal {
			t.Fatalf("mark error %v: Await = %+v, %v", markErr, rec, err)
		}
		// Load, mark, reload (still in flight: sleep), woken, load: final.
		if marks != 1 || loads != 3 {
			t.Fatalf("mark error %v: %d marks, %d loads; want 1 mark, 3 loads", markErr, marks, loads)
		}
	}

	final := func(context.Context) (*stores.Record, time.Duration, error) {
		return &stores.Record{State: stores.StateFinal}, 0, nil
	}
	never := func(context.Context) error {
		t.Error("a final record was marked")
		return nil
	}
	if rec, err := Await(context.Background(), Backoff{Min: time.Hour, Max: time.Hour}, final, nil, never); err != nil || rec.State != stores.StateFinal {
		t.Fatalf("Await = %+v, %v", rec, err)
	}
}

// Marking is once per reservation: after a release, a new reservation of
// the key (a new creation time) is marked again; the same one is not.
func TestAwaitMarksEachReservation(t *testing.T) {
	first, second := time.Unix(1, 0), time.Unix(2, 0)
	seq := []time.Time{first, first, first, second, second, second}
	var loads int
	var marked []time.Time
	load := func(context.Context) (*stores.Record, time.Duration, error) {
		if loads == len(seq) {
			return nil, 0, nil
		}
		loads++
		return &stores.Record{State: stores.StateInFlight, CreatedAt: seq[loads-1]}, time.Hour, nil
	}
	mark := func(context.Context) error {
		marked = append(marked, seq[loads-1])
		return nil
	}
	if rec, err := Await(context.Background(), Backoff{Min: time.Millisecond, Max: time.Millisecond}, load, nil, mark); err != nil || rec != nil {
		t.Fatalf("Await = %+v, %v", rec, err)
	}
	if len(marked) != 2 || !marked[0].Equal(first) || !marked[1].Equal(second) {
		t.Fatalf("marked %v, want each reservation once", marked)
	}
}
