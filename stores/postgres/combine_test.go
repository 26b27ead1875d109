package postgres

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
		s, _ := openStore(t, func(c *Config) { c.ListenNotify = true; c.CombinedWrites = 1 })
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

func TestReserveRaceCombinedWrites(t *testing.T) {
	s, _ := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
	reserveRace(t, s)
}

func TestCombinedWrites(t *testing.T) {
	sqltest.RunCombined(t, func(t *testing.T) sqltest.CombineRig {
		s, cfg := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
		conn := admin(t)
		ctx := context.Background()
		if _, err := conn.Exec(ctx, fmt.Sprintf(`CREATE FUNCTION %[1]s_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.path = '/refused' THEN RAISE EXCEPTION 'refused by the test'; END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER refuse BEFORE INSERT ON %[1]s FOR EACH ROW EXECUTE FUNCTION %[1]s_refuse();`, cfg.Table)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = admin(t).Exec(context.Background(), fmt.Sprintf("DROP FUNCTION IF EXISTS %s_refuse() CASCADE", cfg.Table))
		})
		return sqltest.CombineRig{
			Store: s,
			State: s.combined.State,
			Block: blockBatch(s, cfg.Table),
			// xmin is the transaction that wrote a row's current version.
			Commits: func(t *testing.T, keys []string) (int, bool) {
				var n int
				if err := conn.QueryRow(ctx, fmt.Sprintf(`SELECT count(DISTINCT xmin::text) FROM %s WHERE key = ANY($1)`, cfg.Table), keys).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n, true
			},
		}
	})
}

// A batch whose call gave up must not commit afterwards: pgx gives up by
// closing the connection, and sends a cancel request first, which stops
// the statement waiting for its lock, so the pipeline's implicit
// transaction aborts (a backend left to read on would run the rest of the
// pipeline and commit it at its Sync).
func TestBatchGivenUpDoesNotCommitLater(t *testing.T) {
	s, cfg := openStore(t, func(c *Config) { c.CombinedWrites = 1; c.StatementTimeout = time.Second })
	sqltest.BatchGivenUpDoesNotCommitLater(t, s, s.combined.State, func(t *testing.T) (string, func()) {
		tx, key := holdKey(t, cfg.Table)
		return key, func() { _ = tx.Rollback(context.Background()) }
	})
}

// blockBatch is a CombineRig's Block: a Reserve that waits on a key another
// transaction holds, keeping s's batch slot busy until the returned func
// rolls that transaction back.
func blockBatch(s *Store, table string) func(t *testing.T) func() {
	return func(t *testing.T) func() {
		ctx := context.Background()
		tx, key := holdKey(t, table)
		blocked := make(chan error, 1)
		go func() {
			_, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
			blocked <- err
		}()
		return func() {
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-blocked; err != nil {
				t.Fatal(err)
			}
		}
	}
}
