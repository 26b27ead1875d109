package sqltest

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// LateReserveWritesNothing runs storetest.LateReserveWritesNothing on s, a
// store reaching its server through proxy with a statement timeout of
// timeout. The server's statement timeout counts from when a statement
// arrives, so it did not bound one held up on its way there.
func LateReserveWritesNothing(t *testing.T, s, direct stores.Store, proxy *Proxy, timeout time.Duration) {
	t.Helper()
	storetest.LateReserveWritesNothing(t, s, direct, func(key string) <-chan struct{} {
		return proxy.HoldNext([]byte(key), timeout+sqlstore.ClockMargin+time.Second)
	}, 20*time.Second)
}

// LateRenewalRevivesNothing runs storetest.LateRenewalRevivesNothing on s,
// a store reaching its server through proxy with a statement timeout of
// timeout, as LateReserveWritesNothing.
func LateRenewalRevivesNothing(t *testing.T, s, direct stores.Store, proxy *Proxy, timeout time.Duration) {
	t.Helper()
	storetest.LateRenewalRevivesNothing(t, s, direct, func(key string) <-chan struct{} {
		return proxy.HoldNext([]byte(key), timeout+sqlstore.ClockMargin+time.Second)
	}, 20*time.Second)
}

// LateRefusal checks err, the answer to a call the server ran after the
// end of its call: nothing was written, and the handler must neither undo
// it nor take it for final (not sent, transient), as Redis's answer to a
// late Reserve.
func LateRefusal(t *testing.T, what string, err error) {
	t.Helper()
	switch {
	case err == nil:
		t.Fatalf("%s run after the end of its call succeeded", what)
	case !stores.NotSent(err) || !sqlstore.IsTransient(err):
		t.Fatalf("%s run after the end of its call: not marked not sent and transient: %v", what, err)
	case errors.Is(err, stores.ErrNotOwner):
		t.Fatalf("%s run after the end of its call: %v", what, err)
	}
}

// ClockSteppedBack checks s, whose reading of the server's clock
// stepBack makes an hour early (as if the server's clock had jumped
// forward, or this node's back, by that much since it was read): every
// statement that creates a reservation then reaches the server after the
// end of its call on the server's clock. Reserve, TakeOver and ExtendLease
// must write nothing and say so (LateRefusal); the store then reads the
// clock again, and the next call goes through.
func ClockSteppedBack(t *testing.T, s stores.Store, stepBack func()) {
	t.Helper()
	ctx := context.Background()

	key := storetest.NewKey(t)
	stepBack()
	_, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
	LateRefusal(t, "Reserve", err)
	if rec, err := s.Load(ctx, key); err != nil || rec != nil {
		t.Fatalf("a Reserve refused as late left %+v, %v", rec, err)
	}
	if res, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long)); err != nil || !res.Reserved {
		t.Fatalf("Reserve after the clock was read again: %+v, %v", res, err)
	}

	// An abandoned record: its lease lapsed.
	old := storetest.Reservation(storetest.NewKey(t), 50*time.Millisecond, storetest.Long)
	if res, err := s.Reserve(ctx, old); err != nil || !res.Reserved {
		t.Fatalf("Reserve: %+v, %v", res, err)
	}
	time.Sleep(200 * time.Millisecond)
	stepBack()
	_, err = s.TakeOver(ctx, old.Key, old.Owner, "new-owner", storetest.Long, storetest.Long)
	LateRefusal(t, "TakeOver", err)
	if rec, err := s.Load(ctx, old.Key); err != nil || rec == nil || rec.Owner != old.Owner || !rec.Abandoned {
		t.Fatalf("a TakeOver refused as late changed the record: %+v, %v", rec, err)
	}
	if ok, err := s.TakeOver(ctx, old.Key, old.Owner, "new-owner", storetest.Long, storetest.Long); err != nil || !ok {
		t.Fatalf("TakeOver after the clock was read again: %v, %v", ok, err)
	}

	// A renewal of an abandoned record, which would make it live again.
	lapsed := storetest.Reservation(storetest.NewKey(t), 50*time.Millisecond, storetest.Long)
	if res, err := s.Reserve(ctx, lapsed); err != nil || !res.Reserved {
		t.Fatalf("Reserve: %+v, %v", res, err)
	}
	time.Sleep(200 * time.Millisecond)
	stepBack()
	err = s.ExtendLease(ctx, lapsed.Key, lapsed.Owner, storetest.Long, storetest.Long)
	LateRefusal(t, "ExtendLease", err)
	if rec, err := s.Load(ctx, lapsed.Key); err != nil || rec == nil || !rec.Abandoned {
		t.Fatalf("a renewal refused as late changed the record: %+v, %v", rec, err)
	}
	if err := s.ExtendLease(ctx, lapsed.Key, lapsed.Owner, storetest.Long, storetest.Long); err != nil {
		t.Fatalf("ExtendLease after the clock was read again: %v", err)
	}
	if rec, err := s.Load(ctx, lapsed.Key); err != nil || rec == nil || rec.Abandoned {
		t.Fatalf("a renewal after the clock was read again left %+v, %v; want the lease live", rec, err)
	}
}

// LateBatchWritesNothing checks a store that combines writes (rig), whose
// reading of the server's clock stepBack makes an hour early: a combined
// batch of reservations that reaches the server after the end of its call
// on that reading is refused and commits none of them, the reading is
// dropped, and its writes, run again alone, share one new reading (reads
// counts the store's reads of the clock) and go through, each bounded by
// the end of its own call (a lone statement that arrives after it is
// refused: LateReserveWritesNothing). Until the build after 997d217 the
// lone writes went with the old reading and were refused again: 32 of 32
// concurrent Reserves of a batch failed, as a 503 to each request.
func LateBatchWritesNothing(t *testing.T, rig CombineRig, stepBack func(), reads func() int) {
	t.Helper()
	ctx := context.Background()
	rs, keys := reservations(t, 32)
	release := rig.Block(t)
	rig.WaitState(t, 0, 1)
	results := make([]stores.ReserveResult, len(rs))
	errs := make([]error, len(rs))
	var wg sync.WaitGroup
	for i, r := range rs {
		wg.Go(func() { results[i], errs[i] = rig.Store.Reserve(ctx, r) })
	}
	rig.WaitState(t, len(rs), 1)
	// The batch is built and sent once the slot is given back, after the
	// clock reading was set back.
	stepBack()
	before := reads()
	release()
	wg.Wait()
	rig.WaitState(t, 0, 0)
	refused := 0
	for i, err := range errs {
		if err != nil || !results[i].Reserved {
			refused++
			t.Errorf("a Reserve of %s in a batch refused as late, run again alone: %+v, %v", keys[i], results[i], err)
		}
	}
	if refused > 0 {
		t.Fatalf("%d of %d Reserves of a batch refused as late failed when run again alone", refused, len(rs))
	}
	// Only a refusal as late drops the reading: a batch that committed
	// leaves it, and the count, as they were.
	if n := reads() - before; n != 1 {
		t.Fatalf("the server's clock was read %d times after the batch, want once (the batch refused, its writes sharing one reading)", n)
	}
	for i, key := range keys {
		if rec, err := rig.Store.Load(ctx, key); err != nil || rec == nil || rec.Owner != rs[i].Owner || rec.State != stores.StateInFlight {
			t.Fatalf("a Reserve of %s run again alone left %+v, %v", key, rec, err)
		}
	}
}
