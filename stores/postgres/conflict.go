package postgres

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Every statement of the store's request path is one implicit transaction,
// which READ COMMITTED, PostgreSQL's default, never rolls back for a
// conflict with a concurrent one. A database or role whose
// default_transaction_isolation is REPEATABLE READ or SERIALIZABLE does:
// two reservations of one key fail one of them ("could not serialize
// access due to concurrent update"), and under SERIALIZABLE reservations
// and finalizations of distinct keys fail now and then too, their index
// reads conflicting by page ("… read/write dependencies among
// transactions": 146 of 4,800 reserve-and-finalize pairs, 32 at a time).
// Such a failure is an ERROR, which rolled the statement back whole: the
// store runs it again rather than answer 503 for it.

// conflictAttempts bounds how often a statement runs when the server keeps
// rolling it back for conflicts. With 10, under SERIALIZABLE, one of
// 12,800 reservations through Caddy, 32 at a time, still failed.
const conflictAttempts = 30

// rolledBackByConflict reports whether err is the server's rollback of a
// statement for a conflict with a concurrent transaction: a serialization
// failure or a deadlock.
func rolledBackByConflict(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "40001" || pe.Code == "40P01")
}

// runAgainOnConflict runs call, and runs it again while the server rolls
// it back for a conflict (see rolledBackByConflict), at most
// conflictAttempts times in all and while ctx lasts, after a pause of up
// to a millisecond per attempt so far (at most 10 ms), so that the
// transaction it conflicted with can commit.
func runAgainOnConflict(ctx context.Context, call func() error) error {
	for attempt := 1; ; attempt++ {
		err := call()
		if err == nil || attempt == conflictAttempts || !rolledBackByConflict(err) {
			return err
		}
		pause := time.NewTimer(rand.N(time.Duration(min(attempt, 10)) * time.Millisecond))
		select {
		case <-ctx.Done():
			pause.Stop()
			return err
		case <-pause.C:
		}
	}
}
