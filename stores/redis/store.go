package redis

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// Store is a stores.Store in Redis or Valkey. Use Open.
type Store struct {
	client  goredis.UniversalClient
	cfg     Config
	timeout time.Duration
	channel string
	log     *zap.Logger

	listenOnce sync.Once
	listener   *listener // set by the first Warm or Await

	evictionOnce sync.Once
	// checking is the checks of checkEviction and checkAccess under way,
	// which Close waits for: they log, and nothing may log for a store
	// after its Close.
	checking sync.WaitGroup

	// awaits shares one wait per key on this node: a thousand duplicates
	// of one key then cost one poll loop and one load of the answer, not
	// a thousand, which emptied the pool and answered many of them 503.
	awaits sqlstore.AwaitGroup

	// clock bounds a Reserve on the server's clock (deadline.go).
	clock serverClock

	// access holds operations back while the server refuses the store's
	// user a command they need (access.go).
	access access

	closeOnce sync.Once
	closed    chan struct{}
}

var _ stores.Store = (*Store)(nil)

// Open checks the configuration and sets up the client without connecting:
// the server need not be up. Connections are made by the first command;
// while the server is unreachable every call fails (transiently, see
// sqlstore.IsTransient) within the configured timeouts, and works again,
// without reopening, once it answers.
func Open(cfg Config, logger *zap.Logger) (*Store, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = zap.NewNop()
	}
	opts := &goredis.UniversalOptions{
		Addrs:         cfg.Addrs,
		IsClusterMode: cfg.Cluster,
		Username:      cfg.Username,
		Password:      cfg.Password,
		DB:            cfg.DB,
		DialTimeout:   cfg.DialTimeout,
		ReadTimeout:   cfg.ReadTimeout,
		WriteTimeout:  cfg.WriteTimeout,
		PoolSize:      cfg.PoolSize,
		// A call that waits this long for a pooled connection fails with
		// ErrPoolTimeout, which proves it sent nothing. go-redis's own
		// default (read timeout + 1 s) outlasts the call's deadline, whose
		// error proves nothing, and the handler would undo the call.
		PoolTimeout: cfg.opTimeout() / 2,
		// A store call is one attempt: the handler decides about retries
		// (a script whose reply was lost may have run; a blind resend of
		// Finalize would then report ErrNotOwner, as the SQL stores do).
		MaxRetries: -1,
		// Deadlines of the callers' contexts reach the sockets.
		ContextTimeoutEnabled: true,
		// RESP2: understood by every Redis and Valkey version and proxy.
		Protocol: 2,
		// No CLIENT SETINFO at connect: one round trip less, and proxies
		// that refuse it stay quiet.
		DisableIdentity: true,
	}
	if cfg.TLS {
		opts.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cfg.TLSServerName}
	}
	s := &Store{
		client:  goredis.NewUniversalClient(opts),
		cfg:     cfg,
		timeout: cfg.opTimeout(),
		channel: cfg.KeyPrefix + "changed",
		log:     logger.With(zap.Strings("addresses", cfg.Addrs), zap.String("key_prefix", cfg.KeyPrefix)),
		closed:  make(chan struct{}),
	}
	return s, nil
}

// Warm starts the subscription that wakes Await, in the background. The
// Caddy app calls it from Start, so that `caddy validate` connects to
// nothing; Await starts it too.
func (s *Store) Warm() {
	s.startListener()
	s.evictionOnce.Do(func() {
		select {
		case <-s.closed:
			return
		default:
		}
		s.checking.Go(s.checkEviction)
		_ = s.allowed()
	})
}

// checkEviction warns, once, when the server's maxmemory-policy may evict
// records: every record has a TTL, so volatile-* policies evict exactly
// them, and an evicted record lets its retry execute again. A server that
// refuses CONFIG (managed services often do) is only noted at debug.
func (s *Store) checkEviction() {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	v, err := s.client.ConfigGet(ctx, "maxmemory-policy").Result()
	select {
	case <-s.closed:
		return // closed meanwhile: err is most likely the closed client's
	default:
	}
	if err != nil {
		s.log.Debug("could not read maxmemory-policy: make sure it is noeviction", zap.Error(err))
		return
	}
	p := v["maxmemory-policy"]
	if p == "" || p == "noeviction" {
		s.log.Debug("maxmemory-policy keeps records", zap.String("maxmemory_policy", p))
		return
	}
	s.log.Warn("maxmemory-policy evicts keys: once Redis reaches maxmemory, it deletes records (each has a TTL), "+
		"and a retry of a commit whose record was evicted executes again; set maxmemory-policy noeviction",
		zap.String("maxmemory_policy", p))
}

