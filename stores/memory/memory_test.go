package memory

import (
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

func TestEvictionBeyondMaxEntries(t *testing.T) {
	var evicted []string
	s, err := New(Options{MaxEntries: 2, OnEvict: func(key string, _ stores.State) { evicted = append(evicted, key) }})
	if err != nil {
		t.Fatal(err)
	}
	keys := []string{storetest.NewKey(t), storetest.NewKey(t), storetest.NewKey(t)}
	for _, k := range keys {
		if _, err := s.Reserve(t.Context(), storetest.Reservation(k, time.Hour, time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	if s.Len() != 2 {
		t.Fatalf("Len = %d, want 2", s.Len())
	}
	if len(evicted) != 1 || evicted[0] != keys[0] {
		t.Fatalf("evicted = %v, want [%s]", evicted, keys[0])
	}
	if rec, _ := s.Load(t.Context(), keys[0]); rec != nil {
		t.Fatal("evicted record still loadable")
	}
	// Deliberate removals are not evictions.
	res, _ := s.Reserve(t.Context(), storetest.Reservation(keys[2], time.Hour, time.Hour))
	if err := s.Release(t.Context(), keys[2], res.Existing.Owner); err != nil {
		t.Fatal(err)
	}
	if len(evicted) != 1 {
		t.Fatalf("Release reported as eviction: %v", evicted)
	}
}
