package catalog

import (
	"encoding/json"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/apache/iceberg-go/table"
)

// unitSeparator joins namespace levels in paths and in the parent query
// parameter, as the spec prescribes (sent as %1F).
const unitSeparator = "\x1f"

// parseNamespace splits a decoded {namespace} path value into its levels.
func parseNamespace(raw string) (table.Identifier, error) {
	if raw == "" {
		return nil, badRequest("namespace must not be empty")
	}
	levels := strings.Split(raw, unitSeparator)
	for _, l := range levels {
		if l == "" {
			return nil, badRequest("namespace %q has an empty level", raw)
		}
	}

	return levels, nil
}

// pathNamespace is the {namespace} of the request path.
func (c *call) pathNamespace() (table.Identifier, error) {
	return parseNamespace(c.r.PathValue("namespace"))
}

// pathIdent is the namespace plus the object named by the path value key
// ("table" or "view").
func (c *call) pathIdent(key string) (table.Identifier, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return nil, err
	}
	name := c.r.PathValue(key)
	if err := checkName(name); err != nil {
		return nil, err
	}

	return append(slices.Clone(ns), name), nil
}

// checkName rejects names the file warehouse cannot hold: the SQL catalog
// turns them into directory names.
func checkName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return badRequest("invalid name %q", name)
	}

	return nil
}

// restIdentifier is the spec's TableIdentifier.
type restIdentifier struct {
	Namespace []string `json:"namespace"`
	Name      string   `json:"name"`
}

func (id restIdentifier) toIdent() (table.Identifier, error) {
	if len(id.Namespace) == 0 {
		return nil, badRequest("identifier %q has no namespace", id.Name)
	}
	for _, l := range id.Namespace {
		if l == "" {
			return nil, badRequest("identifier namespace has an empty level")
		}
	}
	if err := checkName(id.Name); err != nil {
		return nil, err
	}

	return append(slices.Clone(id.Namespace), id.Name), nil
}

func toRestIdentifier(ident table.Identifier) restIdentifier {
	return restIdentifier{Namespace: slices.Clone(ident[:len(ident)-1]), Name: ident[len(ident)-1]}
}

// namespaceKey mirrors how iceberg-go's SQL catalog stores a namespace in its
// table_namespace column (dot-joined, or a JSON encoding behind a marker when
// a level contains a dot), for the rows this package writes itself.
func namespaceKey(ns table.Identifier) string {
	const marker = "__iceberg_namespace_v1__:"
	joined := strings.Join(ns, ".")
	if !strings.Contains(joined, marker) && !slices.ContainsFunc(ns, func(p string) bool { return strings.Contains(p, ".") }) {
		return joined
	}
	b, _ := json.Marshal([]string(ns))

	return marker + string(b)
}

// sortIdents orders identifiers so that pages are stable across requests.
func sortIdents(ids []table.Identifier) {
	sort.Slice(ids, func(i, j int) bool {
		return slices.Compare(ids[i], ids[j]) < 0
	})
}

// page cuts one page out of a sorted list. The page token is the offset of
// the page; an empty next token means this was the last page.
func page[T any](c *call, items []T) ([]T, string, error) {
	q := c.r.URL.Query()
	start := 0
	if tok := q.Get("pageToken"); tok != "" {
		n, err := strconv.Atoi(tok)
		if err != nil || n < 0 {
			return nil, "", badRequest("invalid pageToken %q", tok)
		}
		start = min(n, len(items))
	}
	end := len(items)
	if ps := q.Get("pageSize"); ps != "" {
		n, err := strconv.Atoi(ps)
		if err != nil || n < 1 {
			return nil, "", badRequest("invalid pageSize %q", ps)
		}
		end = min(start+n, len(items))
	}
	next := ""
	if end < len(items) {
		next = strconv.Itoa(end)
	}

	return items[start:end], next, nil
}