func (s *Store) startListener() {
	s.listenOnce.Do(func() {
		select {
		case <-s.closed:
			return
		default:
		}
		s.listener = startListener(s.client, s.channel, s.cfg.Username, s.cfg.NotifyFallback, s.log)
	})
}

// Close stops the subscription and closes the connections.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		close(s.closed)
		s.listenOnce.Do(func() {})   // no listener starts after this
		s.evictionOnce.Do(func() {}) // nor a check of the eviction policy
		s.stopChecks()               // nor of the user's commands
		if s.listener != nil {
			s.listener.stop()
		}
		_ = s.client.Close()
		s.checking.Wait()
	})
	return nil
}

// SelfExpiring implements stores.SelfExpiring: Redis deletes expired
// records itself (key TTL), so PurgeExpired has nothing to do.
func (s *Store) SelfExpiring() bool { return true }

func (s *Store) key(k string) string { return s.cfg.KeyPrefix + k }

// run runs one script on key, bounded by the store's timeout.
func (s *Store) run(ctx context.Context, op string, script *goredis.Script, key string, args ...any) (any, error) {
	select {
	case <-s.closed:
		return nil, stores.MarkNotSent(fmt.Errorf("redis %s: %w", op, sqlstore.ErrClosed))
	default:
	}
	if err := s.allowed(); err != nil {
		return nil, fmt.Errorf("redis %s: %w", op, err)
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	v, err := script.Run(ctx, s.client, []string{s.key(key)}, args...).Result()
	if err != nil {
		if refusedAccess(err) {
			// The operation's own refusal is as much the server's word
			// as the check's verdict (see sqlstore.OperationRefused).
			s.recheckAccess()
			return nil, sqlstore.OperationRefused(s.wrap(op, err), s.grantHint())
		}
		return nil, s.wrap(op, err)
	}
	return v, nil
}

// wrap names the operation and marks the error transient when calling
// again later may succeed, and not sent when it proves that (see
// stores.MarkNotSent): no connection could be had, or the server refused
// the command before running it (refusedUnrun), on a client that sends a
// command once (MaxRetries -1), so that this was the command's only
// attempt; a cluster client's never is. go-redis errors never carry the
// password.
func (s *Store) wrap(op string, err error) error {
	out := fmt.Errorf("redis %s: %w", op, err)
	if !s.resends() && redirected(err) {
		out = fmt.Errorf("redis %s: %w (the address is a Redis Cluster node: set cluster on, or list several nodes)", op, err)
	}
	if !s.resends() && (errors.Is(err, goredis.ErrPoolTimeout) || sqlstore.DialFailed(err) || refusedUnrun(err)) {
		out = stores.MarkNotSent(out)
	}
	if transient(err) {
		return sqlstore.MarkTransient(out)
	}
	return out
}

// notNow are the prefixes of the server's "not now" replies (loading its
// data set after a restart, a replica or a cluster in failover, a script
// still running, a server at maxmemory, one that cannot persist, one short
// of the replicas min-replicas-to-write asks for): calling again later may
// succeed.
var notNow = []string{"LOADING ", "READONLY ", "MASTERDOWN ", "TRYAGAIN ", "CLUSTERDOWN ", "BUSY ", "OOM ", "MISCONF ", "NOREPLICAS "}

// refusedUnrun reports a reply of the server that refuses the command
// instead of running it: while it loads its data set (LOADING), on a
// replica (READONLY: no write of a script runs there), without a reachable
// master (MASTERDOWN), while another script runs (BUSY), or on a
// connection that is not logged in (NOAUTH; WRONGPASS, which the login at
// connect answers, before any command is sent on it), or by a cluster node
// that does not serve the key's slot (MOVED, ASK: only the cluster client
// follows them). And the refusals of a script's first write: at maxmemory
// under noeviction (OOM), after a failed save or AOF write (MISCONF), short
// of min-replicas-to-write (NOREPLICAS). For a script that declares no
// flags, as none of these does, Redis checks these (and READONLY) at each
// write command only until the script's first write has run, since it
// cannot stop a script half-way: a script refused so wrote nothing. Until
// the build after 333d799 they counted as lost replies, and each Reserve
// refused at maxmemory sent 25 releases in the next 10 s, and one
// refused with NOREPLICAS or MISCONF, which refuse the releases too, two a
// second for 2 minutes. A script that ran and failed answers an ERR
// reply, and NOPERM may come from a command after others wrote: neither
// counts.
func refusedUnrun(err error) bool {
	return replyStarts(err, "LOADING ", "READONLY ", "MASTERDOWN ", "BUSY ", "NOAUTH ", "WRONGPASS ", "MOVED ", "ASK ",
		"OOM ", "MISCONF ", "NOREPLICAS ")
}

// replyStarts reports whether err is an error reply of the server that
// starts with one of prefixes.
func replyStarts(err error, prefixes ...string) bool {
	var rerr goredis.Error
	if !errors.As(err, &rerr) {
		return false
	}
	msg := rerr.Error()
	for _, p := range prefixes {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

// redirected reports a cluster node's redirection (MOVED, ASK), which a
// client for a single server meets when its address is a cluster's.
func redirected(err error) bool { return replyStarts(err, "MOVED ", "ASK ") }

// resends reports a cluster client, which sends a command again after a
// network error whatever MaxRetries says (to the same node, then another):
// its final error, even a dial error, does not prove that no attempt ran.
func (s *Store) resends() bool {
	_, cluster := s.client.(*goredis.ClusterClient)
	return cluster
}

// transient reports network failures and timeouts, and the server's own
// "not now" answers (loading its data set, a replica or a cluster in
// failover, a busy script).
func transient(err error) bool {
	if errors.Is(err, goredis.ErrPoolTimeout) || sqlstore.NetworkError(err) {
		return true
	}
	msg := err.Error()
	for _, p := range notNow {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

// durMS converts a duration for the scripts, rounding up so that a
// positive duration never becomes 0.
func durMS(d time.Duration) int64 {
	if d <= 0 {
		return 1
	}
	return int64(math.Ceil(float64(d) / float64(time.Millisecond)))
}

// Reserve implements stores.Store. One script.
func (s *Store) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	if err := sqlstore.CheckKey(r.Key); err != nil {
		return stores.ReserveResult{}, fmt.Errorf("redis reserve: %w", err)
	}
	out, err := s.runBounded(ctx, "reserve", reserveScript, r.Key,
		r.Operation, r.Path, r.Principal, r.Fingerprint, r.Owner, durMS(r.Lease), durMS(r.RecordTTL()))
	if err != nil {
		return stores.ReserveResult{}, err
	}
	if flag, _ := out[0].(int64); flag == 1 {
		return stores.ReserveResult{Reserved: true}, nil
	}
	rec, _, err := decode(r.Key, out[1:])
	if err != nil {
		return stores.ReserveResult{}, fmt.Errorf("redis reserve: %w", err)
	}
	return stores.ReserveResult{Existing: rec}, nil
}

// decode turns {now, field, value, ...} into a record (nil when there are
// no fields) and its remaining lease.
func decode(key string, reply []any) (*stores.Record, time.Duration, error) {
	now, ok := reply[0].(int64)
	if !ok {
		return nil, 0, fmt.Errorf("record %s: server time is %T", key, reply[0])
	}
	if len(reply) == 1 {
		return nil, 0, nil
	}
	f := make(map[string]string, len(reply)/2)
	for i := 1; i+1 < len(reply); i += 2 {
		k, _ := reply[i].(string)
		v, _ := reply[i+1].(string)
		f[k] = v
	}
	msTime := func(name string) (int64, error) {
		n, err := strconv.ParseInt(f[name], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%w: record %s: field %s: %w", stores.ErrUnreadableRecord, key, name, err)
		}
		return n, nil
	}
	created, err := msTime("created")
	if err != nil {
		return nil, 0, err
	}
	expires, err := msTime("expires")
	if err != nil {
		return nil, 0, err
	}
	rec := &stores.Record{
		Key:       key,
		Binding:   stores.Binding{Operation: f["op"], Path: f["path"], Principal: f["principal"], Fingerprint: f["fp"]},
		State:     stores.State(f["state"]),
		CreatedAt: time.UnixMilli(created),
		ExpiresAt: time.UnixMilli(expires),
	}
	var left time.Duration
	switch rec.State {
	case stores.StateInFlight:
		lease, err := msTime("lease")
		if err != nil {
			return nil, 0, err
		}
		rec.Owner = f["owner"]
		rec.Abandoned = lease <= now
		left = time.Duration(max(lease-now, 0)) * time.Millisecond
	case stores.StateFinal:
		body := []byte(f["body"])
		if id := f["key_id"]; id != "" {
			// Sealed: status and headers are inside the opaque body.
			rec.Response = &stores.Response{Body: body, KeyID: id}
			break
		}
		status, err := strconv.Atoi(f["status"])
		if err != nil {
			return nil, 0, fmt.Errorf("%w: record %s: status: %w", stores.ErrUnreadableRecord, key, err)
		}
		h, err := sqlstore.DecodeHeader([]byte(f["headers"]))
		if err != nil {
			return nil, 0, fmt.Errorf("%w: record %s: %w", stores.ErrUnreadableRecord, key, err)
		}
		rec.Response = &stores.Response{Status: status, Header: h, Body: body}
	default:
		return nil, 0, fmt.Errorf("%w: record %s has unknown state %q", stores.ErrUnreadableRecord, key, rec.State)
	}
	return rec, left, nil
}

// load reads key's live record and its remaining lease by the server's
// clock.
func (s *Store) load(ctx context.Context, key string) (*stores.Record, time.Duration, error) {
	v, err := s.run(ctx, "load", loadScript, key)
	if err != nil {
		return nil, 0, err
	}
	out, ok := v.([]any)
	if !ok || len(out) == 0 {
		return nil, 0, fmt.Errorf("redis load %s: unexpected reply %T", key, v)
	}
	rec, left, err := decode(key, out)
	if err != nil {
		return nil, 0, fmt.Errorf("redis load: %w", err)
	}
	return rec, left, nil
}

// Load implements stores.Store.
func (s *Store) Load(ctx context.Context, key string) (*stores.Record, error) {
	rec, _, err := s.load(ctx, key)
	return rec, err
}

// Await implements stores.Store: it wakes on the change message the
// scripts publish, re-reads every NotifyFallback in case one was lost,
// and no later than the lease's end.
func (s *Store) Await(ctx context.Context, key string) (*stores.Record, error) {
	s.startListener()
	load := func(ctx context.Context) (*stores.Record, time.Duration, error) { return s.load(ctx, key) }
	var sub sqlstore.SubscribeFunc
	if l := s.listener; l != nil {
		sub = func() (<-chan struct{}, func()) { return l.Subscribe(key) }
	}
	backoff := sqlstore.Backoff{Min: s.cfg.NotifyFallback, Max: s.cfg.NotifyFallback}
	return s.awaits.Do(ctx, key, load, func(ctx context.Context, load sqlstore.LoadFunc) (*stores.Record, error) {
		return sqlstore.Await(ctx, backoff, load, sub, nil)
	})
}

// cas runs a compare-and-swap script and reports whether it applied.
func (s *Store) cas(ctx context.Context, op string, script *goredis.Script, key string, args ...any) (bool, error) {
	v, err := s.run(ctx, op, script, key, args...)
	if err != nil {
		return false, err
	}
	n, ok := v.(int64)
	if !ok {
		return false, fmt.Errorf("redis %s %s: unexpected reply %T", op, key, v)
	}
	return n == 1, nil
}

func notOwner(ok bool, err error) error {
	if err == nil && !ok {
		return stores.ErrNotOwner
	}
	return err
}

// Finalize implements stores.Store. The body is stored as raw bytes.
func (s *Store) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	if err := resp.Check(); err != nil {
		return fmt.Errorf("redis finalize %s: %w", key, err)
	}
	status, headers := "", []byte{}
	if resp.KeyID == "" {
		h, err := sqlstore.EncodeHeader(resp.Header)
		if err != nil {
			return fmt.Errorf("redis finalize %s: %w", key, err)
		}
		status, headers = strconv.Itoa(resp.Status), h
	}
	body := resp.Body
	if body == nil {
		body = []byte{}
	}
	return notOwner(s.cas(ctx, "finalize", finalizeScript, key, owner, status, headers, body, resp.KeyID, s.channel, key))
}

// Release implements stores.Store.
func (s *Store) Release(ctx context.Context, key, owner string) error {
	return notOwner(s.cas(ctx, "release", releaseScript, key, owner, s.channel, key))
}

// ExtendLease implements stores.Store. It is bounded as Reserve: a
// renewal held up on its way past its owner's mark of the record as
// abandoned (the execution ended meanwhile) made the record read as in
// flight for a whole lease more, every retry hearing 503 instead of the
// outcome.
func (s *Store) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	out, err := s.runBounded(ctx, "extend lease", extendScript, key, owner, durMS(lease), durMS(lease+ttl))
	if err != nil {
		return err
	}
	flag, _ := out[0].(int64)
	return notOwner(flag == 1, nil)
}

// Abandon implements stores.Store.
func (s *Store) Abandon(ctx context.Context, key, owner string) error {
	return notOwner(s.cas(ctx, "abandon", abandonScript, key, owner, s.channel, key))
}

// TakeOver implements stores.Store. It is bounded as Reserve: one that
// landed after its caller's undo had ended gave the record to an owner
// that never executes, with a lease nobody renews, and the request still
// executing under the old owner could no longer finalize it.
func (s *Store) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	out, err := s.runBounded(ctx, "take over", takeOverScript, key, oldOwner, newOwner, durMS(lease), s.channel, key, durMS(lease+ttl))
	if err != nil {
		return false, err
	}
	flag, _ := out[0].(int64)
	return flag == 1, nil
}

// runBounded runs a script that creates a reservation (Reserve, TakeOver)
// or renews one (ExtendLease), with the end of its call on the server's
// clock as its last argument (see deadline.go), and returns its reply: a
// flag, the server's time in milliseconds, and what else the script
// returns. The flag is never 2, the
// script's "run after not-after, wrote nothing".
func (s *Store) runBounded(ctx context.Context, op string, script *goredis.Script, key string, args ...any) ([]any, error) {
	// One deadline for the clock's reading and the script: the call is
	// bounded by the store's timeout, as any.
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	if err := s.syncClock(ctx); err != nil {
		return nil, err
	}
	for try := 1; ; try++ {
		sent := time.Now()
		v, err := s.run(ctx, op, script, key, append(args, s.clock.notAfter(ctx.Deadline()))...)
		if err != nil {
			return nil, err
		}
		out, ok := v.([]any)
		if !ok || len(out) < 2 {
			return nil, fmt.Errorf("redis %s %s: unexpected reply %T", op, key, v)
		}
		if t, ok := out[1].(int64); ok && !s.resends() {
			s.clock.learn(t, sent)
		}
		if flag, _ := out[0].(int64); flag != 2 {
			return out, nil
		}
		// Run after its deadline, it wrote nothing. A call whose deadline
		// has not passed here was judged late only because a clock
		// stepped (the server's forward, or this node's back) since the
		// offset was learned, by more than ClockMargin plus the time the
		// call had left: sent again, it carries the offset the reply just
		// taught. Until the build after d8c00a9 it was answered 503.
		if try > 1 || ctx.Err() != nil {
			return nil, sqlstore.MarkTransient(stores.MarkNotSent(
				fmt.Errorf("redis %s %s: the server ran it after its deadline (clock stepped?)", op, key)))
		}
	}
}

// PurgeExpired implements stores.Store. Redis expires records by their key
// TTL on its own; there is never anything to purge.
func (s *Store) PurgeExpired(context.Context, int) (int, error) { return 0, nil }
