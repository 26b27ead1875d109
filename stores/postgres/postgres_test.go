package postgres

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, nil)
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

func TestConformanceListenNotify(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, func(c *Config) { c.ListenNotify = true })
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

func TestReserveOverExpiredRebinds(t *testing.T) {
	s, _ := openStore(t, nil)
	ctx := context.Background()
	key := storetest.NewKey(t)
	if _, err := s.Reserve(ctx, storetest.Reservation(key, 150*time.Millisecond, 150*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond)
	r := storetest.Reservation(key, storetest.Long, storetest.Long)
	r.Binding.Path = "/v1/other"
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve over expired = %+v, %v", res, err)
	}
	rec, err := s.Load(ctx, key)
	if err != nil || rec.Binding != r.Binding || rec.Owner != r.Owner || rec.Abandoned || rec.Response != nil {
		t.Fatalf("record = %+v, %v", rec, err)
	}
}

func TestKeyTooLong(t *testing.T) {
	s, _ := openStore(t, nil)
	r := storetest.Reservation(storetest.NewKey(t)+"x", storetest.Long, storetest.Long)
	if _, err := s.Reserve(context.Background(), r); err == nil {
		t.Fatal("a 37-byte key was accepted")
	}
}

// The server counts statement_timeout in whole milliseconds, and 0 there
// is no limit: a shorter one (JSON's nanoseconds) was sent as 0.
func TestStatementTimeoutBelowAMillisecond(t *testing.T) {
	_, err := Open(context.Background(), Config{DSN: "postgres://postgres@127.0.0.1:1/x", StatementTimeout: 500 * time.Microsecond}, nil)
	if err == nil || !strings.Contains(err.Error(), "statement_timeout must be at least 1ms") {
		t.Fatalf("Open with a 500µs statement_timeout = %v", err)
	}
}
