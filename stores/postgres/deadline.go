package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// statement_timeout bounds a statement from when the server receives it,
// not one held up on its way there: Reserve's INSERT and the UPDATEs of
// TakeOver and ExtendLease carry the end of their call on the server's
// clock, and the server refuses them after it (see sqlstore.SendDeadline
// and lateGuard).

// syncClock reads the server's clock at the first contact, and again
// before a Reserve, TakeOver or ExtendLease once the reading is old or was
// dropped (see sqlstore.ServerClock.Sync). A reading that could not be had
// leaves the statement unsent.
func (s *Store) syncClock(ctx context.Context) error {
	return s.clock.Sync(ctx, func(ctx context.Context) (time.Time, time.Time, error) {
		ctx, cancel := s.opCtx(ctx)
		defer cancel()
		c, err := s.pool.Acquire(ctx)
		if err != nil {
			return time.Time{}, time.Time{}, s.wrap("reading the server's clock", acquireError{err})
		}
		defer c.Release()
		sent := time.Now()
		var micros int64
		// One round trip, nothing prepared: the reading is an upper bound
		// of the server's lead, and a slower call only loosens it. The
		// time goes as a number: a text timestamp is written as the DSN's
		// DateStyle says (SQL, DMY: "06/12/2026 11:33:06.9 UTC", which pgx
		// cannot read), and the simple protocol is refused by pgx itself
		// under a client_encoding other than UTF8 or
		// standard_conforming_strings off: each failed the first contact
		// with an error that named neither.
		if err := c.QueryRow(ctx, "SELECT (extract(epoch FROM now()) * 1000000)::bigint", pgx.QueryExecModeExec).Scan(&micros); err != nil {
			return time.Time{}, time.Time{}, stores.MarkNotSent(s.wrap("reading the server's clock", err))
		}
		return time.UnixMicro(micros), sent, nil
	})
}

// lateRefusal reports whether err is lateGuard's: the server ran the
// statement after the end of its call, and wrote nothing.
func lateRefusal(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "21000"
}

// wrapLate is wrap for Reserve, TakeOver and ExtendLease. A refusal as late
// was made by a server whose clock is not where the last reading put it
// (stepped back, or another server after a failover): the reading is
// dropped, and the error is transient and not sent (nothing was written),
// as Redis's answer to a late Reserve.
func (s *Store) wrapLate(op string, err error) error {
	if !lateRefusal(err) {
		return s.wrap(op, err)
	}
	s.clock.Forget()
	return sqlstore.MarkTransient(stores.MarkNotSent(s.wrap(op,
		fmt.Errorf("the server ran it after the end of its call (a clock stepped?), writing nothing: %w", err))))
}

// execBounded runs a statement bounded by the end of its call (its args
// carry sqlstore.SendDeadline: TakeOver's, ExtendLease's) with the server's
// clock read first when needed, and returns the rows it changed. The read
// and the statement share one statement_timeout: the lease counts a
// renewal as one call of at most that (see checkLease), and with a
// timeout each, a slow refresh of an old reading and a slow statement
// after it ended a renewal and its retry past the lease they renewed.
func (s *Store) execBounded(ctx context.Context, op, sql string, args ...any) (int64, error) {
	if err := s.lazy.Ready(ctx); err != nil {
		return 0, err
	}
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	if err := s.syncClock(ctx); err != nil {
		return 0, err
	}
	tag, err := s.poolExec(ctx, sql, args...)
	if err != nil {
		return 0, s.wrapLate(op, err)
	}
	return tag.RowsAffected(), nil
}
