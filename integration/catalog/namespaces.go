package catalog

import (
	"net/http"
	"slices"
	"strings"

	"github.com/apache/iceberg-go"
	"github.com/apache/iceberg-go/table"
)

// namespaceResponse is the spec's CreateNamespaceResponse and
// GetNamespaceResponse.
type namespaceResponse struct {
	Namespace  []string          `json:"namespace"`
	Properties map[string]string `json:"properties"`
}

// listNamespaces returns the direct children of ?parent (top-level namespaces
// without it). iceberg-go's SQL catalog lists every descendant, so deeper
// levels are cut back to the child they live under.
func (s *Server) listNamespaces(c *call) (int, any, error) {
	var parent table.Identifier
	if raw := c.r.URL.Query().Get("parent"); raw != "" {
		p, err := parseNamespace(raw)
		if err != nil {
			return 0, nil, err
		}
		parent = p
	}
	all, err := s.cat.ListNamespaces(c.ctx, parent)
	if err != nil {
		return 0, nil, err
	}
	seen := map[string]bool{}
	children := []table.Identifier{}
	for _, ns := range all {
		if len(ns) <= len(parent) || !slices.Equal(ns[:len(parent)], parent) {
			continue
		}
		child := slices.Clone(ns[:len(parent)+1])
		key := strings.Join(child, unitSeparator)
		if !seen[key] {
			seen[key] = true
			children = append(children, child)
		}
	}
	sortIdents(children)
	items, next, err := page(c, children)
	if err != nil {
		return 0, nil, err
	}
	body := map[string]any{"namespaces": items}
	if next != "" {
		body["next-page-token"] = next
	}

	return http.StatusOK, body, nil
}

func (s *Server) createNamespace(c *call) (int, any, error) {
	var req struct {
		Namespace  []string           `json:"namespace"`
		Properties iceberg.Properties `json:"properties"`
	}
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	if len(req.Namespace) == 0 || slices.Contains(req.Namespace, "") {
		return 0, nil, badRequest("namespace must have at least one non-empty level")
	}
	if req.Properties == nil {
		req.Properties = iceberg.Properties{}
	}
	if err := s.cat.CreateNamespace(c.ctx, req.Namespace, req.Properties); err != nil {
		return 0, nil, err
	}

	return http.StatusOK, namespaceResponse{Namespace: req.Namespace, Properties: req.Properties}, nil
}

func (s *Server) loadNamespace(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	props, err := s.cat.LoadNamespaceProperties(c.ctx, ns)
	if err != nil {
		return 0, nil, err
	}
	if props == nil {
		props = iceberg.Properties{}
	}

	return http.StatusOK, namespaceResponse{Namespace: ns, Properties: props}, nil
}

func (s *Server) namespaceExists(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	ok, err := s.cat.CheckNamespaceExists(c.ctx, ns)
	if err != nil {
		return 0, nil, err
	}
	if !ok {
		return 0, nil, newAPIError(http.StatusNotFound, typeNoSuchNamespace, "namespace does not exist: %s", strings.Join(ns, "."))
	}

	return http.StatusNoContent, nil, nil
}

func (s *Server) dropNamespace(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	if err := s.cat.DropNamespace(c.ctx, ns); err != nil {
		return 0, nil, err
	}

	return http.StatusNoContent, nil, nil
}

// updateProperties applies removals and updates. A key in both is the
// spec's 422 UnprocessableEntityException, checked here because iceberg-go
// reports it as an untyped error.
func (s *Server) updateProperties(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	var req struct {
		Removals []string           `json:"removals"`
		Updates  iceberg.Properties `json:"updates"`
	}
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	for _, k := range req.Removals {
		if _, ok := req.Updates[k]; ok {
			return 0, nil, newAPIError(http.StatusUnprocessableEntity, typeUnprocessable,
				"property %q is both removed and updated", k)
		}
	}
	sum, err := s.cat.UpdateNamespaceProperties(c.ctx, ns, req.Removals, req.Updates)
	if err != nil {
		return 0, nil, err
	}
	nonNil := func(v []string) []string {
		if v == nil {
			return []string{}
		}

		return v
	}

	return http.StatusOK, map[string]any{
		"updated": nonNil(sum.Updated),
		"removed": nonNil(sum.Removed),
		"missing": sum.Missing,
	}, nil
}
