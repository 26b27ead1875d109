package postgres

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestReserveRace hammers keys with concurrent reservers: exactly one wins
// each. Fresh keys, where ON CONFLICT waits for the concurrent reserver's
// row; and keys whose row has expired, where every INSERT meets a row that
// is not live, and the reservers delete it and run again, racing each
// other (queries.reserve). Until the build after 80fc55f only fresh keys
// were raced, which re-run nothing ("0 re-run over 800"), although this
// comment said the test was about the re-run.
func TestReserveRace(t *testing.T) {
	s, _ := openStore(t, nil)
	reserveRace(t, s)
	t.Run("expired row", func(t *testing.T) {
		before := s.lostRaces.Load()
		reserveRaceOver(t, s, func(key string) {
			reserveOnceForRace(t, s, key)
		})
		if s.lostRaces.Load() == before {
			t.Fatal("no reserve statement re-run over expired rows: the path this subtest is for was not taken")
		}
	})
}

// reserveOnceForRace leaves key an expired row.
func reserveOnceForRace(t *testing.T, s *Store, key string) {
	t.Helper()
	if res, err := s.Reserve(context.Background(), storetest.Reservation(key, 5*time.Millisecond, 5*time.Millisecond)); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	time.Sleep(30 * time.Millisecond)
}

func reserveRace(t *testing.T, s *Store) {
	reserveRaceOver(t, s, func(string) {})
}

// reserveRaceOver races reservers on keys that before has set up.
func reserveRaceOver(t *testing.T, s *Store, before func(key string)) {
	ctx := context.Background()
	const rounds, racers = 50, 16
	for range rounds {
		key := storetest.NewKey(t)
		before(key)
		var winners atomic.Int32
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range racers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				res, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
				switch {
				case err != nil:
					t.Error(err)
				case res.Reserved:
					winners.Add(1)
				case res.Existing == nil:
					t.Error("neither reserved nor existing")
				}
			}()
		}
		close(start)
		wg.Wait()
		if winners.Load() != 1 {
			t.Fatalf("%d winners", winners.Load())
		}
	}
	t.Logf("%d reserve statements re-run after a lost race, over %d reservations", s.lostRaces.Load(), rounds*racers)
}
