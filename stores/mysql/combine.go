package mysql

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// maxCombined bounds the statements of one combined batch.
const maxCombined = 64

// write is one of the hot path's statements: prepared for running alone,
// as text for a combined batch, where statements of a mergeable kind go
// together as one (see batchQuery).
type write struct {
	stmt  *sql.Stmt
	sql   string
	merge mergeKind
}

func (s *Store) newCombiner(maxFlushes int) *sqlstore.Combiner[write] {
	return &sqlstore.Combiner[write]{
		MaxFlushes: maxFlushes,
		MaxBatch:   maxCombined,
		// A batch of one, or one of a batch that rolled back. A batch
		// refused as late dropped the reading of the server's clock
		// (runBatch), and its reservations, bounded by the same ends of
		// their calls, share one new reading before they go: with the old
		// one each was refused again, and every request of the batch
		// heard 503 after a clock step.
		Alone: func(ctx context.Context, st sqlstore.Statement[write]) (int64, error) {
			if sqlstore.Bounded(st.Args) {
				if err := s.syncClock(ctx); err != nil {
					return 0, err
				}
			}
			return s.execOnce(ctx, st.Stmt.stmt, st.Args...)
		},
		Together: s.execTogether,
	}
}

// writeOnce runs one of the hot path's statements once, combined with
// concurrent ones when the store combines writes.
func (s *Store) writeOnce(ctx context.Context, key string, w write, args ...any) (int64, error) {
	if s.combined == nil {
		return s.execOnce(ctx, w.stmt, args...)
	}
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	return s.combined.Exec(ctx, sqlstore.Statement[write]{Stmt: w, Args: args, Key: key})
}

// errBatchTooLarge sends a batch's statements off to run alone: together
// they would not fit in one packet.
var errBatchTooLarge = errors.New("combined statements exceed the packet limit")

// execTogether sends the statements in one round trip, between START
// TRANSACTION and COMMIT, as one multi-statement query on a connection of
// batchDB (the driver interpolates the arguments, escaping them for the
// session). The server stops at the first statement it refuses, before
// the COMMIT: nothing of the batch committed, and the transaction is
// rolled back before the connection goes back to the pool. A refused
// COMMIT committed nothing either. A broken connection, or a kill's error,
// leaves the outcome unknown. Statements of a mergeable kind go merged
// (see mergeKind); a merged statement the server refuses sends the batch
// once more unmerged.
func (s *Store) execTogether(sts []sqlstore.Statement[write]) ([]int64, bool, error) {
	rows, rolledBack, err := s.runBatch(sts, true)
	var me *mysql.MySQLError
	if err != nil && rolledBack && errors.As(err, &me) && (me.Number == errDuplicateKey || me.Number == errGuardRefused) {
		// A merged statement met a key that exists or a record no longer
		// owned: the batch goes once more unmerged, still one round trip
		// and one commit, where each statement gets its own answer. A
		// retry arriving while the database is slow would otherwise send
		// every statement of its batch alone.
		return s.runBatch(sts, false)
	}
	return rows, rolledBack, err
}

// Errors a merged statement is refused with (see mergeKind).
const (
	errDuplicateKey = 1062 // ER_DUP_ENTRY: a merged INSERT met a key that exists
	errGuardRefused = 1172 // ER_TOO_MANY_ROWS: unmatchedGuard
)

