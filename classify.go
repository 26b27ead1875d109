package icebergidempotency

import (
	"net/http"
	"slices"
	"strings"
	"sync/atomic"

	"go.uber.org/zap"
)

// warnKeyBelowPrefix says, once, that a keyed request the handler passes
// would be a guarded mutation below some prefix of its path: most often
// the catalog is mounted under a prefix the handler sees, and base_path is
// not set (the directive at the site level with handle_path, or in a
// handle block that keeps the prefix), so every mutation passes unguarded.
// Another catalog under another prefix, guarded by a handler of its own,
// looks the same: hence "may".
func (h *Handler) warnKeyBelowPrefix(r *http.Request) {
	path := normalizePath(r.URL.EscapedPath())
	for i := 1; i < len(path); i++ {
		j := strings.Index(path[i:], "/v1/")
		if j < 0 {
			return
		}
		i += j
		if classify(r.Method, path[i:]) != "" {
			h.warnBelowPrefix(&h.keyBelowPrefixWarned, r, "a keyed mutation passes unguarded")
			return
		}
	}
}

// warnBelowPrefix logs, once per flag, that a request below a prefix the
// handler does not know passes unguarded.
func (h *Handler) warnBelowPrefix(flag *int32, r *http.Request, what string) {
	if atomic.CompareAndSwapInt32(flag, 0, 1) {
		h.logger.Warn(what+" below a prefix iceberg_idempotency does not know: "+
			"if the catalog is mounted under that prefix here, set base_path to it",
			zap.String("method", r.Method), zap.String("path", r.URL.EscapedPath()), zap.String("base_path", h.BasePath))
	}
}

// classifyHTTP is ServeHTTP's classification of r, whose escaped path is
// escaped: the mutation it is guarded as ("" to pass it through) and the
// path its key is bound to. The method is read as sent and as its
// X-HTTP-Method-Override header names it, a commit reading first (see
// readingPick).
func (h *Handler) classifyHTTP(r *http.Request, escaped string) (op, bound string) {
	var pick readingPick
	for _, method := range [...]string{r.Method, methodOverride(r)} {
		if mutationMethod(method) && pick.offer(h.classifyRequest(method, escaped)) {
			break
		}
	}
	return pick.op, pick.bound
}

// methodOverrideHeader names the method a catalog on Javalin (Apache
// Amoro's Iceberg REST catalog) executes a request as, whatever its
// method: JavalinServletContext reads it before the request line's, so
// "GET …/tables/t" with "X-HTTP-Method-Override: POST" is a commit there.
// Until the build after 051e419 such a request passed unguarded, and a
// keyed retry executed again.
const methodOverrideHeader = "X-Http-Method-Override"

// methodOverride is r's X-HTTP-Method-Override, "" without one, without
// the spaces and tabs around it (fieldValue): Go's HTTP/2 server leaves
// them on, Caddy forwards the header to the catalog over HTTP/1.1, and the
// catalog's HTTP/1 parser takes them off. Read as sent, "GET …/tables/t"
// with " POST" over HTTP/2 passed unguarded, and was a commit to a catalog
// that routes by the override as Javalin does.
func methodOverride(r *http.Request) string {
	if v := r.Header[methodOverrideHeader]; len(v) > 0 {
		return fieldValue(v[0])
	}
	return ""
}

// boundMethod is the method a key is bound to: the request line's, and
// the override a catalog may execute instead, so that a retry that names
// another is told the key was used for a different request.
func boundMethod(r *http.Request) string {
	if o := methodOverride(r); o != "" {
		return r.Method + " " + o
	}
	return r.Method
}

