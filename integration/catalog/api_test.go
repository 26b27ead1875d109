package catalog

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"

	"github.com/apache/iceberg-go/table"
)

var rawSchema = map[string]any{
	"type": "struct", "schema-id": 0,
	"fields": []any{map[string]any{"id": 1, "name": "id", "type": "int", "required": true}},
}

// TestStatusesAndErrors drives the wire protocol directly: success statuses
// and bodies the spec and iceberg-go's client expect, and the error model.
func TestStatusesAndErrors(t *testing.T) {
	_, hs := newTestServer(t, Options{})
	base := hs.URL + "/v1"

	st, body := doJSON(t, http.MethodGet, base+"/config", nil)
	if st != http.StatusOK {
		t.Fatalf("config: %d %s", st, body)
	}
	var cfg map[string]any
	decodeJSON(t, body, &cfg)
	for _, k := range []string{"defaults", "overrides", "endpoints"} {
		if _, ok := cfg[k]; !ok {
			t.Errorf("config lacks %q: %s", k, body)
		}
	}
	if _, ok := cfg["idempotency-key-lifetime"]; ok {
		t.Errorf("config must not advertise idempotency-key-lifetime: %s", body)
	}

	st, body = doJSON(t, http.MethodPost, base+"/namespaces", map[string]any{"namespace": []string{"db"}, "properties": map[string]string{"k": "v"}})
	if st != http.StatusOK {
		t.Fatalf("createNamespace: %d %s", st, body)
	}
	var ns namespaceResponse
	decodeJSON(t, body, &ns)
	if !slices.Equal(ns.Namespace, []string{"db"}) || ns.Properties["k"] != "v" {
		t.Fatalf("createNamespace body: %s", body)
	}

	st, body = doJSON(t, http.MethodPost, base+"/namespaces", map[string]any{"namespace": []string{"db"}})
	expectError(t, st, body, http.StatusConflict, "AlreadyExistsException")

	st, body = doJSON(t, http.MethodPost, base+"/namespaces", map[string]any{"namespace": []string{}})
	expectError(t, st, body, http.StatusBadRequest, "BadRequestException")

	st, body = doJSON(t, http.MethodPost, base+"/namespaces", "not an object")
	expectError(t, st, body, http.StatusBadRequest, "BadRequestException")

	if st, _ = doJSON(t, http.MethodHead, base+"/namespaces/db", nil); st != http.StatusNoContent {
		t.Fatalf("namespaceExists: %d", st)
	}
	if st, _ = doJSON(t, http.MethodHead, base+"/namespaces/nope", nil); st != http.StatusNotFound {
		t.Fatalf("namespaceExists(missing): %d", st)
	}

	st, body = doJSON(t, http.MethodGet, base+"/namespaces/db/tables/missing", nil)
	expectError(t, st, body, http.StatusNotFound, "NoSuchTableException")
	st, body = doJSON(t, http.MethodGet, base+"/namespaces/nope", nil)
	expectError(t, st, body, http.StatusNotFound, "NoSuchNamespaceException")
	st, body = doJSON(t, http.MethodGet, base+"/namespaces/db/views/missing", nil)
	expectError(t, st, body, http.StatusNotFound, "NoSuchViewException")
	st, body = doJSON(t, http.MethodPost, base+"/namespaces/nope/tables", map[string]any{"name": "t", "schema": rawSchema})
	expectError(t, st, body, http.StatusNotFound, "NoSuchNamespaceException")

	createTable := map[string]any{"name": "t", "schema": rawSchema}
	st, body = doJSON(t, http.MethodPost, base+"/namespaces/db/tables", createTable)
	if st != http.StatusOK {
		t.Fatalf("createTable: %d %s", st, body)
	}
	var created struct {
		MetadataLocation string         `json:"metadata-location"`
		Metadata         map[string]any `json:"metadata"`
		Config           map[string]any `json:"config"`
	}
	decodeJSON(t, body, &created)
	if created.MetadataLocation == "" || created.Metadata["table-uuid"] == nil || created.Config == nil {
		t.Fatalf("createTable body lacks LoadTableResult fields: %s", body)
	}

	st, body = doJSON(t, http.MethodPost, base+"/namespaces/db/tables", createTable)
	expectError(t, st, body, http.StatusConflict, "AlreadyExistsException")

	if st, _ = doJSON(t, http.MethodHead, base+"/namespaces/db/tables/t", nil); st != http.StatusNoContent {
		t.Fatalf("tableExists: %d", st)
	}

	// A requirement that no longer holds is CommitFailed, not a 500.
	stale := map[string]any{
		"requirements": []any{map[string]any{"type": "assert-table-uuid", "uuid": "00000000-0000-0000-0000-000000000001"}},
		"updates":      []any{map[string]any{"action": "set-properties", "updates": map[string]string{"a": "b"}}},
	}
	st, body = doJSON(t, http.MethodPost, base+"/namespaces/db/tables/t", stale)
	expectError(t, st, body, http.StatusConflict, "CommitFailedException")

	commit := map[string]any{
		"requirements": []any{map[string]any{"type": "assert-table-uuid", "uuid": created.Metadata["table-uuid"]}},
		"updates":      []any{map[string]any{"action": "set-properties", "updates": map[string]string{"a": "b"}}},
	}
	st, body = doJSON(t, http.MethodPost, base+"/namespaces/db/tables/t", commit)
	if st != http.StatusOK {
		t.Fatalf("updateTable: %d %s", st, body)
	}
	var committed struct {
		MetadataLocation string `json:"metadata-location"`
		Metadata         struct {
			Properties map[string]string `json:"properties"`
		} `json:"metadata"`
	}
	decodeJSON(t, body, &committed)
	if committed.MetadataLocation == "" || committed.MetadataLocation == created.MetadataLocation || committed.Metadata.Properties["a"] != "b" {
		t.Fatalf("updateTable body: %s", body)
	}

	st, body = doJSON(t, http.MethodPost, base+"/namespaces/db/tables/missing", commit)
	expectError(t, st, body, http.StatusNotFound, "NoSuchTableException")

	st, body = doJSON(t, http.MethodPost, base+"/namespaces/db/tables/t", map[string]any{
		"updates": []any{map[string]any{"action": "no-such-update"}},
	})
	expectError(t, st, body, http.StatusBadRequest, "BadRequestException")

	rename := map[string]any{
		"source":      map[string]any{"namespace": []string{"db"}, "name": "t"},
		"destination": map[string]any{"namespace": []string{"db"}, "name": "t2"},
	}
	if st, body = doJSON(t, http.MethodPost, base+"/tables/rename", rename); st != http.StatusNoContent {
		t.Fatalf("renameTable: %d %s", st, body)
	}
	st, body = doJSON(t, http.MethodPost, base+"/tables/rename", rename)
	expectError(t, st, body, http.StatusNotFound, "NoSuchTableException")

	st, body = doJSON(t, http.MethodPost, base+"/namespaces/db/register", map[string]any{"name": "t2", "metadata-location": committed.MetadataLocation})
	expectError(t, st, body, http.StatusConflict, "AlreadyExistsException")
	st, body = doJSON(t, http.MethodPost, base+"/namespaces/db/register", map[string]any{"name": "copy", "metadata-location": committed.MetadataLocation})
	if st != http.StatusOK {
		t.Fatalf("registerTable: %d %s", st, body)
	}
	var registered struct {
		MetadataLocation string `json:"metadata-location"`
	}
	decodeJSON(t, body, &registered)
	if registered.MetadataLocation != committed.MetadataLocation {
		t.Fatalf("registerTable location %q, want %q", registered.MetadataLocation, committed.MetadataLocation)
	}

	st, body = doJSON(t, http.MethodDelete, base+"/namespaces/db", nil)
	expectError(t, st, body, http.StatusConflict, "NamespaceNotEmptyException")

	st, body = doJSON(t, http.MethodPost, base+"/namespaces/db/properties", map[string]any{"removals": []string{"k"}, "updates": map[string]string{"k": "x"}})
	expectError(t, st, body, http.StatusUnprocessableEntity, "UnprocessableEntityException")

	for _, name := range []string{"t2", "copy"} {
		if st, body = doJSON(t, http.MethodDelete, base+"/namespaces/db/tables/"+name, nil); st != http.StatusNoContent {
			t.Fatalf("dropTable %s: %d %s", name, st, body)
		}
	}
	st, body = doJSON(t, http.MethodDelete, base+"/namespaces/db/tables/t2", nil)
	expectError(t, st, body, http.StatusNotFound, "NoSuchTableException")
	if st, body = doJSON(t, http.MethodDelete, base+"/namespaces/db", nil); st != http.StatusNoContent {
		t.Fatalf("dropNamespace: %d %s", st, body)
	}
	st, body = doJSON(t, http.MethodDelete, base+"/namespaces/db", nil)
	expectError(t, st, body, http.StatusNotFound, "NoSuchNamespaceException")

	st, body = doJSON(t, http.MethodGet, base+"/nowhere/at/all", nil)
	expectError(t, st, body, http.StatusNotFound, "NotFoundException")
}

