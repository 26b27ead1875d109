package postgres

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestConnectionLimitWarned: a role limited to fewer connections than the
// store's pool may open (max_conns, and one for LISTEN) is warned of at the
// first contact, naming both numbers and the limit; a pool within it is
// not.
func TestConnectionLimitWarned(t *testing.T) {
	_, cfg := openStore(t, nil)
	dsn := rowsOnlyRole(t, cfg.Table)
	cc, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin(t).Exec(context.Background(), "ALTER ROLE "+cc.User+" CONNECTION LIMIT 5"); err != nil {
		t.Fatal(err)
	}
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
