package memory

import (
	"context"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

var (
	_ stores.Forgetter = (*Store)(nil)
	_ stores.Counter   = (*Store)(nil)
	_ stores.Inspector = (*Store)(nil)
)

// Forget implements stores.Forgetter. It wakes the key's waiters, who then
// find no record and execute afresh.
func (s *Store) Forget(_ context.Context, key string, force bool) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.inflight[key]; ok {
		if !force && e.leaseUntil.After(s.now()) {
			return false, nil
		}
		delete(s.inflight, key)
		s.notify(key)
		return true, nil
	}
	if f, ok := s.final[key]; ok && force {
		s.dropFinal(f)
		return true, nil
	}
	return false, nil
}

// Count implements stores.Counter exactly; it walks every record under the
// store's lock, which is cheap next to the bounds on what it holds.
func (s *Store) Count(context.Context) (stores.Counts, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	var c stores.Counts
	for _, e := range s.inflight {
		switch {
		case !e.rec.ExpiresAt.After(now):
		case e.leaseUntil.After(now):
			c.InFlight++
		default:
			c.Abandoned++
		}
	}
	for _, f := range s.final {
		if !f.expiredAt(now) {
			c.Final++
		}
	}
	return c, nil
}

// Inspect implements stores.Inspector. Unlike Load it leaves the recency
// order alone: an operator's look is not a use of the record.
func (s *Store) Inspect(_ context.Context, key string) (*stores.Record, time.Duration, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if f, ok := s.final[key]; ok {
		if f.expiredAt(now) {
			return nil, 0, nil
		}
		return f.snapshot(), 0, nil
	}
	e, ok := s.inflight[key]
	if !ok || !e.rec.ExpiresAt.After(now) {
		return nil, 0, nil
	}
	rec := snapshot(e, nil, now)
	var left time.Duration
	if !rec.Abandoned {
		left = e.leaseUntil.Sub(now)
	}
	return rec, left, nil
}
