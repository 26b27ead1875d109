package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// Store is a stores.Store in MySQL or MariaDB. Use Open.
type Store struct {
	db *sql.DB
	// idleKept is how many connections db keeps idle: max_conns, then
	// one once a reload dropped the store (ReleaseIdle).
	idleKept atomic.Int32
	stmts    statements // prepared by the first contact
	cfg      Config
	timeout  time.Duration
	backoff  sqlstore.Backoff
	dsn      string
	password string
	// loggedDSN is the DSN as log lines show it (sqlstore.LoggedDSN).
	loggedDSN string
	log       *zap.Logger
	lazy      sqlstore.Lazy
	migrated  bool // by an earlier attempt of the first contact
	// limitsChecked: an earlier attempt of the first contact read the
	// server's connection limits (see checkConnectionLimits).
	limitsChecked bool

	// maxRow is the largest encoded row Finalize sends, derived from the
	// server's max_allowed_packet at the first contact.
	maxRow            atomic.Int64
	clientPacketLimit int64 // the driver's cap on packets it sends

	// MySQL has no notification: Awaits poll, one shared poll per key
	// (awaits), and a change made through this store wakes its own
	// node's Awaits at once (wakers); other nodes' see it at their next
	// poll.
	awaits sqlstore.AwaitGroup
	wakers sqlstore.Wakers

	// combined runs Reserve's and Finalize's statements together with
	// those of concurrent requests; nil when Config.CombinedWrites is 0.
	combined *sqlstore.Combiner[write]
	// batchDB holds the connections combined batches run on: they send
	// several statements in one query, with interpolated arguments.
	batchDB *sql.DB
	// batchThreads are the server thread ids of batchDB's connections, to
	// end a batch whose outcome is unknown.
	batchThreads threadIDs
	// kills are the KILLs of batch threads under way (killThread), which
	// Close waits for before it closes the pool they run on; killsClosed
	// (under killsMu) refuses new ones once it began.
	killsMu     sync.Mutex
	killsClosed bool
	kills       sync.WaitGroup
	q           queries

	// clock bounds Reserve's and TakeOver's statements on the server's
	// clock (see sqlstore.SendDeadline and syncClock).
	clock sqlstore.ServerClock

	closeOnce sync.Once
}

// statements are prepared once; database/sql prepares each again on every
// new connection by itself, so a call costs one round trip, not the
// prepare-execute-close of an unprepared call with arguments.
type statements struct {
	reserveFresh, reserve, load, owned, finalize, release, extend, abandon, takeOver, purge, forget *sql.Stmt
}

var _ stores.Store = (*Store)(nil)

