package postgres

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A write is marked not sent (stores.NotSent) only when it provably never
// reached the server, since the handler then skips undoing it: a
// reservation that did commit and is never undone holds its key for a
// request nobody executes, and its retries hear "outcome unknown". (A
// store whose first contact fails: TestStartWithDatabaseDown.)
func TestNotSentOnlyWhenProvablyUnsent(t *testing.T) {
	proxy, proxied := proxiedDSN(t)
	ctx := context.Background()

	t.Run("connect_refused", func(t *testing.T) {
		s, _ := openStore(t, func(c *Config) { c.DSN = proxied; c.StatementTimeout = time.Second })
		proxy.Stop()
		defer proxy.Start()
		s.pool.Reset() // no idle connection left: the next call must dial
		_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
		if err == nil || !stores.NotSent(err) || !sqlstore.IsTransient(err) {
			t.Fatalf("Reserve with connections refused: err = %v, NotSent = %v, transient = %v; want both marks",
				err, stores.NotSent(err), sqlstore.IsTransient(err))
		}
	})

	t.Run("sent_and_timed_out", func(t *testing.T) {
		// The caller gives up long before the server's statement_timeout
		// (an ERROR the server answers aborted the statement, and is
		// marked not sent).
		s, cfg := openStore(t, func(c *Config) { c.StatementTimeout = 5 * time.Second })
		// Another transaction writes the key's row and stays open: the
		// store's INSERT waits for it and times out. Had that transaction
		// rolled back a moment later, the waiting INSERT would have
		// committed: exactly the write a lost reply leaves possible.
		_, key := holdKey(t, cfg.Table)
		r := storetest.Reservation(key, storetest.Long, storetest.Long)
		short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		_, err := s.Reserve(short, r)
		if err == nil || stores.NotSent(err) {
			t.Fatalf("Reserve that waited for a lock: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
		}
	})

	// An ERROR aborts the statement's transaction: nothing committed, and
	// nothing is left to undo (a standby that refuses writes answers every
	// Reserve so, and each used to leave a background release).
	t.Run("refused_by_the_server", func(t *testing.T) {
		s, cfg := openStore(t, nil)
		if _, err := admin(t).Exec(ctx, fmt.Sprintf(`CREATE FUNCTION %[1]s_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refused by the test'; END $$;
CREATE TRIGGER refuse BEFORE INSERT ON %[1]s FOR EACH ROW EXECUTE FUNCTION %[1]s_refuse();`, cfg.Table)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = admin(t).Exec(context.Background(), fmt.Sprintf("DROP FUNCTION IF EXISTS %s_refuse() CASCADE", cfg.Table))
		})
		_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
		if err == nil || !stores.NotSent(err) {
			t.Fatalf("Reserve the server refused: err = %v, NotSent = %v; want an error marked not sent", err, stores.NotSent(err))
		}
	})

	// A connection lost after the statement went out proves nothing, over
	// the simple protocol as over the extended one. The simple protocol is
	// what a DSN with default_query_exec_mode=simple_protocol (as PgBouncer
	// setups use) sends every statement over; pgx before v5.13.0 called
	// that loss "conn closed" and safe to retry, and the handler skipped
	// the release of a reservation that had committed. Here the INSERT
	// waits for a lock while the proxy cuts its connection, and commits
	// once the lock is let go: its record is there, under the store's
	// owner, although the caller heard an error. (The default mode,
	// cache_statement, sends statements with arguments over the extended
	// protocol.)
	for _, mode := range []string{"cache_statement", "simple_protocol"} {
		t.Run("reply_lost/"+mode, func(t *testing.T) {
			proxy, proxied := proxiedDSN(t)
			s, cfg := openStore(t, func(c *Config) {
				c.DSN = proxied + "&default_query_exec_mode=" + mode
				c.StatementTimeout = 5 * time.Second
			})
			tx, key := holdKey(t, cfg.Table)
			r := storetest.Reservation(key, storetest.Long, storetest.Long)
			done := make(chan error, 1)
			go func() { _, err := s.Reserve(ctx, r); done <- err }()
			waitForLockWait(t, cfg.Table)
			proxy.Stop()
			err := <-done
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			a := admin(t)
			var owner string
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				err := a.QueryRow(ctx, fmt.Sprintf("SELECT owner FROM %s WHERE key = $1", cfg.Table), key).Scan(&owner)
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the INSERT whose reply was lost never committed: %v", err)
				}
			}
			if owner != r.Owner {
				t.Fatalf("record owner = %q; want the Reserve's %q", owner, r.Owner)
			}
			if err == nil || stores.NotSent(err) {
				t.Fatalf("Reserve whose reply was lost: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
			}
		})
	}

	// A FATAL ends the session, and may come after the commit: it proves
	// nothing. Here the backend waiting for a lock is terminated.
	t.Run("session_terminated", func(t *testing.T) {
		s, cfg := openStore(t, func(c *Config) { c.StatementTimeout = 5 * time.Second })
		_, key := holdKey(t, cfg.Table)
		r := storetest.Reservation(key, storetest.Long, storetest.Long)
		done := make(chan error, 1)
		go func() { _, err := s.Reserve(ctx, r); done <- err }()
		waitForLockWait(t, cfg.Table)
		var n int
		if err := admin(t).QueryRow(ctx, "SELECT count(pg_terminate_backend(pid)) "+lockWaiters, cfg.Table).Scan(&n); err != nil || n == 0 {
			t.Fatalf("terminating the waiting backend: %d terminated, %v", n, err)
		}
		if err := <-done; err == nil || stores.NotSent(err) {
			t.Fatalf("Reserve whose session was terminated: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
		}
	})
}

// lockWaiters selects the backends (other than the caller's) whose
// statement on the table $1 waits for a lock.
const lockWaiters = `FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()`

// waitForLockWait returns once a statement on table waits for a row lock.
func waitForLockWait(t *testing.T, table string) {
	t.Helper()
	a := admin(t)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var n int
		if err := a.QueryRow(context.Background(), "SELECT count(*) "+lockWaiters, table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the store's INSERT never waited for the lock")
		}
	}
}
