package icebergidempotency

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestClassify(t *testing.T) {
	mutationsByPath := []struct{ method, path, op string }{
		{"POST", "/v1/{p}namespaces", "createNamespace"},
		{"DELETE", "/v1/{p}namespaces/ns", "dropNamespace"},
		{"POST", "/v1/{p}namespaces/ns/properties", "updateProperties"},
		{"POST", "/v1/{p}namespaces/ns/tables", "createTable"},
		{"POST", "/v1/{p}namespaces/ns/tables/t/plan", "planTableScan"},
		{"DELETE", "/v1/{p}namespaces/ns/tables/t/plan/plan-1", "cancelPlanning"},
		{"POST", "/v1/{p}namespaces/ns/tables/t/tasks", "fetchScanTasks"},
		{"POST", "/v1/{p}namespaces/ns/register", "registerTable"},
		{"POST", "/v1/{p}namespaces/ns/tables/t", "updateTable"},
		{"DELETE", "/v1/{p}namespaces/ns/tables/t", "dropTable"},
		{"POST", "/v1/{p}namespaces/ns/tables/t/unregister", "unregisterTable"},
		{"POST", "/v1/{p}tables/rename", "renameTable"},
		{"POST", "/v1/{p}transactions/commit", "commitTransaction"},
		{"POST", "/v1/{p}namespaces/ns/views", "createView"},
		{"POST", "/v1/{p}namespaces/ns/views/v", "replaceView"},
		{"DELETE", "/v1/{p}namespaces/ns/views/v", "dropView"},
		{"POST", "/v1/{p}views/rename", "renameView"},
		{"POST", "/v1/{p}namespaces/ns/register-view", "registerView"},
		// Multi-level namespace, escaped unit separator.
		{"POST", "/v1/{p}namespaces/a%1Fb/tables/t", "updateTable"},
		// Names that look like path keywords.
		{"POST", "/v1/{p}namespaces/tables/tables/plan", "updateTable"},
		{"POST", "/v1/{p}namespaces/namespaces/tables", "createTable"},
	}
	reads := []struct{ method, path string }{
		{"GET", "/v1/config"},
		{"POST", "/v1/oauth/tokens"},
		{"GET", "/v1/{p}namespaces"},
		{"GET", "/v1/{p}namespaces/ns"},
		{"HEAD", "/v1/{p}namespaces/ns"},
		{"GET", "/v1/{p}namespaces/ns/tables"},
		{"GET", "/v1/{p}namespaces/ns/tables/t"},
		{"HEAD", "/v1/{p}namespaces/ns/tables/t"},
		{"GET", "/v1/{p}namespaces/ns/tables/t/plan/plan-1"},
		{"GET", "/v1/{p}namespaces/ns/tables/t/credentials"},
		{"POST", "/v1/{p}namespaces/ns/tables/t/metrics"},
		{"POST", "/v1/{p}namespaces/ns/tables/t/sign"},
		{"GET", "/v1/{p}namespaces/ns/views"},
		{"GET", "/v1/{p}namespaces/ns/views/v"},
		{"HEAD", "/v1/{p}namespaces/ns/views/v"},
		{"GET", "/v1/{p}namespaces/ns/functions"},
		{"PUT", "/v1/{p}namespaces/ns/tables/t"},
		{"POST", "/v1/{p}namespaces/"},
		{"POST", "/v1/{p}namespaces//tables"},
		{"POST", "/v1/{p}namespaces/ns/tables/"},
		{"POST", "/v1/{p}unknown/thing"},
		{"DELETE", "/v1/{p}namespaces/ns/tables/t/plan/plan-1/more"},
		{"POST", "/v1/{p}namespaces/ns/tables/t/a/b/c/d/e/f"},
	}
	// A prefix of several segments, as catalogs hand out (Unity Catalog's
	// catalogs/{catalog}, BigLake's projects/{p}/catalogs/{c}) and the Java
	// client joins into the path: before, every mutation under one passed
	// unguarded while /v1/config advertised keys.
	for _, prefix := range []string{"", "wh/", "my%20catalog/", "catalogs/c/", "projects/p/catalogs/c/", "a/b/c/d/e/f/g/h/i/j/"} {
		for _, m := range mutationsByPath {
			path := replacePrefix(m.path, prefix)
			if got := classify(m.method, path); got != m.op {
				t.Errorf("classify(%s %s) = %q, want %q", m.method, path, got, m.op)
			}
		}
		for _, r := range reads {
			path := replacePrefix(r.path, prefix)
			if got := classify(r.method, path); got != "" {
				t.Errorf("classify(%s %s) = %q, want pass-through", r.method, path, got)
			}
		}
	}
	if got := classify("POST", "/v2/namespaces"); got != "" {
		t.Errorf("classify outside /v1/ = %q", got)
	}
	if got := classify("DELETE", "/v1/wh/Namespaces/ns"); got != "dropNamespace" {
		t.Errorf("classify(DELETE /v1/wh/Namespaces/ns) = %q, want dropNamespace", got)
	}
	// A path that one prefix reads as a commit and a shorter one as another
	// mutation is the commit, whose 502 leaves the key unknown: before, the
	// shortest prefix won, and a 502 after the commit released the key.
	for path, want := range map[string]string{
		// Prefix "namespaces", namespace "tables", table "plan"; without a
		// prefix: planTableScan of table "tables".
		"/v1/namespaces/namespaces/tables/tables/plan":       "updateTable",
		"/v1/namespaces/namespaces/tables/tables/tasks":      "updateTable",
		"/v1/namespaces/namespaces/tables/tables/unregister": "updateTable",
		// The shortest prefix still wins among non-commits.
		"/v1/namespaces/namespaces/tables": "createTable",
		// v1 and template words in any case, as Iceberg's reference
		// servlet and Hive's HMS REST catalog match them: before, these
		// passed unguarded, or read as another mutation.
		"/v1/wh/namespaces/ns/Tables/t":                     "updateTable",
		"/V1/wh/namespaces/ns/tables/t":                     "updateTable",
		"/v1/TRANSACTIONS/commit":                           "commitTransaction",
		"/v1/wh/namespaces/ns/Views/v":                      "replaceView",
		"/v1/wh/Namespaces":                                 "createNamespace",
		"/v1/namespaces/namespaces/Tables/tables":           "updateTable",
		"/v1/wh/namespaces/namespaces/Tables/register-view": "updateTable",
	} {
		if got := classify("POST", path); got != want {
			t.Errorf("classify(POST %s) = %q, want %q", path, got, want)
		}
	}
}

