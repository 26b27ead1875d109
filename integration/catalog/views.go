package catalog

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/apache/iceberg-go"
	icecat "github.com/apache/iceberg-go/catalog"
	"github.com/apache/iceberg-go/io"
	"github.com/apache/iceberg-go/table"
	"github.com/apache/iceberg-go/view"
	"github.com/google/uuid"
)

// Views are kept in the SQL catalog's iceberg_tables rows with type VIEW, as
// iceberg-go's SQL catalog does, but created, loaded, replaced and renamed
// here: its view API takes a single SQL string and cannot replace or rename
// (see store.go). Drop, exists and list go through the SQL catalog.

// loadViewResult is the spec's LoadViewResult.
type loadViewResult struct {
	MetadataLocation string            `json:"metadata-location"`
	Metadata         view.Metadata     `json:"metadata"`
	Config           map[string]string `json:"config"`
}

func (s *Server) listViews(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	var ids []table.Identifier
	for id, err := range s.cat.ListViews(c.ctx, ns) {
		if err != nil {
			return 0, nil, err
		}
		ids = append(ids, id)
	}
	sortIdents(ids)
	items, next, err := page(c, ids)
	if err != nil {
		return 0, nil, err
	}
	out := make([]restIdentifier, len(items))
	for i, id := range items {
		out[i] = toRestIdentifier(id)
	}
	body := map[string]any{"identifiers": out}
	if next != "" {
		body["next-page-token"] = next
	}

	return http.StatusOK, body, nil
}

// requireFree fails with AlreadyExists when ident names a table or view.
func (s *Server) requireFree(ctx context.Context, ident table.Identifier) error {
	kind, taken, err := s.rowKind(ctx, ident)
	switch {
	case err != nil:
		return err
	case !taken:
		return nil
	case kind == rowView:
		return fmt.Errorf("%w: %s", icecat.ErrViewAlreadyExists, strings.Join(ident, "."))
	default:
		return fmt.Errorf("%w: %s", icecat.ErrTableAlreadyExists, strings.Join(ident, "."))
	}
}

func (s *Server) createView(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	var req struct {
		Name        string             `json:"name"`
		Location    string             `json:"location"`
		Schema      *iceberg.Schema    `json:"schema"`
		ViewVersion *view.Version      `json:"view-version"`
		Properties  iceberg.Properties `json:"properties"`
	}
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	if err := checkName(req.Name); err != nil {
		return 0, nil, err
	}
	if req.Schema == nil || req.ViewVersion == nil {
		return 0, nil, badRequest("schema and view-version are required")
	}
	ident := append(slices.Clone(ns), req.Name)
	nsProps, err := s.cat.LoadNamespaceProperties(c.ctx, ns)
	if err != nil {
		return 0, nil, err
	}
	if err := s.requireFree(c.ctx, ident); err != nil {
		return 0, nil, err
	}
	loc := strings.TrimRight(req.Location, "/")
	if loc == "" {
		if loc, err = s.defaultLocation(ns, nsProps, req.Name); err != nil {
			return 0, nil, err
		}
	}
	md, err := view.NewMetadata(req.ViewVersion, req.Schema, loc, req.Properties)
	if err != nil {
		return 0, nil, badRequest("invalid view definition: %v", err)
	}
	metaLoc, err := s.writeViewMetadata(c.ctx, md, 0)
	if err != nil {
		return 0, nil, err
	}
	if err := s.insertRow(c.ctx, ident, rowView, metaLoc); err != nil {
		return 0, nil, err
	}

	return http.StatusOK, loadViewResult{MetadataLocation: metaLoc, Metadata: md, Config: map[string]string{}}, nil
}

// writeViewMetadata writes md as <location>/metadata/<version>-<uuid>.metadata.json.
func (s *Server) writeViewMetadata(ctx context.Context, md view.Metadata, version int) (string, error) {
	loc := fmt.Sprintf("%s/metadata/%05d-%s.metadata.json", strings.TrimRight(md.Location(), "/"), version, uuid.NewString())
	data, err := json.Marshal(md)
	if err != nil {
		return "", fmt.Errorf("encoding view metadata: %w", err)
	}
	fs, err := io.LoadFS(ctx, s.props, loc)
	if err != nil {
		return "", err
	}
	wfs, ok := fs.(io.WriteFileIO)
	if !ok {
		return "", errors.New("warehouse file system is read-only")
	}
	if err := wfs.WriteFile(loc, data); err != nil {
		return "", fmt.Errorf("writing view metadata: %w", err)
	}

	return loc, nil
}

// readView loads a view's metadata and its location, or NoSuchView.
func (s *Server) readView(ctx context.Context, ident table.Identifier) (view.Metadata, string, error) {
	loc, err := s.rowLocation(ctx, ident, rowView)
	if errors.Is(err, errNoRow) {
		return nil, "", fmt.Errorf("%w: %s", icecat.ErrNoSuchView, strings.Join(ident, "."))
	}
	if err != nil {
		return nil, "", err
	}
	v, err := view.NewFromLocation(ctx, ident, loc, io.LoadFSFunc(s.props, loc))
	if err != nil {
		return nil, "", fmt.Errorf("reading view metadata %s: %w", loc, err)
	}

	return v.Metadata(), loc, nil
}

func (s *Server) loadView(c *call) (int, any, error) {
	ident, err := c.pathIdent("view")
	if err != nil {
		return 0, nil, err
	}
	md, loc, err := s.readView(c.ctx, ident)
	if err != nil {
		return 0, nil, err
	}

	return http.StatusOK, loadViewResult{MetadataLocation: loc, Metadata: md, Config: map[string]string{}}, nil
}

