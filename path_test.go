package icebergidempotency

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestNormalizePath(t *testing.T) {
	for in, want := range map[string]string{
		"/v1/wh/namespaces":                "/v1/wh/namespaces",
		"/v1/wh/%6Eamespaces":              "/v1/wh/namespaces",
		"/v1/wh/%6eamespaces":              "/v1/wh/namespaces",
		"/%76%31/wh/namespaces":            "/v1/wh/namespaces",
		"/v1//wh///namespaces":             "/v1/wh/namespaces",
		"/v1/wh/namespaces/":               "/v1/wh/namespaces",
		"/v1/./wh/x/../namespaces":         "/v1/wh/namespaces",
		"/v1/wh/%2E%2E/namespaces":         "/v1/namespaces",
		"/v1/namespaces/a%1Fb/tables/t":    "/v1/namespaces/a%1Fb/tables/t",
		"/v1/namespaces/a%1fb/tables/t":    "/v1/namespaces/a%1Fb/tables/t",
		"/v1/namespaces/a%2fb/tables":      "/v1/namespaces/a%2Fb/tables",
		"/v1/namespaces/%zz/tables":        "/v1/namespaces/%25zz/tables",
		"/v1/namespaces/abc%":              "/v1/namespaces/abc%25",
		"/v1/namespaces/abc%4":             "/v1/namespaces/abc%254",
		"/000%a%41":                        "/000%25aA",
		"":                                 "/",
		"/":                                "/",
		"/../..":                           "/",
		"/api/catalog/v1/wh/tables/rename": "/api/catalog/v1/wh/tables/rename",
		"/v1/namespaces;x=1":               "/v1/namespaces",
		"/v1/wh;a/namespaces;b/ns/tables;": "/v1/wh/namespaces/ns/tables",
		"/v1/wh/namespaces/..;x/tables":    "/v1/wh/tables",
		"/v1/namespaces/a%3Bb":             "/v1/namespaces/a%3Bb",
	} {
		if got := normalizePath(in); got != want {
			t.Errorf("normalizePath(%q) = %q, want %q", in, got, want)
		}
	}
}

// Spellings of one path classify the same: before, "/v1/wh/%6Eamespaces"
// reached the catalog as "/v1/wh/namespaces" but was not classified, so it
// went unguarded and bypassed require_key.
func TestClassifyPathSpellings(t *testing.T) {
	h := &Handler{}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{
		"/v1/wh/namespaces", "/v1/wh/%6Eamespaces", "/v1//wh/namespaces", "/v1/wh/namespaces/",
		"/v1/wh/./namespaces", "/v1/%77h/namespaces",
		// JAX-RS and servlet containers route these as /v1/wh/namespaces.
		"/v1/wh/namespaces;x=1", "/v1/wh;p/namespaces", "/v1;/wh/namespaces;",
	} {
		if got, _ := h.classifyPath("POST", normalizePath(p)); got != "createNamespace" {
			t.Errorf("classify(POST %s) = %q, want createNamespace", p, got)
		}
	}
}

