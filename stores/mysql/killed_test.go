package mysql

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A kill's error reply proves nothing about a combined batch: the server
// checks for a kill after a statement ran and answers the kill in place of
// its OK, COMMIT included. The batch's writes must hear "outcome unknown"
// (the handler then undoes a reservation, which is harmless if nothing
// committed), not run again alone: a caller whose time was spent by then
// heard "not sent" of a reservation that may have committed, and the key
// stayed held for a request nobody executes. The kill here is real and
// lands while the batch waits for a row lock, before its COMMIT; where it
// lands cannot be told from the reply, which is why the reply may not be
// taken for a rollback.
func TestKilledBatchLeavesOutcomeUnknown(t *testing.T) {
	r, s, cfg := combineRig(t, func(c *Config) { c.StatementTimeout = 10 * time.Second })
	db := admin(t)
	ctx := context.Background()

	release := r.Block(t)
	r.WaitState(t, 0, 1)
	// The batch's merged INSERT will wait for this row's lock.
	_, held := holdKey(t, db, cfg.Table)
	free := storetest.NewKey(t)
	keys, names := []string{free, held}, []string{"free", "held"}
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	for i, key := range keys {
		wg.Go(func() {
			_, errs[i] = s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
		})
	}
	r.WaitState(t, len(keys), 1)
	release()

	var thread int64
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		err := db.QueryRowContext(ctx, "SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE CONCAT('%INSERT INTO ', ?, '%') AND ID <> CONNECTION_ID() LIMIT 1",
			cfg.Table).Scan(&thread)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the combined batch never showed in the process list: %v", err)
		}
	}
	if _, err := db.ExecContext(ctx, "KILL QUERY "+strconv.FormatInt(thread, 10)); err != nil {
		t.Fatal(err)
	}
	wg.Wait()

	for i, err := range errs {
		var me *mysql.MySQLError
		if err == nil || stores.NotSent(err) {
			t.Errorf("Reserve of the %s key in a killed batch: err = %v, NotSent = %v; want an error not marked not sent",
				names[i], err, stores.NotSent(err))
		} else if !errors.As(err, &me) || me.Number != 1317 {
			t.Errorf("Reserve of the %s key in a killed batch: err = %v; want the kill's ER_QUERY_INTERRUPTED", names[i], err)
		}
	}
	// The kill landed before the COMMIT: nothing of the batch is there.
	if rec, err := s.Load(ctx, free); err != nil || rec != nil {
		t.Fatalf("Load of the free key after the killed batch: %+v, %v; want no record", rec, err)
	}
}

// An autocommit statement past MariaDB's max_statement_time is killed by
// a timer, the same kill as KILL QUERY: its error may come after the
// commit, so it is not marked not sent either. (The session variable is
// set through the DSN, as an operator would set it; it is MariaDB's, so
// the test skips on MySQL.)
func TestStatementTimeoutNotMarkedNotSent(t *testing.T) {
	var version string
	if err := admin(t).QueryRow("SELECT VERSION()").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.ToLower(version), "mariadb") {
		t.Skipf("max_statement_time is MariaDB's; the server is %s", version)
	}
	mc, err := mysql.ParseDSN(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	if mc.Params == nil {
		mc.Params = map[string]string{}
	}
	mc.Params["max_statement_time"] = "0.5"
	s, cfg := openStore(t, func(c *Config) { c.DSN = mc.FormatDSN(); c.StatementTimeout = 5 * time.Second })
	_, key := holdKey(t, admin(t), cfg.Table)
	_, err = s.Reserve(context.Background(), storetest.Reservation(key, storetest.Long, storetest.Long))
	var me *mysql.MySQLError
	if !errors.As(err, &me) || me.Number != 1969 {
		t.Fatalf("Reserve waiting for a lock past max_statement_time: err = %v; want ER_STATEMENT_TIMEOUT (1969)", err)
	}
	if stores.NotSent(err) {
		t.Fatalf("Reserve stopped by max_statement_time: err = %v marked not sent; want it left unknown", err)
	}
}
