package postgres

import (
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// rowDest lists scan targets in recordCols order.
func rowDest(r *sqlstore.Row) []any {
	return []any{&r.Key, &r.Operation, &r.Path, &r.Principal, &r.Fingerprint, &r.State,
		&r.Owner, &r.Abandoned, &r.Status, &r.Headers, &r.Body, &r.CreatedAt, &r.ExpiresAt,
		&r.LeaseLeftMicros, &r.KeyID}
}

// nullRow scans recordCols from the outer side of Reserve's LEFT JOIN,
// where every column is NULL when the reservation succeeded.
type nullRow struct {
	Key, Operation, Path, Principal, Fingerprint, State, Owner, KeyID *string
	Abandoned                                                         *bool
	Status                                                            *int
	Headers, Body                                                     []byte
	CreatedAt, ExpiresAt                                              *time.Time
	LeaseLeftMicros                                                   *int64
}

func (n *nullRow) dest() []any {
	return []any{&n.Key, &n.Operation, &n.Path, &n.Principal, &n.Fingerprint, &n.State,
		&n.Owner, &n.Abandoned, &n.Status, &n.Headers, &n.Body, &n.CreatedAt, &n.ExpiresAt,
		&n.LeaseLeftMicros, &n.KeyID}
}

func (n *nullRow) row() *sqlstore.Row {
	deref := func(p *string) string {
		if p == nil {
			return ""
		}
		return *p
	}
	r := &sqlstore.Row{
		Key: deref(n.Key), Operation: deref(n.Operation), Path: deref(n.Path),
		Principal: deref(n.Principal), Fingerprint: deref(n.Fingerprint),
		State: deref(n.State), Owner: deref(n.Owner), KeyID: deref(n.KeyID),
		Headers: n.Headers, Body: n.Body,
	}
	if n.Abandoned != nil {
		r.Abandoned = *n.Abandoned
	}
	if n.Status != nil {
		r.Status = *n.Status
	}
	if n.CreatedAt != nil {
		r.CreatedAt = *n.CreatedAt
	}
	if n.ExpiresAt != nil {
		r.ExpiresAt = *n.ExpiresAt
	}
	if n.LeaseLeftMicros != nil {
		r.LeaseLeftMicros = *n.LeaseLeftMicros
	}
	return r
}
