package postgres

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// counter counts the statements a Store sends, and separately the prepares
// pgx makes the first time a connection sees a statement.
type counter struct{ queries, prepares atomic.Int64 }

func (c *counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.queries.Add(1)
	return ctx
}

func (c *counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *counter) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	c.prepares.Add(1)
	return ctx
}

func (c *counter) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

func (c *counter) take() (queries, prepares int64) {
	return c.queries.Swap(0), c.prepares.Swap(0)
}

func TestStatementCounts(t *testing.T) {
	for _, notify := range []bool{false, true} {
		c := &counter{}
		s, _ := openStore(t, func(cfg *Config) {
			cfg.tracer = c
			cfg.MaxConns = 1 // one connection: each statement is prepared once
			cfg.ListenNotify = notify
		})
		ctx := context.Background()
		resp := stores.Response{Status: 200, Body: []byte("{}")}
		fresh := func() (key string, reserve, finalize [2]int64) {
			key = storetest.NewKey(t)
			r := storetest.Reservation(key, storetest.Long, storetest.Long)
			c.take()
			if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
				t.Fatalf("Reserve = %+v, %v", res, err)
			}
			q, p := c.take()
			reserve = [2]int64{q, p}
			if err := s.Finalize(ctx, key, r.Owner, resp); err != nil {
				t.Fatal(err)
			}
			q, p = c.take()
			finalize = [2]int64{q, p}
			return key, reserve, finalize
		}
		replay := func(key string) [2]int64 {
			c.take()
			if res, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long)); err != nil || res.Existing == nil {
				t.Fatalf("replay Reserve = %+v, %v", res, err)
			}
			q, p := c.take()
			return [2]int64{q, p}
		}
		key, r1, f1 := fresh()
		p1 := replay(key)
		t.Logf("listen_notify=%v cold connection: reserve %d stmt (+%d prepare), finalize %d (+%d), replay %d (+%d)",
			notify, r1[0], r1[1], f1[0], f1[1], p1[0], p1[1])
		key, r2, f2 := fresh()
		p2 := replay(key)
		t.Logf("listen_notify=%v warm connection: reserve %d stmt (+%d prepare), finalize %d (+%d), replay %d (+%d)",
			notify, r2[0], r2[1], f2[0], f2[1], p2[0], p2[1])
		// A fresh key, the common case, is one INSERT; a replay, which
		// happens only on a retry, is the INSERT that met the row and the
		// SELECT that loads it.
		if r2 != [2]int64{1, 0} || f2 != [2]int64{1, 0} || p2 != [2]int64{2, 0} {
			t.Fatalf("warm: reserve %v finalize %v replay %v; want 1, 1 and 2 statements, no prepares", r2, f2, p2)
		}
	}
}
