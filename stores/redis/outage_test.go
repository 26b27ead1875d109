package redis

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis/redistest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

const outageTimeout = time.Second

// TestOutageAndRecovery cuts the network to the server under an open
// Store, first refusing connections, then swallowing them: calls must fail
// within the timeout with a transient error, and work again once the
// server is back, without reopening the Store (change messages included).
func TestOutageAndRecovery(t *testing.T) {
	proxy := sqltest.NewProxy(t, redistest.Addr(t))
	s, _ := openStore(t, func(c *Config) {
		c.Addrs = []string{proxy.Addr()}
		c.DialTimeout, c.ReadTimeout, c.WriteTimeout = outageTimeout, outageTimeout, outageTimeout
	})
	s.Warm()
	ctx := context.Background()
	key := storetest.NewKey(t)
	if _, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long)); err != nil {
		t.Fatal(err)
	}
	calls := outageCalls(t, s, key)
	for _, mode := range []string{"refused", "blackhole"} {
		proxy.Stop()
		if mode == "blackhole" {
			proxy.Blackhole()
		}
		checkCallsFail(t, mode, calls)
	}
	proxy.Stop()
	proxy.Start()

	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := s.Load(ctx, key)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no recovery: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Awaits wake by message again once the subscription is back (its
	// backoff is at most 5s). The fallback poll (1s) would hide a dead
	// subscription, so wait past it and measure.
	deadline = time.Now().Add(15 * time.Second)
	for {
		k := storetest.NewKey(t)
		r := storetest.Reservation(k, storetest.Long, storetest.Long)
		if _, err := s.Reserve(ctx, r); err != nil {
			t.Fatal(err)
		}
		done := make(chan time.Time, 1)
		go func() {
			if _, err := s.Await(ctx, k); err != nil {
				t.Error(err)
			}
			done <- time.Now()
		}()
		time.Sleep(1100 * time.Millisecond)
		start := time.Now()
		if err := s.Finalize(ctx, k, r.Owner, stores.Response{Status: 200}); err != nil {
			t.Fatal(err)
		}
		lat := (<-done).Sub(start)
		if lat < 300*time.Millisecond {
			t.Logf("wake-up after recovery: %v", lat)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Await woke %v after Finalize: the subscription did not recover", lat)
		}
	}
}

func outageCalls(t *testing.T, s *Store, key string) []func() error {
	ctx := context.Background()
	return []func() error{
		func() error { _, err := s.Load(ctx, key); return err },
		func() error {
			_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
			return err
		},
		func() error { return s.Finalize(ctx, key, "x", stores.Response{Status: 200}) },
		func() error { return s.ExtendLease(ctx, key, "x", time.Second, time.Minute) },
		func() error { _, err := s.TakeOver(ctx, key, "x", "y", time.Second, time.Minute); return err },
	}
}

// checkCallsFail runs the calls concurrently: each must fail, transiently,
// within the timeout, and not as ErrNotOwner.
func checkCallsFail(t *testing.T, mode string, calls []func() error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(calls))
	start := time.Now()
	for i, call := range calls {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = call() }()
	}
	wg.Wait()
	if el := time.Since(start); el > outageTimeout+500*time.Millisecond {
		t.Fatalf("%s: calls took %v with the server down (timeout %v)", mode, el, outageTimeout)
	}
	for _, err := range errs {
		if err == nil || errors.Is(err, stores.ErrNotOwner) || !sqlstore.IsTransient(err) {
			t.Fatalf("%s: call = %v, want a transient store error", mode, err)
		}
	}
	t.Logf("%s: %v", mode, errs[0])
}

// TestStartWithServerDown opens a Store while its server is unreachable:
// Open succeeds without touching it, calls fail fast and transiently
// (the password never in the error or the log), and once the server
// answers the store works without being reopened, subscription included.
func TestStartWithServerDown(t *testing.T) {
	proxy := sqltest.NewProxy(t, redistest.Addr(t))
	proxy.Stop()
	const pw = "S3cr?t-startup"
	core, logs := observer.New(zap.DebugLevel)
	// The fallback poll a minute apart: at 1 s, its sixth poll landed just
	// after the Finalize 6 s on, and the wake-up check passed with the
	// subscription turned off.
	cfg := Config{
		Addrs: []string{proxy.Addr()}, KeyPrefix: redistest.Prefix(t),
		DialTimeout: outageTimeout, ReadTimeout: outageTimeout, WriteTimeout: outageTimeout,
		NotifyFallback: time.Minute,
	}
	// The test server has no password; send one only to check it is never
	// shown, on a store that is not used once the server answers.
	withPW := cfg
	withPW.Password = pw
	sp, err := Open(withPW, zap.New(core))
	if err != nil {
		t.Fatalf("Open with the server down: %v", err)
	}
	defer sp.Close()
	s, err := Open(cfg, zap.New(core))
	if err != nil {
		t.Fatalf("Open with the server down: %v", err)
	}
	defer s.Close()
	s.Warm()
	sp.Warm()

	key := storetest.NewKey(t)
	for _, mode := range []string{"refused", "blackhole"} {
		if mode == "blackhole" {
			proxy.Blackhole()
		}
		checkCallsFail(t, mode, outageCalls(t, s, key))
		_, err := sp.Load(context.Background(), key)
		if err == nil || strings.Contains(err.Error(), pw) {
			t.Fatalf("%s: Load with password = %v", mode, err)
		}
	}
	proxy.Stop()
	proxy.Start()

	ctx := context.Background()
	deadline := time.Now().Add(10 * time.Second)
	r := storetest.Reservation(key, storetest.Long, storetest.Long)
	for {
		res, err := s.Reserve(ctx, r)
		if err == nil {
			if !res.Reserved {
				t.Fatalf("Reserve after recovery = %+v", res)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no recovery: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	done := make(chan time.Time, 1)
	go func() {
		if _, err := s.Await(ctx, key); err != nil {
			t.Error(err)
		}
		done <- time.Now()
	}()
	// The subscription retries with a backoff of at most 5s.
	time.Sleep(6 * time.Second)
	start := time.Now()
	if err := s.Finalize(ctx, key, r.Owner, stores.Response{Status: 200}); err != nil {
		t.Fatalf("Finalize after recovery: %v", err)
	}
	if lat := (<-done).Sub(start); lat > 300*time.Millisecond {
		t.Errorf("Await woke %v after Finalize: no subscription after recovery", lat)
	}
	for _, e := range logs.All() {
		if line := e.Message + " " + strings.Join(fieldStrings(e), " "); strings.Contains(line, pw) {
			t.Fatalf("password in log: %s", line)
		}
	}
}

func fieldStrings(e observer.LoggedEntry) []string {
	var out []string
	for k, v := range e.ContextMap() {
		out = append(out, k+"="+strings.TrimSpace(fmtAny(v)))
	}
	return out
}

func fmtAny(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	if e, ok := v.(error); ok {
		return e.Error()
	}
	return ""
}
