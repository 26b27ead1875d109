package mysql

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

// Forget implements stores.Forgetter: one DELETE by primary key, re-run
// after a deadlock like the request path's writes.
func (s *Store) Forget(ctx context.Context, key string, force bool) (bool, error) {
	if err := sqlstore.CheckKey(key); err != nil {
		return false, fmt.Errorf("mysql forget: %w", err)
	}
	n, err := s.exec(ctx, "forget", &s.stmts.forget, key, force)
	if n > 0 {
		s.wakers.Wake(key)
	}
	return n > 0, err
}

// Count implements stores.Counter with one aggregate over the whole table:
// a full scan, fine for an operator's occasional look, not for a
// dashboard polling it.
func (s *Store) Count(ctx context.Context) (stores.Counts, error) {
	if err := s.ready(ctx); err != nil {
		return stores.Counts{}, err
	}
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	var c stores.Counts
	err := s.db.QueryRowContext(ctx, fmt.Sprintf(`SELECT
	COALESCE(SUM(state = 'in_flight' AND lease_until > now6), 0),
	COALESCE(SUM(state = 'in_flight' AND lease_until <= now6), 0),
	COALESCE(SUM(state = 'final'), 0)
FROM %s, (SELECT UTC_TIMESTAMP(6) AS now6) AS clock WHERE expires_at > now6`, s.cfg.Table)).Scan(&c.InFlight, &c.Abandoned, &c.Final)
	if err != nil {
		return stores.Counts{}, s.wrap("count", err)
	}
	return c, nil
}

// Inspect implements stores.Inspector with the statement Load runs.
func (s *Store) Inspect(ctx context.Context, key string) (*stores.Record, time.Duration, error) {
	if err := sqlstore.CheckKey(key); err != nil {
		return nil, 0, fmt.Errorf("mysql inspect: %w", err)
	}
	return s.load(ctx, key)
}
