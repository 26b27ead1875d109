package storetest

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// RunAdmin checks the optional admin interfaces of stores/admin.go
// (Forgetter, Counter, Inspector). A store that lacks one fails: call it
// only for stores that claim them all.
func RunAdmin(t *testing.T, open Open) {
	ctx := context.Background()
	type admin interface {
		stores.Store
		stores.Forgetter
		stores.Counter
		stores.Inspector
	}
	get := func(t *testing.T) (admin, Harness) {
		h := open(t)
		a, ok := h.Store.(admin)
		if !ok {
			t.Fatalf("%T lacks Forgetter, Counter or Inspector", h.Store)
		}
		return a, h
	}

	t.Run("ForgetInFlight", func(t *testing.T) {
		s, _ := get(t)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		reserve(t, s, r)
		if ok, err := s.Forget(ctx, key, true); err != nil || !ok {
			t.Fatalf("Forget = %v, %v; want true", ok, err)
		}
		if rec := load(t, s, key); rec != nil {
			t.Fatalf("Load after Forget = %+v, want nil", rec)
		}
		// The old owner lost the key, like after an expiry.
		if err := s.Finalize(ctx, key, r.Owner, stores.Response{Status: 200}); err != stores.ErrNotOwner {
			t.Fatalf("Finalize by the forgotten owner = %v, want ErrNotOwner", err)
		}
		if res := reserve(t, s, Reservation(key, Long, Long)); !res.Reserved {
			t.Fatalf("Reserve after Forget = %+v, want reserved afresh", res)
		}
	})

	// Unless forced, a record in flight under a live lease stays, judged
	// in the delete itself: the admin API looks before it forgets, and a
	// record abandoned when it looked may have been taken over since, its
	// commit executing again. An abandoned one goes.
	t.Run("ForgetKeepsLiveLeaseUnlessForced", func(t *testing.T) {
		s, h := get(t)
		live, abandoned := NewKey(t), NewKey(t)
		rl, ra := Reservation(live, Long, Long), Reservation(abandoned, Lease, Long)
		reserve(t, s, rl)
		reserve(t, s, ra)
		h.Advance(Lease + 200*time.Millisecond)
		newOwner := "taker-" + NewKey(t)
		if ok, err := s.TakeOver(ctx, abandoned, ra.Owner, newOwner, Long, TTL); err != nil || !ok {
			t.Fatalf("TakeOver = %v, %v; want true", ok, err)
		}
		for _, key := range []string{live, abandoned} {
			if ok, err := s.Forget(ctx, key, false); err != nil || ok {
				t.Fatalf("Forget of %s in flight under a live lease = %v, %v; want false", key, ok, err)
			}
			if rec := load(t, s, key); rec == nil || rec.State != stores.StateInFlight {
				t.Fatalf("record after an unforced Forget = %+v, want it in flight", rec)
			}
		}
		if err := s.Abandon(ctx, abandoned, newOwner); err != nil {
			t.Fatal(err)
		}
		if ok, err := s.Forget(ctx, abandoned, false); err != nil || !ok {
			t.Fatalf("Forget of an abandoned record = %v, %v; want true", ok, err)
		}
		if ok, err := s.Forget(ctx, live, true); err != nil || !ok {
			t.Fatalf("forced Forget = %v, %v; want true", ok, err)
		}
	})

	t.Run("ForgetFinal", func(t *testing.T) {
		s, _ := get(t)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		reserve(t, s, r)
		if err := s.Finalize(ctx, key, r.Owner, stores.Response{Status: 201, Body: []byte("{}")}); err != nil {
			t.Fatal(err)
		}
		// Unforced, a final record stays: the operator may have seen it
		// abandoned, its owner storing the answer since.
		if ok, err := s.Forget(ctx, key, false); err != nil || ok {
			t.Fatalf("unforced Forget of a final record = %v, %v; want false", ok, err)
		}
		if rec := load(t, s, key); rec == nil || rec.State != stores.StateFinal {
			t.Fatalf("Load after an unforced Forget = %+v, want the final record", rec)
		}
		if ok, err := s.Forget(ctx, key, true); err != nil || !ok {
			t.Fatalf("forced Forget = %v, %v; want true", ok, err)
		}
		if rec := load(t, s, key); rec != nil {
			t.Fatalf("Load after Forget = %+v, want nil", rec)
		}
		if ok, err := s.Forget(ctx, key, true); err != nil || ok {
			t.Fatalf("second Forget = %v, %v; want false", ok, err)
		}
	})

	// An owner whose lease lapsed (its renewals failed) still stores its
	// answer: a record the operator saw abandoned may be final by the time
	// the forget runs, and an unforced forget then keeps it, judged in the
	// delete itself. Before, it went, and the client's retry executed the
	// commit a second time.
	t.Run("ForgetKeepsRecordFinalizedAfterItsLeaseLapsed", func(t *testing.T) {
		s, h := get(t)
		key := NewKey(t)
		r := Reservation(key, Lease, Long)
		reserve(t, s, r)
		h.Advance(Lease + 200*time.Millisecond)
		if rec := load(t, s, key); rec == nil || !rec.Abandoned {
			t.Fatalf("record past its lease = %+v, want abandoned", rec)
		}
		if err := s.Finalize(ctx, key, r.Owner, stores.Response{Status: 200}); err != nil {
			t.Fatalf("Finalize by the owner whose lease lapsed: %v", err)
		}
		if ok, err := s.Forget(ctx, key, false); err != nil || ok {
			t.Fatalf("unforced Forget of a record finalized since = %v, %v; want false", ok, err)
		}
		if res := reserve(t, s, Reservation(key, Long, Long)); res.Reserved || res.Existing.State != stores.StateFinal {
			t.Fatalf("Reserve after the refused Forget = %+v, want the final record", res)
		}
	})

	t.Run("ForgetWakesAwait", func(t *testing.T) {
		s, _ := get(t)
		key := NewKey(t)
		reserve(t, s, Reservation(key, Long, Long))
		done := make(chan error, 1)
		go func() {
			actx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			rec, err := s.Await(actx, key)
			if err == nil && rec != nil {
				t.Errorf("Await after Forget = %+v, want nil", rec)
			}
			done <- err
		}()
		time.Sleep(50 * time.Millisecond)
		if _, err := s.Forget(ctx, key, true); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatalf("Await: %v", err)
		}
	})

	t.Run("CountAndInspect", func(t *testing.T) {
		s, h := get(t)
		if c, err := s.Count(ctx); err != nil || c != (stores.Counts{}) {
			t.Fatalf("Count of an empty store = %+v, %v", c, err)
		}
		final := NewKey(t)
		rf := Reservation(final, Long, Long)
		reserve(t, s, rf)
		if err := s.Finalize(ctx, final, rf.Owner, stores.Response{Status: 200}); err != nil {
			t.Fatal(err)
		}
		healthy := NewKey(t)
		reserve(t, s, Reservation(healthy, Long, Long))
		abandoned := NewKey(t)
		ra := Reservation(abandoned, Long, Long)
		reserve(t, s, ra)
		if err := s.Abandon(ctx, abandoned, ra.Owner); err != nil {
			t.Fatal(err)
		}
		expiring := NewKey(t)
		reserve(t, s, Reservation(expiring, Lease, TTL))

		want := stores.Counts{InFlight: 2, Abandoned: 1, Final: 1}
		if c, err := s.Count(ctx); err != nil || c != want {
			t.Fatalf("Count = %+v, %v; want %+v", c, err, want)
		}
		rec, left, err := s.Inspect(ctx, healthy)
		if err != nil || rec == nil || rec.State != stores.StateInFlight || rec.Abandoned {
			t.Fatalf("Inspect(healthy) = %+v, %v", rec, err)
		}
		if left <= Long-time.Minute || left > Long {
			t.Fatalf("Inspect(healthy) lease left = %v, want about %v", left, Long)
		}
		if rec, left, err := s.Inspect(ctx, abandoned); err != nil || rec == nil || !rec.Abandoned || left != 0 {
			t.Fatalf("Inspect(abandoned) = %+v, %v, %v", rec, left, err)
		}
		if rec, left, err := s.Inspect(ctx, final); err != nil || rec == nil || rec.State != stores.StateFinal || left != 0 {
			t.Fatalf("Inspect(final) = %+v, %v, %v", rec, left, err)
		}
		if rec, _, err := s.Inspect(ctx, NewKey(t)); err != nil || rec != nil {
			t.Fatalf("Inspect(unknown) = %+v, %v", rec, err)
		}

		h.Advance(Lease + TTL + 100*time.Millisecond) // expiring: past its lease, then its TTL
		want = stores.Counts{InFlight: 1, Abandoned: 1, Final: 1}
		if c, err := s.Count(ctx); err != nil || c != want {
			t.Fatalf("Count after one record expired = %+v, %v; want %+v (expired ones not counted)", c, err, want)
		}
		if rec, _, err := s.Inspect(ctx, expiring); err != nil || rec != nil {
			t.Fatalf("Inspect(expired) = %+v, %v; want nil", rec, err)
		}
	})
}
