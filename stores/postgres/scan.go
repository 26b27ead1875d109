package postgres

import "github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"

// rowDest lists scan targets in recordCols order.
func rowDest(r *sqlstore.Row) []any {
	return []any{&r.Key, &r.Operation, &r.Path, &r.Principal, &r.Fingerprint, &r.State,
		&r.Owner, &r.Abandoned, &r.Status, &r.Headers, &r.Body, &r.CreatedAt, &r.ExpiresAt,
		&r.LeaseLeftMicros, &r.KeyID}
}
