package postgres

import (
	"context"
	"fmt"
	"strings"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// checkPrivileges refuses to make the store ready while its role lacks a
// privilege its statements need on the records table. PostgreSQL checks a
// privilege only as a statement runs, and a role without DELETE started
// fine: then every release failed, so a key the catalog provably did not
// execute was left to lapse into "unknown" (500 to its retries, where
// without the module they would have executed), and every purge failed.
// MySQL refuses such a store as it prepares its statements; this makes
// PostgreSQL do the same, with the same verdict.
func (s *Store) checkPrivileges(ctx context.Context) error {
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	var user string
	var missing []string
	// SELECT, INSERT and UPDATE may be granted column by column, on
	// every column (a role that ran the store so must keep doing so; one
	// column short, its statements fail); DELETE has no such form.
	err := s.pool.QueryRow(ctx, `SELECT current_user::text, coalesce(array_agg(p ORDER BY o), '{}')
FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']) WITH ORDINALITY AS u(p, o)
WHERE NOT has_table_privilege($1, p) AND (p = 'DELETE' OR EXISTS (
	SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped
	AND NOT has_column_privilege($1::regclass, attnum, p)))`,
		s.cfg.Table).Scan(&user, &missing)
	if err != nil {
		return s.wrap("check privileges", err)
	}
	if len(missing) == 0 {
		return nil
	}
	return sqlstore.PrivilegeMissing("postgres", s.cfg.Table,
		fmt.Errorf("role %s lacks %s", user, strings.Join(missing, ", ")))
}
