package sqlstore

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// The attempt is a fake here: what is tested is who runs it and when. The
// stores' tests run the real first contact against real servers.

// Concurrent callers of a store that is not ready share one attempt; after
// it fails, they fail fast with its error until the cooldown passes.
func TestLazyOneAttemptForConcurrentCallers(t *testing.T) {
	var calls atomic.Int32
	release := make(chan struct{})
	down := errors.New("connection refused")
	l := &Lazy{Name: "test", Cooldown: time.Hour, AttemptTimeout: time.Minute,
		Attempt: func(ctx context.Context) error {
			calls.Add(1)
			<-release
			return MarkTransient(down)
		}}
	defer l.Close()
	const callers = 20
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for range callers {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- l.Ready(context.Background()) }()
	}
	for calls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		if !errors.Is(err, ErrNotReady) || !errors.Is(err, down) || !IsTransient(err) {
			t.Fatalf("Ready = %v, want a transient ErrNotReady wrapping the attempt's error", err)
		}
	}
	// Within the cooldown: the last error, no new attempt.
	if err := l.Ready(context.Background()); !errors.Is(err, down) {
		t.Fatalf("Ready = %v", err)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("%d attempts for %d concurrent callers, want 1", n, callers)
	}
	if l.IsReady() {
		t.Fatal("ready after a failed attempt")
	}
}

// A caller whose context ends stops waiting; the attempt goes on detached
// and its success makes the store ready for everyone. The attempt ends
// with its context, as a real one does: until the build after 80fc55f it
// did not, and an attempt cancelled with its first caller passed.
func TestLazyAttemptOutlivesAnImpatientCaller(t *testing.T) {
	release := make(chan struct{})
	var calls atomic.Int32
	l := &Lazy{Name: "test", AttemptTimeout: time.Minute,
		Attempt: func(ctx context.Context) error {
			calls.Add(1)
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}}
	defer l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- l.Ready(ctx) }()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) || !errors.Is(err, ErrNotReady) {
		t.Fatalf("Ready = %v, want Canceled and ErrNotReady", err)
	}
	close(release)
	if err := l.Ready(context.Background()); err != nil {
		t.Fatalf("Ready = %v", err)
	}
	if !l.IsReady() {
		t.Fatal("not ready after a successful attempt")
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("%d attempts, want the one the impatient caller began", n)
	}
}

// Warm retries with backoff until an attempt succeeds, logging each failure
// with the redacted DSN: a warning while unreachable, an error for a schema
// that needs a file applied.
func TestLazyWarmRetriesUntilReady(t *testing.T) {
	var calls atomic.Int32
	core, logs := observer.New(zap.InfoLevel)
	l := &Lazy{Name: "test", DSN: "postgres://u:s3cr?t@db/x", AttemptTimeout: time.Minute,
		Retry: Backoff{Min: time.Millisecond, Max: 2 * time.Millisecond}, Log: zap.New(core),
		Attempt: func(ctx context.Context) error {
			switch calls.Add(1) {
			case 1, 2:
				return errors.New("connection refused")
			case 3:
				return &SchemaError{Msg: "apply sql/postgres/0001_records.sql"}
			}
			return nil
		}}
	defer l.Close()
	l.Warm()
	l.Warm() // no second loop
	for !l.IsReady() {
		time.Sleep(time.Millisecond)
	}
	for logs.FilterMessage("database reachable, store ready").Len() == 0 {
		time.Sleep(time.Millisecond)
	}
	if n := calls.Load(); n != 4 {
		t.Fatalf("%d attempts, want 4", n)
	}
	warns := logs.FilterMessage("database unreachable, will retry").All()
	if len(warns) != 2 || warns[0].Level != zap.WarnLevel || warns[0].ContextMap()["dsn"] != "postgres://u:xxxxx@db/x" {
		t.Fatalf("warnings = %v", warns)
	}
	if errs := logs.FilterMessage("database schema check failed, will retry").All(); len(errs) != 1 || errs[0].Level != zap.ErrorLevel {
		t.Fatalf("schema errors = %v", errs)
	}
	l.Warm() // ready: nothing to do
	if n := calls.Load(); n != 4 {
		t.Fatalf("%d attempts after Warm on a ready store, want 4", n)
	}
}

// Close ends the warm-up loop and the attempt in progress; afterwards
// operations fail with ErrClosed.
func TestLazyCloseStopsWarm(t *testing.T) {
	started := make(chan struct{}, 1)
	l := &Lazy{Name: "test", AttemptTimeout: time.Hour, Retry: Backoff{Min: time.Hour, Max: time.Hour},
		Attempt: func(ctx context.Context) error {
			select {
			case started <- struct{}{}:
			default:
			}
			<-ctx.Done()
			return ctx.Err()
		}}
	l.Warm()
	<-started
	l.Close() // returns only once the attempt and the loop ended
	if err := l.Ready(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Ready after Close = %v, want ErrClosed", err)
	}
	l.Warm() // no-op after Close
}