// Open checks the configuration and sets up the connection pool without
// connecting: the database need not be up. The first contact — connect,
// read max_allowed_packet, check or migrate the schema, prepare — happens
// when Warm's background loop or the first operation gets through (see
// sqlstore.Lazy); until then operations fail with errors matching
// sqlstore.ErrNotReady. Errors never contain the DSN's password.
func Open(ctx context.Context, cfg Config, logger *zap.Logger) (*Store, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = zap.NewNop()
	}
	mc, err := mysql.ParseDSN(cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("mysql: parse dsn (the driver's form is user:password@tcp(host:3306)/dbname?param=value, not a URL): %w", sqlstore.RedactParseError(err, cfg.DSN))
	}
	s := &Store{
		cfg:       cfg,
		timeout:   cfg.StatementTimeout,
		backoff:   sqlstore.Backoff{Min: cfg.PollMin, Max: cfg.PollMax},
		dsn:       cfg.DSN,
		password:  mc.Passwd,
		loggedDSN: sqlstore.LoggedDSN(cfg.DSN, mc.Passwd),
		log:       logger.With(zap.String("table", cfg.Table)),
	}
	s.clientPacketLimit = int64(mc.MaxAllowedPacket)
	mc.ParseTime = true
	mc.Loc = time.UTC // the columns hold UTC; the driver must not shift them
	mc.ClientFoundRows = false
	// A pooled connection the server closed (a restart, a failover, KILL)
	// is found before a statement is sent on it, and replaced. With
	// checkConnLiveness=false in the DSN, the next call on each such
	// connection failed (preparing its statement, so nothing ran): a 503
	// for one request per pooled connection.
	mc.CheckConnLiveness = true
	// The driver's own complaints (a broken connection it closes) go to
	// the store's log, not to Caddy's stderr in a format of their own.
	mc.Logger = driverLogger{log: s.log, dsn: cfg.DSN, password: mc.Passwd}
	if mc.Timeout == 0 || mc.Timeout > cfg.StatementTimeout {
		mc.Timeout = cfg.StatementTimeout
	}
	lockWaitBound(mc, cfg.StatementTimeout)
	sessionVars(mc)
	connector, err := mysql.NewConnector(mc)
	if err != nil {
		return nil, s.wrap("open", err)
	}
	// sql.OpenDB connects to nothing until the first call.
	s.db = sql.OpenDB(connector)
	s.db.SetMaxOpenConns(cfg.MaxConns)
	s.db.SetMaxIdleConns(cfg.MaxConns)
	s.idleKept.Store(int32(cfg.MaxConns))
	// Below the servers' and middleboxes' idle cut-offs, so the pool rarely
	// hands out a connection that is already dead.
	s.db.SetConnMaxLifetime(3 * time.Minute)
	s.q = newQueries(cfg.Table)
	if cfg.CombinedWrites > 0 {
		bc := mc.Clone()
		bc.InterpolateParams = true
		bc.MultiStatements = true
		batchConnector, err := mysql.NewConnector(bc)
		if err != nil {
			s.db.Close()
			return nil, s.wrap("open", err)
		}
		s.batchDB = sql.OpenDB(batchConnector)
		s.batchDB.SetMaxOpenConns(cfg.CombinedWrites)
		s.batchDB.SetMaxIdleConns(cfg.CombinedWrites)
		s.batchDB.SetConnMaxLifetime(3 * time.Minute)
		s.combined = s.newCombiner(cfg.CombinedWrites)
	}
	s.lazy = sqlstore.Lazy{
		Name:    "mysql",
		DSN:     s.loggedDSN,
		Attempt: s.firstContact,
		// Connect, read the packet limit, the migration (whose lock wait
		// is bounded by two statement timeouts), prepare.
		AttemptTimeout: 4 * cfg.StatementTimeout,
		Retry:          sqlstore.Backoff{Min: cfg.RetryMin, Max: cfg.RetryMax},
		Cooldown:       cfg.RetryCooldown,
		Log:            s.log,
	}
	return s, nil
}

// lockWaitBound bounds on the server, too, how long a statement waits for a
// row lock: about when the driver gives up on its reply (the statement
// timeout) instead of the server's default of 50s, like PostgreSQL's
// server-side statement_timeout. A reservation whose caller gave up could
// otherwise commit long afterwards, holding its key for a request nobody
// executes; the handler's undo of a lost reply counts on such a statement
// settling within its store call's bound. A DSN that sets
// innodb_lock_wait_timeout keeps its own.
func lockWaitBound(mc *mysql.Config, timeout time.Duration) {
	if _, _, set := dsnLockWait(mc.Params); set {
		return
	}
	if mc.Params == nil {
		mc.Params = map[string]string{}
	}
	mc.Params[lockWaitVar] = strconv.Itoa(max(1, int(math.Ceil(timeout.Seconds()))))
}

const lockWaitVar = "innodb_lock_wait_timeout"

// dsnLockWait finds the DSN's own innodb_lock_wait_timeout, whatever the
// case of its name (the server's is not case-sensitive): a bound added
// beside INNODB_LOCK_WAIT_TIMEOUT went out in one SET with it, in the
// order of a map, so half the connections waited the DSN's time and the
// undo of a lost reply stopped after the other's.
func dsnLockWait(params map[string]string) (name, value string, set bool) {
	for k, v := range params {
		if strings.EqualFold(k, lockWaitVar) {
			return k, v, true
		}
	}
	return "", "", false
}

// dsnLockWaitSeconds is the DSN's innodb_lock_wait_timeout in seconds (0
// when it sets none, or 0: MariaDB's "do not wait"), or an error when it
// sets one that is not a whole number of seconds the servers take: the
// store's undo of a lost reservation keeps trying as long as a statement
// may wait for a lock, which DEFAULT or an expression would leave it to
// guess, and a number past the servers' maximum would overflow the wait.
func dsnLockWaitSeconds(params map[string]string) (int, error) {
	name, v, set := dsnLockWait(params)
	if !set {
		return 0, nil
	}
	n, err := strconv.Atoi(strings.Trim(v, "'\""))
	if err != nil || n < 0 || n > maxLockWait {
		return 0, fmt.Errorf("mysql: the DSN's %s=%s must be a whole number of seconds from 0 to %d (the undo of a lost reservation waits as long as a statement may wait for a lock)", name, v, maxLockWait)
	}
	return n, nil
}

