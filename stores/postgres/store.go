package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// Store is a stores.Store in PostgreSQL. Use Open.
type Store struct {
	pool    *pgxpool.Pool
	q       queries
	cfg     Config
	timeout time.Duration
	// listener is nil unless Config.ListenNotify and notifications reach
	// it: set by the first contact, or later by relisten (see listen).
	listener atomic.Pointer[listener]
	dsn      string
	password string
	// loggedDSN is the DSN as log lines show it (sqlstore.LoggedDSN).
	loggedDSN string
	log       *zap.Logger
	lazy      sqlstore.Lazy
	migrated  bool // by an earlier attempt of the first contact
	// timeoutChecked: an earlier attempt of the first contact read the
	// sessions' statement_timeout and connection limits (see
	// checkServerTimeout and checkConnectionLimits).
	timeoutChecked bool
	// listenChecked: an earlier attempt of the first contact started
	// listening and found out whether notifications arrive (see listen),
	// or left that to relisten.
	listenChecked bool
	// stopRelisten ends relisten and waits for it; nil when it never ran.
	stopRelisten func()
	// combined runs Reserve's and Finalize's statements together with
	// those of concurrent requests; nil when Config.CombinedWrites is 0.
	combined *sqlstore.Combiner[string]
	awaits   sqlstore.AwaitGroup
	// clock bounds Reserve's and TakeOver's statements on the server's
	// clock (see sqlstore.SendDeadline and syncClock).
	clock sqlstore.ServerClock

	closeOnce sync.Once
	// lostRaces counts Reserve statements re-run after seeing neither a
	// reservation nor a row (see queries.reserve); tests read it.
	lostRaces atomic.Int64
	// marks counts Await's marks that set watched on a row (see
	// queries.mark); tests read it.
	marks atomic.Int64
	// noStartupTimeout is set once a pooler refused the statement_timeout
	// startup parameter: later connections go without it (see pooler.go).
	noStartupTimeout atomic.Bool
}

var _ stores.Store = (*Store)(nil)

// Open checks the configuration and sets up the connection pool without
// connecting: the database need not be up. The first contact — connect,
// check or migrate the schema, LISTEN — happens when Warm's background
// loop or the first operation gets through (see sqlstore.Lazy); until then
// operations fail with errors matching sqlstore.ErrNotReady. Errors never
// contain the DSN's password.
func Open(ctx context.Context, cfg Config, logger *zap.Logger) (*Store, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = zap.NewNop()
	}
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		// The password is unknown when the DSN does not parse: redact by form.
		return nil, fmt.Errorf("postgres: parse dsn: %w", sqlstore.RedactParseError(err, cfg.DSN))
	}
	s := &Store{
		cfg:       cfg,
		timeout:   cfg.StatementTimeout,
		dsn:       cfg.DSN,
		password:  pcfg.ConnConfig.Password,
		loggedDSN: sqlstore.LoggedDSN(cfg.DSN, pcfg.ConnConfig.Password),
		log:       logger.With(zap.String("table", cfg.Table)),
	}
	switch {
	case cfg.MaxConns > 0:
		pcfg.MaxConns = int32(cfg.MaxConns)
	case !strings.Contains(cfg.DSN, "pool_max_conns"):
		pcfg.MaxConns = DefaultMaxConns
	}
	pcfg.ShouldPing = shouldPing
	pcfg.BeforeConnect = s.beforeConnect
	cc := pcfg.ConnConfig
	if cc.ConnectTimeout == 0 || cc.ConnectTimeout > cfg.StatementTimeout {
		cc.ConnectTimeout = cfg.StatementTimeout
	}
	// Server-side bound too: a statement stuck on a lock is cancelled by
	// the server even if the client's cancel request is lost.
	cc.RuntimeParams["statement_timeout"] = fmt.Sprint(cfg.StatementTimeout.Milliseconds())
	if cc.RuntimeParams["application_name"] == "" {
		cc.RuntimeParams["application_name"] = "caddy-iceberg-idempotency"
	}
	if cfg.tracer != nil {
		cc.Tracer = cfg.tracer
	}
	// Changes notify a watched row whether or not this node listens: a
	// waiter on a node with listen_notify on marks the row, and the owner
	// may run on a node with it off (nodes mid-way through a rolling
	// change of the option); without the NOTIFY the waiter would sleep
	// until its fallback poll. An unwatched row sends none, so a node that
	// does not listen pays nothing for it.
	s.q = newQueries(cfg.Table, cfg.Table+"_changed")

	// No connection is made here (pgxpool connects on first use, unless
	// the DSN asks for pool_min_conns).
	s.pool, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, s.wrap("open", err)
	}
	if cfg.CombinedWrites > 0 {
		s.combined = s.newCombiner(cfg.CombinedWrites)
	}
	s.lazy = sqlstore.Lazy{
		Name:    "postgres",
		DSN:     s.loggedDSN,
		Attempt: s.firstContact,
		// Connect, the migration transaction, the LISTEN connection.
		AttemptTimeout: 3 * cfg.StatementTimeout,
		Retry:          sqlstore.Backoff{Min: cfg.RetryMin, Max: cfg.RetryMax},
		Cooldown:       cfg.RetryCooldown,
		Log:            s.log,
	}
	return s, nil
}

