package redis

import (
	"testing"

	"go.uber.org/zap/zaptest"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis/redistest"
)

// openStore opens a Store under a fresh key prefix.
func openStore(t testing.TB, mutate func(*Config)) (*Store, Config) {
	t.Helper()
	cfg := Config{Addrs: []string{redistest.Addr(t)}, KeyPrefix: redistest.Prefix(t)}
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

// accessChecked reports whether a check of s's commands has run to its end.
func (s *Store) accessChecked() bool {
	s.access.mu.Lock()
	defer s.access.mu.Unlock()
	return !s.access.running && !s.access.lastAt.IsZero()
}