func (s *Server) viewExists(c *call) (int, any, error) {
	ident, err := c.pathIdent("view")
	if err != nil {
		return 0, nil, err
	}
	ok, err := s.cat.CheckViewExists(c.ctx, ident)
	if err != nil {
		return 0, nil, err
	}
	if !ok {
		return 0, nil, newAPIError(http.StatusNotFound, typeNoSuchView, "view does not exist: %s", strings.Join(ident, "."))
	}

	return http.StatusNoContent, nil, nil
}

func (s *Server) dropView(c *call) (int, any, error) {
	ident, err := c.pathIdent("view")
	if err != nil {
		return 0, nil, err
	}
	if err := s.cat.DropView(c.ctx, ident); err != nil {
		return 0, nil, err
	}

	return http.StatusNoContent, nil, nil
}

// replaceView applies a CommitViewRequest: requirements are checked against
// the current metadata (409 on failure), updates applied through iceberg-go's
// view metadata builder, and the pointer swapped only if unchanged.
func (s *Server) replaceView(c *call) (int, any, error) {
	ident, err := c.pathIdent("view")
	if err != nil {
		return 0, nil, err
	}
	var req struct {
		Identifier   *restIdentifier   `json:"identifier"`
		Requirements view.Requirements `json:"requirements"`
		Updates      view.Updates      `json:"updates"`
	}
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	if req.Identifier != nil {
		bodyIdent, err := req.Identifier.toIdent()
		if err != nil {
			return 0, nil, err
		}
		if !slices.Equal(bodyIdent, ident) {
			return 0, nil, badRequest("identifier in body does not match path")
		}
	}
	base, baseLoc, err := s.readView(c.ctx, ident)
	if err != nil {
		return 0, nil, err
	}
	for _, r := range req.Requirements {
		if err := r.Validate(base); err != nil {
			return 0, nil, commitFailed(err)
		}
	}
	b, err := view.MetadataBuilderFromBase(base)
	if err != nil {
		return 0, nil, err
	}
	for _, u := range req.Updates {
		if err := u.Apply(b); err != nil {
			return 0, nil, badRequest("cannot apply %s: %v", u.Action(), err)
		}
	}
	built, err := b.Build()
	if err != nil {
		return 0, nil, badRequest("invalid view update: %v", err)
	}
	md := built.Metadata
	metaLoc, err := s.writeViewMetadata(c.ctx, md, metadataVersion(baseLoc)+1)
	if err != nil {
		return 0, nil, err
	}
	swapped, err := s.swapLocation(c.ctx, ident, rowView, baseLoc, metaLoc)
	if err != nil {
		return 0, nil, err
	}
	if !swapped {
		return 0, nil, commitFailed(fmt.Errorf("view %s changed concurrently", strings.Join(ident, ".")))
	}

	return http.StatusOK, loadViewResult{MetadataLocation: metaLoc, Metadata: md, Config: map[string]string{}}, nil
}

// metadataVersion parses the leading number of a <n>-<uuid>.metadata.json
// file name; files named otherwise count as version 0.
func metadataVersion(loc string) int {
	name := loc[strings.LastIndex(loc, "/")+1:]
	n := 0
	for _, r := range name {
		if r < '0' || r > '9' {
			break
		}
		n = n*10 + int(r-'0')
	}

	return n
}

func (s *Server) renameView(c *call) (int, any, error) {
	var req renameRequest
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	from, to, err := req.idents()
	if err != nil {
		return 0, nil, err
	}
	if _, err := s.rowLocation(c.ctx, from, rowView); errors.Is(err, errNoRow) {
		return 0, nil, fmt.Errorf("%w: %s", icecat.ErrNoSuchView, strings.Join(from, "."))
	} else if err != nil {
		return 0, nil, err
	}
	toNs := to[:len(to)-1]
	if ok, err := s.cat.CheckNamespaceExists(c.ctx, toNs); err != nil {
		return 0, nil, err
	} else if !ok {
		return 0, nil, fmt.Errorf("%w: %s", icecat.ErrNoSuchNamespace, strings.Join(toNs, "."))
	}
	if err := s.requireFree(c.ctx, to); err != nil {
		return 0, nil, err
	}
	renamed, err := s.renameRow(c.ctx, from, to, rowView)
	if err != nil {
		return 0, nil, err
	}
	if !renamed {
		return 0, nil, fmt.Errorf("%w: %s", icecat.ErrNoSuchView, strings.Join(from, "."))
	}

	return http.StatusNoContent, nil, nil
}

// registerView adds an existing view metadata file under a name.
func (s *Server) registerView(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	var req struct {
		Name             string `json:"name"`
		MetadataLocation string `json:"metadata-location"`
	}
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	if err := checkName(req.Name); err != nil {
		return 0, nil, err
	}
	if req.MetadataLocation == "" {
		return 0, nil, badRequest("metadata-location is required")
	}
	ident := append(slices.Clone(ns), req.Name)
	if ok, err := s.cat.CheckNamespaceExists(c.ctx, ns); err != nil {
		return 0, nil, err
	} else if !ok {
		return 0, nil, fmt.Errorf("%w: %s", icecat.ErrNoSuchNamespace, strings.Join(ns, "."))
	}
	v, err := view.NewFromLocation(c.ctx, ident, req.MetadataLocation, io.LoadFSFunc(s.props, req.MetadataLocation))
	if err != nil {
		return 0, nil, badRequest("cannot read view metadata at %s: %v", req.MetadataLocation, err)
	}
	if err := s.requireFree(c.ctx, ident); err != nil {
		return 0, nil, err
	}
	if err := s.insertRow(c.ctx, ident, rowView, req.MetadataLocation); err != nil {
		return 0, nil, err
	}

	return http.StatusOK, loadViewResult{MetadataLocation: req.MetadataLocation, Metadata: v.Metadata(), Config: map[string]string{}}, nil
}
