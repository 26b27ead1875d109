package postgres

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// transient reports whether a pgx error is worth another call: see
// sqlstore.IsTransient.
func transient(err error) bool {
	if sqlstore.NetworkError(err) || pgconn.Timeout(err) || pgconn.SafeToRetry(err) {
		return true
	}
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	if len(pe.Code) == 5 && pe.Code[:2] == "08" { // connection_exception
		return true
	}
	switch pe.Code {
	case "40001", // serialization_failure
		"40P01", // deadlock_detected
		"53300", // too_many_connections
		"55P03", // lock_not_available
		"57014", // query_canceled (statement_timeout)
		"57P01", // admin_shutdown
		"57P02", // crash_shutdown
		"57P03": // cannot_connect_now
		return true
	}
	return false
}

// notSent reports whether a pgx error proves that the statement did not
// commit: it never reached the server (a ConnectError: refused,
// unreachable, or the login or its setup failed; or pgx guarantees it
// wrote nothing, SafeToRetry), or the server answered ERROR, which aborts
// the statement's implicit transaction (a read-only standby, a full disk,
// its own statement_timeout), as execTogether relies on for a batch. A
// FATAL or PANIC ends the session, maybe after a commit: it proves nothing.
func notSent(err error) bool {
	var ce *pgconn.ConnectError
	var pe *pgconn.PgError
	var ae acquireError
	return errors.As(err, &ae) || errors.As(err, &ce) || pgconn.SafeToRetry(err) || errors.As(err, &pe) && severity(pe) == "ERROR"
}

// acquireError is the failure to get a connection from the pool: the
// statement was never handed to one, so nothing was sent. pgxpool returns
// the bare context error when the call's deadline passes while it waits
// for a busy pool or for a connect that hangs (a partitioned server),
// which alone proves nothing.
type acquireError struct{ err error }

func (e acquireError) Error() string { return e.err.Error() }
func (e acquireError) Unwrap() error { return e.err }

// poolExec runs sql on a connection of its own from the pool, and tells a
// failure to get one (acquireError) from a failure of the statement. A
// statement bounded by its call's end (sqlstore.SendDeadline) gets ctx's.
// A statement rolled back for a conflict runs again (see
// runAgainOnConflict).
func (s *Store) poolExec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	var tag pgconn.CommandTag
	err := runAgainOnConflict(ctx, func() error {
		c, err := s.pool.Acquire(ctx)
		if err != nil {
			return acquireError{err}
		}
		defer c.Release()
		tag, err = c.Exec(ctx, sql, s.clock.Fill(ctx, args)...)
		return err
	})
	return tag, err
}
