package mysql

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// finalizeTooLarge finalizes a fresh key with body and expects
// ErrResponseTooLarge with the record left in flight under its owner, who
// can then release it: the key is not stranded.
func finalizeTooLarge(t *testing.T, s *Store, body []byte) {
	t.Helper()
	ctx := context.Background()
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: body})
	if !errors.Is(err, stores.ErrResponseTooLarge) {
		t.Fatalf("Finalize of %d bytes = %v, want ErrResponseTooLarge", len(body), err)
	}
	t.Log(err)
	rec, err := s.Load(ctx, r.Key)
	if err != nil || rec == nil || rec.State != stores.StateInFlight || rec.Owner != r.Owner {
		t.Fatalf("after the refused Finalize: %+v, %v; want in flight under its owner", rec, err)
	}
	if err := s.Release(ctx, r.Key, r.Owner); err != nil {
		t.Fatalf("Release after the refused Finalize: %v", err)
	}
}

func finalizeFits(t *testing.T, s *Store, body []byte) {
	t.Helper()
	ctx := context.Background()
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	if err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: body}); err != nil {
		t.Fatalf("Finalize of %d bytes: %v", len(body), err)
	}
	rec, err := s.Load(ctx, r.Key)
	if err != nil || rec == nil || !bytes.Equal(rec.Response.Body, body) {
		t.Fatalf("Load of %d bytes: %v", len(body), err)
	}
}

// openObserved opens a store on a fresh table with its warnings captured,
// and makes the first contact.
func openObserved(t *testing.T, mutate func(*Config)) (*Store, *observer.ObservedLogs) {
	t.Helper()
	cfg := Config{DSN: testDSN(t), Table: sqltest.TableName(t), AutoMigrate: true}
	if mutate != nil {
		mutate(&cfg)
	}
	dropOnCleanup(t, cfg.Table)
	core, logs := observer.New(zap.WarnLevel)
	s, err := Open(context.Background(), cfg, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if err := s.Ready(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s, logs
}

const packetWarning = "mysql max_allowed_packet is below the default max_response_size: larger responses are delivered but not stored, and their keys' outcome is unknown (a retry gets the abandoned policy's answer); raise max_allowed_packet on the server"

// A response that cannot fit the packet limit is refused with
// ErrResponseTooLarge before it is sent, and the first contact warns that
// the limit is below the default max_response_size. Here the limit comes
// from the test hook; TestPacketLimitOfTheServer lowers the server's.
func TestResponseAboveThePacketLimit(t *testing.T) {
	s, logs := openObserved(t, func(c *Config) { c.packetLimit = rowHeadroom + 4096 })
	if n := logs.FilterMessage(packetWarning).Len(); n != 1 {
		t.Errorf("packet limit warning logged %d times, want 1", n)
	}
	finalizeFits(t, s, bytes.Repeat([]byte("a"), 2048))
	finalizeTooLarge(t, s, bytes.Repeat([]byte("a"), 4096))

	// The server's default (MariaDB 16 MiB) is below 16 MiB plus headroom.
	_, logs = openObserved(t, nil)
	var limit int64
	if err := admin(t).QueryRow("SELECT @@global.max_allowed_packet").Scan(&limit); err != nil {
		t.Fatal(err)
	}
	if want := limit-rowHeadroom < TypicalMaxResponseSize; (logs.FilterMessage(packetWarning).Len() == 1) != want {
		t.Errorf("max_allowed_packet %d: warning logged %d times, want it %v", limit, logs.FilterMessage(packetWarning).Len(), want)
	}
}

// TestPacketLimitOfTheServer reads the real server's max_allowed_packet
// at the first contact: a response just below it, which the server would
// refuse with the rest of the row, is refused by Finalize before sending,
// and the key can be released; a response within the headroom fits. The
// server's setting is not changed: other packages' tests share the server
// and run at the same time.
func TestPacketLimitOfTheServer(t *testing.T) {
	var limit int
	if err := admin(t).QueryRow("SELECT @@global.max_allowed_packet").Scan(&limit); err != nil {
		t.Fatal(err)
	}
	if limit > 64<<20 {
		t.Skipf("max_allowed_packet is %d: too large to fill in a test", limit)
	}
	s, _ := openObserved(t, func(c *Config) { c.MaxConns = 1 })
	finalizeFits(t, s, bytes.Repeat([]byte{0}, limit-rowHeadroom-1024))
	finalizeTooLarge(t, s, bytes.Repeat([]byte{0}, limit-10))
}

// The limit lowered after the first contact: the server drops the
// connection under a row just below its limit (the driver sees a reset,
// not the error), and Finalize reads the limit again.
func TestPacketLimitLoweredLater(t *testing.T) {
	if os.Getenv("ICEBERG_IDEMPOTENCY_TEST_MYSQL_GLOBALS") != "1" {
		t.Skip("lowers the shared server's max_allowed_packet for a while; set ICEBERG_IDEMPOTENCY_TEST_MYSQL_GLOBALS=1 to run it alone: go test -run TestPacketLimitLoweredLater ./stores/mysql/")
	}
	db := admin(t)
	var orig int64
	if err := db.QueryRow("SELECT @@global.max_allowed_packet").Scan(&orig); err != nil {
		t.Fatal(err)
	}
	s, _ := openObserved(t, func(c *Config) { c.MaxConns = 1 })
	const limit = 1 << 20
	if _, err := db.Exec("SET GLOBAL max_allowed_packet = ?", limit); err != nil {
		t.Skipf("cannot lower max_allowed_packet: %v", err)
	}
	t.Cleanup(func() {
		if _, err := db.Exec("SET GLOBAL max_allowed_packet = ?", orig); err != nil {
			t.Errorf("restoring max_allowed_packet to %d: %v", orig, err)
		}
	})
	// The pool's one connection predates the change: replace it.
	if _, err := s.db.Exec("DO 1"); err != nil {
		t.Fatal(err)
	}
	s.db.SetMaxIdleConns(0)
	s.db.SetMaxIdleConns(1)
	for _, size := range []int{limit - 10, limit + 10} {
		finalizeTooLarge(t, s, bytes.Repeat([]byte{0}, size))
	}
}
