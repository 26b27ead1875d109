package postgres

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// The pool holds DefaultMaxConns unless max_conns or the DSN's
// pool_max_conns says otherwise. Opening connects to nothing, so this
// needs no server.
func TestPoolSize(t *testing.T) {
	for _, tt := range []struct {
		name     string
		dsn      string
		maxConns int
		want     int32
	}{
		{"default", "postgres://u@127.0.0.1:1/db", 0, DefaultMaxConns},
		{"max_conns", "postgres://u@127.0.0.1:1/db", 5, 5},
		{"dsn pool_max_conns", "postgres://u@127.0.0.1:1/db?pool_max_conns=3", 0, 3},
		{"max_conns over the dsn", "postgres://u@127.0.0.1:1/db?pool_max_conns=3", 7, 7},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, err := Open(t.Context(), Config{DSN: tt.dsn, MaxConns: tt.maxConns}, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			if got := s.pool.Config().MaxConns; got != tt.want {
				t.Fatalf("pool max conns %d, want %d", got, tt.want)
			}
		})
	}
}

// pgx keeps the pool size in an int32: a larger max_conns is refused, where
// it used to wrap around (4294967297 opened a pool of 1).
func TestPoolSizeOverInt32IsRefused(t *testing.T) {
	s, err := Open(t.Context(), Config{DSN: "postgres://u@127.0.0.1:1/db", MaxConns: 1<<32 + 1}, nil)
	if err == nil {
		s.Close()
		t.Fatal("max_conns 4294967297 accepted")
	}
	if !strings.Contains(err.Error(), "max_conns 4294967297 is more than 2147483647") {
		t.Fatalf("error %v, want it to name max_conns and the bound", err)
	}
}

// ReleaseIdle closes the idle connections a store a reload dropped holds,
// and the store still serves the old config's late requests.
func TestReleaseIdle(t *testing.T) {
	s, _ := openStore(t, nil)
	ctx := context.Background()
	var wg sync.WaitGroup
	for range 4 { // several connections at once
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.pool.Exec(ctx, "SELECT pg_sleep(0.05)"); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if idle := s.pool.Stat().IdleConns(); idle < 2 {
		t.Fatalf("%d idle connections before, want several", idle)
	}
	s.ReleaseIdle()
	if idle := s.pool.Stat().IdleConns(); idle != 0 {
		t.Fatalf("%d idle connections after ReleaseIdle, want 0", idle)
	}
	if _, err := s.Load(ctx, storetest.NewKey(t)); err != nil {
		t.Fatalf("Load after ReleaseIdle: %v", err)
	}
}
