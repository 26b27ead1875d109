package catalog

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/apache/iceberg-go"
	icecat "github.com/apache/iceberg-go/catalog"
	"github.com/apache/iceberg-go/catalog/catalogtest"
	"github.com/apache/iceberg-go/catalog/rest"
	"github.com/apache/iceberg-go/table"
)

func expectCount(t *testing.T, what string, got, want int) {
	t.Helper()
	if got != want {
		t.Fatalf("%s = %d, want %d", what, got, want)
	}
}

// waitReached fails the test if no request reaches the stall in time.
func waitReached(t *testing.T, st *Stall) {
	t.Helper()
	select {
	case <-st.Reached():
	case <-time.After(10 * time.Second):
		t.Fatalf("no %s request reached the stall", st.Op())
	}
}

// TestExecutionCounts checks that only performed mutations are counted.
func TestExecutionCounts(t *testing.T) {
	ctx := context.Background()
	s, hs := newTestServer(t, Options{})
	cat := newRESTClient(t, hs.URL)

	if err := cat.CreateNamespace(ctx, table.Identifier{"db"}, nil); err != nil {
		t.Fatal(err)
	}
	_ = cat.CreateNamespace(ctx, table.Identifier{"db"}, nil) // 409: not an execution
	expectCount(t, "Executions(createNamespace)", s.Executions(OpCreateNamespace), 1)
	expectCount(t, "Requests(createNamespace)", s.Requests(OpCreateNamespace), 2)

	ident := table.Identifier{"db", "t"}
	tbl, err := cat.CreateTable(ctx, ident, catalogtest.Schema)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cat.LoadTable(ctx, ident); err != nil {
		t.Fatal(err)
	}
	expectCount(t, "Executions(loadTable)", s.Executions(OpLoadTable), 0)
	expectCount(t, "Requests(loadTable)", s.Requests(OpLoadTable), 1)

	upd := []table.Update{table.NewSetPropertiesUpdate(iceberg.Properties{"k": "v"})}
	if _, _, err := cat.CommitTable(ctx, ident, []table.Requirement{table.AssertTableUUID(tbl.Metadata().TableUUID())}, upd); err != nil {
		t.Fatal(err)
	}
	if _, _, err := cat.CommitTable(ctx, ident, []table.Requirement{table.AssertCurrentSchemaID(42)}, upd); err == nil {
		t.Fatal("stale commit succeeded")
	}
	expectCount(t, "Executions(updateTable)", s.Executions(OpUpdateTable), 1)

	// A staged create writes nothing; its assert-create commit is the execution.
	if _, err := cat.CreateTable(ctx, table.Identifier{"db", "staged"}, catalogtest.Schema,
		icebergStaged()...); err != nil {
		t.Fatal(err)
	}
	expectCount(t, "Executions(createTable)", s.Executions(OpCreateTable), 1)
	expectCount(t, "Executions(updateTable)", s.Executions(OpUpdateTable), 2)
	expectCount(t, "TotalExecutions", s.TotalExecutions(), 4)

	s.ResetFaults()
	expectCount(t, "TotalExecutions after reset", s.TotalExecutions(), 0)
	expectCount(t, "TotalRequests after reset", s.TotalRequests(), 0)
}