// maxLockWait is the largest innodb_lock_wait_timeout MySQL and MariaDB
// take, in seconds (about 34 years).
const maxLockWait = 1073741824

// storeSessionVars are the session variables the store's statements need
// whatever a DSN sets, which the driver sends as SET on each connection
// (with innodb_lock_wait_timeout's, in one statement). autocommit=0 left
// every statement run alone uncommitted, visible to its own connection
// only and rolled back when that connection closed: a record finalized
// under it was gone, and the key's retry executed again.
// sql_select_limit=0 had every SELECT without a LIMIT answer no rows, and
// the first contact failed with "sql: no rows in result set".
var storeSessionVars = map[string]string{"autocommit": "1", "sql_select_limit": "DEFAULT"}

// sessionVars sets storeSessionVars on mc, in place of the DSN's own
// (server variable names are not case-sensitive: the driver would send
// both, in no set order).
func sessionVars(mc *mysql.Config) {
	if mc.Params == nil {
		mc.Params = map[string]string{}
	}
	for k := range mc.Params {
		if _, ours := storeSessionVars[strings.ToLower(k)]; ours {
			delete(mc.Params, k)
		}
	}
	maps.Copy(mc.Params, storeSessionVars)
}

// ServerLockWait is how long a statement of the store may wait for a row
// lock on the server: the DSN's innodb_lock_wait_timeout if it sets one,
// else the statement timeout rounded up to whole seconds (lockWaitBound).
func (c Config) ServerLockWait() time.Duration {
	if mc, err := mysql.ParseDSN(c.DSN); err == nil {
		if n, err := dsnLockWaitSeconds(mc.Params); err == nil && n > 0 {
			return time.Duration(n) * time.Second
		}
	}
	return time.Duration(max(1, int(math.Ceil(c.StatementTimeout.Seconds())))) * time.Second
}

// DriverCutsShort is how long before the end of its call the driver may
// give up on a statement it sent: statement_timeout minus the DSN's
// readTimeout or writeTimeout, the shorter, when one is below it (0
// otherwise). The call then fails that much before the end its statement
// carries as its send bound, and the statement may land that much later
// after the failure than one whose call ran to its end.
func (c Config) DriverCutsShort() time.Duration {
	mc, err := mysql.ParseDSN(c.DSN)
	if err != nil {
		return 0
	}
	cut := time.Duration(0)
	for _, t := range []time.Duration{mc.ReadTimeout, mc.WriteTimeout} {
		if t > 0 && t < c.StatementTimeout {
			cut = max(cut, c.StatementTimeout-t)
		}
	}
	return cut
}

// Warm starts connecting in the background (see sqlstore.Lazy.Warm). The
// Caddy app calls it from Start: never at provisioning, so that `caddy
// validate` does not migrate.
func (s *Store) Warm() { s.lazy.Warm() }

// Ready makes the first contact now if it has not succeeded yet (see
// sqlstore.Lazy.Ready); every operation calls it first.
func (s *Store) Ready(ctx context.Context) error { return s.lazy.Ready(ctx) }

// firstContact pings, reads the server's packet limit, checks or migrates
// the schema and prepares the statements. sqlstore.Lazy runs it once at a
// time, until it succeeds.
func (s *Store) firstContact(ctx context.Context) error {
	if err := s.readPacketLimit(ctx); err != nil {
		return err
	}
	if !s.migrated {
		if err := s.migrate(ctx, s.cfg.Table, s.cfg.AutoMigrate); err != nil {
			return err
		}
		s.migrated = true
	}
	if !s.limitsChecked {
		if err := s.checkConnectionLimits(ctx); err != nil {
			return err
		}
		s.limitsChecked = true
	}
	if err := s.syncClock(ctx); err != nil {
		return err
	}
	q := s.q
	for _, p := range []struct {
		dst **sql.Stmt
		sql string
	}{
		{&s.stmts.reserveFresh, q.reserveFresh}, {&s.stmts.reserve, q.reserve}, {&s.stmts.load, q.load}, {&s.stmts.owned, q.owned},
		{&s.stmts.finalize, q.finalize}, {&s.stmts.release, q.release}, {&s.stmts.extend, q.extend},
		{&s.stmts.takeOver, q.takeOver}, {&s.stmts.purge, q.purge}, {&s.stmts.abandon, q.abandon},
		{&s.stmts.forget, q.forget},
	} {
		if *p.dst != nil {
			continue // prepared by an earlier attempt
		}
		pctx, cancel := s.opCtx(ctx)
		stmt, err := s.db.PrepareContext(pctx, p.sql)
		cancel()
		if err != nil {
			// The server checks a statement's privileges as it
			// prepares it: a user without DELETE was "unreachable".
			if privilegeRefused(err) {
				return sqlstore.PrivilegeMissing("mysql", s.cfg.Table, sqlstore.RedactError(err, s.dsn, s.password))
			}
			return s.wrap("prepare", err)
		}
		*p.dst = stmt
	}
	s.log.Info("mysql idempotency store ready", zap.String("dsn", s.loggedDSN))
	return nil
}

