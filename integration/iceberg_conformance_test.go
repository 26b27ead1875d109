package integration_test

// iceberg-go's own catalog conformance suite, run through Caddy with the
// module in front of the real catalog: once with a fresh Idempotency-Key on
// every mutation (the guard must be invisible when nothing is retried) and
// once without keys (the proxy must be transparent).

import (
	"strings"
	"testing"
	"time"

	icecat "github.com/apache/iceberg-go/catalog"
	"github.com/apache/iceberg-go/catalog/catalogtest"
)

// mutationOps are the catalog operations the conformance suite mutates with.
var mutationOps = []string{
	"createNamespace", "dropNamespace", "updateProperties",
	"createTable", "dropTable", "updateTable", "renameTable", "registerTable",
	"commitTransaction", "createView", "replaceView", "dropView", "renameView", "registerView",
}

func catalogMutationRequests(st *icebergStack) int {
	n := 0
	for _, op := range mutationOps {
		n += st.Catalog.Requests(op)
	}
	return n
}

// guardLogCount counts the guard's debug log lines with the given message.
func guardLogCount(st *icebergStack, msg string) int {
	return strings.Count(st.Caddy.Logs(), `"msg":"`+msg+`"`)
}

// waitGuardLogs waits until the guard logged msg want times: Caddy's log
// lines reach the harness through a pipe, a moment after the responses.
func waitGuardLogs(t *testing.T, st *icebergStack, msg string, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for guardLogCount(st, msg) < want && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if got := guardLogCount(st, msg); got != want {
		t.Errorf("Caddy logged %q %d times, want %d", msg, got, want)
	}
}

// TestIcebergGoConformanceWithKeys runs the suite with a UUIDv7 key on every
// mutation and checks each keyed mutation was executed by the guard once.
func TestIcebergGoConformanceWithKeys(t *testing.T) {
	st := startIcebergStack(t, true)
	keying := &keyingTransport{base: st.Spec}
	catalogtest.RunCatalogTests(t, catalogtest.Config{
		SupportsNamespaceProperties: true,
		// One shared catalog and proxy: the suite names everything uniquely
		// per test, as it does for any server-backed catalog.
		NewCatalog: func(t *testing.T) icecat.Catalog { return newIcebergGoClient(t, st, keying) },
	})
	if t.Failed() {
		return
	}
	// Subtests' cleanups (namespace and table drops) have run by now.
	keyed := int(keying.keyed.Load())
	if keyed == 0 {
		t.Fatal("the suite sent no mutations")
	}
	if n := catalogMutationRequests(st); n != keyed {
		t.Errorf("catalog received %d mutations, client sent %d keyed ones: every fresh key must execute exactly once", n, keyed)
	}
	waitGuardLogs(t, st, "key reserved: executing", keyed)
	if n := guardLogCount(st, "no key: passing through"); n != 0 {
		t.Errorf("guard passed %d mutations through as unkeyed, want 0", n)
	}
	if n := guardLogCount(st, "replaying stored response"); n != 0 {
		t.Errorf("guard replayed %d responses for fresh keys, want 0", n)
	}
	// Counted from the answers the client got: until the build after
	// b12fe5d the want was keyed less the guard's own "key released"
	// lines, so a guard that released every key passed (0 == 0).
	waitGuardLogs(t, st, "response finalized", int(keying.final.Load()))
	t.Logf("%d keyed mutations, each executed once through the guard", keyed)
}

// TestIcebergGoConformanceWithoutKeys runs the suite with no keys: every
// mutation passes through the guard untouched.
func TestIcebergGoConformanceWithoutKeys(t *testing.T) {
	st := startIcebergStack(t, true)
	counting := &countingTransport{base: st.Spec}
	catalogtest.RunCatalogTests(t, catalogtest.Config{
		SupportsNamespaceProperties: true,
		NewCatalog:                  func(t *testing.T) icecat.Catalog { return newIcebergGoClient(t, st, counting) },
	})
	if t.Failed() {
		return
	}
	sent := int(counting.mutations.Load())
	if sent == 0 {
		t.Fatal("the suite sent no mutations")
	}
	if n := catalogMutationRequests(st); n != sent {
		t.Errorf("catalog received %d mutations, client sent %d", n, sent)
	}
	waitGuardLogs(t, st, "no key: passing through", sent)
	if n := guardLogCount(st, "key reserved: executing"); n != 0 {
		t.Errorf("guard executed %d unkeyed mutations as keyed", n)
	}
	t.Logf("%d unkeyed mutations passed through", sent)
}