// runBatch runs sts as one batch, merged or not; see execTogether.
func (s *Store) runBatch(sts []sqlstore.Statement[write], merge bool) ([]int64, bool, error) {
	ctx, cancel := s.opCtx(context.Background())
	defer cancel()
	// A reservation's bound is the batch's end: its caller waits for the
	// batch (see sqlstore.Combiner.Exec).
	bounded := make([]sqlstore.Statement[write], len(sts))
	for i, st := range sts {
		st.Args = s.clock.Fill(ctx, st.Args)
		bounded[i] = st
	}
	bq, err := newBatchQuery(s.q, bounded, merge)
	if err != nil {
		return nil, true, err
	}
	if int64(bq.size) > s.maxRow.Load() {
		return nil, true, errBatchTooLarge
	}

	conn, err := s.batchDB.Conn(ctx)
	if err != nil {
		return nil, true, err // nothing sent
	}
	defer conn.Close()
	thread, err := s.batchThreads.of(ctx, conn)
	if err != nil {
		discard(conn)
		return nil, true, err // nothing sent
	}
	var rows []int64
	err = conn.Raw(func(dc any) error {
		res, err := dc.(driver.ExecerContext).ExecContext(ctx, bq.text.String(), bq.args)
		if err != nil {
			return err
		}
		rows = res.(mysql.Result).AllRowsAffected()
		return nil
	})
	var me *mysql.MySQLError
	switch {
	case err == nil:
		out, err := bq.outcomes(rows)
		if err != nil {
			return nil, false, err
		}
		return out, false, nil
	case errors.As(err, &me) && refused(me):
		if _, rerr := conn.ExecContext(ctx, "ROLLBACK"); rerr != nil {
			discard(conn)
		}
		if lateRefusal(err) {
			// Its writes run again alone after a new reading (see
			// newCombiner), each still bounded by the end of its call.
			s.clock.Forget()
		}
		return nil, true, err
	}
	discard(conn)
	// The driver gave up (the timeout, a broken connection) by closing the
	// connection, which does not stop the query: the server would run the
	// rest of the batch and could commit it long after its callers were
	// told it failed, since innodb_lock_wait_timeout bounds each lock wait,
	// not the batch. Killing the thread rolls back whatever has not
	// committed yet, so the callers' clean-up (which gives a late commit
	// twice statement_timeout) sees the batch settled. A kill's error reply
	// (see refused) leaves the outcome unknown as well: had the batch's
	// writes run again alone, a caller whose time was spent meanwhile would
	// have heard "not sent" of a reservation that committed, and left it
	// held for a request nobody executes.
	s.startKill(thread)
	return nil, false, err
}

// startKill runs killThread in the background, unless Close began: the
// pool it needs is then closing, and the KILL would only fail.
func (s *Store) startKill(thread uint64) {
	s.killsMu.Lock()
	defer s.killsMu.Unlock()
	if s.killsClosed {
		return
	}
	s.kills.Go(func() { s.killThread(thread) })
}

// killThread ends the server thread of a batch whose outcome is unknown.
// A thread that already ended is what was wanted.
func (s *Store) killThread(id uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	_, err := s.db.ExecContext(ctx, "KILL CONNECTION "+strconv.FormatUint(id, 10))
	var me *mysql.MySQLError
	if err != nil && !(errors.As(err, &me) && me.Number == errNoSuchThread) {
		s.log.Warn("ending the server thread of a combined batch whose outcome is unknown failed: the batch may still commit",
			zap.Uint64("thread", id), zap.Error(err))
	}
}

// errNoSuchThread is ER_NO_SUCH_THREAD: KILL of a thread that ended.
const errNoSuchThread = 1094

// threadIDs remembers the server thread id of each batch connection,
// asked for once per connection (SELECT CONNECTION_ID()).
type threadIDs struct {
	mu  sync.Mutex
	ids map[any]uint64 // by driver connection
}

// maxThreadIDs bounds the connections remembered: batch connections are
// replaced every few minutes (SetConnMaxLifetime) and after errors, and
// the ids of closed ones are dropped all at once when it is reached.
const maxThreadIDs = 64

// of returns conn's server thread id. The driver connection under conn
// is only the key it is remembered by.
func (t *threadIDs) of(ctx context.Context, conn *sql.Conn) (uint64, error) {
	var dc any
	_ = conn.Raw(func(c any) error { dc = c; return nil })
	t.mu.Lock()
	id, ok := t.ids[dc]
	t.mu.Unlock()
	if ok {
		return id, nil
	}
	if err := conn.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&id); err != nil {
		return 0, fmt.Errorf("mysql: asking a batch connection for its CONNECTION_ID(): %w", err)
	}
	t.mu.Lock()
	if t.ids == nil || len(t.ids) >= maxThreadIDs {
		t.ids = make(map[any]uint64)
	}
	t.ids[dc] = id
	t.mu.Unlock()
	return id, nil
}

// discard makes the pool close conn instead of reusing it: its session
// state (an open transaction) is unknown.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
}

// interpolatedSize bounds the bytes v takes in an interpolated query:
// escaping at most doubles a string, plus quotes and an introducer.
func interpolatedSize(v driver.Value) int {
	switch v := v.(type) {
	case []byte:
		return 2*len(v) + 16
	case string:
		return 2*len(v) + 16
	}
	return 32
}
