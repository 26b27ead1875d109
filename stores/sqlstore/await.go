package sqlstore

import (
	"context"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Default polling bounds for Await.
const (
	DefaultPollMin = 10 * time.Millisecond
	DefaultPollMax = 200 * time.Millisecond
)

// Backoff yields Min, 2·Min, 4·Min, … capped at Max.
type Backoff struct {
	Min, Max time.Duration
	next     time.Duration
}

// Next returns the next wait.
func (b *Backoff) Next() time.Duration {
	if b.next == 0 {
		b.next = b.Min
	}
	d := b.next
	if b.next *= 2; b.next > b.Max {
		b.next = b.Max
	}
	return min(d, b.Max)
}

// LoadFunc reads key's live record (nil when there is none) and, for an
// in-flight record, how long its lease still runs by the database clock.
type LoadFunc func(ctx context.Context) (rec *stores.Record, leaseLeft time.Duration, err error)

// SubscribeFunc registers interest in changes of the awaited key before it
// is loaded. The channel is closed on a change; cancel unregisters.
type SubscribeFunc func() (changed <-chan struct{}, cancel func())

// MarkFunc asks the store to notify the awaited key's next change: a store
// whose changes notify only the keys someone waits for marks the in-flight
// record. Await ignores its error: the backoff bounds the cost of a
// notification that is then never sent.
type MarkFunc func(ctx context.Context) error

// Await implements stores.Store.Await on top of load: it loads the record
// until it is final, gone or abandoned, sleeping per backoff between loads.
// A sleep never outlasts the lease, so an abandoned record is reported as
// soon as its lease lapses. With subscribe, a change notification ends a
// sleep early; backoff then only bounds the cost of a missed notification.
// With mark (nil: none), the first load of a reservation in flight is
// followed by mark and at once by a reload, before any sleep.
func Await(ctx context.Context, backoff Backoff, load LoadFunc, subscribe SubscribeFunc, mark MarkFunc) (*stores.Record, error) {
	// leaseSlack lets the lease lapse by the database clock before the
	// reload, so that the reload sees it abandoned.
	const leaseSlack = 2 * time.Millisecond
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	// markedAt is the creation time of the reservation marked last: a key
	// released and reserved again is a new, unmarked reservation.
	var (
		marked   bool
		markedAt time.Time
	)
	for {
		var changed <-chan struct{}
		cancel := func() {}
		if subscribe != nil {
			changed, cancel = subscribe()
		}
		rec, leaseLeft, err := load(ctx)
		if err == nil && mark != nil && rec != nil && rec.State == stores.StateInFlight && !rec.Abandoned &&
			(!marked || !rec.CreatedAt.Equal(markedAt)) {
			// Subscribed, then loaded, then marked, then reloaded, each
			// statement after the previous one: if the change the waiter
			// waits for (say Finalize) committed before the mark, the
			// reload sees it; if after, the changing statement sees the
			// row marked and notifies, and the subscription made before
			// the reload receives it. No change falls in between.
			marked, markedAt = true, rec.CreatedAt
			_ = mark(ctx) // on failure, the backoff bounds the wait
			rec, leaseLeft, err = load(ctx)
		}
		if err != nil {
			cancel()
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, err
		}
		if rec == nil || rec.State != stores.StateInFlight || rec.Abandoned {
			cancel()
			return rec, nil
		}
		wait := backoff.Next()
		if leaseLeft+leaseSlack < wait {
			wait = leaseLeft + leaseSlack
		}
		timer.Reset(wait)
		select {
		case <-changed:
			// Since Go 1.23 Stop and Reset discard a pending tick: no drain.
			timer.Stop()
		case <-timer.C:
		case <-ctx.Done():
			cancel()
			return nil, ctx.Err()
		}
		cancel()
	}
}
