// Package redistest helps tests find the Redis test server and give each
// test a key prefix of its own, deleted when it ends (the server is
// shared: never FLUSHALL).
package redistest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"sync"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

const (
	// AddrEnv names the test server's address.
	AddrEnv     = "ICEBERG_IDEMPOTENCY_TEST_REDIS_ADDR"
	defaultAddr = "127.0.0.1:6379"
	startHint   = `redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no`
)

var (
	pingOnce sync.Once
	pingErr  error
)

// Addr returns the test server's address; it skips (fails under CI=true)
// when the server is unreachable.
func Addr(t testing.TB) string {
	t.Helper()
	addr := sqltest.DSN(AddrEnv, defaultAddr)
	pingOnce.Do(func() {
		c := goredis.NewClient(&goredis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 2 * time.Second})
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		pingErr = c.Ping(ctx).Err()
	})
	if pingErr != nil {
		sqltest.Unavailable(t, "Redis", AddrEnv, startHint, pingErr)
	}
	return addr
}

// Admin is a plain client for a test's own commands.
func Admin(t testing.TB) *goredis.Client {
	t.Helper()
	c := goredis.NewClient(&goredis.Options{Addr: Addr(t)})
	t.Cleanup(func() { c.Close() })
	return c
}

// Prefix returns a fresh key prefix whose keys are deleted when the test
// ends.
func Prefix(t testing.TB) string {
	t.Helper()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	prefix := "iceberg_idempotency_test_" + hex.EncodeToString(b[:]) + ":"
	c := Admin(t)
	t.Cleanup(func() {
		ctx := context.Background()
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			c.Del(ctx, iter.Val())
		}
		if err := iter.Err(); err != nil {
			t.Errorf("clean up %s*: %v", prefix, err)
		}
	})
	return prefix
}

// AwaitRefusal waits, with Loads (which write nothing), until the
// background check of s's commands has refused one, and returns that
// error: the check never runs in an operation's time, so a test of what a
// refused user's operations do awaits its verdict first.
func AwaitRefusal(t testing.TB, s stores.Store) error {
	t.Helper()
	var denied *sqlstore.AccessError
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		_, err := s.Load(context.Background(), storetest.NewKey(t))
		// The check's verdict wraps no error of its own; an
		// operation's own refusal by the ACL (see
		// sqlstore.OperationRefused) is not the verdict.
		if errors.As(err, &denied) && denied.Err == nil {
			return err
		}
		if time.Now().After(deadline) {
			t.Fatalf("no check refused the store's commands within 5 s: %v", err)
		}
	}
}