// Warm starts connecting in the background (see sqlstore.Lazy.Warm). The
// Caddy app calls it from Start: never at provisioning, so that `caddy
// validate` does not migrate.
func (s *Store) Warm() { s.lazy.Warm() }

// Ready makes the first contact now if it has not succeeded yet (see
// sqlstore.Lazy.Ready); every operation calls it first.
func (s *Store) Ready(ctx context.Context) error { return s.lazy.Ready(ctx) }

// firstContact pings, checks or migrates the schema and starts listening.
// sqlstore.Lazy runs it once at a time, until it succeeds.
func (s *Store) firstContact(ctx context.Context) error {
	err := s.ping(ctx)
	if startupTimeoutRefused(err) && !s.noStartupTimeout.Swap(true) {
		// Info: what matters is whether the sessions are bounded all the
		// same (by the role), which checkServerTimeout warns of if not.
		s.log.Info("postgres (or a pooler in front of it) refused the statement_timeout startup parameter: connecting without it")
		err = s.ping(ctx)
	}
	if err != nil {
		return s.wrap("connect", err)
	}
	if !s.migrated {
		if err := s.migrate(ctx, s.cfg.Table, s.cfg.AutoMigrate); err != nil {
			return err
		}
		s.migrated = true
	}
	if err := s.checkPrivileges(ctx); err != nil {
		return err
	}
	if !s.timeoutChecked {
		if err := s.checkServerTimeout(ctx); err != nil {
			return err
		}
		if err := s.checkConnectionLimits(ctx); err != nil {
			return err
		}
		s.timeoutChecked = true
	}
	if err := s.syncClock(ctx); err != nil {
		return err
	}
	if s.cfg.ListenNotify && !s.listenChecked {
		err := s.listen(ctx)
		var refused listenRefused
		switch {
		case errors.As(err, &refused):
			// The pool works: waiting duplicates poll until the LISTEN
			// connection opens, rather than every keyed request failing
			// until then.
			s.log.Warn("postgres listen: could not open the LISTEN connection: waiting duplicates poll until it opens", zap.Error(err))
			s.relisten()
		case err != nil:
			return err
		}
		s.listenChecked = true
	}
	s.log.Info("postgres idempotency store ready",
		zap.String("dsn", s.loggedDSN), zap.Bool("listen_notify", s.listener.Load() != nil))
	return nil
}

// listenRefused is the failure to open the LISTEN connection at all, when
// the pool's own connections work (a server at its connection limit, say).
type listenRefused struct{ err error }

func (e listenRefused) Error() string { return e.err.Error() }
func (e listenRefused) Unwrap() error { return e.err }

// relisten tries listen again in the background, from 1 s to 30 s apart,
// until the LISTEN connection opens; Close stops it.
func (s *Store) relisten() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	s.stopRelisten = func() { cancel(); <-done }
	go func() {
		defer close(done)
		retry := sqlstore.Backoff{Min: time.Second, Max: 30 * time.Second}
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(retry.Next()):
			}
			err := s.listen(ctx)
			if ctx.Err() != nil {
				return
			}
			if err == nil {
				s.log.Info("postgres listen: the LISTEN connection opened", zap.Bool("listen_notify", s.listener.Load() != nil))
				return
			}
			s.log.Debug("postgres listen: could not open the LISTEN connection, will retry", zap.Error(err))
		}
	}()
}

