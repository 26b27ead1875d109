package mysql

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A call that never got a connection from the pool never sent its
// statement: database/sql returns the bare context error when the call's
// deadline passes while every connection is busy, and the handler then
// undid it with a background Release retried for two minutes, on the same
// exhausted pool (the postgres and redis stores' TestPoolWaitIsNotSent).
func TestPoolWaitIsNotSent(t *testing.T) {
	ctx := context.Background()
	s, _ := openStore(t, func(c *Config) { c.MaxConns = 1; c.StatementTimeout = time.Second })
	// Something else holds the pool's one connection.
	c, err := s.db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	err = s.Release(ctx, storetest.NewKey(t), "owner")
	if err == nil || !stores.NotSent(err) {
		t.Fatalf("Release that found no free connection: err = %v, NotSent = %v; want a not-sent error", err, stores.NotSent(err))
	}
}