// Close stops connecting, closes the statements and the pool.
func (s *Store) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.lazy.Close() // no first contact runs after this
		// A batch thread left running could still commit after its
		// callers were told it failed; its KILL needs the pool.
		s.killsMu.Lock()
		s.killsClosed = true
		s.killsMu.Unlock()
		s.kills.Wait()
		for _, st := range []*sql.Stmt{s.stmts.reserveFresh, s.stmts.reserve, s.stmts.load, s.stmts.owned, s.stmts.finalize,
			s.stmts.release, s.stmts.extend, s.stmts.takeOver, s.stmts.purge, s.stmts.abandon, s.stmts.forget} {
			if st != nil {
				st.Close()
			}
		}
		err = s.db.Close()
		if s.batchDB != nil {
			err = errors.Join(err, s.batchDB.Close())
		}
	})
	return err
}

// ReleaseIdle closes the idle connections of both pools but one, and keeps
// no more idle from then on; later calls open new ones. The one is there
// for what a dropped store must still do on a server short of connections:
// the KILL of a batch whose caller gave up, a background repair. The
// store's pool key was dropped by a reload (see the root package's
// idleReleaser).
func (s *Store) ReleaseIdle() {
	s.idleKept.Store(1)
	s.db.SetMaxIdleConns(1)
	if s.batchDB != nil {
		s.batchDB.SetMaxIdleConns(0)
	}
}

// opCtx bounds one database call, connecting included, so a dead server
// costs at most StatementTimeout; the driver closes the connection when the
// context ends mid-statement.
func (s *Store) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.timeout)
}