// backoff is Await's polling: slow, as a fallback, while notifications
// wake it; from PollMin to PollMax otherwise.
func (s *Store) backoff() sqlstore.Backoff {
	if s.listener.Load() != nil {
		return sqlstore.Backoff{Min: s.cfg.NotifyFallback, Max: s.cfg.NotifyFallback}
	}
	return sqlstore.Backoff{Min: s.cfg.PollMin, Max: s.cfg.PollMax}
}

// listen starts the LISTEN connection and checks, by notifying it through
// the pool, that notifications reach it. When they do not (a pooler in
// transaction or statement mode), Await would sleep until its fallback
// poll after every change: the store stops listening, warns, and polls as
// with listen_notify off. A LISTEN connection that cannot be opened is a
// listenRefused error.
func (s *Store) listen(ctx context.Context) error {
	cc := s.pool.Config().ConnConfig.Copy()
	if err := s.beforeConnect(ctx, cc); err != nil {
		return err
	}
	l, err := startListener(ctx, cc, s.cfg.Table+"_changed", s.log)
	if err != nil {
		return listenRefused{s.wrap("listen", err)}
	}
	pctx, cancel := s.opCtx(ctx)
	defer cancel()
	heard, err := l.hears(pctx, func(ctx context.Context, payload string) error {
		_, err := s.pool.Exec(ctx, "SELECT pg_notify($1, $2)", l.channel, payload)
		return err
	})
	if err == nil && !heard && ctx.Err() != nil {
		err = ctx.Err() // the caller gave up: that proves nothing of the notification
	}
	if err != nil {
		l.stop()
		return s.wrap("listen: notify", err)
	}
	if !heard {
		s.log.Warn("postgres notifications do not reach the store's LISTEN connection (a connection pooler in transaction or statement mode?): waiting duplicates poll instead; set listen_notify off",
			zap.Duration("waited", s.timeout))
		l.stop()
		return nil
	}
	s.listener.Store(l)
	return nil
}

// ping gets a connection and pings it, within one call's time.
func (s *Store) ping(ctx context.Context) error {
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	return s.pool.Ping(ctx)
}

// Close stops connecting, stops listening and closes the pool.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.lazy.Close() // no first contact runs after this
		if s.stopRelisten != nil {
			s.stopRelisten() // nor a later listen
		}
		if l := s.listener.Load(); l != nil {
			l.stop()
		}
		s.pool.Close()
	})
	return nil
}

// ReleaseIdle closes the pool's idle connections; those in use close as
// they come back, and later calls open new ones, which the pool keeps as
// usual until it closes (a reload's late requests are few). The store's
// pool key was dropped by a reload (see the root package's idleReleaser).
func (s *Store) ReleaseIdle() { s.pool.Reset() }

// opCtx bounds one database call, pool acquisition and connecting included,
// so a dead server costs at most StatementTimeout.
func (s *Store) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.timeout)
}

// wrap names the operation, keeps the DSN's password out of the error and
// marks it transient when it is (see sqlstore.IsTransient), and not sent
// when it proves that (see stores.MarkNotSent).
func (s *Store) wrap(op string, err error) error {
	out := fmt.Errorf("postgres %s: %w%s", op, sqlstore.RedactError(err, s.dsn, s.password), preparedStatementHint(err))
	if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) && pe.Code == insufficientPrivilege {
		out = sqlstore.StatementRefused(out, s.cfg.Table)
	}
	if ae, ce := (acquireError{}), (*pgconn.ConnectError)(nil); errors.As(err, &ae) || errors.As(err, &ce) {
		out = sqlstore.MarkNoConnection(out)
	}
	if notSent(err) {
		out = stores.MarkNotSent(out)
	}
	if transient(err) {
		return sqlstore.MarkTransient(out)
	}
	return out
}

