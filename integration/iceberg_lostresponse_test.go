package integration_test

// The scenario the project exists for: a table commit succeeds in the
// catalog, the answer is lost on the way back, and the client resends the
// same commit with the same Idempotency-Key. Driven with iceberg-go's real
// REST client and real table writes (a Parquet append), against a real
// catalog, through a real Caddy — once with the module and once without.

import (
	"bytes"
	"errors"
	"net/http"
	"testing"

	"github.com/apache/iceberg-go/catalog/rest"
	"github.com/apache/iceberg-go/table"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/catalog"
)

// lostCommit creates a table through the stack, then appends a snapshot
// whose first commit answer is dropped by the client's transport.
func lostCommit(t *testing.T, st *icebergStack) (lt *lostResponseTransport, commitErr error, snapshotsAfter int) {
	t.Helper()
	ctx := testContext(t)
	keying := &keyingTransport{}
	lt = &lostResponseTransport{base: st.Spec, match: isTableCommit}
	// The key is set above the loss, so the resend carries the same key.
	keying.base = lt
	cat := newIcebergGoClient(t, st, keying)

	tbl, err := createDemoTable(ctx, cat, "lost_response", "events")
	if err != nil {
		t.Fatalf("creating namespace and table through the proxy: %v", err)
	}
	if n := len(tbl.Metadata().Snapshots()); n != 0 {
		t.Fatalf("new table has %d snapshots, want 0", n)
	}

	_, commitErr = appendRows(ctx, tbl)
	if _, _, fired := lt.exchanges(); !fired {
		t.Fatal("the append sent no updateTable request: the loss was never simulated")
	}

	reloaded, err := cat.LoadTable(ctx, table.Identifier{"lost_response", "events"})
	if err != nil {
		t.Fatalf("reloading the table: %v", err)
	}
	return lt, commitErr, len(reloaded.Metadata().Snapshots())
}

// TestIcebergGoLostCommitReplayed: with the module, the resent commit gets
// the original success, the client reports success, and the catalog
// committed exactly once.
func TestIcebergGoLostCommitReplayed(t *testing.T) {
	st := startIcebergStack(t, true)
	lt, err, snapshots := lostCommit(t, st)
	lost, resent, _ := lt.exchanges()

	if err != nil {
		t.Errorf("iceberg-go reported the commit as failed: %v", err)
	}
	if lost.Status != http.StatusOK || lost.Header.Get("Idempotent-Replayed") != "" {
		t.Errorf("first (lost) answer: %d replayed=%q, want 200 from the catalog", lost.Status, lost.Header.Get("Idempotent-Replayed"))
	}
	if resent.Status != lost.Status || resent.Header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("answer to the resent commit: %d replayed=%q, want %d with Idempotent-Replayed: true",
			resent.Status, resent.Header.Get("Idempotent-Replayed"), lost.Status)
	}
	if !bytes.Equal(resent.Body, lost.Body) {
		t.Errorf("replayed body differs from the original:\noriginal: %s\nreplayed: %s", lost.Body, resent.Body)
	}
	if ct := resent.Header.Get("Content-Type"); ct != lost.Header.Get("Content-Type") {
		t.Errorf("replayed Content-Type %q, original %q", ct, lost.Header.Get("Content-Type"))
	}
	if n := st.Catalog.Executions(catalog.OpUpdateTable); n != 1 {
		t.Errorf("catalog executed updateTable %d times, want 1", n)
	}
	if n := st.Catalog.Requests(catalog.OpUpdateTable); n != 1 {
		t.Errorf("updateTable reached the catalog %d times, want 1 (the retry must be answered by the proxy)", n)
	}
	if snapshots != 1 {
		t.Errorf("table has %d snapshots after the append, want exactly 1", snapshots)
	}
}

// TestIcebergGoLostCommitWithoutModule shows the harm the module prevents:
// through plain reverse_proxy the resent commit conflicts with its own first
// attempt, iceberg-go reports CommitFailed, yet the table has the snapshot.
func TestIcebergGoLostCommitWithoutModule(t *testing.T) {
	st := startIcebergStack(t, false)
	lt, err, snapshots := lostCommit(t, st)
	lost, resent, _ := lt.exchanges()

	if !errors.Is(err, rest.ErrCommitFailed) {
		t.Errorf("iceberg-go commit error = %v, want ErrCommitFailed", err)
	}
	if lost.Status != http.StatusOK {
		t.Errorf("first (lost) answer: %d, want 200: the commit succeeded in the catalog", lost.Status)
	}
	if resent.Status != http.StatusConflict || resent.Header.Get("Idempotent-Replayed") != "" {
		t.Errorf("answer to the resent commit: %d replayed=%q, want 409 from the catalog",
			resent.Status, resent.Header.Get("Idempotent-Replayed"))
	}
	if !bytes.Contains(resent.Body, []byte("CommitFailedException")) {
		t.Errorf("resent commit body %s, want a CommitFailedException", resent.Body)
	}
	if n := st.Catalog.Executions(catalog.OpUpdateTable); n != 1 {
		t.Errorf("catalog executed updateTable %d times, want 1 (the first attempt)", n)
	}
	if n := st.Catalog.Requests(catalog.OpUpdateTable); n != 2 {
		t.Errorf("updateTable reached the catalog %d times, want 2", n)
	}
	if snapshots != 1 {
		t.Errorf("table has %d snapshots, want 1: the first attempt committed although the client saw a failure", snapshots)
	}
}