// wrap names the operation, keeps the DSN's password out of the error and
// marks it transient when it is (see sqlstore.IsTransient), and not sent
// when it proves that (see stores.MarkNotSent).
func (s *Store) wrap(op string, err error) error {
	out := fmt.Errorf("mysql %s: %w", op, sqlstore.RedactError(err, s.dsn, s.password))
	if privilegeRefused(err) {
		out = sqlstore.StatementRefused(out, s.cfg.Table)
	}
	if unhanded := (*unhandedError)(nil); errors.As(err, &unhanded) || sqlstore.DialFailed(err) {
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

// maxAttempts bounds re-runs after an InnoDB deadlock (which rolls the
// statement back, so re-running it is safe) or, for Reserve, after the row
// that blocked the INSERT vanished before the SELECT could read it.
const maxAttempts = 10

// errDeadlock is ER_LOCK_DEADLOCK. Concurrent upserts of one key can
// deadlock in InnoDB; the server picks a victim and rolls it back.
const errDeadlock = 1213

func retryable(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == errDeadlock
}

// ready makes sure the first contact was made: see sqlstore.Lazy.
func (s *Store) ready(ctx context.Context) error { return s.lazy.Ready(ctx) }

// exec runs a write statement, re-running it after a deadlock, and returns
// the number of rows it changed. The statement is passed by address and read
// only once the first contact has prepared it: a caller that runs before
// then (the purge loop, the admin API) must not hand over a nil statement.
func (s *Store) exec(ctx context.Context, op string, stmt **sql.Stmt, args ...any) (int64, error) {
	return s.retry(ctx, op, func(ctx context.Context) (int64, error) { return s.execOnce(ctx, *stmt, args...) })
}

// retry runs once after the first contact, again after a deadlock.
func (s *Store) retry(ctx context.Context, op string, once func(context.Context) (int64, error)) (int64, error) {
	if err := s.ready(ctx); err != nil {
		return 0, err
	}
	for attempt := 1; ; attempt++ {
		n, err := once(ctx)
		if err == nil {
			return n, nil
		}
		if !retryable(err) || attempt == maxAttempts || ctx.Err() != nil {
			return 0, s.wrap(op, err)
		}
	}
}

// execOnce runs stmt once. A failure before a connection took the
// statement comes back as an unhandedError (see handOff).
func (s *Store) execOnce(ctx context.Context, stmt *sql.Stmt, args ...any) (int64, error) {
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	args, handed := withHandOff(s.clock.Fill(ctx, args))
	res, err := stmt.ExecContext(ctx, args...)
	if err != nil {
		if !handed() {
			return 0, &unhandedError{err}
		}
		return 0, err
	}
	return res.RowsAffected()
}

// Reserve implements stores.Store: an INSERT of a fresh key (see
// queries.reserveFresh), and only if it did not reserve, a SELECT of the
// existing row. A fresh key costs one statement, a replay two; a key whose
// row expired costs a third, the INSERT … ON DUPLICATE KEY UPDATE that
// overwrites an expired row (see queries.reserve).
func (s *Store) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	if err := sqlstore.CheckKey(r.Key); err != nil {
		return stores.ReserveResult{}, fmt.Errorf("mysql reserve: %w", err)
	}
	if err := s.ready(ctx); err != nil {
		return stores.ReserveResult{}, err
	}
	// One statement_timeout for the clock's read and the statements, as
	// for every call (see execBounded).
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	if err := s.syncClock(ctx); err != nil {
		return stores.ReserveResult{}, err
	}
	w := write{s.stmts.reserveFresh, s.q.reserveFresh, mergeInsert}
	for range maxAttempts {
		var late bool
		n, err := s.retry(ctx, "reserve", func(ctx context.Context) (int64, error) {
			n, err := s.writeOnce(ctx, r.Key, w, r.Key, r.Operation, r.Path, r.Principal, r.Fingerprint, sqlstore.SendDeadline, r.Owner,
				sqlstore.Micros(r.Lease), sqlstore.Micros(r.RecordTTL()))
			late = lateRefusal(err)
			return n, err
		})
		if err != nil {
			return stores.ReserveResult{}, s.lateError(late, err)
		}
		if n > 0 { // 1: inserted, 2: an expired row overwritten
			return stores.ReserveResult{Reserved: true}, nil
		}
		rec, _, err := s.load(ctx, r.Key)
		if err != nil {
			return stores.ReserveResult{}, err
		}
		if rec != nil {
			return stores.ReserveResult{Existing: rec}, nil
		}
		// Expired, or released or purged in between: reserve again,
		// overwriting an expired row.
		w = write{s.stmts.reserve, s.q.reserve, mergeNone}
	}
	return stores.ReserveResult{}, fmt.Errorf("mysql reserve %s: key kept changing under %d attempts", r.Key, maxAttempts)
}

func (s *Store) load(ctx context.Context, key string) (*stores.Record, time.Duration, error) {
	if err := s.ready(ctx); err != nil {
		return nil, 0, err
	}
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	var row sqlstore.Row
	err := s.stmts.load.QueryRowContext(ctx, key).Scan(&row.Key, &row.Operation, &row.Path, &row.Principal,
		&row.Fingerprint, &row.State, &row.Owner, &row.Abandoned, &row.Status, &row.Headers, &row.Body,
		&row.CreatedAt, &row.ExpiresAt, &row.LeaseLeftMicros, &row.KeyID)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, s.wrap("load", err)
	}
	rec, left, err := row.Record()
	if err != nil {
		return nil, 0, s.wrap("load", err)
	}
	return rec, left, nil
}

// Load implements stores.Store.
func (s *Store) Load(ctx context.Context, key string) (*stores.Record, error) {
	rec, _, err := s.load(ctx, key)
	return rec, err
}

// Await implements stores.Store by polling with backoff.
func (s *Store) Await(ctx context.Context, key string) (*stores.Record, error) {
	if err := s.ready(ctx); err != nil {
		return nil, err
	}
	load := func(ctx context.Context) (*stores.Record, time.Duration, error) { return s.load(ctx, key) }
	subscribe := func() (<-chan struct{}, func()) { return s.wakers.Subscribe(key) }
	return s.awaits.Do(ctx, key, load, func(ctx context.Context, load sqlstore.LoadFunc) (*stores.Record, error) {
		return sqlstore.Await(ctx, s.backoff, load, subscribe, nil)
	})
}