func replacePrefix(path, prefix string) string {
	const marker = "{p}"
	for i := 0; i+len(marker) <= len(path); i++ {
		if path[i:i+len(marker)] == marker {
			return path[:i] + prefix + path[i+len(marker):]
		}
	}
	return path
}

// The base path is stripped before classification; other requests outside
// it pass, but catalog paths are guarded all the same (the directive inside
// handle_path, which strips the prefix first, sees nothing else).
func TestBasePath(t *testing.T) {
	h := &Handler{BasePath: "/api/catalog"}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{
		"/api/catalog/v1/namespaces":    "createNamespace",
		"/api/catalog/v1/wh/namespaces": "createNamespace",
		"/v1/namespaces":                "createNamespace",
		"/api/catalogx/v1/namespaces":   "",
		"/api/v1/namespaces":            "",
		// Caddy's path matcher (handle_path, uri strip_prefix) reads a
		// prefix without case and with escapes decoded: these reach the
		// catalog as /v1/namespaces.
		"/API/Catalog/v1/namespaces":      "createNamespace",
		"/api%2Fcatalog/v1/namespaces":    "createNamespace",
		"/api%2fcatalog%2Fv1/namespaces":  "createNamespace",
		"/%61pi/c%61talog/v1/namespaces":  "createNamespace",
		"/api/catalog%2Fv1/wh/namespaces": "createNamespace",
		"/API/CATALOGS/v1/namespaces":     "",
		"/api%2Fcatalogx/v1/namespaces":   "",
		// A prefix of several segments.
		"/api/catalog/v1/projects/p/catalogs/c/transactions/commit": "commitTransaction",
	} {
		if got, _ := h.classifyPath("POST", normalizePath(path)); got != want {
			t.Errorf("classifyPath(POST %s) = %q, want %q", path, got, want)
		}
	}
}

// classify splits into an array of maxTemplateSegments+1 entries and
// refuses longer paths up front: a template longer than that would never
// match.
func TestMaxTemplateSegments(t *testing.T) {
	longest := 0
	for _, op := range mutations {
		longest = max(longest, len(op.template))
	}
	if longest != maxTemplateSegments {
		t.Fatalf("longest template has %d segments; maxTemplateSegments is %d", longest, maxTemplateSegments)
	}
}

// Requests that are not mutations, and mutations without a key, pass
// through without a single allocation of the handler's own: they are most
// of a catalog's traffic.
func TestPassThroughAllocatesNothing(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	w := httptest.NewRecorder()
	for _, c := range []struct{ method, path string }{
		{http.MethodPost, "/v1/wh/namespaces/ns/tables/t"}, // a mutation, no key
		{http.MethodGet, "/v1/wh/namespaces/ns/tables/t"},
		{http.MethodPost, "/v1/wh/namespaces/ns/tables/t/metrics"},
		{http.MethodGet, "/v1/wh/namespaces/ns/tables/t/plan/p/a/b/c"},
	} {
		r := httptest.NewRequest(c.method, c.path, nil)
		allocs := testing.AllocsPerRun(100, func() {
			if err := h.ServeHTTP(w, r, next); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("%s %s: %v allocations per request, want 0", c.method, c.path, allocs)
		}
	}
}

// mutationMethod is the handler's first test of every request: a method it
// misses would let that operation's retries execute twice.
func TestMutationMethodCoversMutations(t *testing.T) {
	for _, op := range mutations {
		if !mutationMethod(op.method) {
			t.Errorf("%s uses %s, which mutationMethod does not report", op.id, op.method)
		}
	}
	// Any case of POST and DELETE is one: Javalin (Apache Amoro's catalog)
	// upper-cases the method before routing.
	for _, m := range []string{"post", "Post", "delete", "dELETE"} {
		if !mutationMethod(m) {
			t.Errorf("mutationMethod(%q) = false, but Javalin routes it as %s", m, strings.ToUpper(m))
		}
	}
	for _, m := range []string{"GET", "HEAD", "OPTIONS", "PUT", "PATCH", "POSTS", "DELET"} {
		if mutationMethod(m) {
			t.Errorf("mutationMethod(%q) = true, but no operation uses it", m)
		}
	}
}