// maxReserveAttempts bounds Reserve's re-runs when the INSERT met a row
// that was gone or expired by the time it was loaded (see queries.reserve);
// a second attempt normally settles it.
const maxReserveAttempts = 10

// Reserve implements stores.Store: one statement for a fresh key, two when
// the key exists; see queries.reserve.
func (s *Store) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	if err := sqlstore.CheckKey(r.Key); err != nil {
		return stores.ReserveResult{}, fmt.Errorf("postgres reserve: %w", err)
	}
	if err := s.lazy.Ready(ctx); err != nil {
		return stores.ReserveResult{}, err
	}
	// One statement_timeout for the clock's read and the statements, as
	// for every call (see execBounded).
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	if err := s.syncClock(ctx); err != nil {
		return stores.ReserveResult{}, err
	}
	for range maxReserveAttempts {
		res, err := s.reserveOnce(ctx, r)
		if err != nil || res.Reserved || res.Existing != nil {
			return res, err
		}
		s.lostRaces.Add(1)
	}
	return stores.ReserveResult{}, fmt.Errorf("postgres reserve %s: key kept changing under %d attempts", r.Key, maxReserveAttempts)
}

// reserveOnce is one attempt of Reserve, under Reserve's deadline.
func (s *Store) reserveOnce(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	n, err := s.write(ctx, r.Key, s.q.reserve,
		r.Key, r.Operation, r.Path, r.Principal, r.Fingerprint, r.Owner,
		sqlstore.Micros(r.Lease), sqlstore.Micros(r.RecordTTL()), sqlstore.SendDeadline,
	)
	if err != nil {
		return stores.ReserveResult{}, s.wrapLate("reserve", err)
	}
	if n == 1 {
		return stores.ReserveResult{Reserved: true}, nil
	}
	rec, _, err := s.queryRecord(ctx, "reserve", r.Key)
	if err != nil {
		return stores.ReserveResult{}, err
	}
	if rec == nil {
		// An expired row holds the key, or the row was released or purged
		// since the INSERT met it: clear the former (a no-op otherwise)
		// and let the caller retry. Keys are UUIDv7, so reuse after
		// expiry is rare and this path is cold.
		if _, err := s.poolExec(ctx, s.q.deleteExpired, r.Key); err != nil {
			return stores.ReserveResult{}, s.wrap("reserve", err)
		}
		return stores.ReserveResult{}, nil
	}
	return stores.ReserveResult{Existing: rec}, nil
}

// load reads key's live record and its remaining lease.
func (s *Store) load(ctx context.Context, key string) (*stores.Record, time.Duration, error) {
	if err := s.lazy.Ready(ctx); err != nil {
		return nil, 0, err
	}
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	return s.queryRecord(ctx, "load", key)
}

// queryRecord reads key's live record and its remaining lease (nil when
// there is none), naming op in its errors.
func (s *Store) queryRecord(ctx context.Context, op, key string) (*stores.Record, time.Duration, error) {
	var row sqlstore.Row
	err := runAgainOnConflict(ctx, func() error { return s.pool.QueryRow(ctx, s.q.load, key).Scan(rowDest(&row)...) })
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, s.wrap(op, err)
	}
	rec, left, err := row.Record()
	if err != nil {
		return nil, 0, s.wrap(op, err)
	}
	return rec, left, nil
}

// Load implements stores.Store.
func (s *Store) Load(ctx context.Context, key string) (*stores.Record, error) {
	rec, _, err := s.load(ctx, key)
	return rec, err
}

// Await implements stores.Store: polling with backoff, or, with
// ListenNotify, waking on NOTIFY with a slow fallback poll. Changes notify
// only a watched row, so with ListenNotify Await first marks the in-flight
// row it waits for (see sqlstore.Await and queries.mark).
func (s *Store) Await(ctx context.Context, key string) (*stores.Record, error) {
	if err := s.lazy.Ready(ctx); err != nil {
		return nil, err
	}
	load := func(ctx context.Context) (*stores.Record, time.Duration, error) { return s.load(ctx, key) }
	var (
		sub  sqlstore.SubscribeFunc
		mark sqlstore.MarkFunc
	)
	if l := s.listener.Load(); l != nil {
		sub = func() (<-chan struct{}, func()) { return l.Subscribe(key) }
		mark = func(ctx context.Context) error { return s.mark(ctx, key) }
	}
	// One shared wait per key on this node: a thousand duplicates of one
	// key then cost one mark and one reload per notification, not a
	// thousand.
	return s.awaits.Do(ctx, key, load, func(ctx context.Context, load sqlstore.LoadFunc) (*stores.Record, error) {
		return sqlstore.Await(ctx, s.backoff(), load, sub, mark)
	})
}

