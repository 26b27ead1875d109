package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/catalog"
)

// TestWalkthrough runs the demo's walk-through (in-process Caddy with the
// module, bundled catalog) and checks the story it tells: the lost commit
// executed once, its retry was replayed, and the table gained one snapshot.
func TestWalkthrough(t *testing.T) {
	s, err := startStack(t.TempDir(), 0)
	if err != nil {
		t.Fatalf("starting the demo stack: %v", err)
	}
	defer s.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out strings.Builder
	rep, err := walkthrough(ctx, s, &out)
	t.Logf("walk-through output:\n%s", out.String())
	if err != nil {
		t.Fatalf("walkthrough: %v", err)
	}

	if rep.Lifetime != "PT30M" {
		t.Errorf("advertised lifetime %q, want PT30M", rep.Lifetime)
	}
	if rep.NamespaceExecutions != 1 || rep.TableExecutions != 1 {
		t.Errorf("createNamespace/createTable executions %d/%d, want 1/1", rep.NamespaceExecutions, rep.TableExecutions)
	}
	if rep.CommitExecutions != 1 {
		t.Errorf("updateTable executions %d, want exactly 1", rep.CommitExecutions)
	}
	// Until the build after 28dfe25 only Executions were checked, which miss a second arrival the catalog answered 409.
	for _, op := range []string{catalog.OpCreateNamespace, catalog.OpCreateTable, catalog.OpUpdateTable} {
		if n := s.Catalog.Requests(op); n != 1 {
			t.Errorf("%s reached the catalog %d times, want 1 (the retry must be answered by the proxy)", op, n)
		}
	}
	if got := rep.SnapshotsAfter - rep.SnapshotsBefore; got != 1 {
		t.Errorf("new snapshots %d (%d -> %d), want exactly 1", got, rep.SnapshotsBefore, rep.SnapshotsAfter)
	}
	if rep.LostStatus != 200 || rep.RetryStatus != 200 || !rep.RetryReplayed || !rep.RetryBodySame {
		t.Errorf("lost %d, retry %d replayed=%v same body=%v; want 200, 200 replayed with the same body",
			rep.LostStatus, rep.RetryStatus, rep.RetryReplayed, rep.RetryBodySame)
	}
	if rep.CommitErr != nil {
		t.Errorf("iceberg-go reported the commit as failed: %v", rep.CommitErr)
	}
	for _, want := range []string{"Idempotent-Replayed: true", "catalog executions of updateTable: 1", "snapshots: 0 before, 1 after"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
}
