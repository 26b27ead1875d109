package mysql

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, nil)
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

func TestReserveOverExpiredRebinds(t *testing.T) {
	s, _ := openStore(t, nil)
	ctx := context.Background()
	key := storetest.NewKey(t)
	if _, err := s.Reserve(ctx, storetest.Reservation(key, 150*time.Millisecond, 150*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond)
	r := storetest.Reservation(key, storetest.Long, storetest.Long)
	r.Binding.Path = "/v1/other"
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve over expired = %+v, %v", res, err)
	}
	rec, err := s.Load(ctx, key)
	if err != nil || rec.Binding != r.Binding || rec.Owner != r.Owner || rec.Abandoned || rec.Response != nil {
		t.Fatalf("record = %+v, %v", rec, err)
	}
}

func TestKeyTooLong(t *testing.T) {
	s, _ := openStore(t, nil)
	r := storetest.Reservation(storetest.NewKey(t)+"x", storetest.Long, storetest.Long)
	if _, err := s.Reserve(context.Background(), r); err == nil {
		t.Fatal("a 37-byte key was accepted")
	}
}

// ReleaseIdle closes the idle connections a store a reload dropped holds
// but one (for a KILL or a repair on a server short of connections), keeps
// no more idle after, and the store still serves the old config's late
// requests.
func TestReleaseIdle(t *testing.T) {
	s, _ := openStore(t, nil)
	ctx := context.Background()
	var wg sync.WaitGroup
	for range 4 { // several connections at once
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.db.ExecContext(ctx, "DO SLEEP(0.05)"); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if idle := s.db.Stats().Idle; idle < 2 {
		t.Fatalf("%d idle connections before, want several", idle)
	}
	s.ReleaseIdle()
	if idle := s.db.Stats().Idle; idle != 1 {
		t.Fatalf("%d idle connections after ReleaseIdle, want 1", idle)
	}
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.Load(ctx, storetest.NewKey(t)); err != nil {
				t.Errorf("Load after ReleaseIdle: %v", err)
			}
		}()
	}
	wg.Wait()
	if idle := s.db.Stats().Idle; idle > 1 {
		t.Fatalf("%d idle connections after late Loads, want 1 at most", idle)
	}
}
