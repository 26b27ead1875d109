package mysql

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/go-sql-driver/mysql"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestIsolationLevels runs the store's concurrent writes on sessions at
// each isolation level a server or user may default to (InnoDB's own is
// REPEATABLE READ): reservations of one key racing each other find one
// winner, and reservations and finalizations of distinct keys, 32 at a
// time, all succeed. InnoDB's deadlocks among them are run again (see
// Store.exec); PostgreSQL's counterpart is its TestStrictIsolation.
func TestIsolationLevels(t *testing.T) {
	// MariaDB before 11.1 knows the variable as tx_isolation only, MySQL
	// 8 as transaction_isolation only.
	variable := "transaction_isolation"
	if err := admin(t).QueryRow("SELECT @@" + variable).Scan(new(string)); err != nil {
		variable = "tx_isolation"
	}
	for _, level := range []string{"READ-COMMITTED", "REPEATABLE-READ", "SERIALIZABLE"} {
		t.Run(level, func(t *testing.T) {
			s, _ := openStore(t, func(c *Config) {
				mc, err := mysql.ParseDSN(c.DSN)
				if err != nil {
					t.Fatal(err)
				}
				if mc.Params == nil {
					mc.Params = map[string]string{}
				}
				mc.Params[variable] = "'" + level + "'"
				c.DSN, c.MaxConns = mc.FormatDSN(), 32
			})
			ctx := context.Background()
			var got string
			if err := s.db.QueryRowContext(ctx, "SELECT @@"+variable).Scan(&got); err != nil || got != level {
				t.Fatalf("the store's sessions run at %q (%v), want %s", got, err, level)
			}
			var failed atomic.Int64
			fail := func(err error) {
				if failed.Add(1) <= 3 {
					t.Error(err)
				}
			}
			var wg sync.WaitGroup
			for range 32 {
				wg.Go(func() {
					for range 100 {
						r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
						_, err := s.Reserve(ctx, r)
						if err == nil {
							err = s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: make([]byte, 2048)})
						}
						if err != nil {
							fail(err)
						}
					}
				})
			}
			wg.Wait()
			for range 50 {
				key := storetest.NewKey(t)
				var winners atomic.Int32
				for range 16 {
					wg.Go(func() {
						res, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
						switch {
						case err != nil:
							fail(err)
						case res.Reserved:
							winners.Add(1)
						}
					})
				}
				wg.Wait()
				if winners.Load() != 1 {
					t.Fatalf("%d winners of one key", winners.Load())
				}
			}
			if f := failed.Load(); f > 0 {
				t.Fatalf("%d calls failed", f)
			}
		})
	}
}
