package postgres

import (
	"context"

	"go.uber.org/zap"
)

// checkConnectionLimits warns, at the first contact, when the server
// would refuse some of the connections this node's store may open: its
// pool's MaxConns, and one more for LISTEN. A connection the server
// refuses ("too many connections for role", SQLSTATE 53300) fails the
// request that needed it with 503, while the connections the pool holds
// keep working: through a built Caddy, with the role limited to 5
// connections, max_conns 16 and combined_writes off, 899 of 12,800 fresh
// keyed requests from 32 clients got 503. The limits are the role's
// CONNECTION LIMIT, the database's, and the server's max_connections less
// the slots reserved for superusers (the first two do not bind a
// superuser). Other nodes and other applications share the last two, so
// a quiet check proves no room; it catches a pool larger than the limit
// alone. Behind a connection pooler these are the pooler's connections,
// not the store's: the message says so.
func (s *Store) checkConnectionLimits(ctx context.Context) error {
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	var super bool
	var role, database, server int64
	err := s.pool.QueryRow(ctx, `SELECT r.rolsuper, r.rolconnlimit, d.datconnlimit,
	current_setting('max_connections')::bigint - current_setting('superuser_reserved_connections')::bigint
FROM pg_roles r, pg_database d WHERE r.rolname = current_user AND d.datname = current_database()`).Scan(&super, &role, &database, &server)
	if err != nil {
		return s.wrap("check connection limits", err)
	}
	want := int64(s.pool.Config().MaxConns)
	if s.cfg.ListenNotify {
		want++
	}
	limit, of := server, "the server's max_connections less superuser_reserved_connections"
	if !super && database >= 0 && database < limit {
		limit, of = database, "the database's CONNECTION LIMIT"
	}
	if !super && role >= 0 && role < limit {
		limit, of = role, "the role's CONNECTION LIMIT"
	}
	if want <= limit {
		return nil
	}
	s.log.Warn("postgres may refuse some of the connections the store opens: under load, requests that need one more get 503 (too many connections); lower max_conns, or raise the limit (behind a connection pooler, these are the pooler's connections and its own limits apply)",
		zap.Int64("store_connections", want), zap.Int64("limit", limit), zap.String("limit_of", of),
		zap.Bool("listen_notify", s.cfg.ListenNotify))
	return nil
}
