package mysql

import (
	"context"

	"go.uber.org/zap"
)

// checkConnectionLimits warns, at the first contact, when the server
// would refuse some of the connections this node's store may open: its
// pool's MaxConns and the CombinedWrites connections its batches run on.
// A refused connection ("User … has exceeded the 'max_user_connections'
// resource", "Too many connections") fails the request that needed it with
// 503, while the open ones keep working. The limits are the account's
// MAX_USER_CONNECTIONS (the session's max_user_connections shows it when
// set), the server's max_user_connections, and its max_connections. Other
// nodes and other applications share the server's, so a quiet check proves
// no room; it catches a pool larger than the limit alone.
func (s *Store) checkConnectionLimits(ctx context.Context) error {
	qctx, cancel := s.opCtx(ctx)
	defer cancel()
	var user, server int64
	if err := s.db.QueryRowContext(qctx, "SELECT @@max_user_connections, @@max_connections").Scan(&user, &server); err != nil {
		return s.wrap("check connection limits", err)
	}
	want := int64(s.cfg.MaxConns + s.cfg.CombinedWrites)
	limit, of := server, "the server's max_connections"
	if user > 0 && user < limit {
		limit, of = user, "max_user_connections (the account's, or the server's)"
	}
	if want <= limit {
		return nil
	}
	s.log.Warn("mysql may refuse some of the connections the store opens: under load, requests that need one more get 503; lower max_conns, or raise the limit",
		zap.Int64("store_connections", want), zap.Int64("limit", limit), zap.String("limit_of", of))
	return nil
}
