package icebergidempotency

import (
	"strings"
	"unicode/utf8"
)

// operation is one Iceberg REST mutation, matched by method and by the path
// template after "/v1/{prefix}/" ("*" matches one non-empty segment).
type operation struct {
	method   string
	template []string
	id       string
}

// mutations lists the operations guarded by the handler: the spec's 17
// operations that accept an Idempotency-Key, plus createView, which the spec
// does not list but which is a mutation all the same. reportMetrics, reads and
// OAuth are deliberately absent.
var mutations = []operation{
	{"POST", seg("namespaces"), "createNamespace"},
	{"DELETE", seg("namespaces/*"), "dropNamespace"},
	{"POST", seg("namespaces/*/properties"), "updateProperties"},
	{"POST", seg("namespaces/*/tables"), "createTable"},
	{"POST", seg("namespaces/*/tables/*/plan"), "planTableScan"},
	{"DELETE", seg("namespaces/*/tables/*/plan/*"), "cancelPlanning"},
	{"POST", seg("namespaces/*/tables/*/tasks"), "fetchScanTasks"},
	{"POST", seg("namespaces/*/register"), "registerTable"},
	{"POST", seg("namespaces/*/tables/*"), "updateTable"},
	{"DELETE", seg("namespaces/*/tables/*"), "dropTable"},
	{"POST", seg("namespaces/*/tables/*/unregister"), "unregisterTable"},
	{"POST", seg("tables/rename"), "renameTable"},
	{"POST", seg("transactions/commit"), "commitTransaction"},
	{"POST", seg("namespaces/*/views"), "createView"},
	{"POST", seg("namespaces/*/views/*"), "replaceView"},
	{"DELETE", seg("namespaces/*/views/*"), "dropView"},
	{"POST", seg("views/rename"), "renameView"},
	{"POST", seg("namespaces/*/register-view"), "registerView"},
}

// rerunnable reports whether running op twice changes nothing a client
// reads: scan planning plans a table's scan (a plan the catalog may keep
// until it expires or is cancelled) and hands out its tasks, changing no
// table, view or namespace. Where another operation's outcome would be
// unknown (the request may have reached the catalog, and no answer came
// back), its key is released, and an abandoned one is taken over: a retry
// runs it again, as it would without this module. Under the "unknown"
// answer, iceberg-go's retries of a scan plan whose answer was lost (it
// retries 5xx with the same key) each got 500 CommitStateUnknownException,
// and the scan failed. cancelPlanning is left out: run again after it
// succeeded, it answers 404.
func rerunnable(op string) bool {
	return op == "planTableScan" || op == "fetchScanTasks"
}

// mutationMethod reports whether some operation in mutations uses method
// (TestMutationMethodCoversMutations keeps the two in step): a request with
// any other method is no mutation, whatever its path.
func mutationMethod(method string) bool {
	return methodIndex(method) >= 0
}

func seg(template string) []string { return strings.Split(template, "/") }

// maxTemplateSegments is the length of the longest template in mutations,
// checked by TestMaxTemplateSegments.
const maxTemplateSegments = 6

// maxPrefixSegments bounds the segments of a {prefix}: a path with more
// than these and a template's is no mutation.
const maxPrefixSegments = 10

// classify returns the operationId of a mutation, or "" for anything that is
// not one. rel is the escaped path below the configured base path, starting
// with "/v1/". The {prefix} is optional in deployments, so "/v1/namespaces"
// and "/v1/{prefix}/namespaces" both match, and it may span several segments:
// the spec gives it as one path parameter, but the Java client joins it into
// the path as it is, and catalogs answer /v1/config with prefixes such as
// catalogs/{catalog} (Unity Catalog) or projects/{p}/catalogs/{c} (BigLake).
// The shortest prefix whose remainder matches a template wins, the
// unprefixed reading first, unless a longer one reads the path as a
// commit (see isCommit).
//
// "v1" and the template's words match in any case: Iceberg's reference
// servlet (the REST fixture's Route) and Hive's HMS REST catalog compare
// them with equalsIgnoreCase, so "POST …/ns/Tables/t" is a commit there.
// Before, such a path passed unguarded, and a keyed retry executed again.
func classify(method, rel string) string {
	m := methodIndex(method)
	rest, ok := rel, len(rel) >= 4 && strings.EqualFold(rel[:4], "/v1/")
	if ok {
		rest = rel[4:]
	}
	if m < 0 || !ok {
		return ""
	}
	// The segments go to an array on the stack, which keeps requests that
	// pass through free of allocations.
	var buf [maxPrefixSegments + maxTemplateSegments]string
	segs := buf[:0]
	for {
		i := strings.IndexByte(rest, '/')
		if i < 0 {
			segs = append(segs, rest)
			break
		}
		if len(segs) == len(buf)-1 {
			return "" // longer than the longest prefix and template
		}
		segs = append(segs, rest[:i])
		rest = rest[i+1:]
	}
	first := ""
	for k := range min(len(segs), maxPrefixSegments+1) {
		if k > 0 && segs[k-1] == "" {
			return first // a prefix has no empty segment
		}
		if len(segs)-k > maxTemplateSegments {
			continue
		}
		if id := match(m, segs[k:]); id != "" {
			if isCommit(id) {
				return id // a commit reading wins: see isCommit
			}
			if first == "" {
				first = id
			}
		}
	}
	return first
}

