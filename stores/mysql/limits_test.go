package mysql

import (
	"context"
	"fmt"
	"testing"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestConnectionLimitWarned: an account limited to fewer connections than
// the store may open (max_conns, and combined_writes for its batches) is
// warned of at the first contact, naming both numbers; one within it is
// not.
func TestConnectionLimitWarned(t *testing.T) {
	_, cfg := openStore(t, nil)
	dsn := rowsOnlyUser(t, cfg.Table)
	mc, err := mysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin(t).Exec(fmt.Sprintf("ALTER USER '%s'@'%%' WITH MAX_USER_CONNECTIONS 5", mc.User)); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		maxConns, combined int
		warned             bool
	}{{10, 1, true}, {4, 2, true}, {4, 1, false}, {5, 0, false}} {
		core, logs := observer.New(zap.WarnLevel)
		s := openAs(t, Config{DSN: dsn, Table: cfg.Table, MaxConns: c.maxConns, CombinedWrites: c.combined}, zap.New(core))
		if err := s.Ready(context.Background()); err != nil {
			t.Fatal(err)
		}
		s.Close()
		warned := logs.FilterMessageSnippet("may refuse some of the connections").All()
		if len(warned) != map[bool]int{true: 1, false: 0}[c.warned] {
			t.Fatalf("max_conns %d, combined_writes %d: %d warnings, want warned = %v: %v", c.maxConns, c.combined, len(warned), c.warned, logs.All())
		}
		if c.warned {
			if f := warned[0].ContextMap(); f["store_connections"] != int64(c.maxConns+c.combined) || f["limit"] != int64(5) {
				t.Fatalf("max_conns %d, combined_writes %d: the warning says %v", c.maxConns, c.combined, f)
			}
		}
	}
}
