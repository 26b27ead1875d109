package postgres

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestReserveRace hammers fresh keys with concurrent reservers, the case
// where the reserve statement's snapshot misses a row committed by a
// concurrent reserver and must be re-run.
func TestReserveRace(t *testing.T) {
	s, _ := openStore(t, nil)
	reserveRace(t, s)
}

func reserveRace(t *testing.T, s *Store) {
	ctx := context.Background()
	const rounds, racers = 50, 16
	for range rounds {
		key := storetest.NewKey(t)
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
