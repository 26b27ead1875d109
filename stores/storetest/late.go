package storetest

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// LateReserveWritesNothing checks that a Reserve held up on its way to the
// server (a partition that drops packets, after which the kernel delivers
// what it had accepted, even from a socket its caller closed) creates no
// record once its caller has given up. Without a bound of its own, it did:
// the handler's undo of the lost Reserve had ended by then (ErrNotOwner
// after the settle window), the record stayed in flight and then abandoned,
// and every retry of a key whose request never reached the catalog heard
// "unknown" for the record's TTL. s reaches its server through a proxy that
// stands in for the partition; hold makes that proxy keep back the next
// Reserve of key until its caller has given up, and returns a channel
// closed once the proxy delivered it. direct reads the same records
// without the proxy. wait bounds how long the delivery may take.
func LateReserveWritesNothing(t *testing.T, s, direct stores.Store, hold func(key string) <-chan struct{}, wait time.Duration) {
	t.Helper()
	ctx := context.Background()
	// A connection in the pool, with the statement prepared or the script
	// loaded: the held write is the one that executes it, as on a busy
	// node.
	if _, err := s.Reserve(ctx, Reservation(NewKey(t), Long, Long)); err != nil {
		t.Fatal(err)
	}

	key := NewKey(t)
	delivered := hold(key)
	if _, err := s.Reserve(ctx, Reservation(key, Long, Long)); err == nil {
		t.Fatal("a Reserve held up on its way succeeded")
	}
	select {
	case <-delivered:
	case <-time.After(wait):
		t.Fatal("the held Reserve was never delivered")
	}
	time.Sleep(200 * time.Millisecond) // for the server to run it
	rec, err := direct.Load(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if rec != nil {
		t.Fatalf("a Reserve that reached the server after its caller gave up left a record: %s, owner %q", rec.State, rec.Owner)
	}

	// One on time still reserves.
	if res, err := s.Reserve(ctx, Reservation(key, Long, Long)); err != nil || !res.Reserved {
		t.Fatalf("Reserve on time: %+v, %v", res, err)
	}
}

// LateRenewalRevivesNothing checks that a lease renewal held up on its way
// to the server, as the Reserve of LateReserveWritesNothing, renews
// nothing once its caller has given up. Without a bound of its own, it
// landed after the owner, its execution over, had marked the record
// abandoned, and the record read as in flight for a whole lease more:
// every retry heard "still in flight" instead of the outcome. hold makes
// s's proxy keep back the next renewal of key until its caller has given
// up; direct reads and marks the record without the proxy.
func LateRenewalRevivesNothing(t *testing.T, s, direct stores.Store, hold func(key string) <-chan struct{}, wait time.Duration) {
	t.Helper()
	ctx := context.Background()
	r := Reservation(NewKey(t), Long, Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve: %+v, %v", res, err)
	}
	// A renewal on time first: the held one then goes on a pooled
	// connection, with the statement prepared or the script loaded.
	if err := s.ExtendLease(ctx, r.Key, r.Owner, Long, TTL); err != nil {
		t.Fatalf("ExtendLease on time: %v", err)
	}

	delivered := hold(r.Key)
	if err := s.ExtendLease(ctx, r.Key, r.Owner, Long, TTL); err == nil {
		t.Fatal("a renewal held up on its way succeeded")
	}
	// The execution ended meanwhile: its owner marks the record abandoned,
	// as the handler does.
	if err := direct.Abandon(ctx, r.Key, r.Owner); err != nil {
		t.Fatalf("Abandon: %v", err)
	}
	select {
	case <-delivered:
	case <-time.After(wait):
		t.Fatal("the held renewal was never delivered")
	}
	time.Sleep(200 * time.Millisecond) // for the server to run it
	rec, err := direct.Load(ctx, r.Key)
	if err != nil {
		t.Fatal(err)
	}
	if rec == nil || rec.State != stores.StateInFlight || !rec.Abandoned {
		t.Fatalf("a renewal that reached the server after its caller gave up left %+v; want the record in flight and abandoned", rec)
	}
}