// classifyRequest is classifyPath of the readings a catalog may give a
// path: normalized; as sent (dot segments and path parameters kept, as axum
// does, or a servlet that reads getRequestURI: "DELETE /v1/namespaces/;x"
// is dropNamespace of ";x", "POST …/tables/%2E%2E" updateTable); with "%2F"
// decoded before routing (as Starlette does: "POST /v1/wh%2Fnamespaces" is
// createNamespace); and both ("DELETE /v1/wh%2Fnamespaces/;x"). With
// base_path, the same readings of what "uri strip_prefix" of the base, in a
// route or handle after this handler, leaves of the path come last: Caddy
// cuts the prefix before it decodes and cleans the rest, so
// "/api/catalog/%2E%2E/v1/…", which the handler reads as "/api/v1/…"
// (outside the base, no catalog path), reaches the catalog as "/v1/…".
//
// The first reading that is a commit wins, else the first that is a
// mutation other than scan planning, else the first scan planning (see
// isCommit, readingPick). Guarding a reading the catalog does not use
// costs at most a stored 4xx, or a key left unknown.
func (h *Handler) classifyRequest(method, escaped string) (op, bound string) {
	var pick readingPick
	normal := normalizePath(escaped)
	if pick.offer(h.classifyPath(method, normal)) || pick.otherReadings(method, escaped, normal, h.classifyPath) {
		return pick.op, pick.bound
	}
	// Without an escape or a path parameter, the rest strip_prefix leaves
	// is the normalized path's below the base, read already (Caddy cleans
	// the path before it cuts the prefix), unless the base ends inside a
	// segment: strip_prefix cuts "/api/catalogv1/…" to "/v1/…" all the
	// same, where belowBase sees no base.
	if h.basePath == "" || !strings.ContainsAny(escaped, "%;") && !h.continuesPastBase(normal) {
		return pick.op, pick.bound
	}
	if rest, ok := strippedPath(escaped, h.basePath); ok {
		stripped := func(method, rel string) (string, string) {
			if op := classify(method, rel); op != "" {
				return op, h.basePath + rel
			}
			return "", ""
		}
		normal = normalizePath(rest)
		_ = pick.offer(stripped(method, normal)) || pick.otherReadings(method, rest, normal, stripped)
	}
	return pick.op, pick.bound
}

// readingPick keeps, of the readings offered, the first commit; until one
// comes, the first mutation other than scan planning; until then, the
// first scan planning.
type readingPick struct{ op, bound string }

// offer takes a reading's classification and reports whether it is a
// commit: the pick is then final.
//
// Scan planning ranks last because a guard takes it for rerunnable: its
// unknown outcome releases the key, and its abandoned key is taken over.
// Read as scan planning first, "POST …/namespaces/A/tables/namespaces/plan"
// with "X-HTTP-Method-Override: DELETE", which a catalog routing by the
// override under the prefix "namespaces/A/tables" executes as dropNamespace
// of "plan", was executed again by the retry of its lost answer until the
// build after a95b973.
func (p *readingPick) offer(op, bound string) bool {
	switch {
	case isCommit(op):
		p.op, p.bound = op, bound
		return true
	case op == "":
	case p.op == "", rerunnable(p.op) && !rerunnable(op):
		p.op, p.bound = op, bound
	}
	return false
}

// otherReadings offers classifyPath (or another classifier) of the readings
// of escaped besides its normalized form, normal: each order in which a
// catalog's server may cut path parameters, decode "%2F" and resolve dot
// segments (readingOrders), and reports whether one was a commit. Until the
// build after 051e419 only four were read (normalized; as sent; "%2F"
// decoded, normalized or as sent), and three others let a mutation through
// unguarded, or guarded as another whose 502 released the key:
//   - parameters cut, dots kept, as Spring MVC (UrlPathHelper, PathContainer)
//     and Jersey read a path: "POST /v1;x=1/namespaces/%2E/tables/tables"
//     is a commit of table "tables" in namespace ".", not createTable;
//   - parameters cut before "%2F" is decoded, as Spring MVC and Jetty do:
//     "POST /v1/wh/namespaces/t/tables;x%2Fa/plan" is a commit of table
//     "plan", not planTableScan of table "a";
//   - dots resolved with empty segments kept (RFC 3986 section 5.2.4), as
//     Vert.x's normalizePath (Quarkus: Polaris, Nessie) and Jetty's
//     canonicalPath do: "POST /v1/wh/namespaces/ns/tables//../t" is a
//     commit of table "t" there, and was no mutation here.
func (p *readingPick) otherReadings(method, escaped, normal string, classifyPath func(method, path string) (string, string)) bool {
	if p.offerSuffix(method, normal, classifyPath) {
		return true
	}
	if escaped != "" && alreadyNormal(escaped) {
		return false // every reading is the normalized one
	}
	params := strings.IndexByte(escaped, ';') >= 0
	slashes := strings.Contains(escaped, "%2F") || strings.Contains(escaped, "%2f")
	segs, scratch := readingSegments(escaped)
	var seen [numReadingOrders]string
	n := 0
	for _, steps := range readingOrders {
		if !params && slices.Contains(steps, cutParams) || !slashes && slices.Contains(steps, decodeSlash) {
			continue
		}
		path := readingOf(segs, steps, scratch)
		if path == normal || slices.Contains(seen[:n], path) {
			continue
		}
		seen[n] = path
		n++
		if p.offer(classifyPath(method, path)) || p.offerSuffix(method, path, classifyPath) {
			return true
		}
	}
	return false
}

