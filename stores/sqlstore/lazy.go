package sqlstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// ErrNotReady is matched (errors.Is) by the errors of operations on a store
// whose first contact with its database has not succeeded yet: the
// database was unreachable, or its schema is not the one this build needs.
var ErrNotReady = errors.New("store not ready")

// ErrClosed is returned by operations on a closed store.
var ErrClosed = errors.New("store closed")

// SchemaError is a schema check's verdict: the database answers but its
// schema is not at the version this build needs. Its message names the
// file in sql/ to apply.
type SchemaError struct{ Msg string }

func (e *SchemaError) Error() string { return e.Msg }

// AccessError is the database's refusal of a statement the store needs
// for want of privilege: it answers, but a DBA must grant the store's user
// what the README's Privileges paragraph lists. Its message says so. Err,
// when set, is the refused operation's own error (see OperationRefused).
type AccessError struct {
	Msg string
	Err error
}

func (e *AccessError) Error() string { return e.Msg }
func (e *AccessError) Unwrap() error { return e.Err }

// OperationRefused is the verdict on an operation of a ready store that
// the server refused its user for want of privilege (err, the operation's
// error, named and redacted; grant, what to grant): a grant revoked while
// Caddy runs. It is an AccessError, as the refusal at first contact is, so
// that fail_open does not pass the request: until the build after d4fe47c
// it was a plain store error, and every keyed request, the retries of
// answered keys too, executed again for as long as the grant was missing.
func OperationRefused(err error, grant string) error {
	return &AccessError{Msg: fmt.Sprintf("%v: %s", err, grant), Err: err}
}

// StatementRefused is OperationRefused for a SQL store's statement on
// table, naming the README's grant.
func StatementRefused(err error, table string) error {
	return OperationRefused(err, fmt.Sprintf("grant the store's database user SELECT, INSERT, UPDATE and DELETE on %s and %s_schema", table, table))
}

// Defaults of Lazy's retry timing.
const (
	DefaultRetryMin = 500 * time.Millisecond
	DefaultRetryMax = 30 * time.Second
	// DefaultCooldown is how long operations fail fast with the last
	// error after a failed attempt, instead of each trying again.
	DefaultCooldown = time.Second
)

// Lazy runs a store's first contact with its database — connect, check or
// migrate the schema, prepare — when the store is first needed rather than
// when it is opened. Opening a store therefore needs no database: Caddy
// loads a config whose database is down (keyed requests get store errors
// until it answers), and `caddy validate`, which provisions but never
// starts, writes nothing.
//
// Two things trigger an attempt: Warm, a background loop with backoff that
// the app starts, and Ready, which every operation calls first. Ready is an
// atomic load once an attempt has succeeded. Before that, one attempt runs
// at a time and concurrent callers wait for its outcome instead of each
// starting one; after a failure they fail fast with its error for Cooldown.
// Attempts run detached from the callers (a request that gives up does not
// abort a migration half-way) and end when the store closes.
type Lazy struct {
	// Name prefixes messages, e.g. "postgres".
	Name string
	// DSN is logged, redacted (the stores pass it as LoggedDSN gives it).
	DSN string
	// Attempt makes the first contact. It must be safe to run again after
	// it failed, and bound each database call by itself.
	Attempt func(ctx context.Context) error
	// AttemptTimeout bounds one whole attempt.
	AttemptTimeout time.Duration
	// Retry bounds Warm's backoff between attempts. Defaults
	// DefaultRetryMin and DefaultRetryMax.
	Retry Backoff
	// Cooldown: see DefaultCooldown.
	Cooldown time.Duration
	Log      *zap.Logger

	ready atomic.Bool

	mu       sync.Mutex
	running  *attempt // the attempt in progress, if any
	lastErr  error
	lastAt   time.Time
	warming  bool
	closed   bool
	closeCtx context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
}

type attempt struct {
	done chan struct{}
	err  error
}

func (l *Lazy) init() {
	if l.closeCtx == nil {
		l.closeCtx, l.cancel = context.WithCancel(context.Background())
		if l.Log == nil {
			l.Log = zap.NewNop()
		}
		if l.Retry.Min <= 0 {
			l.Retry.Min = DefaultRetryMin
		}
		if l.Retry.Max < l.Retry.Min {
			l.Retry.Max = max(DefaultRetryMax, l.Retry.Min)
		}
		if l.Cooldown <= 0 {
			l.Cooldown = DefaultCooldown
		}
	}
}

