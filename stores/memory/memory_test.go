package memory

import (
	"testing"
	"time"

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
