package redis

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"sync"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

const (
	addrEnv     = "ICEBERG_IDEMPOTENCY_TEST_REDIS_ADDR"
	defaultAddr = "127.0.0.1:6379"
	startHint   = `redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no`
)

var (
	pingOnce sync.Once
	pingErr  error
)

// testAddr returns the test server's address; it skips (fails under
// CI=true) when the server is unreachable.
func testAddr(t testing.TB) string {
	t.Helper()
	addr := sqltest.DSN(addrEnv, defaultAddr)
	pingOnce.Do(func() {
		c := goredis.NewClient(&goredis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 2 * time.Second})
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		pingErr = c.Ping(ctx).Err()
	})
	if pingErr != nil {
		sqltest.Unavailable(t, "Redis", addrEnv, startHint, pingErr)
	}
	return addr
}

// admin is a plain client for a test's own commands.
func admin(t testing.TB) *goredis.Client {
	t.Helper()
	c := goredis.NewClient(&goredis.Options{Addr: testAddr(t)})
	t.Cleanup(func() { c.Close() })
	return c
}

// testPrefix returns a fresh key prefix whose keys are deleted when the
// test ends (the server is shared: never FLUSHALL).
func testPrefix(t testing.TB) string {
	t.Helper()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	prefix := "iceberg_idempotency_test_" + hex.EncodeToString(b[:]) + ":"
	c := admin(t)
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

// openStore opens a Store under a fresh key prefix.
func openStore(t testing.TB, mutate func(*Config)) (*Store, Config) {
	t.Helper()
	cfg := Config{Addrs: []string{testAddr(t)}, KeyPrefix: testPrefix(t)}
	if mutate != nil {
		mutate(&cfg)
	}
	s, err := Open(cfg, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, cfg
}
