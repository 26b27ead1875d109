package redis

import (
	"context"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A script is marked not sent (stores.NotSent) only when it provably never
// reached the server, since the handler then skips undoing it. Refused,
// the client has no connection to send on; blackholed, the connection it
// holds takes the command and no answer comes back, so the script may have
// run.
func TestNotSentOnlyWhenProvablyUnsent(t *testing.T) {
	proxy := sqltest.NewProxy(t, testAddr(t))
	s, _ := openStore(t, func(c *Config) {
		c.Addrs = []string{proxy.Addr()}
		c.DialTimeout, c.ReadTimeout, c.WriteTimeout = outageTimeout, outageTimeout, outageTimeout
	})
	ctx := context.Background()
	reserve := func() error {
		_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
		return err
	}
	if err := reserve(); err != nil {
		t.Fatal(err)
	}
	proxy.Stop()
	if err := reserve(); err == nil || !stores.NotSent(err) {
		t.Fatalf("Reserve with connections refused: err = %v, NotSent = %v; want a not-sent error", err, stores.NotSent(err))
	}
	proxy.Start()
	if err := reserve(); err != nil {
		t.Fatalf("Reserve after the server came back: %v", err)
	}
	proxy.Blackhole()
	defer proxy.Stop()
	if err := reserve(); err == nil || stores.NotSent(err) {
		t.Fatalf("Reserve on a blackholed connection: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
	}
}

// A cluster client resends a command after a network error, whatever
// MaxRetries says, so even its dial error does not prove that no attempt
// ran: it is never marked not sent.
func TestClusterErrorsNeverNotSent(t *testing.T) {
	a, b := sqltest.NewProxy(t, testAddr(t)), sqltest.NewProxy(t, testAddr(t))
	a.Stop()
	b.Stop()
	s, err := Open(Config{Addrs: []string{a.Addr(), b.Addr()}, KeyPrefix: testPrefix(t),
		DialTimeout: outageTimeout, ReadTimeout: outageTimeout, WriteTimeout: outageTimeout}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_, err = s.Reserve(context.Background(), storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
	if err == nil || stores.NotSent(err) {
		t.Fatalf("cluster Reserve with every node refusing: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
	}
}
