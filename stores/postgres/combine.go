package postgres

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// maxCombined bounds the statements of one combined batch.
const maxCombined = 64

func (s *Store) newCombiner(maxFlushes int) *sqlstore.Combiner[string] {
	return &sqlstore.Combiner[string]{
		MaxFlushes: maxFlushes,
		MaxBatch:   maxCombined,
		Alone:      s.execBatchedAlone,
		Together:   s.execTogether,
	}
}

// execBatchedAlone runs a statement of the combiner alone: a batch of one,
// or one of a batch that rolled back. A batch refused as late dropped the
// reading of the server's clock (execTogether), and its reservations,
// bounded by the same ends of their calls, share one new reading before
// they go: with the old one each was refused again, and every request of
// the batch heard 503 after a clock step.
func (s *Store) execBatchedAlone(ctx context.Context, st sqlstore.Statement[string]) (int64, error) {
	if sqlstore.Bounded(st.Args) {
		if err := s.syncClock(ctx); err != nil {
			return 0, err
		}
	}
	return s.execAlone(ctx, st)
}

func (s *Store) execAlone(ctx context.Context, st sqlstore.Statement[string]) (int64, error) {
	tag, err := s.poolExec(ctx, st.Stmt, st.Args...)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

// execTogether sends the statements as one pipelined batch: pgx ends it
// with a single Sync, so the server runs them as one implicit transaction
// that commits at the Sync. Close reads up to the Sync's answer, so the
// rows are reported only once the commit is confirmed. An ERROR from the
// server aborted that transaction and left the session: nothing of the
// batch committed. Anything else (the connection broke, the timeout)
// leaves the commit unknown.
func (s *Store) execTogether(sts []sqlstore.Statement[string]) ([]int64, bool, error) {
	ctx, cancel := s.opCtx(context.Background())
	defer cancel()
	b := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, len(sts))}
	for _, st := range sts {
		// A reservation's bound is the batch's end: its caller waits for
		// the batch (see sqlstore.Combiner.Exec).
		b.Queue(st.Stmt, s.clock.Fill(ctx, st.Args)...)
	}
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		// Nothing was sent: each write runs again alone, or, its caller's
		// time spent, ends as not sent.
		return nil, true, acquireError{err}
	}
	defer c.Release()
	br := c.SendBatch(ctx, b)
	rows := make([]int64, len(sts))
	for i := range sts {
		tag, e := br.Exec()
		if e != nil {
			err = e
			break
		}
		rows[i] = tag.RowsAffected()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		if lateRefusal(err) {
			// The server's clock is not where the reading put it, or
			// the batch was held up on its way: its writes run again
			// alone after a new reading (execBatchedAlone), each still
			// bounded by the end of its call.
			s.clock.Forget()
		}
		var pe *pgconn.PgError
		return nil, errors.As(err, &pe) && severity(pe) == "ERROR", err
	}
	return rows, false, nil
}

// severity is the error's severity in English (older servers send only
// the localized one).
func severity(pe *pgconn.PgError) string {
	if pe.SeverityUnlocalized != "" {
		return pe.SeverityUnlocalized
	}
	return pe.Severity
}