// Finalize implements stores.Store. One statement; it always changes the
// row (state becomes final), so zero changed rows means not owned.
func (s *Store) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	f, err := sqlstore.EncodeFinal(resp)
	if err != nil {
		return fmt.Errorf("mysql finalize %s: %w", key, err)
	}
	if err := s.ready(ctx); err != nil {
		return err
	}
	// key_id (at most 64 bytes) fits in rowHeadroom.
	if err := s.checkRowSize(key, owner, f.Headers, f.Body); err != nil {
		return err
	}
	// In the order of finalizeCols, then the key and the owner.
	args := []any{f.Status, f.HeadersArg(), f.Body, f.KeyID, key, owner}
	finalize := write{s.stmts.finalize, s.q.finalize, mergeFinalize}
	n, err := s.writeOnce(ctx, key, finalize, args...)
	for attempt := 2; err != nil && retryable(err) && attempt <= maxAttempts && ctx.Err() == nil; attempt++ {
		n, err = s.writeOnce(ctx, key, finalize, args...)
	}
	if err != nil {
		if packetTooLarge(err) || s.shrunkPacketLimit(ctx, err, key, owner, f.Headers, f.Body) {
			// The server refused it unexecuted: the record is still ours.
			// It also closed that connection, which the driver may have
			// put back in the pool: drop the idle ones, so that the
			// Release which follows does not meet it.
			s.db.SetMaxIdleConns(0)
			s.db.SetMaxIdleConns(int(s.idleKept.Load()))
			return fmt.Errorf("%w: %w", s.wrap("finalize", err), stores.ErrResponseTooLarge)
		}
		return s.wrap("finalize", err)
	}
	if n == 0 {
		return stores.ErrNotOwner
	}
	s.wakers.Wake(key)
	return nil
}

// Release implements stores.Store.
func (s *Store) Release(ctx context.Context, key, owner string) error {
	n, err := s.exec(ctx, "release", &s.stmts.release, key, owner)
	if err != nil {
		return err
	}
	if n == 0 {
		return stores.ErrNotOwner
	}
	s.wakers.Wake(key)
	return nil
}

// ExtendLease implements stores.Store. It is bounded as Reserve: a
// renewal held up on its way past its owner's mark of the record as
// abandoned (the execution ended meanwhile) made the record read as in
// flight for a whole lease more, every retry hearing 503 instead of the
// outcome. MySQL counts changed, not matched, rows: renewing a lease to
// the very microsecond it already ends at changes nothing and reports 0.
// Only then a second statement tells that apart from a lost ownership.
func (s *Store) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	n, err := s.execBounded(ctx, "extend lease", &s.stmts.extend, sqlstore.SendDeadline, sqlstore.Micros(lease), sqlstore.Micros(lease+ttl), key, owner)
	if err != nil {
		return err
	}
	if n > 0 {
		return nil
	}
	return s.confirmOwned(ctx, "extend lease", key, owner)
}

// Abandon implements stores.Store.
func (s *Store) Abandon(ctx context.Context, key, owner string) error {
	n, err := s.exec(ctx, "abandon", &s.stmts.abandon, key, owner)
	if err != nil {
		return err
	}
	if n == 0 {
		if err := s.confirmOwned(ctx, "abandon", key, owner); err != nil {
			return err
		}
	}
	s.wakers.Wake(key)
	return nil
}

// confirmOwned tells a statement that matched no row because the owner's
// row needed no change from one that matched none because the key is not
// in flight under owner (ErrNotOwner).
func (s *Store) confirmOwned(ctx context.Context, op, key, owner string) error {
	if err := s.ready(ctx); err != nil {
		return err
	}
	qctx, cancel := s.opCtx(ctx)
	defer cancel()
	var owned int
	if err := s.stmts.owned.QueryRowContext(qctx, key, owner).Scan(&owned); err != nil {
		return s.wrap(op, err)
	}
	if owned == 0 {
		return stores.ErrNotOwner
	}
	return nil
}

// TakeOver implements stores.Store. The row always changes when it matches
// (a new owner, or a lease moved from the past into the future).
func (s *Store) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	n, err := s.execBounded(ctx, "take over", &s.stmts.takeOver, sqlstore.SendDeadline, newOwner, sqlstore.Micros(lease), sqlstore.Micros(lease+ttl), key, oldOwner)
	if err != nil {
		return false, err
	}
	if n == 1 {
		s.wakers.Wake(key)
	}
	return n == 1, nil
}

// PurgeExpired implements stores.Store.
func (s *Store) PurgeExpired(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	n, err := s.exec(ctx, "purge", &s.stmts.purge, limit)
	return int(n), err
}

// LoggedDSN returns the DSN as the store's log lines show it: without its
// password, whatever characters it holds.
func (s *Store) LoggedDSN() string { return s.loggedDSN }
