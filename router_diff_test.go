package icebergidempotency

// A differential audit of the classifier against models of the routers
// Iceberg REST catalogs run on. Each model reads a request (method,
// X-HTTP-Method-Override, escaped path as reverse_proxy sends it on) the
// way its framework routes it, and returns every mutation it may execute
// the request as (a union over the settings the model is unsure of). The
// handler must guard each of them, and guard as a commit any request that
// some reading makes a commit.

import (
	"fmt"
	"math/rand"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// routeTable is the spec's mutation routes after "/v1/{prefix}/",
// written out here rather than taken from mutations.
var routeTable = []struct{ method, tmpl, op string }{
	{"POST", "namespaces", "createNamespace"},
	{"DELETE", "namespaces/{}", "dropNamespace"},
	{"POST", "namespaces/{}/properties", "updateProperties"},
	{"POST", "namespaces/{}/tables", "createTable"},
	{"POST", "namespaces/{}/tables/{}/plan", "planTableScan"},
	{"DELETE", "namespaces/{}/tables/{}/plan/{}", "cancelPlanning"},
	{"POST", "namespaces/{}/tables/{}/tasks", "fetchScanTasks"},
	{"POST", "namespaces/{}/register", "registerTable"},
	{"POST", "namespaces/{}/tables/{}", "updateTable"},
	{"DELETE", "namespaces/{}/tables/{}", "dropTable"},
	{"POST", "namespaces/{}/tables/{}/unregister", "unregisterTable"},
	{"POST", "tables/rename", "renameTable"},
	{"POST", "transactions/commit", "commitTransaction"},
	{"POST", "namespaces/{}/views", "createView"},
	{"POST", "namespaces/{}/views/{}", "replaceView"},
	{"DELETE", "namespaces/{}/views/{}", "dropView"},
	{"POST", "views/rename", "renameView"},
	{"POST", "namespaces/{}/register-view", "registerView"},
}

// routerModel is one framework's reading of a request.
type routerModel struct {
	name, source string
	// method returns the method the router dispatches on, "" if none.
	method func(method, override string) string
	// readings returns the segment lists the router may match, each in
	// the form its literals are compared with.
	readings func(escaped string) [][]string
	// eq compares a template literal with a segment.
	eq func(lit, seg string) bool
	// prefixes lists how many segments the {prefix} may take.
	prefixes []int
	// suffix: Spring MVC's suffix pattern match ("tables.json").
	suffix bool
	// optSlash: a trailing empty segment is ignored.
	optSlash bool
}

func exactMethod(method, _ string) string { return method }

func (m routerModel) ops(method, override, escaped string) []string {
	meth := m.method(method, override)
	if meth == "" {
		return nil
	}
	var out []string
	for _, segs := range m.readings(escaped) {
		if m.optSlash && len(segs) > 1 && segs[len(segs)-1] == "" {
			segs = segs[:len(segs)-1]
		}
		if len(segs) == 0 || !m.eq("v1", segs[0]) {
			continue
		}
		for _, p := range m.prefixes {
			rest := segs[1:]
			if len(rest) < p {
				continue
			}
			okPrefix := true
			for _, s := range rest[:p] {
				if s == "" {
					okPrefix = false
				}
			}
			if !okPrefix {
				continue
			}
			rest = rest[p:]
			for _, rt := range routeTable {
				if rt.method != meth {
					continue
				}
				tm := strings.Split(rt.tmpl, "/")
				if len(tm) != len(rest) {
					continue
				}
				ok := true
				for i, t := range tm {
					s := rest[i]
					switch {
					case t == "{}":
						ok = s != ""
					case m.eq(t, s):
					case m.suffix && i == len(tm)-1 && strings.HasPrefix(s, t+"."):
					default:
						ok = false
					}
					if !ok {
						break
					}
				}
				if ok {
					out = append(out, rt.op)
				}
			}
		}
	}
	return out
}

// ---- path helpers of the models ----

func splitKeep(p string) []string {
	p = strings.TrimPrefix(p, "/")
	return strings.Split(p, "/")
}

func splitDrop(p string) []string {
	var out []string
	for _, s := range strings.Split(p, "/") {
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}

// pctDecode decodes every escape; ok false for an invalid escape or
// invalid UTF-8 (Java decoders reject or replace: no route either way).
func pctDecode(s string) (string, bool) {
	d, err := url.PathUnescape(s)
	if err != nil || !utf8.ValidString(d) {
		return "", false
	}
	return d, true
}

// decodeUnreservedOnly is Vert.x's and Armeria's: escapes of unreserved
// characters decoded, others kept.
func decodeUnreservedOnly(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '%' && i+2 < len(s) && unhex(s[i+1]) >= 0 && unhex(s[i+2]) >= 0 {
			c := byte(unhex(s[i+1])<<4 | unhex(s[i+2]))
			if isUnreserved(c) {
				b.WriteByte(c)
				i += 2
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// removeDots is RFC 3986 section 5.2.4 on segments (leading "" kept).
func removeDotsSegs(segs []string) []string {
	var out []string
	for i, s := range segs {
		last := i == len(segs)-1
		switch s {
		case ".":
			if last {
				out = append(out, "")
			}
		case "..":
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
			if last {
				out = append(out, "")
			}
		default:
			out = append(out, s)
		}
	}
	return out
}

func cutParamSegs(segs []string) []string {
	out := make([]string, len(segs))
	for i, s := range segs {
		out[i], _, _ = strings.Cut(s, ";")
	}
	return out
}

func collapse(segs []string) []string {
	var out []string
	for i, s := range segs {
		if s != "" || i == len(segs)-1 {
			out = append(out, s)
		}
	}
	return out
}

func decodeSegs(segs []string) ([]string, bool) {
	out := make([]string, len(segs))
	for i, s := range segs {
		d, ok := pctDecode(s)
		if !ok {
			return nil, false
		}
		out[i] = d
	}
	return out, true
}

// javaEqualsIgnoreCase is String.equalsIgnoreCase: UTF-16 units compared
// equal, or equal upper-cased, or equal lower-cased after upper-casing
// (Character's simple case mappings, which Go's unicode.ToUpper/ToLower
// share).
func javaEqualsIgnoreCase(a, b string) bool {
	ua, ub := utf16Units(a), utf16Units(b)
	if len(ua) != len(ub) {
		return false
	}
	for i := range ua {
		c1, c2 := ua[i], ub[i]
		if c1 == c2 {
			continue
		}
		if c1 >= 0xD800 && c1 < 0xE000 || c2 >= 0xD800 && c2 < 0xE000 {
			return false
		}
		u1, u2 := unicode.ToUpper(c1), unicode.ToUpper(c2)
		if u1 == u2 || unicode.ToLower(u1) == unicode.ToLower(u2) {
			continue
		}
		return false
	}
	return true
}

func utf16Units(s string) []rune {
	var out []rune
	for _, r := range s {
		if r >= 0x10000 {
			out = append(out, 0xD800, 0xDC00) // a surrogate pair: two units
			continue
		}
		out = append(out, r)
	}
	return out
}

func exactEq(a, b string) bool { return a == b }

// ---- the models ----

var routerModels = []routerModel{
	{
		name:   "spring5-ant",
		source: "spring-framework 5.x UrlPathHelper.getLookupPathForRequest (removeSemicolonContent, decode, getSanitizedPath), AntPathMatcher (ignoreEmptyTokens, trimTokens=false, useTrailingSlashMatch)",
		method: exactMethod,
		readings: func(p string) [][]string {
			var rs [][]string
			raw := strings.Join(cutParamSegs(splitKeep(p)), "/")
			if d, ok := pctDecode(raw); ok {
				segs := splitDrop(d)
				rs = append(rs, segs)
				// the servlet path, as the container normalizes it
				rs = append(rs, splitDrop(strings.Join(removeDotsSegs(append([]string{""}, segs...)), "/")))
			}
			return rs
		},
		eq:       exactEq,
		prefixes: []int{0, 1, 2},
	},
	{
		name:     "spring5-ant+suffix",
		source:   "as spring5-ant, with useSuffixPatternMatch (the default before 5.3 outside Spring Boot)",
		method:   exactMethod,
		eq:       exactEq,
		prefixes: []int{0, 1, 2},
		suffix:   true,
	},
	{
		name:   "spring6-pathpattern",
		source: "spring-framework 6 PathPatternParser, PathContainer (segments split on raw '/', valueToMatch decoded without ;params), matchOptionalTrailingSeparator=false",
		method: exactMethod,
		readings: func(p string) [][]string {
			if segs, ok := decodeSegs(cutParamSegs(splitKeep(p))); ok {
				return [][]string{segs}
			}
			return nil
		},
		eq:       exactEq,
		prefixes: []int{0, 1, 2},
	},
	{
		name:   "jersey",
		source: "jersey MatchResultInitializerRouter (request.getPath(false): encoded path), PathPattern regexes ([^/]+ variables, (/)? optional trailing slash)",
		method: exactMethod,
		readings: func(p string) [][]string {
			segs := splitKeep(p)
			return [][]string{segs, cutParamSegs(segs)}
		},
		eq:       exactEq,
		prefixes: []int{0, 1, 2},
		optSlash: true,
	},
	{
		name:   "quarkus-resteasy-reactive",
		source: "vert.x HttpUtils.normalizePath (decode unreserved, removeDots, newer versions collapse //), RESTEasy Reactive matrix parameter removal and optional trailing slash; decoded variant as well",
		method: exactMethod,
		readings: func(p string) [][]string {
			norm := removeDotsSegs(append([]string{""}, splitKeep(decodeUnreservedOnly(p))...))[1:]
			var rs [][]string
			for _, segs := range [][]string{norm, collapse(norm)} {
				for _, s2 := range [][]string{segs, cutParamSegs(segs)} {
					rs = append(rs, s2)
					if d, ok := decodeSegs(s2); ok {
						rs = append(rs, d)
					}
				}
			}
			return rs
		},
		eq:       exactEq,
		prefixes: []int{0, 1, 2},
		optSlash: true,
	},
	{
		name:   "armeria",
		source: "armeria RequestTarget (decode unreserved, collapse //, strip ;matrix by default, reject ..), exact routes",
		method: exactMethod,
		readings: func(p string) [][]string {
			segs := splitKeep(decodeUnreservedOnly(p))
			for _, s := range segs {
				if s == "." || s == ".." {
					return nil
				}
			}
			return [][]string{segs, collapse(segs), cutParamSegs(segs), collapse(cutParamSegs(segs))}
		},
		eq:       exactEq,
		prefixes: []int{0, 1, 2},
	},
	{
		name:   "vertx-web",
		source: "vert.x-web RoutingContext.normalizedPath (HttpUtils.normalizePath), exact path routes with optional trailing slash",
		method: exactMethod,
		readings: func(p string) [][]string {
			norm := removeDotsSegs(append([]string{""}, splitKeep(decodeUnreservedOnly(p))...))[1:]
			return [][]string{norm, collapse(norm)}
		},
		eq:       exactEq,
		prefixes: []int{0, 1, 2},
		optSlash: true,
	},
	{
		name:   "javalin (Amoro)",
		source: "javalin HandlerType.findByName (method upper-cased), JavalinServletContext.method (X-HTTP-Method-Override first), routing on requestURI with ignoreTrailingSlashes; amoro RestCatalogService",
		method: func(method, override string) string {
			if override != "" {
				method = override
			}
			return strings.ToUpper(method)
		},
		readings: func(p string) [][]string { return [][]string{splitKeep(p)} },
		eq:       exactEq,
		prefixes: []int{0, 1, 2},
		optSlash: true,
	},
	{
		name:   "hive-hms-rest",
		source: "hive HMSCatalogServlet (request.getPathInfo(): ;params cut, decoded, dots resolved by Jetty), HMSCatalogAdapter.Route.matches (Splitter.on('/'), equalsIgnoreCase), HTTPMethod.valueOf",
		method: exactMethod,
		readings: func(p string) [][]string {
			d, ok := pctDecode(strings.Join(cutParamSegs(splitKeep(p)), "/"))
			if !ok {
				return nil
			}
			segs := removeDotsSegs(append([]string{""}, strings.Split(d, "/")...))[1:]
			return [][]string{segs}
		},
		eq:       javaEqualsIgnoreCase,
		prefixes: []int{0},
	},
	{
		name:     "iceberg-fixture (unicode fold)",
		source:   "iceberg RESTCatalogServlet (request.getRequestURI(), raw), RESTCatalogAdapter.Route (equalsIgnoreCase)",
		method:   exactMethod,
		readings: func(p string) [][]string { return [][]string{splitKeep(p)} },
		eq:       javaEqualsIgnoreCase,
		prefixes: []int{0, 1},
	},
}

func init() {
	// spring5-ant+suffix reads as spring5-ant does
	routerModels[1].readings = routerModels[0].readings
}

// ---- generation ----

var (
	genPrefixes = [][]string{nil, {"wh"}, {"catalogs", "c"}}
	genNames    = []string{"ns", "t", "tables", "namespaces", "plan", "a%1Fb", "x.y"}
	// spellings of one letter a decoding, Unicode-folding catalog reads as it
	unicodeFolds = map[byte][]string{
		's': {"%C5%BF"},           // ſ U+017F
		'S': {"%C5%BF"},           //
		'k': {"%E2%84%AA"},        // K U+212A
		'i': {"%C4%B1", "%C4%B0"}, // ı U+0131, İ U+0130
	}
)

func genMethod(rng *rand.Rand, base string) (method, override string) {
	switch rng.Intn(10) {
	case 0:
		return strings.ToLower(base), ""
	case 1:
		return base[:1] + strings.ToLower(base[1:]), ""
	case 2:
		others := []string{"GET", "PUT", "PATCH", "OPTIONS", "HEAD"}
		return others[rng.Intn(len(others))], []string{base, strings.ToLower(base)}[rng.Intn(2)]
	case 3:
		return "POST", []string{"DELETE", "delete"}[rng.Intn(2)]
	}
	return base, ""
}

func spellWord(rng *rand.Rand, w string, literal bool) string {
	var b strings.Builder
	for i := 0; i < len(w); i++ {
		c := w[i]
		switch r := rng.Intn(48); {
		case literal && r < 3 && unicodeFolds[c] != nil:
			f := unicodeFolds[c]
			b.WriteString(f[rng.Intn(len(f))])
		case r < 5 && literal && 'a' <= c && c <= 'z':
			b.WriteByte(c - 32)
		case r < 7 && isUnreserved(c):
			h := fmt.Sprintf("%%%02X", c)
			if rng.Intn(2) == 0 {
				h = strings.ToLower(h)
			}
			b.WriteString(h)
		default:
			b.WriteByte(c)
		}
	}
	s := b.String()
	switch rng.Intn(30) {
	case 0:
		s += ";x=1"
	case 1:
		s += ";"
	case 2:
		s += ".json"
	case 3:
		s += "."
	case 4:
		s += "%20"
	case 5:
		s += "+"
	case 6:
		s += "%00"
	case 7:
		s += "%5C"
	}
	return s
}

func genPath(rng *rand.Rand) (method, override, path string) {
	rt := routeTable[rng.Intn(len(routeTable))]
	segs := []string{spellWord(rng, "v1", true)}
	for _, p := range genPrefixes[rng.Intn(len(genPrefixes))] {
		segs = append(segs, spellWord(rng, p, false))
	}
	for _, t := range strings.Split(rt.tmpl, "/") {
		if t == "{}" {
			segs = append(segs, spellWord(rng, genNames[rng.Intn(len(genNames))], false))
		} else {
			segs = append(segs, spellWord(rng, t, true))
		}
	}
	var b strings.Builder
	for i, s := range segs {
		sep := "/"
		switch r := rng.Intn(48); {
		case i > 0 && r == 0:
			sep = "%2F"
		case i > 0 && r == 1:
			sep = "%2f"
		case r == 2:
			sep = "//"
		case r == 3:
			sep = "/./"
		case r == 4:
			sep = "/x/../"
		case r == 5:
			sep = "/%2E/"
		case r == 6:
			sep = "/x/%2e%2e/"
		case r == 7:
			sep = "//../"
		case r == 8:
			sep = "/x/..;x=1/"
		case r == 9:
			sep = "/..;/"
		case r == 10:
			sep = "/.;x/"
		case i > 0 && r == 11:
			sep = "/..%2F"
		}
		b.WriteString(sep)
		b.WriteString(s)
	}
	if rng.Intn(10) == 0 {
		b.WriteString("/")
	}
	method, override = genMethod(rng, rt.method)
	return method, override, b.String()
}

// forwarded is the escaped path Caddy's reverse_proxy sends on (Go's
// URL.EscapedPath of the parsed request target), and whether Go's server
// accepts the request line at all.
func forwarded(path string) (string, bool) {
	u, err := url.ParseRequestURI(path)
	if err != nil {
		return "", false
	}
	return u.EscapedPath(), true
}

// guardedAs is the handler's decision for a request: what ServeHTTP
// classifies it as.
func guardedAs(h *Handler, method, override, escaped string) string {
	r := &http.Request{Method: method, Header: http.Header{}, URL: &url.URL{Path: "/"}}
	if override != "" {
		r.Header.Set("X-HTTP-Method-Override", override)
	}
	op, _ := h.classifyHTTP(r, escaped)
	return op
}

func TestRouterDiff(t *testing.T) {
	// ROUTER_DIFF_N=300000 for a longer run; ROUTER_DIFF_REPORT=1 to log
	// the counts without failing.
	n := 40000
	if v, err := strconv.Atoi(os.Getenv("ROUTER_DIFF_N")); err == nil && v > 0 {
		n = v
	} else if testing.Short() {
		n = 5000
	}
	h := &Handler{}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(20261206))
	type stat struct {
		paths, reads, unguarded, notCommit int
		examples                           []string
	}
	stats := make([]stat, len(routerModels))
	accepted := 0
	for range n {
		method, override, raw := genPath(rng)
		escaped, ok := forwarded(raw)
		if !ok {
			continue
		}
		accepted++
		got := guardedAs(h, method, override, escaped)
		for i, m := range routerModels {
			st := &stats[i]
			st.paths++
			ops := m.ops(method, override, escaped)
			if len(ops) == 0 {
				continue
			}
			st.reads++
			bad := ""
			for _, op := range ops {
				switch {
				case got == "":
					st.unguarded++
					bad = "unguarded"
				case isCommit(op) && !isCommit(got):
					st.notCommit++
					bad = "guarded as " + got
				}
				if bad != "" {
					if len(st.examples) < 6 {
						st.examples = append(st.examples, fmt.Sprintf("%s (override %q) %s: router %s, handler %s", method, override, escaped, op, bad))
					}
					break
				}
			}
		}
	}
	t.Logf("%d generated requests, %d accepted by Go's server", n, accepted)
	// A generator or a forwarded() that let nothing through would leave
	// every count at 0, and the test passing with nothing compared.
	if accepted < n/10 {
		t.Fatalf("only %d of %d generated requests accepted by Go's server: the comparison below would be empty", accepted, n)
	}
	failed := false
	for i, m := range routerModels {
		st := stats[i]
		t.Logf("%-30s paths %d, read as a mutation %d, unguarded %d, not guarded as the commit %d", m.name, st.paths, st.reads, st.unguarded, st.notCommit)
		for _, e := range st.examples {
			t.Logf("    %s", e)
		}
		if st.unguarded+st.notCommit > 0 {
			failed = true
		}
		if st.reads == 0 {
			t.Errorf("%s read none of %d paths as a mutation: nothing of it was compared", m.name, st.paths)
		}
	}
	if failed && os.Getenv("ROUTER_DIFF_REPORT") == "" {
		t.Error("some router executes a request the handler does not guard as it")
	}
}