// A path whose normalized form is no mutation, but whose literal reading
// is, is guarded as that: a catalog routing the path as sent would execute
// it.
func TestClassifyLiteralReading(t *testing.T) {
	h := &Handler{}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	wantClassified(t, h, []classified{
		{"POST", "/v1/wh/namespaces/ns/tables/%2E%2E", "updateTable", "/v1/wh/namespaces/ns/tables/.."},
		{"DELETE", "/v1/wh/namespaces/;x", "dropNamespace", "/v1/wh/namespaces/;x"},
		{"DELETE", "/v1/wh/namespaces/ns/tables/.", "dropTable", "/v1/wh/namespaces/ns/tables/."},
		// A catalog that decodes %2F before routing.
		{"POST", "/v1/wh%2Fnamespaces", "createNamespace", "/v1/wh/namespaces"},
		// A catalog that decodes %2F and routes the rest as sent (Starlette:
		// no dot segments resolved, ";" kept). Before, none of the readings
		// was this one, and these passed unguarded.
		{"DELETE", "/v1/wh%2Fnamespaces/;x", "dropNamespace", "/v1/wh/namespaces/;x"},
		{"DELETE", "/v1/wh%2Fnamespaces/..", "dropNamespace", "/v1/wh/namespaces/.."},
		{"DELETE", "/v1/wh%2Fnamespaces/ns/tables/.", "dropTable", "/v1/wh/namespaces/ns/tables/."},
		{"POST", "/v1/wh%2Fnamespaces/ns/tables/%2E%2E", "updateTable", "/v1/wh/namespaces/ns/tables/.."},
		// A %2F in a path that is a mutation as it is stays in its segment.
		{"DELETE", "/v1/wh/namespaces/ns%2ftables%2Ft", "dropNamespace", "/v1/wh/namespaces/ns%2Ftables%2Ft"},
		{"DELETE", "/v1/wh/namespaces/ns/tables/a%2Fb", "dropTable", "/v1/wh/namespaces/ns/tables/a%2Fb"},
		// A table or view named "." as sent: the normalized reading is a
		// create, the literal one a commit, which wins (its 502 must leave
		// the key unknown). Before, the create did, and a 502 after the
		// commit released the key: the retry committed again.
		{"POST", "/v1/wh/namespaces/ns/tables/%2E", "updateTable", "/v1/wh/namespaces/ns/tables/."},
		{"POST", "/v1/wh/namespaces/ns/views/%2E", "replaceView", "/v1/wh/namespaces/ns/views/."},
		// Every reading is read for a commit: before, the first mutation
		// won, and with a lower-case %2f the literal reading (createTable)
		// came before the %2F-decoded one (updateTable of table "tables").
		{"POST", "/v1/wh/namespaces/a%2ftables/tables", "updateTable", "/v1/wh/namespaces/a/tables/tables"},
		{"POST", "/v1/wh/namespaces/a%2Ftables/tables;x", "updateTable", "/v1/wh/namespaces/a/tables/tables"},
		// The normalized reading wins where it is a mutation.
		{"POST", "/v1/wh/namespaces;x=1", "createNamespace", "/v1/wh/namespaces"},
		// Neither reading is a mutation.
		{"POST", "/v1/wh/namespaces/ns/tables/t/metrics", "", ""},
	})
}

// End to end, through reverse_proxy to a catalog that decodes %2F and
// commits table "tables", then answers 502: the key is left unknown, and
// the retry does not commit again, whatever the case of the escape.
// Before, "%2f" was guarded as createTable, whose 502 released the key.
func TestCommitReadingWinsEndToEnd(t *testing.T) {
	for _, p := range []string{"/v1/wh/namespaces/a%2Ftables/tables", "/v1/wh/namespaces/a%2ftables/tables"} {
		h := newTestHandler(t, newMemoryStore(t))
		catalog := newCountingCatalog(t, answerStatus(http.StatusBadGateway, typeServiceFailure))
		proxy := newReverseProxy(t, catalog.addr())
		key := storetest.NewKey(t)
		first := serve(t, h, proxy, "POST", p, key, commitBody)
		retry := serve(t, h, proxy, "POST", p, key, commitBody)
		if n := catalog.executed.Load(); n != 1 || retry.errorType() != typeCommitStateUnknown {
			t.Errorf("POST %s: first %d, retry %d %s, catalog executed %d times; want the retry told unknown, one execution",
				p, first.code(), retry.code(), retry.errorType(), n)
		}
	}
}