// offerSuffix offers path read as Spring MVC before 5.3 reads it outside
// Spring Boot (useSuffixPatternMatch, on by default there): the last
// segment's "extension" ignored, so that "POST /v1/wh/namespaces.json" is
// createNamespace and "POST /v1/transactions/commit.x" a commit. Until
// the build after 051e419 these passed unguarded. It reports whether the
// reading was a commit.
func (p *readingPick) offerSuffix(method, path string, classifyPath func(method, path string) (string, string)) bool {
	last := strings.LastIndexByte(path, '/') + 1
	if dot := strings.IndexByte(path[last:], '.'); dot > 0 {
		return p.offer(classifyPath(method, path[:last+dot]))
	}
	return false
}

// isConfigRequest reports whether r's normalized path is GET /v1/config's.
// A path whose decoded form lacks "config" cannot normalize to it (its
// segments only lose escapes of unreserved characters, or go away), which
// spares every other read the normalization.
func (h *Handler) isConfigRequest(r *http.Request) bool {
	if !strings.Contains(r.URL.Path, "config") {
		return false
	}
	path := normalizePath(r.URL.EscapedPath())
	rel, ok := h.belowBase(path)
	if !ok && path == "/v1/config" {
		h.warnOutsideBase(path)
		return true
	}
	if ok && rel == "/v1/config" {
		return true
	}
	if strings.HasSuffix(path, "/v1/config") && atomic.LoadInt32(&h.configBelowPrefixWarned) == 0 {
		h.warnBelowPrefix(&h.configBelowPrefixWarned, r, "a config request gets the catalog's answer, no idempotency-key-lifetime added,")
	}
	return false
}

// classifyPath returns the mutation's operationId, or "" for requests that
// pass straight through (outside the base path, reads, unknown paths), and
// the path its key is bound to: the configured spelling of the base path,
// whichever the client used, then the normalized path below it.
//
// A catalog path outside base_path is classified too: with the directive
// inside handle_path, which strips the prefix first, base_path makes every
// request look outside it, and the catalog would be left unguarded.
func (h *Handler) classifyPath(method, path string) (op, bound string) {
	rel, ok := h.belowBase(path)
	if !ok {
		if op = classify(method, path); op != "" {
			h.warnOutsideBase(path)
			return op, path
		}
		return "", ""
	}
	if op = classify(method, rel); op == "" {
		return "", ""
	}
	return op, h.basePath + rel
}

// warnOutsideBase says, once, that catalog requests arrive without
// base_path's prefix, and are guarded (or advertised to) all the same.
func (h *Handler) warnOutsideBase(path string) {
	if atomic.CompareAndSwapInt32(&h.outsideBaseWarned, 0, 1) {
		h.logger.Warn("a catalog request arrived outside base_path: guarded all the same. Inside handle_path (or after uri strip_prefix), "+
			"which strips the prefix before this handler, leave base_path out",
			zap.String("base_path", h.BasePath), zap.String("path", path))
	}
}

// continuesPastBase reports whether the normalized path starts with
// base_path, as belowBase matches it, and goes on inside the base's last
// segment ("/api/catalogv1/…", "/api/catalog./v1/…"). uri strip_prefix
// cuts such a prefix and anchors what is left: "/v1/…".
func (h *Handler) continuesPastBase(path string) bool {
	rest, ok := cutPrefixFold(path, h.basePath)
	return ok && rest != "" && rest[0] != '/' && !strings.HasPrefix(rest, "%2F")
}

// belowBase returns the part of the normalized path below base_path, which
// it must start with as Caddy's path matcher (handle_path, uri
// strip_prefix) reads a prefix: case-insensitively and with escapes
// decoded, so that "/API/Catalog/v1/…" and "/api%2Fcatalog/v1/…" are below
// "/api/catalog" too. A stricter reading would let those spellings reach
// the catalog, prefix stripped, unguarded; a looser one costs at most a
// stored 4xx from a catalog that routes them nowhere.
//
// The base ends at a segment boundary, as handle_path's matched prefix
// does: "/v1/…" is not below "/v" (as "1/…", no catalog path, it went
// unguarded), it is outside it. uri strip_prefix, which cuts inside a
// segment too, is classifyRequest's concern.
func (h *Handler) belowBase(path string) (string, bool) {
	rel, ok := cutPrefixFold(path, h.basePath)
	if !ok {
		return "", false
	}
	if strings.HasPrefix(rel, "%2F") {
		rel = "/" + rel[3:] // the base's own separator, escaped
	}
	if rel != "" && rel[0] != '/' {
		return "", false
	}
	return rel, true
}
