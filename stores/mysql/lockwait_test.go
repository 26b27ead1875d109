package mysql

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A reservation whose statement waits for a row lock stops waiting on the
// server about when the store's call gives up on it, so that it cannot
// commit afterwards for a caller that reported failure: such a reservation
// would hold its key for a request nobody executes. Without the bound the
// server waited its default 50s, and the reservation committed the moment
// the lock was freed.
func TestLockWaitEndsWithTheCall(t *testing.T) {
	s, cfg := openStore(t, func(c *Config) { c.StatementTimeout = time.Second })
	db := admin(t)
	ctx := context.Background()
	tx, key := holdKey(t, db, cfg.Table)
	if _, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long)); err == nil {
		t.Fatal("Reserve behind an uncommitted row of its key succeeded")
	}
	// The call failed; the server must stop waiting about then too.
	// INNODB_TRX is a snapshot InnoDB takes again only once it has gone
	// unread for 0.1 s (CACHE_MIN_IDLE_TIME_NS, trx0i_s.cc): polled more
	// often, it shows its first snapshot for ever. Polled every 50 ms, a
	// first read just before the wait timed out listed that wait 5 s later
	// (in about 1 run of 30 on a loaded machine).
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(250 * time.Millisecond) {
		var waiting int
		// Only this test's table: the server is shared with other tests.
		if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE CONCAT('%', ?, '%')", cfg.Table).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d statements still wait for a row lock 5s after the call with a 1s statement timeout failed", waiting)
		}
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if rec, err := s.Load(ctx, key); err != nil || rec != nil {
		t.Fatalf("record after the failed Reserve and the lock's release = %+v, %v; want none", rec, err)
	}
}

// A combined batch whose statements each wait for a row lock less than the
// lock-wait bound, but together longer than the call's timeout: the
// driver gives up at the timeout and closes the connection, which does not
// stop the query, so the server went on and committed the batch after its
// callers were told it failed (a reservation nobody executes, holding its
// key). The batch's server thread is killed when its outcome is unknown:
// nothing of it commits afterwards.
func TestBatchGivenUpDoesNotCommitLater(t *testing.T) {
	s, cfg := openStore(t, func(c *Config) { c.CombinedWrites = 1; c.StatementTimeout = time.Second })
	db := admin(t)
	sqltest.BatchGivenUpDoesNotCommitLater(t, s, s.combined.State, func(t *testing.T) (string, func()) {
		tx, key := holdKey(t, db, cfg.Table)
		return key, func() { _ = tx.Rollback() }
	})
}

// The bound is the statement timeout rounded up to whole seconds (the
// variable's unit), and a DSN's own setting wins.
func TestLockWaitBound(t *testing.T) {
	for _, c := range []struct {
		dsn     string
		timeout time.Duration
		want    string
	}{
		{"root@tcp(127.0.0.1:3306)/db", 5 * time.Second, "5"},
		{"root@tcp(127.0.0.1:3306)/db", 1500 * time.Millisecond, "2"},
		{"root@tcp(127.0.0.1:3306)/db", 100 * time.Millisecond, "1"},
		{"root@tcp(127.0.0.1:3306)/db?innodb_lock_wait_timeout=20", 5 * time.Second, "20"},
		// The server's names are not case-sensitive: no second one.
		{"root@tcp(127.0.0.1:3306)/db?INNODB_LOCK_WAIT_TIMEOUT=20", 5 * time.Second, "20"},
	} {
		mc, err := mysql.ParseDSN(c.dsn)
		if err != nil {
			t.Fatal(err)
		}
		lockWaitBound(mc, c.timeout)
		if _, got, _ := dsnLockWait(mc.Params); got != c.want || len(mc.Params) != 1 {
			t.Errorf("%s with timeout %v: %s=%q in %v, want %q alone", c.dsn, c.timeout, lockWaitVar, got, mc.Params, c.want)
		}
	}
}

// A DSN's innodb_lock_wait_timeout in capitals is the one every connection
// gets. The store used to add its own bound in lower case beside it, and
// the driver sent both in one SET, in the order of a map: on about half
// the connections the server waited the store's bound, on the others the
// DSN's, which the undo of a lost reservation did not wait for.
func TestDSNLockWaitInCapitalsIsKept(t *testing.T) {
	s, _ := openStore(t, func(c *Config) {
		sep := "?"
		if strings.Contains(c.DSN, "?") {
			sep = "&"
		}
		c.DSN += sep + "INNODB_LOCK_WAIT_TIMEOUT=7"
		c.StatementTimeout = 2 * time.Second
	})
	ctx := context.Background()
	// Connections held at once, so that each is a new one: with both
	// names, all eight agreed by chance once in 128 runs.
	var conns []*sql.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range 8 {
		c, err := s.db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		var wait int
		if err := c.QueryRowContext(ctx, "SELECT @@SESSION.innodb_lock_wait_timeout").Scan(&wait); err != nil {
			t.Fatal(err)
		}
		if wait != 7 {
			t.Fatalf("connection %d waits %d s for a lock, want the DSN's 7", i, wait)
		}
	}
	if got := s.cfg.ServerLockWait(); got != 7*time.Second {
		t.Errorf("ServerLockWait = %v, want the DSN's 7s", got)
	}
}

// A DSN's innodb_lock_wait_timeout that is not a whole number of seconds
// the servers take leaves the undo of a lost reservation nothing to wait
// by: it is refused, naming it. It used to be taken as the statement
// timeout, and DEFAULT (the server's 50 s) outlasted the undo ten times; a
// number past the maximum overflowed the wait, and the undo used 11 s.
// MariaDB's 0 (do not wait) and quoted numbers are kept.
func TestDSNLockWaitNotInSecondsRefused(t *testing.T) {
	for _, v := range []string{"DEFAULT", "-1", "1.5", "@@global.innodb_lock_wait_timeout", "10000000000"} {
		_, err := Config{DSN: "root@tcp(127.0.0.1:1)/db?innodb_lock_wait_timeout=" + v}.WithDefaults()
		if err == nil || !strings.Contains(err.Error(), "innodb_lock_wait_timeout="+v+" must be a whole number of seconds") {
			t.Errorf("innodb_lock_wait_timeout=%s: %v, want it refused, naming it", v, err)
		}
	}
	for _, v := range []string{"'20'", "0", "1073741824"} {
		if _, err := (Config{DSN: "root@tcp(127.0.0.1:1)/db?innodb_lock_wait_timeout=" + v}).WithDefaults(); err != nil {
			t.Errorf("innodb_lock_wait_timeout=%s: %v", v, err)
		}
	}
}

// Close waits for the KILL of a batch thread under way before it closes
// the pool the KILL runs on: a batch left running could commit after its
// callers were told it failed. Before, a Close right after a batch was
// given up (the process exiting) closed the pool under the KILL, and the
// thread ran on. The thread here is a session of its own running SLEEP,
// standing in for a batch.
func TestCloseWaitsForTheKillOfABatch(t *testing.T) {
	s, _ := openStore(t, nil)
	db := admin(t)
	conn, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var id uint64
	if err := conn.QueryRowContext(context.Background(), "SELECT CONNECTION_ID()").Scan(&id); err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = conn.ExecContext(context.Background(), "SELECT SLEEP(30)") }()
	running := func() bool {
		var n int
		if err := db.QueryRow("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND INFO LIKE 'SELECT SLEEP%'", id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	for deadline := time.Now().Add(5 * time.Second); !running(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the stand-in batch never started")
		}
	}
	s.startKill(id)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(2 * time.Second); running(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the batch's thread still runs 2 s after Close: its KILL was cut off")
		}
	}
}