// With base_path set and "uri strip_prefix" of it after the directive (in
// a route, or a handle that does not strip), Caddy cuts the prefix from the
// path as sent and only then decodes and cleans the rest, whose ".."
// segments stop at its own root: these reach the catalog as the mutations
// below. Read whole, their dot segments climb out of the base ("/api/v1/…":
// no catalog path), and before they passed unguarded.
func TestClassifyAfterStripPrefix(t *testing.T) {
	h := &Handler{BasePath: "/api/catalog"}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	wantClassified(t, h, []classified{
		{"POST", "/api/catalog/%2E%2E/v1/wh/namespaces", "createNamespace", "/api/catalog/v1/wh/namespaces"},
		{"POST", "/API/Catalog/%2e%2e/v1/wh/namespaces", "createNamespace", "/api/catalog/v1/wh/namespaces"},
		{"POST", "/api/catalog/x%2F..%2F..%2Fv1/wh/namespaces", "createNamespace", "/api/catalog/v1/wh/namespaces"},
		// The rest read as sent, by a catalog that keeps path parameters.
		{"DELETE", "/api/catalog/%2E%2E/v1/wh/namespaces/;x", "dropNamespace", "/api/catalog/v1/wh/namespaces/;x"},
		// A path parameter on "..": Caddy's clean keeps the segment, a
		// servlet catalog resolves it.
		{"POST", "/api/catalog/..;x/v1/wh/namespaces", "createNamespace", "/api/catalog/v1/wh/namespaces"},
		// The base ending inside a segment: strip_prefix cuts it all the
		// same, and anchors the rest at "/". Until the build after 051e419
		// these passed unguarded.
		{"POST", "/api/catalogv1/wh/namespaces", "createNamespace", "/api/catalog/v1/wh/namespaces"},
		{"POST", "/API/CATALOG./v1/wh/namespaces/ns/tables/t", "updateTable", "/api/catalog/v1/wh/namespaces/ns/tables/t"},
		{"POST", "/api/catalog../v1/wh/namespaces/ns/tables/t", "updateTable", "/api/catalog/v1/wh/namespaces/ns/tables/t"},
		{"POST", "/api/catalogx/v1/wh/namespaces", "", ""},
		// Not below the base: strip_prefix leaves it alone, and read whole
		// it is no catalog path.
		{"POST", "/api/other/%2E%2E/v1/wh/namespaces", "", ""},
		{"POST", "/api/catalog/v1/wh/namespaces/ns/tables/t/metrics", "", ""},
	})
}

// classified is a request and what classifyRequest should make of it: the
// operation and the path its key is bound to ("" for a pass-through).
type classified struct{ method, path, op, bound string }

// wantClassified fails t for each case h classifies otherwise.
func wantClassified(t *testing.T, h *Handler, cases []classified) {
	t.Helper()
	for _, c := range cases {
		if op, bound := h.classifyRequest(c.method, c.path); op != c.op || bound != c.bound {
			t.Errorf("%s %s = %q bound to %q, want %q bound to %q", c.method, c.path, op, bound, c.op, c.bound)
		}
	}
}

// A path is below base_path only at a segment boundary, as a prefix a
// handle_path or path matcher strips ends at one. Before, "/v1/namespaces"
// was below base_path "/v" as "1/namespaces", which is no catalog path:
// the mutation, outside the base and guarded as such once the prefix was
// stripped, passed unguarded without a warning.
func TestBasePathEndsAtASegment(t *testing.T) {
	h := &Handler{BasePath: "/v"}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ path, op, bound string }{
		{"/v1/namespaces", "createNamespace", "/v1/namespaces"},
		{"/v/v1/namespaces", "createNamespace", "/v/v1/namespaces"},
		{"/V%2Fv1/namespaces", "createNamespace", "/v/v1/namespaces"},
	} {
		if op, bound := h.classifyRequest("POST", c.path); op != c.op || bound != c.bound {
			t.Errorf("POST %s below base_path /v = %q bound to %q, want %q bound to %q", c.path, op, bound, c.op, c.bound)
		}
	}
	h = &Handler{BasePath: "/api"}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	if _, ok := h.belowBase("/apix/v1/namespaces"); ok {
		t.Error("/apix/v1/namespaces is taken as below base_path /api")
	}
}

