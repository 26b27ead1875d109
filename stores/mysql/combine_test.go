package mysql

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestConformanceCombinedWrites(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

func TestCombinedWrites(t *testing.T) {
	sqltest.RunCombined(t, func(t *testing.T) sqltest.CombineRig {
		r, _, _ := combineRig(t)
		return r
	})
}

// combineRig opens a store with one batch slot and the rig that queues
// writes behind it. Its table refuses a reservation whose path is
// /refused.
func combineRig(t *testing.T, mutate ...func(*Config)) (sqltest.CombineRig, *Store, Config) {
	s, cfg := openStore(t, func(c *Config) {
		c.CombinedWrites = 1
		for _, m := range mutate {
			m(c)
		}
	})
	db := admin(t)
	ctx := context.Background()
	trigger := cfg.Table + "_refuse"
	if _, err := db.Exec(fmt.Sprintf("CREATE TRIGGER %s BEFORE INSERT ON %s FOR EACH ROW BEGIN\n"+
		"IF NEW.path = '/refused' THEN SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'; END IF;\nEND", trigger, cfg.Table)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Exec("DROP TRIGGER IF EXISTS " + trigger) })
	// InnoDB does not tell which transaction wrote a row: count the
	// server's COMMIT statements, which only a combined batch sends
	// (a statement alone commits by autocommit).
	comCommit := func(t *testing.T) int {
		var name string
		var n int
		if err := db.QueryRow("SHOW GLOBAL STATUS LIKE 'Com_commit'").Scan(&name, &n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	last := comCommit(t)
	return sqltest.CombineRig{
		Store: s,
		State: s.combined.State,
		Block: func(t *testing.T) func() {
			tx, key := holdKey(t, db, cfg.Table)
			blocked := make(chan error, 1)
			go func() {
				_, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
				blocked <- err
			}()
			return func() {
				if err := tx.Rollback(); err != nil {
					t.Fatal(err)
				}
				if err := <-blocked; err != nil {
					t.Fatal(err)
				}
			}
		},
		Commits: func(t *testing.T, _ []string) (int, bool) {
			now := comCommit(t)
			n := now - last
			last = now
			return n, false
		},
	}, s, cfg
}
