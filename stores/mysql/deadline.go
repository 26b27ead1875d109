package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// innodb_lock_wait_timeout bounds a statement's lock waits once the server
// has it, not a statement held up on its way there: Reserve's INSERT and
// the UPDATEs of TakeOver and ExtendLease carry the end of their call on
// the server's clock, and the server refuses them after it (see
// sqlstore.SendDeadline and inTime).

// syncClock reads the server's clock at the first contact, and again
// before a Reserve, TakeOver or ExtendLease once the reading is old or was
// dropped (see sqlstore.ServerClock.Sync). A reading that could not be had
// leaves the statement unsent.
func (s *Store) syncClock(ctx context.Context) error {
	return s.clock.Sync(ctx, func(ctx context.Context) (time.Time, time.Time, error) {
		ctx, cancel := s.opCtx(ctx)
		defer cancel()
		conn, err := s.db.Conn(ctx)
		if err != nil {
			return time.Time{}, time.Time{}, stores.MarkNotSent(s.wrap("reading the server's clock", err))
		}
		defer conn.Close()
		sent := time.Now()
		var now time.Time
		// Sent as text, one round trip: the reading is an upper bound of
		// the server's lead, and a slower call only loosens it.
		if err := conn.QueryRowContext(ctx, "SELECT UTC_TIMESTAMP(6)").Scan(&now); err != nil {
			return time.Time{}, time.Time{}, stores.MarkNotSent(s.wrap("reading the server's clock", err))
		}
		return now, sent, nil
	})
}

// errOutOfRange is ER_DATA_OUT_OF_RANGE: the refusal of a statement run
// after its bound (see inTime); the stores' statements overflow nothing
// else.
const errOutOfRange = 1690

// lateRefusal reports whether err is the refusal of a statement run after
// the end of its call: it wrote nothing.
func lateRefusal(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == errOutOfRange
}

// lateError is the error of a Reserve, TakeOver or ExtendLease that failed
// with err (wrapped), late when the server refused it as run after the end
// of its call: a server whose clock is not where the last reading put it
// (stepped back, or another server after a failover). The reading is then
// dropped, and the error is transient and not sent (nothing was written),
// as Redis's answer to a late Reserve.
func (s *Store) lateError(late bool, err error) error {
	if !late {
		return err
	}
	s.clock.Forget()
	return sqlstore.MarkTransient(stores.MarkNotSent(
		fmt.Errorf("the server ran it after the end of its call (a clock stepped?), writing nothing: %w", err)))
}

// execBounded runs stmt, bounded by the end of its call (its args carry
// sqlstore.SendDeadline: TakeOver's, ExtendLease's), with the server's
// clock read first when needed, and returns the rows it changed. stmt is
// read once the store is ready, which prepares it, as exec does. The read
// and the statement, re-runs after a deadlock included, share one
// statement_timeout: the lease counts a renewal as one call of at most
// that (see checkLease), and with a timeout each, a slow refresh of an old
// reading and a slow statement after it ended a renewal and its retry
// past the lease they renewed.
func (s *Store) execBounded(ctx context.Context, op string, stmt **sql.Stmt, args ...any) (int64, error) {
	if err := s.ready(ctx); err != nil {
		return 0, err
	}
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	if err := s.syncClock(ctx); err != nil {
		return 0, err
	}
	var late bool
	n, err := s.retry(ctx, op, func(ctx context.Context) (int64, error) {
		n, err := s.execOnce(ctx, *stmt, args...)
		late = lateRefusal(err)
		return n, err
	})
	if err != nil {
		return 0, s.lateError(late, err)
	}
	return n, nil
}
