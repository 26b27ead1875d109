package postgres

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A write is marked not sent (stores.NotSent) only when it provably never
// reached the server, since the handler then skips undoing it: a
// reservation that did commit and is never undone holds its key for a
// request nobody executes, and its retries hear "outcome unknown". (A
// store whose first contact fails: TestStartWithDatabaseDown.)
func TestNotSentOnlyWhenProvablyUnsent(t *testing.T) {
	cc, err := pgx.ParseConfig(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	proxy := sqltest.NewProxy(t, net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port))))
	host, port, _ := net.SplitHostPort(proxy.Addr())
	proxied := fmt.Sprintf("postgres://%s@%s:%s/%s?sslmode=disable", cc.User, host, port, cc.Database)
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
		s, _ := openStore(t, func(c *Config) { c.StatementTimeout = time.Second })
		r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
		// Another transaction runs the same INSERT and stays open: the
		// store's INSERT waits for it and times out. Had that transaction
		// rolled back a moment later, the waiting INSERT would have
		// committed: exactly the write a lost reply leaves possible.
		tx, err := admin(t).Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if _, err := tx.Exec(ctx, s.q.reserve, r.Key, r.Operation, r.Path, r.Principal, r.Fingerprint, "other-owner",
			sqlstore.Micros(r.Lease), sqlstore.Micros(r.RecordTTL())); err != nil {
			t.Fatal(err)
		}
		_, err = s.Reserve(ctx, r)
		if err == nil || stores.NotSent(err) {
			t.Fatalf("Reserve that waited for a lock: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
		}
	})
}