// TestPrefix checks both path forms and the advertised prefix.
func TestPrefix(t *testing.T) {
	_, hs := newTestServer(t, Options{Prefix: "wh1"})

	st, body := doJSON(t, http.MethodGet, hs.URL+"/v1/config", nil)
	var cfg struct {
		Overrides map[string]string `json:"overrides"`
	}
	decodeJSON(t, body, &cfg)
	if st != http.StatusOK || cfg.Overrides["prefix"] != "wh1" {
		t.Fatalf("config: %d %s", st, body)
	}
	if st, body = doJSON(t, http.MethodPost, hs.URL+"/v1/wh1/namespaces", map[string]any{"namespace": []string{"a"}}); st != http.StatusOK {
		t.Fatalf("prefixed create: %d %s", st, body)
	}
	if st, _ = doJSON(t, http.MethodHead, hs.URL+"/v1/namespaces/a", nil); st != http.StatusNoContent {
		t.Fatalf("unprefixed exists: %d", st)
	}
	st, body = doJSON(t, http.MethodGet, hs.URL+"/v1/other/namespaces", nil)
	expectError(t, st, body, http.StatusNotFound, "NotFoundException")
}

// TestNestedNamespacesAndPaging covers %1F-separated namespaces in paths and
// the parent query parameter, and page tokens.
func TestNestedNamespacesAndPaging(t *testing.T) {
	_, hs := newTestServer(t, Options{})
	base := hs.URL + "/v1"
	for _, ns := range [][]string{{"a"}, {"a", "b"}, {"a", "c"}, {"a", "b", "d"}, {"z"}} {
		if st, body := doJSON(t, http.MethodPost, base+"/namespaces", map[string]any{"namespace": ns}); st != http.StatusOK {
			t.Fatalf("create %v: %d %s", ns, st, body)
		}
	}
	var list struct {
		Namespaces [][]string `json:"namespaces"`
		Next       string     `json:"next-page-token"`
	}
	st, body := doJSON(t, http.MethodGet, base+"/namespaces", nil)
	decodeJSON(t, body, &list)
	if st != http.StatusOK || len(list.Namespaces) != 2 || list.Namespaces[0][0] != "a" || list.Namespaces[1][0] != "z" {
		t.Fatalf("top level: %d %s", st, body)
	}
	st, body = doJSON(t, http.MethodGet, base+"/namespaces?parent=a&pageSize=1", nil)
	list.Next = ""
	decodeJSON(t, body, &list)
	if st != http.StatusOK || len(list.Namespaces) != 1 || !slices.Equal(list.Namespaces[0], []string{"a", "b"}) || list.Next == "" {
		t.Fatalf("first page under a: %d %s", st, body)
	}
	st, body = doJSON(t, http.MethodGet, base+"/namespaces?parent=a&pageSize=1&pageToken="+list.Next, nil)
	list.Next = ""
	decodeJSON(t, body, &list)
	if st != http.StatusOK || !slices.Equal(list.Namespaces[0], []string{"a", "c"}) || list.Next != "" {
		t.Fatalf("second page under a: %d %s", st, body)
	}
	st, body = doJSON(t, http.MethodGet, base+"/namespaces?parent=a%1Fb", nil)
	decodeJSON(t, body, &list)
	if st != http.StatusOK || len(list.Namespaces) != 1 || !slices.Equal(list.Namespaces[0], []string{"a", "b", "d"}) {
		t.Fatalf("under a.b: %d %s", st, body)
	}
	st, body = doJSON(t, http.MethodPost, base+"/namespaces/a%1Fb/tables", map[string]any{"name": "t", "schema": rawSchema})
	if st != http.StatusOK {
		t.Fatalf("create a.b.t: %d %s", st, body)
	}
	var tables struct {
		Identifiers []restIdentifier `json:"identifiers"`
	}
	st, body = doJSON(t, http.MethodGet, base+"/namespaces/a%1Fb/tables", nil)
	decodeJSON(t, body, &tables)
	if st != http.StatusOK || len(tables.Identifiers) != 1 || !slices.Equal(tables.Identifiers[0].Namespace, []string{"a", "b"}) {
		t.Fatalf("list a.b tables: %d %s", st, body)
	}
	if st, _ = doJSON(t, http.MethodHead, base+"/namespaces/a/tables/t", nil); st != http.StatusNotFound {
		t.Fatalf("a.t must not exist: %d", st)
	}
}

// TestPrefixUsedByClient checks that iceberg-go's client picks the advertised
// prefix up and sends every catalog request below /v1/{prefix}/.
func TestPrefixUsedByClient(t *testing.T) {
	s, err := New(Options{WarehouseDir: t.TempDir(), Prefix: "wh1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	var (
		mu    sync.Mutex
		paths []string
	)
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		paths = append(paths, r.URL.Path)
		mu.Unlock()
		s.ServeHTTP(w, r)
	}))
	t.Cleanup(hs.Close)

	cat := newRESTClient(t, hs.URL)
	if err := cat.CreateNamespace(context.Background(), table.Identifier{"a"}, nil); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(paths) != 2 || paths[0] != "/v1/config" || paths[1] != "/v1/wh1/namespaces" {
		t.Fatalf("paths = %v", paths)
	}
}
