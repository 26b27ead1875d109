package memory

import (
	"runtime"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		clock := storetest.NewFakeClock()
		s, err := New(Options{MaxEntries: 100_000, Now: clock.Now})
		if err != nil {
			t.Fatal(err)
		}
		return storetest.Harness{Store: s, Advance: clock.Advance}
	})
}

// The suite runs on a fake clock; this makes sure the real clock also lets
// Await notice a lapsed lease without any Finalize or Release to wake it.
func TestAwaitNoticesLeaseLapseOnRealClock(t *testing.T) {
	s, err := New(Options{MaxEntries: 10})
	if err != nil {
		t.Fatal(err)
	}
	key := storetest.NewKey(t)
	if _, err := s.Reserve(t.Context(), storetest.Reservation(key, 50*time.Millisecond, time.Hour)); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Await(t.Context(), key)
	if err != nil || rec == nil || !rec.Abandoned {
		t.Fatalf("Await = %+v, %v; want abandoned record", rec, err)
	}
}

func TestNewRejectsNegativeBounds(t *testing.T) {
	if _, err := New(Options{MaxEntries: -1}); err == nil {
		t.Fatal("negative max_entries accepted")
	}
	if _, err := New(Options{MaxBytes: -1}); err == nil {
		t.Fatal("negative max_bytes accepted")
	}
	s, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := s.Limits(), (Limits{MaxEntries: DefaultMaxEntries, MaxBytes: DefaultMaxBytes}); got != want {
		t.Fatalf("Limits = %+v, want defaults %+v", got, want)
	}
}

// evictedUnderAWaiter reserves key in a store of one entry, starts an
// Await on it, and, on one P so that the woken waiter runs only once the
// caller blocks, finalizes key with "the answer" and evicts it by
// finalizing another key. It returns what the Await returns, whether it
// waits (again), and what gives the P back.
func evictedUnderAWaiter(t *testing.T) (s *Store, key string, got <-chan *stores.Record, waiting func() bool, restore func()) {
	t.Helper()
	s, err := New(Options{MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	key, other := storetest.NewKey(t), storetest.NewKey(t)
	r := storetest.Reservation(key, time.Hour, time.Hour)
	if _, err := s.Reserve(ctx, r); err != nil {
		t.Fatal(err)
	}
	out := make(chan *stores.Record, 1)
	go func() {
		rec, err := s.Await(ctx, key)
		if err != nil {
			t.Error(err)
		}
		out <- rec
	}()
	waiting = func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		_, ok := s.changed[key]
		return ok
	}
	for !waiting() {
		time.Sleep(time.Millisecond)
	}
	procs := runtime.GOMAXPROCS(1)
	restore = func() { runtime.GOMAXPROCS(procs) }
	if err := s.Finalize(ctx, key, r.Owner, stores.Response{Status: 200, Body: []byte("the answer")}); err != nil {
		restore()
		t.Fatal(err)
	}
	o := storetest.Reservation(other, time.Hour, time.Hour)
	if _, err := s.Reserve(ctx, o); err != nil {
		restore()
		t.Fatal(err)
	}
	if err := s.Finalize(ctx, other, o.Owner, stores.Response{Status: 200}); err != nil {
		restore()
		t.Fatal(err)
	}
	return s, key, out, waiting, restore
}

// A duplicate waiting on a key is woken by the key's Finalize. If other
// keys' Finalizes evict the record before the waiter runs (a store at its
// bounds), the waiter still gets the final record: before, it found the
// key free, and its request executed the commit a second time.
func TestAwaitGetsTheFinalRecordEvictedBeforeItRan(t *testing.T) {
	s, key, got, _, restore := evictedUnderAWaiter(t)
	defer restore()
	if rec, _ := s.Load(t.Context(), key); rec != nil {
		t.Fatalf("the key's record was not evicted: %+v", rec)
	}
	rec := <-got
	if rec == nil || rec.State != stores.StateFinal || string(rec.Response.Body) != "the answer" {
		t.Fatalf("Await = %+v, want the final record with its answer", rec)
	}
}

// A waiter woken by a Finalize keeps that answer although, by the time it
// runs, the record was evicted and a retry reserved the key again, whose
// request then gets no connection and releases it. The waiter used to
// wait on the retry's reservation, forget the answer it was woken with
// once the release woke it again, find the key free and execute the
// request a second time.
func TestAwaitKeepsTheFinalRecordItWasWokenWith(t *testing.T) {
	s, key, got, waiting, restore := evictedUnderAWaiter(t)
	ctx := t.Context()
	retry := storetest.Reservation(key, time.Hour, time.Hour)
	if res, err := s.Reserve(ctx, retry); err != nil || !res.Reserved {
		restore()
		t.Fatalf("the retry's Reserve after the eviction: %+v, %v", res, err)
	}
	restore()
	// The waiter runs now: it returns, or (as it did) waits on the retry's
	// reservation.
	var rec *stores.Record
	for deadline := time.Now().Add(5 * time.Second); rec == nil && !waiting(); time.Sleep(time.Millisecond) {
		select {
		case rec = <-got:
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the woken waiter neither returned nor waited again")
		}
	}
	if err := s.Release(ctx, key, retry.Owner); err != nil {
		t.Fatal(err)
	}
	if rec == nil {
		rec = <-got
	}
	if rec == nil || rec.State != stores.StateFinal || string(rec.Response.Body) != "the answer" {
		t.Fatalf("Await = %+v, want the final record it was woken with", rec)
	}
}