// mark sets watched on key's in-flight row, so that its next change
// notifies. It writes the row only if no other waiter marked it already.
func (s *Store) mark(ctx context.Context, key string) error {
	n, err := s.exec(ctx, "mark", s.q.mark, key)
	s.marks.Add(n)
	return err
}

// exec runs a compare-and-swap statement and returns how many rows it hit.
func (s *Store) exec(ctx context.Context, op, sql string, args ...any) (int64, error) {
	if err := s.lazy.Ready(ctx); err != nil {
		return 0, err
	}
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	tag, err := s.poolExec(ctx, sql, args...)
	if err != nil {
		return 0, s.wrap(op, err)
	}
	return tag.RowsAffected(), nil
}

// write runs one of the hot path's statements, combined with concurrent
// ones when the store combines writes, and returns the rows it changed.
func (s *Store) write(ctx context.Context, key, sql string, args ...any) (int64, error) {
	st := sqlstore.Statement[string]{Stmt: sql, Args: args, Key: key}
	if s.combined != nil {
		return s.combined.Exec(ctx, st)
	}
	return s.execAlone(ctx, st)
}

// Finalize implements stores.Store. One statement.
func (s *Store) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	f, err := sqlstore.EncodeFinal(resp)
	if err != nil {
		return fmt.Errorf("postgres finalize %s: %w", key, err)
	}
	if err := s.lazy.Ready(ctx); err != nil {
		return err
	}
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	n, err := s.write(ctx, key, s.q.finalize, key, owner, f.Status, f.HeadersArg(), f.Body, f.KeyID)
	if err != nil {
		return s.wrap("finalize", err)
	}
	if n == 0 {
		return stores.ErrNotOwner
	}
	return nil
}

// Release implements stores.Store.
func (s *Store) Release(ctx context.Context, key, owner string) error {
	n, err := s.exec(ctx, "release", s.q.release, key, owner)
	if err != nil {
		return err
	}
	if n == 0 {
		return stores.ErrNotOwner
	}
	return nil
}

// ExtendLease implements stores.Store. It is bounded as Reserve: a
// renewal held up on its way past its owner's mark of the record as
// abandoned (the execution ended meanwhile) made the record read as in
// flight for a whole lease more, every retry hearing 503 instead of the
// outcome.
func (s *Store) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	n, err := s.execBounded(ctx, "extend lease", s.q.extend, key, owner, sqlstore.Micros(lease), sqlstore.Micros(lease+ttl), sqlstore.SendDeadline)
	if err != nil {
		return err
	}
	if n == 0 {
		return stores.ErrNotOwner
	}
	return nil
}

// Abandon implements stores.Store.
func (s *Store) Abandon(ctx context.Context, key, owner string) error {
	n, err := s.exec(ctx, "abandon", s.q.abandon, key, owner)
	if err != nil {
		return err
	}
	if n == 0 {
		return stores.ErrNotOwner
	}
	return nil
}

// TakeOver implements stores.Store.
func (s *Store) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	n, err := s.execBounded(ctx, "take over", s.q.takeOver, key, oldOwner, newOwner, sqlstore.Micros(lease), sqlstore.Micros(lease+ttl), sqlstore.SendDeadline)
	return n == 1, err
}

// PurgeExpired implements stores.Store.
func (s *Store) PurgeExpired(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	n, err := s.exec(ctx, "purge", s.q.purge, limit)
	return int(n), err
}

// LoggedDSN returns the DSN as the store's log lines show it: without its
// password, whatever characters it holds.
func (s *Store) LoggedDSN() string { return s.loggedDSN }