// A base path written with characters a request carries escaped (a raw
// "é", a space, brackets) is compared decoded, so the requests below it
// are guarded: base_path refused them for a build (59cf7a3), although they
// worked.
func TestBasePathWithRawCharacters(t *testing.T) {
	for _, c := range []struct{ base, path string }{
		{"/caf\u00e9", "/caf%C3%A9/v1/namespaces"},
		{"/caf\u00e9", "/caf\u00e9/v1/namespaces"},
		{"/my catalog", "/my%20catalog/v1/namespaces"},
		{"/a[b]", "/a[b]/v1/namespaces"},
		{"/a|b", "/a%7Cb/v1/namespaces"},
	} {
		h := &Handler{BasePath: c.base}
		if err := h.Validate(); err != nil {
			t.Errorf("base_path %q: %v", c.base, err)
			continue
		}
		if err := h.prepare(); err != nil {
			t.Fatal(err)
		}
		if op, _ := h.classifyRequest("POST", c.path); op != "createNamespace" {
			t.Errorf("POST %s below base_path %q = %q, want createNamespace", c.path, c.base, op)
		}
	}
}

// require_key applies to every spelling of a mutation's path.
func TestRequireKeyOnEscapedPath(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	h.RequireKey = true
	called := false
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { called = true; return nil })
	res := serve(t, h, next, "POST", "/v1/wh/%6Eamespaces", "", `{"namespace":["a"]}`)
	if res.code() != http.StatusBadRequest || called {
		t.Fatalf("unkeyed POST /v1/wh/%%6Eamespaces = %d (catalog called: %v), want 400", res.code(), called)
	}
}

// FuzzClassify: the classifier never panics, and two spellings of a path
// that the catalog reads as one (escaped unreserved characters, doubled and
// trailing slashes) classify the same.
func FuzzClassify(f *testing.F) {
	for _, seed := range []string{
		"/v1/namespaces", "/v1/wh/namespaces/ns/tables/t", "/v1/wh/%6Eamespaces", "/v1//namespaces/",
		"/v1/wh/namespaces/a%1Fb/tables/t/plan/p1", "/v1/transactions/commit", "/v1/%2e%2e/x", "%", "/v1/a%zz",
		"/v1/wh/namespaces/ns/tables/t/plan/p", "/v1/wh/namespaces/ns/tables/t/plan/p/x", "/v1/namespaces/ns/tables/t/plan/p",
		"/v1/0/0/namespaces/0", "/v1/a/b/c/d/e/f/g/h/i/j/namespaces/ns/tables/t/plan/p", "/v1/a/b/c/d/e/f/g/h/i/j/k/namespaces",
		"/api/catalog/%2E%2E/v1/wh/namespaces", "/api/catalog/x%2F..%2F..%2Fv1/wh/namespaces", "/v1/wh%2Fnamespaces/;x",
	} {
		f.Add("POST", seed)
		f.Add("DELETE", seed)
	}
	h := &Handler{BasePath: "/api/catalog"}
	if err := h.prepare(); err != nil {
		f.Fatal(err)
	}
	plain := &Handler{}
	if err := plain.prepare(); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, method, path string) {
		norm := normalizePath(path)
		if path != "" && alreadyNormal(path) && rebuildPath(path) != path {
			t.Fatalf("%q is taken as already normal but normalizes to %q", path, rebuildPath(path))
		}
		op, _ := plain.classifyPath(method, norm)
		_, _ = h.classifyPath(method, norm)
		// Every reading binds the key to a path that is the mutation it
		// was read as, below the base or outside it.
		for _, hh := range []*Handler{h, plain} {
			if op, bound := hh.classifyRequest(method, path); op != "" {
				if got := classify(method, strings.TrimPrefix(bound, hh.basePath)); got != op {
					t.Fatalf("%s %q is guarded as %s bound to %q, which is %q", method, path, op, bound, got)
				}
			}
		}
		if len(norm) >= 4 && strings.EqualFold(norm[:4], "/v1/") {
			rel := norm[4:]
			if want := classifyByList(method, rel); op != want {
				t.Fatalf("%s %q classifies as %q, but as %q by the whole list", method, norm, op, want)
			}
		}
		if normalizePath(norm) != norm {
			t.Fatalf("normalizePath is not idempotent: %q → %q → %q", path, norm, normalizePath(norm))
		}
		// Another spelling of the same path: escape every unreserved
		// character of it, double its slashes, add a trailing slash.
		var b strings.Builder
		for i := 0; i < len(norm); i++ {
			c := norm[i]
			switch {
			case c == '/':
				b.WriteString("//")
			case isUnreserved(c) && c != '.':
				b.WriteString("%" + strings.ToLower(string(upperHex[c>>4])+string(upperHex[c&15])))
			default:
				b.WriteByte(c)
			}
		}
		other := b.String() + "/"
		if got, _ := plain.classifyPath(method, normalizePath(other)); got != op {
			t.Fatalf("%q classifies as %q but its spelling %q as %q", path, op, other, got)
		}
	})
}

