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

// Await implements stores.Store.Await on top of load: it loads the record
// until it is final, gone or abandoned, sleeping per backoff between loads.
// A sleep never outlasts the lease, so an abandoned record is reported as
// soon as its lease lapses. With subscribe, a change notification ends a
// sleep early; backoff then only bounds the cost of a missed notification.
func Await(ctx context.Context, backoff Backoff, load LoadFunc, subscribe SubscribeFunc) (*stores.Record, error) {
	// leaseSlack lets the lease lapse by the database clock before the
	// reload, so that the reload sees it abandoned.
	const leaseSlack = 2 * time.Millisecond
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var changed <-chan struct{}
		cancel := func() {}
		if subscribe != nil {
			changed, cancel = subscribe()
		}
		rec, leaseLeft, err := load(ctx)
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
