// Package memory is the embedded, single-node idempotency store: an LRU
// bounded by a number of records, with per-record expiry.
//
// It is correct for one Caddy process only; several nodes behind a load
// balancer need a shared SQL store.
package memory

import (
	"context"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// EvictFunc is told about a record pushed out by the size bound before it
// expired, which means max_entries is too small for the traffic.
type EvictFunc func(key string, state stores.State)

// Options configures a Store.
type Options struct {
	// MaxEntries bounds the number of records held; the least recently used
	// record is evicted beyond it. Required, > 0.
	MaxEntries int
	// OnEvict, if set, is called (with the store locked; it must not call
	// back into the store) for every record evicted before its expiry.
	OnEvict EvictFunc
	// Now is the clock; time.Now when nil. Tests move it.
	Now func() time.Time
}

type entry struct {
	rec        stores.Record
	leaseUntil time.Time
}

// Store is an in-memory stores.Store. The zero value is not usable; use New.
type Store struct {
	mu      sync.Mutex
	lru     *simplelru.LRU[string, *entry]
	changed map[string]chan struct{} // closed when a key's record changes state
	now     func() time.Time
	onEvict EvictFunc
}

var _ stores.Store = (*Store)(nil)

// New returns an empty Store.
func New(opts Options) (*Store, error) {
	s := &Store{
		changed: make(map[string]chan struct{}),
		now:     opts.Now,
		onEvict: opts.OnEvict,
	}
	if s.now == nil {
		s.now = time.Now
	}
	l, err := simplelru.NewLRU[string, *entry](opts.MaxEntries, s.evicted)
	if err != nil {
		return nil, err
	}
	s.lru = l
	return s, nil
}

// evicted runs under s.mu, from inside lru.Add or lru.Remove.
func (s *Store) evicted(key string, e *entry) {
	s.notify(key)
	if s.onEvict != nil && e.rec.ExpiresAt.After(s.now()) && !e.removed() {
		s.onEvict(key, e.rec.State)
	}
}

// removed marks entries deleted on purpose, so that the eviction callback,
// which simplelru also runs for explicit removals, stays quiet for them.
func (e *entry) removed() bool { return e.rec.State == "" }

func (s *Store) remove(key string, e *entry) {
	e.rec.State = ""
	s.lru.Remove(key)
}

// notify wakes every Await on key. Caller holds s.mu.
func (s *Store) notify(key string) {
	if ch, ok := s.changed[key]; ok {
		close(ch)
		delete(s.changed, key)
	}
}

// live returns key's unexpired entry, dropping an expired one. Caller holds s.mu.
func (s *Store) live(key string, now time.Time) *entry {
	e, ok := s.lru.Get(key)
	if !ok {
		return nil
	}
	if !e.rec.ExpiresAt.After(now) {
		s.remove(key, e)
		return nil
	}
	return e
}

// snapshot copies a record for a caller. Response bodies are shared: stored
// responses are never mutated.
func snapshot(e *entry, now time.Time) *stores.Record {
	r := e.rec
	r.Abandoned = r.State == stores.StateInFlight && !e.leaseUntil.After(now)
	return &r
}

// Reserve implements stores.Store.
func (s *Store) Reserve(_ context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if e := s.live(r.Key, now); e != nil {
		return stores.ReserveResult{Existing: snapshot(e, now)}, nil
	}
	s.lru.Add(r.Key, &entry{
		rec: stores.Record{
			Key:       r.Key,
			Binding:   r.Binding,
			State:     stores.StateInFlight,
			Owner:     r.Owner,
			CreatedAt: now,
			ExpiresAt: now.Add(r.TTL),
		},
		leaseUntil: now.Add(r.Lease),
	})
	return stores.ReserveResult{Reserved: true}, nil
}

// Load implements stores.Store.
func (s *Store) Load(_ context.Context, key string) (*stores.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if e := s.live(key, now); e != nil {
		return snapshot(e, now), nil
	}
	return nil, nil
}

// Await implements stores.Store. It needs no polling: Finalize, Release,
// TakeOver and eviction wake it, and a timer covers the lease lapsing.
func (s *Store) Await(ctx context.Context, key string) (*stores.Record, error) {
	for {
		s.mu.Lock()
		now := s.now()
		e := s.live(key, now)
		if e == nil {
			s.mu.Unlock()
			return nil, nil
		}
		rec := snapshot(e, now)
		if rec.State != stores.StateInFlight || rec.Abandoned {
			s.mu.Unlock()
			return rec, nil
		}
		ch, ok := s.changed[key]
		if !ok {
			ch = make(chan struct{})
			s.changed[key] = ch
		}
		lapse := e.leaseUntil.Sub(now)
		s.mu.Unlock()

		timer := time.NewTimer(lapse)
		select {
		case <-ch:
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		}
		timer.Stop()
	}
}

// owned returns key's entry if it is in flight under owner. Caller holds s.mu.
func (s *Store) owned(key, owner string, now time.Time) *entry {
	e := s.live(key, now)
	if e == nil || e.rec.State != stores.StateInFlight || e.rec.Owner != owner {
		return nil
	}
	return e
}

// Finalize implements stores.Store.
func (s *Store) Finalize(_ context.Context, key, owner string, resp stores.Response) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.owned(key, owner, s.now())
	if e == nil {
		return stores.ErrNotOwner
	}
	e.rec.State = stores.StateFinal
	e.rec.Owner = ""
	e.rec.Response = &resp
	s.notify(key)
	return nil
}

// Release implements stores.Store.
func (s *Store) Release(_ context.Context, key, owner string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.owned(key, owner, s.now())
	if e == nil {
		return stores.ErrNotOwner
	}
	s.remove(key, e)
	s.notify(key)
	return nil
}

// ExtendLease implements stores.Store.
func (s *Store) ExtendLease(_ context.Context, key, owner string, lease time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	e := s.owned(key, owner, now)
	if e == nil {
		return stores.ErrNotOwner
	}
	e.leaseUntil = now.Add(lease)
	return nil
}

// Abandon implements stores.Store.
func (s *Store) Abandon(_ context.Context, key, owner string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	e := s.owned(key, owner, now)
	if e == nil {
		return stores.ErrNotOwner
	}
	e.leaseUntil = now
	s.notify(key)
	return nil
}

// TakeOver implements stores.Store.
func (s *Store) TakeOver(_ context.Context, key, oldOwner, newOwner string, lease time.Duration) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	e := s.owned(key, oldOwner, now)
	if e == nil || e.leaseUntil.After(now) {
		return false, nil
	}
	e.rec.Owner = newOwner
	e.leaseUntil = now.Add(lease)
	s.notify(key)
	return true, nil
}

// PurgeExpired implements stores.Store.
func (s *Store) PurgeExpired(_ context.Context, limit int) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	n := 0
	for _, key := range s.lru.Keys() {
		if n >= limit {
			break
		}
		e, ok := s.lru.Peek(key)
		if ok && !e.rec.ExpiresAt.After(now) {
			s.remove(key, e)
			n++
		}
	}
	return n, nil
}

// Len reports how many records are held, expired ones included.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lru.Len()
}

// Close implements stores.Store. Memory needs no cleanup.
func (s *Store) Close() error { return nil }