// classifyByList is classify without byShape: each template of mutations
// tried in turn against the path's segments, after the {prefix}-less
// reading. FuzzClassify holds classify to it.
func classifyByList(method, rest string) string {
	segs := strings.Split(rest, "/")
	try := func(segs []string) string {
		for _, op := range mutations {
			if !strings.EqualFold(op.method, method) || len(op.template) != len(segs) {
				continue
			}
			ok := true
			for i, t := range op.template {
				if segs[i] == "" || (t != "*" && !strings.EqualFold(t, segs[i]) && !javaFoldEqual(t, segs[i])) {
					ok = false
				}
			}
			if ok {
				return op.id
			}
		}
		return ""
	}
	// The {prefix} is optional and may span up to maxPrefixSegments
	// segments, none empty; the shortest that leaves a commit wins, else
	// the shortest that leaves a template.
	first := ""
	for k := 0; k <= maxPrefixSegments && k < len(segs); k++ {
		if k > 0 && segs[k-1] == "" {
			break
		}
		id := try(segs[k:])
		if isCommit(id) {
			return id
		}
		if first == "" {
			first = id
		}
	}
	return first
}

// A catalog mounted under a prefix the handler sees, without base_path:
// its keyed mutations and its config pass unguarded, which the handler
// cannot fix but says once, naming base_path. Before, nothing was logged,
// and every commit behind it ran unguarded.
func TestUnrecognisedPrefixIsWarnedOf(t *testing.T) {
	// Each says what it means for its request: until the build after
	// 797bdb9 both said "passes unguarded (no lifetime advertised for a
	// config)", which fits neither a mutation nor a read.
	for _, tt := range []struct{ method, path, key, says string }{
		{"POST", "/api/catalog/v1/namespaces", storetest.NewKey(t), "a keyed mutation passes unguarded below a prefix"},
		{"GET", "/api/catalog/v1/config", "", "a config request gets the catalog's answer, no idempotency-key-lifetime added, below a prefix"},
	} {
		h := newTestHandler(t, newMemoryStore(t))
		core, logs := observer.New(zapcore.WarnLevel)
		h.logger = zap.New(core)
		up := answering(http.StatusOK, `{}`)
		body := ""
		if tt.method == "POST" {
			body = nsBody
		}
		for range 2 {
			if res := serve(t, h, up, tt.method, tt.path, tt.key, body); res.code() != http.StatusOK || res.header.Get(ReplayedHeader) != "" {
				t.Fatalf("%s %s = %d (replayed %q), want it passed through", tt.method, tt.path, res.code(), res.header.Get(ReplayedHeader))
			}
		}
		if warned := logs.FilterMessageSnippet("set base_path"); warned.Len() != 1 || warned.All()[0].ContextMap()["path"] != tt.path ||
			!strings.HasPrefix(warned.All()[0].Message, tt.says) {
			t.Fatalf("%s %s: log = %v; want one warning naming the path and base_path", tt.method, tt.path, logs.All())
		}
	}
	// No sign of anything: a mutation without a key, under any prefix, and
	// a keyed request the handler passes by design (reportMetrics), below
	// a base_path set right.
	h := &Handler{store: newMemoryStore(t), BasePath: "/api/catalog"}
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	serve(t, h, answering(http.StatusOK, `{}`), "POST", "/other/v1/namespaces", "", nsBody)
	serve(t, h, answering(http.StatusNoContent, ``), "POST", "/api/catalog/v1/wh/namespaces/ns/tables/t/metrics", storetest.NewKey(t), `{}`)
	if logs.Len() != 0 {
		t.Fatalf("log = %v, want nothing", logs.All())
	}
}

