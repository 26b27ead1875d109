package mysql

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/go-sql-driver/mysql"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestKilledConnectionsAreNotUsed ends every connection of a warm pool the
// way a server restart or a failover does (KILL here: the server closes
// each), then calls again at once. The driver finds a closed connection
// before it sends on it, unless the DSN said checkConnLiveness=false: then
// the next call on each pooled connection failed (8 of 16 calls here). The
// store now keeps the check on whatever the DSN says.
// What the driver logs on the way goes to the store's log, not to stderr.
func TestKilledConnectionsAreNotUsed(t *testing.T) {
	for _, params := range []map[string]string{nil, {"checkConnLiveness": "false"}} {
		t.Run(fmt.Sprint(params), func(t *testing.T) {
			const conns = 8
			s, logs := openObserved(t, func(c *Config) {
				mc, err := mysql.ParseDSN(c.DSN)
				if err != nil {
					t.Fatal(err)
				}
				for k, v := range params {
					if k == "checkConnLiveness" {
						mc.CheckConnLiveness = v != "false"
					}
				}
				c.DSN = mc.FormatDSN()
				c.MaxConns = conns
			})
			ids := warmPool(t, s, conns)
			a := admin(t)
			ctx := context.Background()
			for _, id := range ids {
				if _, err := a.ExecContext(ctx, "KILL ?", id); err != nil {
					t.Fatal(err)
				}
			}
			waitConnectionsGone(t, ids)

			var failed []error
			var mu sync.Mutex
			reserve := func() {
				_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
				if err != nil {
					mu.Lock()
					failed = append(failed, err)
					mu.Unlock()
				}
			}
			var wg sync.WaitGroup
			for range conns {
				wg.Go(reserve)
			}
			wg.Wait()
			for range conns {
				reserve()
			}
			if len(failed) > 0 {
				t.Fatalf("%d of %d calls failed on connections the server had closed; the first: %v", len(failed), 2*conns, failed[0])
			}
			// One "closing bad idle connection" each, at least.
			if n := logs.FilterMessage("mysql driver").Len(); n < conns {
				t.Fatalf("the store's log has %d lines from the driver, want %d or more", n, conns)
			}
		})
	}
}

// warmPool makes the store's pool hold n idle connections and returns
// their server-side IDs.
func warmPool(t *testing.T, s *Store, n int) []int64 {
	t.Helper()
	ctx := context.Background()
	var ids []int64
	var held []interface{ Close() error }
	for range n {
		c, err := s.db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var id int64
		if err := c.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
		held = append(held, c)
	}
	for _, c := range held {
		c.Close() // back to the pool
	}
	return ids
}

// waitConnectionsGone waits until the server lists none of ids.
func waitConnectionsGone(t *testing.T, ids []int64) {
	t.Helper()
	a := admin(t)
	list := strings.Trim(strings.Join(strings.Fields(fmt.Sprint(ids)), ","), "[]")
	sqltest.WaitNoneLeft(t, "killed connections", func() (n int, err error) {
		err = a.QueryRow("SELECT count(*) FROM information_schema.processlist WHERE id IN (" + list + ")").Scan(&n)
		return n, err
	})
}
