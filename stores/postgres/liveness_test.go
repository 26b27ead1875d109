package postgres

import (
	"context"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestEndedSessionsAreNotUsed ends every session of a warm pool the way a
// server's fast shutdown, a failover or pg_terminate_backend does (each
// backend sends FATAL 57P01 and closes), then calls again at once. Before,
// each connection used within the last second was handed out dead: the
// statement failed after it was sent, which proves nothing, so every one
// of the pool's connections cost a request a 503 (8 of 8 here). Now none
// does. Over TLS too, where what waits on the socket is a TLS record.
func TestEndedSessionsAreNotUsed(t *testing.T) {
	for _, tc := range []struct{ name, sslmode string }{
		{"tcp", "disable"},
		{"tls", "require"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const conns = 8
			app := "liveness_" + sqltest.TableName(t)
			s, _ := openStore(t, func(c *Config) {
				c.DSN = withParams(t, c.DSN, map[string]string{"application_name": app, "sslmode": tc.sslmode})
				c.MaxConns = conns
			})
			a := admin(t)
			ctx := context.Background()
			reserve := func() error {
				_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
				return err
			}
			for round := range 3 {
				used := warmPool(t, s.pool, conns)
				var n int
				if err := a.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n != conns {
					t.Fatalf("ended %d sessions, want the pool's %d", n, conns)
				}
				waitSessionsGone(t, a, app)
				if since := time.Since(used); since > 800*time.Millisecond {
					// pgxpool pings a connection idle for over a second
					// anyway: the round shows nothing. Only a loaded
					// machine gets here.
					t.Logf("round %d: %v passed before the calls; again", round, since)
					continue
				}
				var failed []error
				var mu sync.Mutex
				var wg sync.WaitGroup
				for range conns {
					wg.Go(func() {
						if err := reserve(); err != nil {
							mu.Lock()
							failed = append(failed, err)
							mu.Unlock()
						}
					})
				}
				wg.Wait()
				for range conns {
					if err := reserve(); err != nil {
						failed = append(failed, err)
					}
				}
				if len(failed) > 0 {
					t.Fatalf("%d of %d calls failed on sessions the server had ended; the first: %v", len(failed), 2*conns, failed[0])
				}
				return
			}
			t.Fatal("the machine was too slow for every round: the case was not shown")
		})
	}
}

// warmPool makes the pool hold n idle connections, each used just now, and
// returns when they were.
func warmPool(t *testing.T, pool *pgxpool.Pool, n int) time.Time {
	t.Helper()
	var held []*pgxpool.Conn
	for range n {
		c, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Exec(context.Background(), "SELECT 1"); err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	for _, c := range held {
		c.Release()
	}
	return time.Now()
}

// waitSessionsGone waits for the ended backends to exit, so that what they
// sent is on the sockets before the calls.
func waitSessionsGone(t *testing.T, a *pgx.Conn, app string) {
	t.Helper()
	sqltest.WaitNoneLeft(t, "ended sessions", func() (n int, err error) {
		err = a.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n)
		return n, err
	})
}

// withParams sets DSN parameters, in either DSN form.
func withParams(t *testing.T, dsn string, params map[string]string) string {
	t.Helper()
	if !strings.Contains(dsn, "://") {
		for k, v := range params {
			dsn += " " + k + "=" + v
		}
		return dsn
	}
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	return u.String()
}