// Javalin, on which Apache Amoro's Iceberg REST catalog runs, routes the
// method upper-cased (HandlerType.findByName) and takes an
// X-HTTP-Method-Override header before the request line's method
// (JavalinServletContext), and Caddy forwards both as sent. Before, "post
// …/tables/t", or "GET …/tables/t" with "X-HTTP-Method-Override: POST",
// passed unguarded, and a keyed retry committed again.
func TestMethodSpellingsAndOverride(t *testing.T) {
	h := &Handler{}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	const table = "/api/iceberg/rest/v1/catalogs/c/namespaces/ns/tables/t"
	wantClassified(t, h, []classified{
		{"post", "/v1/catalogs/c/namespaces/ns/tables/t", "updateTable", "/v1/catalogs/c/namespaces/ns/tables/t"},
		{"Post", "/v1/catalogs/c/namespaces", "createNamespace", "/v1/catalogs/c/namespaces"},
		{"delete", "/v1/catalogs/c/namespaces/ns", "dropNamespace", "/v1/catalogs/c/namespaces/ns"},
	})
	for _, c := range []struct{ method, override, path, op string }{
		{"GET", "POST", "/v1/catalogs/c/namespaces/ns/tables/t", "updateTable"},
		{"PUT", "post", "/v1/catalogs/c/namespaces", "createNamespace"},
		{"PATCH", "DELETE", "/v1/catalogs/c/namespaces/ns", "dropNamespace"},
		{"POST", "DELETE", "/v1/catalogs/c/namespaces/ns", "dropNamespace"},
		// read as sent, a commit; as overridden, a drop: the commit wins
		{"POST", "DELETE", "/v1/catalogs/c/namespaces/ns/tables/t", "updateTable"},
		{"GET", "GET", "/v1/catalogs/c/namespaces/ns/tables/t", ""},
		// read as sent, scan planning; as overridden, a drop under the
		// prefix "namespaces/A/tables": the drop wins, since scan
		// planning is taken for rerunnable (until the build after
		// a95b973 its lost answer released the key, and the retry
		// dropped again)
		{"POST", "DELETE", "/v1/namespaces/A/tables/namespaces/plan", "dropNamespace"},
		{"POST", "DELETE", "/v1/namespaces/commit/tables/tables%2Fplan/tasks", "cancelPlanning"},
		{"POST", "", "/v1/namespaces/A/tables/namespaces/plan", "planTableScan"},
		{"GET", "", "/v1/catalogs/c/namespaces/ns/tables/t", ""},
	} {
		r := httptest.NewRequest(c.method, c.path, nil)
		if c.override != "" {
			r.Header.Set("X-HTTP-Method-Override", c.override)
		}
		if op, _ := h.classifyHTTP(r, r.URL.EscapedPath()); op != c.op {
			t.Errorf("%s %s with X-HTTP-Method-Override %q = %q, want %q", c.method, c.path, c.override, op, c.op)
		}
	}
	// End to end: the retry is answered from the record, not executed.
	for _, c := range []struct{ method, override string }{{"post", ""}, {"GET", "POST"}} {
		h := &Handler{store: newMemoryStore(t), logger: zap.NewNop(), BasePath: "/api/iceberg/rest"}
		if err := h.prepare(); err != nil {
			t.Fatal(err)
		}
		up := answering(http.StatusOK, `{}`)
		key := storetest.NewKey(t)
		for range 2 {
			serve(t, h, up, c.method, table, key, commitBody, "X-HTTP-Method-Override", c.override)
		}
		if n := up.calls.Load(); n != 1 {
			t.Errorf("%s %s (override %q) retried with its key: catalog called %d times, want 1", c.method, table, c.override, n)
		}
	}
}