// TestFailNext checks that an injected 503 happens before commit and only once.
func TestFailNext(t *testing.T) {
	ctx := context.Background()
	s, hs := newTestServer(t, Options{})
	cat := newRESTClient(t, hs.URL)
	if err := cat.CreateNamespace(ctx, table.Identifier{"db"}, nil); err != nil {
		t.Fatal(err)
	}
	ident := table.Identifier{"db", "t"}
	tbl, err := cat.CreateTable(ctx, ident, catalogtest.Schema)
	if err != nil {
		t.Fatal(err)
	}

	s.FailNext(OpUpdateTable)
	commit := map[string]any{"updates": []any{map[string]any{"action": "set-properties", "updates": map[string]string{"a": "b"}}}}
	st, body := doJSON(t, http.MethodPost, hs.URL+"/v1/namespaces/db/tables/t", commit)
	expectError(t, st, body, http.StatusServiceUnavailable, "ServiceUnavailableException")
	after, err := cat.LoadTable(ctx, ident)
	if err != nil {
		t.Fatal(err)
	}
	if after.MetadataLocation() != tbl.MetadataLocation() || after.Properties()["a"] != "" {
		t.Fatal("the injected failure committed")
	}
	expectCount(t, "Executions(updateTable)", s.Executions(OpUpdateTable), 0)
	expectCount(t, "Requests(updateTable)", s.Requests(OpUpdateTable), 1)

	// The client classifies a 503 on commit as an unknown commit state.
	s.FailNext(OpUpdateTable)
	_, _, err = cat.CommitTable(ctx, ident, nil, []table.Update{table.NewSetPropertiesUpdate(iceberg.Properties{"a": "b"})})
	if !errors.Is(err, rest.ErrCommitStateUnknown) {
		t.Fatalf("client err = %v, want rest.ErrCommitStateUnknown", err)
	}

	if st, body = doJSON(t, http.MethodPost, hs.URL+"/v1/namespaces/db/tables/t", commit); st != http.StatusOK {
		t.Fatalf("commit after the injected failures: %d %s", st, body)
	}
	expectCount(t, "Executions(updateTable)", s.Executions(OpUpdateTable), 1)

	// Other operations are unaffected by a pending failure of updateTable.
	s.FailNext(OpUpdateTable)
	if err := cat.CreateNamespace(ctx, table.Identifier{"db2"}, nil); err != nil {
		t.Fatalf("createNamespace with an updateTable failure pending: %v", err)
	}
}

// TestDropNextCommit checks that the dropped commit is in the table although
// its caller got no answer, and that only the next successful execution is
// dropped.
func TestDropNextCommit(t *testing.T) {
	ctx := context.Background()
	s, hs := newTestServer(t, Options{})
	cat := newRESTClient(t, hs.URL)
	if err := cat.CreateNamespace(ctx, table.Identifier{"db"}, nil); err != nil {
		t.Fatal(err)
	}
	ident := table.Identifier{"db", "t"}
	if _, err := cat.CreateTable(ctx, ident, catalogtest.Schema); err != nil {
		t.Fatal(err)
	}
	url := hs.URL + "/v1/namespaces/db/tables/t"
	setProp := func(v string) map[string]any {
		return map[string]any{"updates": []any{map[string]any{"action": "set-properties", "updates": map[string]string{"a": v}}}}
	}

	s.DropNextCommit(OpUpdateTable)
	// A failing commit does not use the drop up.
	stale := map[string]any{
		"requirements": []any{map[string]any{"type": "assert-current-schema-id", "current-schema-id": 42}},
		"updates":      setProp("stale")["updates"],
	}
	if st, body := doJSON(t, http.MethodPost, url, stale); st != http.StatusConflict {
		t.Fatalf("stale commit: %d %s, want 409", st, body)
	}

	data, _ := json.Marshal(setProp("dropped"))
	rsp, err := http.Post(url, "application/json", bytes.NewReader(data))
	if err == nil {
		_ = rsp.Body.Close()
		t.Fatalf("commit with a pending drop answered %s, want no answer", rsp.Status)
	}
	after, err := cat.LoadTable(ctx, ident)
	if err != nil {
		t.Fatal(err)
	}
	if got := after.Properties()["a"]; got != "dropped" {
		t.Fatalf("property a = %q after the dropped commit, want it committed", got)
	}
	expectCount(t, "Executions(updateTable)", s.Executions(OpUpdateTable), 1)

	if st, body := doJSON(t, http.MethodPost, url, setProp("next")); st != http.StatusOK {
		t.Fatalf("commit after the drop: %d %s", st, body)
	}
	expectCount(t, "Executions(updateTable)", s.Executions(OpUpdateTable), 2)
}