// IsReady reports whether an attempt has succeeded.
func (l *Lazy) IsReady() bool { return l.ready.Load() }

// Ready returns nil once the first contact has succeeded, running an
// attempt if none ran within Cooldown. Its errors match ErrNotReady, or
// ErrClosed, or ctx's error when ctx ends first.
func (l *Lazy) Ready(ctx context.Context) error {
	if l.ready.Load() {
		return nil
	}
	// Whatever kept the store from being ready, the caller's own
	// statement was never sent.
	return stores.MarkNotSent(l.try(ctx, false))
}

func (l *Lazy) try(ctx context.Context, force bool) error {
	l.mu.Lock()
	l.init()
	if l.ready.Load() {
		l.mu.Unlock()
		return nil
	}
	if l.closed {
		l.mu.Unlock()
		return fmt.Errorf("%s: %w", l.Name, ErrClosed)
	}
	a := l.running
	if a == nil {
		if !force && l.lastErr != nil && time.Since(l.lastAt) < l.Cooldown {
			err := l.lastErr
			l.mu.Unlock()
			return err
		}
		a = &attempt{done: make(chan struct{})}
		l.running = a
		l.wg.Add(1)
		go l.run(a)
	}
	l.mu.Unlock()
	select {
	case <-a.done:
		return a.err
	case <-ctx.Done():
		return fmt.Errorf("%s %w: waiting for the database: %w", l.Name, ErrNotReady, ctx.Err())
	}
}

func (l *Lazy) run(a *attempt) {
	defer l.wg.Done()
	ctx, cancel := context.WithTimeout(l.closeCtx, l.AttemptTimeout)
	err := l.Attempt(ctx)
	cancel()
	l.mu.Lock()
	if err == nil {
		l.ready.Store(true)
		l.lastErr = nil
	} else {
		if l.closeCtx.Err() != nil {
			err = fmt.Errorf("%s: %w", l.Name, ErrClosed)
		} else {
			err = fmt.Errorf("%s %w: %w", l.Name, ErrNotReady, err)
		}
		l.lastErr, l.lastAt = err, time.Now()
	}
	a.err = err
	l.running = nil
	l.mu.Unlock()
	close(a.done)
}

// Warm starts, in the background, trying to reach the database until an
// attempt succeeds or the store closes, with backoff between attempts. It
// returns at once, and does nothing when the store is ready or already
// warming. A failed attempt is logged: a warning while the database is
// unreachable, an error when its schema needs a file applied by hand or its
// user a grant.
func (l *Lazy) Warm() {
	l.mu.Lock()
	l.init()
	if l.ready.Load() || l.closed || l.warming {
		l.mu.Unlock()
		return
	}
	l.warming = true
	l.wg.Add(1)
	l.mu.Unlock()
	go l.warm()
}

func (l *Lazy) warm() {
	defer l.wg.Done()
	defer func() {
		l.mu.Lock()
		l.warming = false
		l.mu.Unlock()
	}()
	backoff := Backoff{Min: l.Retry.Min, Max: l.Retry.Max}
	dsn := RedactDSN(l.DSN)
	failures := 0
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		err := l.try(l.closeCtx, true)
		if err == nil {
			if failures > 0 {
				l.Log.Info("database reachable, store ready", zap.String("dsn", dsn), zap.Int("failed_attempts", failures))
			}
			return
		}
		if l.closeCtx.Err() != nil {
			return
		}
		failures++
		wait := backoff.Next()
		if se := (*SchemaError)(nil); errors.As(err, &se) {
			l.Log.Error("database schema check failed, will retry", zap.String("dsn", dsn),
				zap.Duration("retry_in", wait), zap.Error(err))
		} else if ae := (*AccessError)(nil); errors.As(err, &ae) {
			l.Log.Error("database refused the store's user a statement, will retry", zap.String("dsn", dsn),
				zap.Duration("retry_in", wait), zap.Error(err))
		} else {
			l.Log.Warn("database unreachable, will retry", zap.String("dsn", dsn),
				zap.Duration("retry_in", wait), zap.Int("attempt", failures), zap.Error(err))
		}
		timer.Reset(wait)
		select {
		case <-l.closeCtx.Done():
			return
		case <-timer.C:
		}
	}
}

// Close ends Warm and any attempt in progress, and waits for them; later
// calls of Ready fail with ErrClosed.
func (l *Lazy) Close() {
	l.mu.Lock()
	l.init()
	l.closed = true
	l.mu.Unlock()
	l.cancel()
	l.wg.Wait()
}
