package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

var (
	_ stores.Forgetter = (*Store)(nil)
	_ stores.Counter   = (*Store)(nil)
	_ stores.Inspector = (*Store)(nil)
)

// Forget implements stores.Forgetter: one DELETE by primary key. It
// notifies like Release, so that waiters on other nodes look again at once
// instead of at their slow fallback poll.
func (s *Store) Forget(ctx context.Context, key string, force bool) (bool, error) {
	if err := sqlstore.CheckKey(key); err != nil {
		return false, fmt.Errorf("postgres forget: %w", err)
	}
	n, err := s.exec(ctx, "forget", s.q.forget, key, force)
	return n > 0, err
}

// Count implements stores.Counter with one aggregate over the whole table:
// a sequential scan, fine for an operator's occasional look, not for a
// dashboard polling it.
func (s *Store) Count(ctx context.Context) (stores.Counts, error) {
	if err := s.lazy.Ready(ctx); err != nil {
		return stores.Counts{}, err
	}
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	var c stores.Counts
	err := s.pool.QueryRow(ctx, fmt.Sprintf(`SELECT
	count(*) FILTER (WHERE state = 'in_flight' AND lease_until > now()),
	count(*) FILTER (WHERE state = 'in_flight' AND lease_until <= now()),
	count(*) FILTER (WHERE state = 'final')
FROM %s WHERE expires_at > now()`, s.cfg.Table)).Scan(&c.InFlight, &c.Abandoned, &c.Final)
	if err != nil {
		return stores.Counts{}, s.wrap("count", err)
	}
	return c, nil
}

// Inspect implements stores.Inspector with the statement Load runs.
func (s *Store) Inspect(ctx context.Context, key string) (*stores.Record, time.Duration, error) {
	if err := sqlstore.CheckKey(key); err != nil {
		return nil, 0, fmt.Errorf("postgres inspect: %w", err)
	}
	return s.load(ctx, key)
}