// TestStall holds one request in flight while others proceed, then lets it
// finish.
func TestStall(t *testing.T) {
	s, hs := newTestServer(t, Options{})
	base := hs.URL + "/v1"

	st := s.StallNext(OpCreateNamespace)
	done := make(chan int, 1)
	go func() {
		code, _ := doJSON(t, http.MethodPost, base+"/namespaces", map[string]any{"namespace": []string{"slow"}})
		done <- code
	}()
	waitReached(t, st)

	// Only the next request stalls, and a stalled one holds no lock.
	if code, body := doJSON(t, http.MethodPost, base+"/namespaces", map[string]any{"namespace": []string{"fast"}}); code != http.StatusOK {
		t.Fatalf("second create while one is stalled: %d %s", code, body)
	}
	if code, _ := doJSON(t, http.MethodHead, base+"/namespaces/slow", nil); code != http.StatusNotFound {
		t.Fatalf("stalled create already visible: %d", code)
	}
	expectCount(t, "Executions(createNamespace) while stalled", s.Executions(OpCreateNamespace), 1)
	select {
	case code := <-done:
		t.Fatalf("stalled request finished early with %d", code)
	default:
	}

	st.Release()
	select {
	case code := <-done:
		if code != http.StatusOK {
			t.Fatalf("released request: %d", code)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("released request did not finish")
	}
	expectCount(t, "Executions(createNamespace)", s.Executions(OpCreateNamespace), 2)
}

// TestStallCancelled checks that a client giving up leaves nothing behind.
func TestStallCancelled(t *testing.T) {
	s, hs := newTestServer(t, Options{})
	st := s.StallNext(OpCreateNamespace)

	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, hs.URL+"/v1/namespaces", nil)
		rsp, err := http.DefaultClient.Do(req)
		if err == nil {
			rsp.Body.Close()
		}
		errc <- err
	}()
	waitReached(t, st)
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled request err = %v", err)
	}
	// The handler notices the cancellation asynchronously; give it a moment
	// and check that it never went past the stall.
	time.Sleep(100 * time.Millisecond)
	expectCount(t, "Requests(createNamespace)", s.Requests(OpCreateNamespace), 0)
	if code, body := doJSON(t, http.MethodPost, hs.URL+"/v1/namespaces", map[string]any{"namespace": []string{"x"}}); code != http.StatusOK {
		t.Fatalf("create after a cancelled stall: %d %s", code, body)
	}
}

// TestStallReleasedByClose checks that Close does not leave requests hanging.
func TestStallReleasedByClose(t *testing.T) {
	s, hs := newTestServer(t, Options{})
	st := s.StallNext(OpListNamespaces)
	done := make(chan struct{})
	go func() {
		defer close(done)
		doJSON(t, http.MethodGet, hs.URL+"/v1/namespaces", nil)
	}()
	waitReached(t, st)
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not release the stalled request")
	}
}

// TestConcurrentCommits races commits that all require the same schema id:
// exactly one may win, the rest must be 409s, never 500s or double commits.
func TestConcurrentCommits(t *testing.T) {
	ctx := context.Background()
	s, hs := newTestServer(t, Options{})
	cat := newRESTClient(t, hs.URL)
	if err := cat.CreateNamespace(ctx, table.Identifier{"db"}, nil); err != nil {
		t.Fatal(err)
	}
	ident := table.Identifier{"db", "t"}
	if _, err := cat.CreateTable(ctx, ident, catalogtest.Schema); err != nil {
		t.Fatal(err)
	}

	const n = 8
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		won      int
		conflict int
		other    []error
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			schema := iceberg.NewSchema(1,
				iceberg.NestedField{ID: 1, Name: "id", Type: iceberg.PrimitiveTypes.Int32, Required: true},
				iceberg.NestedField{ID: 2, Name: "data", Type: iceberg.PrimitiveTypes.String, Required: true},
				iceberg.NestedField{ID: 3, Name: fmt.Sprintf("c%d", i), Type: iceberg.PrimitiveTypes.Int64},
			)
			_, _, err := cat.CommitTable(ctx, ident,
				[]table.Requirement{table.AssertCurrentSchemaID(0)},
				[]table.Update{table.NewAddSchemaUpdate(schema), table.NewSetCurrentSchemaUpdate(-1)})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				won++
			case errors.Is(err, table.ErrCommitFailed):
				conflict++
			default:
				other = append(other, err)
			}
		}()
	}
	wg.Wait()
	if len(other) > 0 {
		t.Fatalf("unexpected errors: %v", other)
	}
	expectCount(t, "winning commits", won, 1)
	expectCount(t, "conflicting commits", conflict, n-1)
	expectCount(t, "Executions(updateTable)", s.Executions(OpUpdateTable), 1)
}

// icebergStaged makes CreateTable use the two-phase staged create.
func icebergStaged() []icecat.CreateTableOpt {
	return []icecat.CreateTableOpt{icecat.WithStagedUpdates(table.NewSetPropertiesUpdate(iceberg.Properties{"staged": "yes"}))}
}