// An X-HTTP-Method-Override with spaces or tabs around its method names
// that method: Go's HTTP/2 server leaves them on the value, Caddy forwards
// it to the catalog over HTTP/1.1, and an HTTP/1 parser takes them off (RFC
// 9110, 5.5; Go's does). Before, "GET …/tables/t" with the override " POST"
// over HTTP/2 passed unguarded, was a commit to a catalog that routes by
// the override as Javalin does, and each keyed retry committed again (4
// executions for 2 keys, against a built Caddy over h2c and a stand-in
// catalog on Go's server); over HTTP/1 it was guarded.
func TestOverrideWithWhitespaceIsGuarded(t *testing.T) {
	h := &Handler{store: newMemoryStore(t), logger: zap.NewNop()}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	for _, override := range []string{" POST", "POST ", "\tpost\t"} {
		r := httptest.NewRequest("GET", commitPath, nil)
		r.Header.Set("X-HTTP-Method-Override", override)
		if op, _ := h.classifyHTTP(r, r.URL.EscapedPath()); op != "updateTable" {
			t.Errorf("GET %s with X-HTTP-Method-Override %q = %q, want updateTable", commitPath, override, op)
		}
		up := answering(http.StatusOK, `{}`)
		key := storetest.NewKey(t)
		for range 2 {
			serve(t, h, up, "GET", commitPath, key, "", "X-HTTP-Method-Override", override)
		}
		if n := up.calls.Load(); n != 1 {
			t.Errorf("GET %s (override %q) retried with its key: catalog called %d times, want 1", commitPath, override, n)
		}
	}
}

// Hive's HMS REST catalog reads the path decoded (getPathInfo) and
// compares the templates' words with String.equalsIgnoreCase, which takes
// long s for "s", the Kelvin sign for "k", and dotted and dotless I for
// "i"; Caddy forwards such a character percent-encoded, as Go's URL
// escapes it. Before, these passed unguarded, and a keyed retry executed
// again.
func TestClassifyJavaCaseFolds(t *testing.T) {
	h := &Handler{}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	wantClassified(t, h, []classified{
		{"POST", "/v1/namespaces/ns/table%C5%BF/t", "updateTable", "/v1/namespaces/ns/table%C5%BF/t"},
		{"POST", "/v1/namespaces/ns/table%c5%bf/t", "updateTable", "/v1/namespaces/ns/table%C5%BF/t"},
		{"POST", "/v1/transaction%C5%BF/comm%C4%B1t", "commitTransaction", "/v1/transaction%C5%BF/comm%C4%B1t"},
		{"POST", "/v1/transactions/COMM%C4%B0T", "commitTransaction", "/v1/transactions/COMM%C4%B0T"},
		{"POST", "/v1/namespaces/ns/tables/t/ta%C5%BF%E2%84%AAs", "fetchScanTasks", "/v1/namespaces/ns/tables/t/ta%C5%BF%E2%84%AAs"},
		{"DELETE", "/v1/name%C5%BFpaces/ns", "dropNamespace", "/v1/name%C5%BFpaces/ns"},
		{"POST", "/v1/namespaces/ns/v%C4%B1ews/v", "replaceView", "/v1/namespaces/ns/v%C4%B1ews/v"},
		// raw, as a caller other than Go's server may hand it over
		{"POST", "/v1/namespaces/ns/table\u017f/t", "updateTable", "/v1/namespaces/ns/table\u017f/t"},
		// not a fold: another character, a letter the character does not
		// fold to, a surrogate pair, an escape cut short
		{"POST", "/v1/namespaces/ns/table%C3%9F/t", "", ""},
		{"POST", "/v1/namespaces/ns/tab%C4%B1es/t", "", ""},
		{"POST", "/v1/namespaces/ns/table%F0%9D%90%AC/t", "", ""},
		{"POST", "/v1/namespaces/ns/table%C5/t", "", ""},
		{"POST", "/v1/namespaces/ns/tables%C5%BF/t", "", ""},
	})
}

