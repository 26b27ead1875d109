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
	rec, err := Await(context.Background(), Backoff{Min: time.Hour, Max: time.Hour}, load, sub)
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
	rec, err := Await(context.Background(), Backoff{Min: time.Hour, Max: time.Hour}, load, nil)
	if err != nil || !rec.Abandoned || time.Since(start) > time.Second {
		t.Fatalf("Await = %+v, %v after %v", rec, err, time.Since(start))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	healthy := func(context.Context) (*stores.Record, time.Duration, error) {
		return &stores.Record{State: stores.StateInFlight}, time.Hour, nil
	}
	if _, err := Await(ctx, Backoff{Min: 10 * time.Millisecond, Max: 20 * time.Millisecond}, healthy, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Await = %v, want DeadlineExceeded", err)
	}
}
