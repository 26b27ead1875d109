package sqltest

import (
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// CallWithoutAConnection checks that a call of a ready store that gets no
// connection is marked so (sqlstore.NoConnection) and transient: purge
// runs the store's call once through proxy (warming it), again once proxy
// blackholes and dropIdle has closed the store's idle connections (the
// call must connect, and the connect hangs: no statement runs), and a
// third time once proxy serves again, which must succeed. The store's
// StatementTimeout bounds the second call. The cleanup loop halves its
// batch only for a statement that ran past its timeout: until the build
// after d4fe47c such a call halved it 8 times in one run (a review: 1000
// down to 7, logged as "retrying with a smaller batch").
func CallWithoutAConnection(t *testing.T, proxy *Proxy, purge func() error, dropIdle func()) {
	t.Helper()
	if err := purge(); err != nil {
		t.Fatal(err)
	}
	proxy.Stop()
	proxy.Blackhole()
	dropIdle()
	err := purge()
	if err == nil || !sqlstore.NoConnection(err) || !sqlstore.IsTransient(err) {
		t.Fatalf("a call without a connection: err = %v, NoConnection = %v, transient = %v; want both marks",
			err, sqlstore.NoConnection(err), sqlstore.IsTransient(err))
	}
	proxy.Stop()
	proxy.Start()
	if err := purge(); err != nil {
		t.Fatalf("the call once the server answers again: %v", err)
	}
}