// javaFolds holds every char that String.equalsIgnoreCase takes for an
// ASCII letter: Character's simple case mappings, which Go's unicode
// package shares.
func TestJavaFoldsAreAll(t *testing.T) {
	want := map[rune]byte{}
	for _, f := range javaFolds {
		r, _ := utf8.DecodeRuneInString(f.utf8)
		want[r] = f.letter
	}
	for a := rune('a'); a <= 'z'; a++ {
		for r := rune(0x80); r <= 0xFFFF; r++ {
			u1, u2 := unicode.ToUpper(r), unicode.ToUpper(a)
			if u1 != u2 && unicode.ToLower(u1) != unicode.ToLower(u2) {
				continue
			}
			if want[r] != byte(a) {
				t.Errorf("equalsIgnoreCase takes U+%04X for %q, javaFolds does not", r, a)
			}
			delete(want, r)
		}
	}
	for r := range want {
		t.Errorf("javaFolds has U+%04X, which equalsIgnoreCase takes for no letter", r)
	}
}

// readingOrders holds each order of the reading steps once, and as many
// as numReadingOrders says.
func TestReadingOrders(t *testing.T) {
	seen := map[string]bool{}
	for _, o := range readingOrders {
		k := fmt.Sprint(o)
		if seen[k] {
			t.Errorf("order %v twice", o)
		}
		seen[k] = true
	}
	if len(readingOrders) != numReadingOrders {
		t.Errorf("%d reading orders, numReadingOrders says %d", len(readingOrders), numReadingOrders)
	}
}

// Readings of a path the handler missed until the build after 051e419,
// each a mutation (or a commit) to a real router: parameters cut with dot
// segments kept (Spring MVC's UrlPathHelper and PathContainer, Jersey),
// parameters cut before "%2F" is decoded (Spring MVC, Jetty), dots
// resolved with empty segments kept (Vert.x's normalizePath, which Quarkus
// routes Polaris and Nessie by; Jetty's canonicalPath). Before, the first
// two were guarded as a create or a scan, whose 502 released the key, and
// the last two passed unguarded: a keyed retry executed again.
func TestClassifyMoreReadings(t *testing.T) {
	h := &Handler{}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	wantClassified(t, h, []classified{
		{"POST", "/v1;x=1/namespaces/%2E/tables/tables", "updateTable", "/v1/namespaces/./tables/tables"},
		{"POST", "/v1/wh%2Fnamespaces/t/tables;x%2Fa/plan", "updateTable", "/v1/wh/namespaces/t/tables/plan"},
		{"POST", "/v1/wh/namespaces/ns/tables//../t", "updateTable", "/v1/wh/namespaces/ns/tables/t"},
		{"DELETE", "/v1/wh/namespaces//../ns", "dropNamespace", "/v1/wh/namespaces/ns"},
	})
}

// Spring MVC before 5.3, outside Spring Boot, matches "/namespaces" to
// "/namespaces.json" too (useSuffixPatternMatch). Before, these passed
// unguarded, and a keyed retry executed again.
func TestClassifySuffixPattern(t *testing.T) {
	h := &Handler{}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	wantClassified(t, h, []classified{
		{"POST", "/v1/wh/namespaces.json", "createNamespace", "/v1/wh/namespaces"},
		{"POST", "/v1/transactions/commit.", "commitTransaction", "/v1/transactions/commit"},
		{"POST", "/v1/wh/namespaces/ns/tables/t/plan.x.y", "planTableScan", "/v1/wh/namespaces/ns/tables/t/plan"},
		{"POST", "/v1/wh/namespaces/ns/tables/t.json", "updateTable", "/v1/wh/namespaces/ns/tables/t.json"},
		{"POST", "/v1;x/wh/namespaces/ns/views%2Ex", "createView", "/v1/wh/namespaces/ns/views"},
		{"POST", "/v1/wh/namespaces/ns/tables/.json", "updateTable", "/v1/wh/namespaces/ns/tables/.json"},
		{"POST", "/v1/wh/namespaces/ns/.json", "", ""},
	})
}
