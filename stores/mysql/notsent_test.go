package mysql

import (
	"context"
	"fmt"
	"strconv"
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
		// No idle connection left: the next call must dial.
		s.db.SetMaxIdleConns(-1)
		if s.batchDB != nil {
			s.batchDB.SetMaxIdleConns(-1)
		}
		_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
		if err == nil || !stores.NotSent(err) || !sqlstore.IsTransient(err) {
			t.Fatalf("Reserve with connections refused: err = %v, NotSent = %v, transient = %v; want both marks",
				err, stores.NotSent(err), sqlstore.IsTransient(err))
		}
	})

	t.Run("sent_and_timed_out", func(t *testing.T) {
		// The caller gives up long before the server would stop waiting
		// for the lock (a lock-wait timeout the server answers rolled the
		// statement back, and is marked not sent).
		s, cfg := openStore(t, func(c *Config) { c.StatementTimeout = 5 * time.Second })
		// Another transaction writes the key's row and stays open: the
		// store's INSERT waits for its lock and times out. Had that
		// transaction rolled back a moment later, the waiting INSERT would
		// have committed: exactly the write a lost reply leaves possible.
		_, key := holdKey(t, admin(t), cfg.Table)
		r := storetest.Reservation(key, storetest.Long, storetest.Long)
		short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		_, err := s.Reserve(short, r)
		if err == nil || stores.NotSent(err) {
			t.Fatalf("Reserve that waited for a lock: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
		}
	})

	// An error reply rolls the autocommit statement back: nothing
	// committed, and nothing is left to undo (a read-only server answers
	// every Reserve so, and each used to leave a background release).
	t.Run("refused_by_the_server", func(t *testing.T) {
		s, cfg := openStore(t, nil)
		if _, err := admin(t).ExecContext(ctx, fmt.Sprintf("CREATE TRIGGER %[1]s_refuse BEFORE INSERT ON %[1]s FOR EACH ROW "+
			"SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'", cfg.Table)); err != nil {
			t.Fatal(err)
		}
		_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
		if err == nil || !stores.NotSent(err) {
			t.Fatalf("Reserve the server refused: err = %v, NotSent = %v; want an error marked not sent", err, stores.NotSent(err))
		}
	})

	// A killed session's error may come after the commit: it proves
	// nothing. Here the thread waiting for a lock is killed (the driver
	// reports it as an invalid connection).
	t.Run("session_killed", func(t *testing.T) {
		s, cfg := openStore(t, func(c *Config) { c.StatementTimeout = 5 * time.Second })
		_, key := holdKey(t, admin(t), cfg.Table)
		r := storetest.Reservation(key, storetest.Long, storetest.Long)
		done := make(chan error, 1)
		go func() { _, err := s.Reserve(ctx, r); done <- err }()
		db := admin(t)
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			var id int64
			err := db.QueryRowContext(ctx, "SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE CONCAT('INSERT INTO ', ?, '%') AND ID <> CONNECTION_ID() LIMIT 1", cfg.Table).Scan(&id)
			if err == nil {
				if _, err := db.ExecContext(ctx, "KILL CONNECTION "+strconv.FormatInt(id, 10)); err != nil {
					t.Fatal(err)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the store's INSERT never showed in the process list: %v", err)
			}
		}
		if err := <-done; err == nil || stores.NotSent(err) {
			t.Fatalf("Reserve whose session was killed: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
		}
	})
}