// byShape holds the mutations by method (methodIndex) and by number of
// template segments, so that a path is compared only with the templates
// of its method and its length: one to four of them, where the whole list
// has eighteen. Classifying is on every mutation's path, keyed or not.
var byShape = func() (t [2][maxTemplateSegments + 1][]operation) {
	for _, op := range mutations {
		m := methodIndex(op.method)
		t[m][len(op.template)] = append(t[m][len(op.template)], op)
	}
	return t
}()

// methodIndex is method's row in byShape, or -1 for a method no mutation
// uses. Methods match in any case: Javalin, on which Apache Amoro's
// Iceberg REST catalog runs, upper-cases the method before routing
// (HandlerType.findByName), so "post …/tables/t" is a commit there, and
// Caddy forwards the method as sent. Until the build after 051e419 such a
// request passed unguarded, and a keyed retry executed again.
func methodIndex(method string) int {
	switch {
	case strings.EqualFold(method, "POST"):
		return 0
	case strings.EqualFold(method, "DELETE"):
		return 1
	}
	return -1
}

func match(m int, segs []string) string {
	if len(segs) > maxTemplateSegments {
		return ""
	}
	for _, op := range byShape[m][len(segs)] {
		ok := true
		for i, t := range op.template {
			if segs[i] == "" || (t != "*" && !wordMatches(t, segs[i])) {
				ok = false
				break
			}
		}
		if ok {
			return op.id
		}
	}
	return ""
}

// wordMatches reports whether the escaped segment seg spells the template
// word w (lower-case ASCII) as a catalog that compares them with Java's
// String.equalsIgnoreCase reads it: in any ASCII case, and with the four
// characters that equalsIgnoreCase takes for an ASCII letter (see
// javaFolds). Hive's HMS REST catalog decodes the path (getPathInfo)
// before its Route compares the words so, and Caddy forwards such a
// character escaped: "POST /v1/namespaces/ns/table%C5%BF/t" is a commit
// there. Until the build after 051e419 it passed unguarded, and a keyed
// retry committed again.
func wordMatches(w, seg string) bool {
	// A folded character is longer than the letter it stands for, escaped
	// (six or nine bytes) or not (two or three).
	return strings.EqualFold(w, seg) || len(seg) > len(w) && javaFoldEqual(w, seg)
}

// javaFolds are the characters other than ASCII letters that Java's
// String.equalsIgnoreCase, which compares Character.toUpperCase and then
// Character.toLowerCase of each char, takes for an ASCII letter: long s
// (to "S"), dotted capital I (lower-cases to "i"), dotless i (to "I"),
// Kelvin sign (lower-cases to "k"). No other char of the BMP does
// (TestJavaFoldsAreAll), nor does a surrogate pair, two chars where a
// letter is one.
var javaFolds = [...]struct {
	utf8   string
	letter byte
}{{"\u017f", 's'}, {"\u0130", 'i'}, {"\u0131", 'i'}, {"\u212a", 'k'}}

// javaFoldEqual reports whether seg, its escapes decoded, equals the
// lower-case ASCII word w under String.equalsIgnoreCase.
func javaFoldEqual(w, seg string) bool {
	j := 0
	for i := 0; i < len(seg); j++ {
		if j == len(w) {
			return false
		}
		c, n := decodedByte(seg[i:])
		if c < utf8.RuneSelf {
			if lowerASCII(c) != w[j] {
				return false
			}
			i += n
			continue
		}
		k := 0
		for _, f := range javaFolds {
			// The fold's bytes are all non-ASCII, which cutPrefixFold
			// compares as they are, escaped or not.
			if f.letter != w[j] {
				continue
			}
			if rest, ok := cutPrefixFold(seg[i:], f.utf8); ok {
				k = len(seg) - i - len(rest)
				break
			}
		}
		if k == 0 {
			return false
		}
		i += k
	}
	return j == len(w)
}
