package postgres

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// limitConnections sets the CONNECTION LIMIT of the role dsn logs in as.
func limitConnections(t *testing.T, dsn string, n int) {
	t.Helper()
	cc, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin(t).Exec(context.Background(), fmt.Sprintf("ALTER ROLE %s CONNECTION LIMIT %d", cc.User, n)); err != nil {
		t.Fatal(err)
	}
}

// TestConnectionLimitWarned: a role limited to fewer connections than the
// store's pool may open (max_conns, and one for LISTEN) is warned of at the
// first contact, naming both numbers and the limit; a pool within it is
// not.
func TestConnectionLimitWarned(t *testing.T) {
	_, cfg := openStore(t, nil)
	dsn := rowsOnlyRole(t, cfg.Table)
	limitConnections(t, dsn, 5)
	for _, c := range []struct {
		maxConns int
		listen   bool
		warned   bool
	}{{16, true, true}, {5, true, true}, {5, false, false}, {4, true, false}} {
		core, logs := observer.New(zap.WarnLevel)
		s := openAs(t, Config{DSN: dsn, Table: cfg.Table, MaxConns: c.maxConns, ListenNotify: c.listen}, zap.New(core))
		if err := s.Ready(context.Background()); err != nil {
			t.Fatal(err)
		}
		s.Close()
		warned := logs.FilterMessageSnippet("may refuse some of the connections").All()
		if len(warned) != map[bool]int{true: 1, false: 0}[c.warned] {
			t.Fatalf("max_conns %d, listen_notify %v: %d warnings, want warned = %v: %v", c.maxConns, c.listen, len(warned), c.warned, logs.All())
		}
		if c.warned {
			f := warned[0].ContextMap()
			want := int64(c.maxConns + 1)
			if f["store_connections"] != want || f["limit"] != int64(5) || f["limit_of"] != "the role's CONNECTION LIMIT" {
				t.Fatalf("max_conns %d: the warning says %v", c.maxConns, f)
			}
		}
	}
}

// TestListenRefusedAtStart: the server refuses the LISTEN connection (here
// the role's limit of one connection, which the pool's holds) although
// the pool works. Until the build after c0ca278 that failed the first
// contact, and every keyed request with it, until a connection came free.
// Now the store is ready, its waiting duplicates poll, and it opens the
// LISTEN connection in the background once the server lets it.
func TestListenRefusedAtStart(t *testing.T) {
	owner, cfg := openStore(t, nil)
	dsn := rowsOnlyRole(t, cfg.Table)
	limitConnections(t, dsn, 1)
	ctx := context.Background()
	core, logs := observer.New(zap.InfoLevel)
	s := openAs(t, Config{DSN: dsn, Table: cfg.Table, MaxConns: 1, ListenNotify: true, NotifyFallback: time.Minute}, zap.New(core))
	if err := s.Ready(ctx); err != nil {
		t.Fatalf("first contact with the LISTEN connection refused: %v", err)
	}
	if n := logs.FilterMessageSnippet("could not open the LISTEN connection").Len(); n != 1 {
		t.Fatalf("%d warnings of the refused LISTEN connection, want 1: %v", n, logs.All())
	}
	// Polling: the waiter wakes although nothing notifies it.
	awaitFinalize(t, owner, s, func(string) { time.Sleep(100 * time.Millisecond) }, "the waiter did not poll")

	limitConnections(t, dsn, 2)
	waitLogged(t, logs, "postgres listen: the LISTEN connection opened")
	// Listening: the waiter marks the record, so that its change notifies.
	awaitFinalize(t, owner, s, func(key string) { waitWatched(t, cfg.Table, key) }, "the waiter slept through the Finalize")
}
