package catalog

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/apache/iceberg-go"
	icecat "github.com/apache/iceberg-go/catalog"
	"github.com/apache/iceberg-go/io"
	"github.com/apache/iceberg-go/table"
)

// loadTableResult is the spec's LoadTableResult. metadata-location is
// omitted only for a staged create, whose metadata is not written yet.
type loadTableResult struct {
	MetadataLocation string            `json:"metadata-location,omitempty"`
	Metadata         table.Metadata    `json:"metadata"`
	Config           map[string]string `json:"config"`
}

func tableResult(t *table.Table) loadTableResult {
	return loadTableResult{MetadataLocation: t.MetadataLocation(), Metadata: t.Metadata(), Config: map[string]string{}}
}

func (s *Server) listTables(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	var ids []table.Identifier
	for id, err := range s.cat.ListTables(c.ctx, ns) {
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

// createTableRequest is the spec's CreateTableRequest. The partition spec and
// write order arrive with source ids of the request schema, so they are
// decoded unbound and bound by iceberg-go when the metadata is built.
type createTableRequest struct {
	Name          string                        `json:"name"`
	Location      string                        `json:"location"`
	Schema        *iceberg.Schema               `json:"schema"`
	PartitionSpec *iceberg.UnboundPartitionSpec `json:"partition-spec"`
	WriteOrder    *table.UnboundSortOrder       `json:"write-order"`
	StageCreate   bool                          `json:"stage-create"`
	Properties    iceberg.Properties            `json:"properties"`
}

func (s *Server) createTable(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	var req createTableRequest
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	if err := checkName(req.Name); err != nil {
		return 0, nil, err
	}
	if req.Schema == nil {
		return 0, nil, badRequest("schema is required")
	}
	ident := append(slices.Clone(ns), req.Name)
	if req.StageCreate {
		return s.stageCreate(c, ident, req)
	}

	opts := []icecat.CreateTableOpt{icecat.WithProperties(req.Properties)}
	if req.Location != "" {
		opts = append(opts, icecat.WithLocation(req.Location))
	}
	if req.PartitionSpec != nil {
		opts = append(opts, icecat.WithPartitionSpec(&req.PartitionSpec.PartitionSpec))
	}
	if req.WriteOrder != nil {
		opts = append(opts, icecat.WithSortOrder(req.WriteOrder.SortOrder))
	}
	tbl, err := s.cat.CreateTable(c.ctx, ident, req.Schema, opts...)
	if err != nil {
		return 0, nil, err
	}

	return http.StatusOK, tableResult(tbl), nil
}

// stageCreate answers a stage-create request with the metadata the table
// would get, writing nothing: the client then commits it with assert-create
// through updateTable, which is when the table comes into existence.
func (s *Server) stageCreate(c *call, ident table.Identifier, req createTableRequest) (int, any, error) {
	ns := ident[:len(ident)-1]
	props, err := s.cat.LoadNamespaceProperties(c.ctx, ns)
	if err != nil {
		return 0, nil, err
	}
	if _, taken, err := s.rowKind(c.ctx, ident); err != nil {
		return 0, nil, err
	} else if taken {
		return 0, nil, fmt.Errorf("%w: %s", icecat.ErrTableAlreadyExists, strings.Join(ident, "."))
	}
	loc := strings.TrimRight(req.Location, "/")
	if loc == "" {
		if loc, err = s.defaultLocation(ns, props, req.Name); err != nil {
			return 0, nil, err
		}
	}
	var spec *iceberg.PartitionSpec
	if req.PartitionSpec != nil {
		spec = &req.PartitionSpec.PartitionSpec
	}
	order := table.UnsortedSortOrder
	if req.WriteOrder != nil {
		order = req.WriteOrder.SortOrder
	}
	md, err := table.NewMetadata(req.Schema, spec, order, loc, req.Properties)
	if err != nil {
		return 0, nil, badRequest("invalid table definition: %v", err)
	}
	c.skipCount = true

	return http.StatusOK, loadTableResult{Metadata: md, Config: map[string]string{}}, nil
}

// defaultLocation places an object the way iceberg-go's SQL catalog does:
// under the namespace's "location" property, else <warehouse>/<ns>.db/<name>.
func (s *Server) defaultLocation(ns table.Identifier, nsProps iceberg.Properties, name string) (string, error) {
	if base := nsProps.Get("location", ""); base != "" {
		return url.JoinPath(base, name)
	}

	return url.JoinPath(s.warehouse, namespaceKey(ns)+".db", name)
}

func (s *Server) loadTable(c *call) (int, any, error) {
	ident, err := c.pathIdent("table")
	if err != nil {
		return 0, nil, err
	}
	tbl, err := s.cat.LoadTable(c.ctx, ident)
	if err != nil {
		return 0, nil, err
	}

	return http.StatusOK, tableResult(tbl), nil
}

func (s *Server) tableExists(c *call) (int, any, error) {
	ident, err := c.pathIdent("table")
	if err != nil {
		return 0, nil, err
	}
	ok, err := s.cat.CheckTableExists(c.ctx, ident)
	if err != nil {
		return 0, nil, err
	}
	if !ok {
		return 0, nil, newAPIError(http.StatusNotFound, typeNoSuchTable, "table does not exist: %s", strings.Join(ident, "."))
	}

	return http.StatusNoContent, nil, nil
}

// commitTableRequest is the spec's CommitTableRequest (and the entries of a
// CommitTransactionRequest).
type commitTableRequest struct {
	Identifier   *restIdentifier    `json:"identifier"`
	Requirements table.Requirements `json:"requirements"`
	Updates      table.Updates      `json:"updates"`
}

func (s *Server) updateTable(c *call) (int, any, error) {
	ident, err := c.pathIdent("table")
	if err != nil {
		return 0, nil, err
	}
	var req commitTableRequest
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	if req.Identifier != nil {
		bodyIdent, err := req.Identifier.toIdent()
		if err != nil {
			return 0, nil, err
		}
		if !slices.Equal(bodyIdent, ident) {
			return 0, nil, badRequest("identifier in body (%s) does not match path (%s)",
				strings.Join(bodyIdent, "."), strings.Join(ident, "."))
		}
	}
	if _, err := s.checkCommit(c.ctx, ident, req); err != nil {
		return 0, nil, err
	}
	md, loc, err := s.cat.CommitTable(c.ctx, ident, req.Requirements, req.Updates)
	if err != nil {
		return 0, nil, err
	}

	return http.StatusOK, map[string]any{"metadata-location": loc, "metadata": md}, nil
}

// checkCommit validates a commit before it is handed to the SQL catalog, which
// would report failed requirements and bad updates as untyped errors. Failed
// requirements are 409 CommitFailedException; updates that cannot apply are
// 400. It returns the current metadata location ("" when the commit creates
// the table). Callers hold the write lock, so the check stays true until the
// commit.
func (s *Server) checkCommit(ctx context.Context, ident table.Identifier, req commitTableRequest) (string, error) {
	var (
		base    table.Metadata
		baseLoc string
	)
	current, err := s.cat.LoadTable(ctx, ident)
	switch {
	case err == nil:
		base, baseLoc = current.Metadata(), current.MetadataLocation()
	case errors.Is(err, icecat.ErrNoSuchTable):
		if !slices.ContainsFunc(req.Requirements, func(r table.Requirement) bool { return r.GetType() == "assert-create" }) {
			return "", err
		}
	default:
		return "", err
	}
	for _, r := range req.Requirements {
		if err := r.Validate(base); err != nil {
			return "", commitFailed(err)
		}
	}
	if base == nil {
		// The SQL catalog creates a table by applying the updates to an empty
		// base; the dry run below does the same.
		if base, err = table.NewMetadata(iceberg.NewSchema(0), nil, table.UnsortedSortOrder, "", nil); err != nil {
			return "", err
		}
	}
	if _, err := table.UpdateTableMetadata(base, req.Updates, baseLoc); err != nil {
		return "", badRequest("cannot apply updates: %v", err)
	}

	return baseLoc, nil
}

func (s *Server) dropTable(c *call) (int, any, error) {
	ident, err := c.pathIdent("table")
	if err != nil {
		return 0, nil, err
	}
	if c.r.URL.Query().Get("purgeRequested") == "true" {
		err = s.cat.PurgeTable(c.ctx, ident)
	} else {
		err = s.cat.DropTable(c.ctx, ident)
	}
	if err != nil {
		return 0, nil, err
	}

	return http.StatusNoContent, nil, nil
}

// renameRequest is the spec's RenameTableRequest, also used for views.
type renameRequest struct {
	Source      *restIdentifier `json:"source"`
	Destination *restIdentifier `json:"destination"`
}

func (r renameRequest) idents() (from, to table.Identifier, err error) {
	if r.Source == nil || r.Destination == nil {
		return nil, nil, badRequest("source and destination are required")
	}
	if from, err = r.Source.toIdent(); err != nil {
		return nil, nil, err
	}
	if to, err = r.Destination.toIdent(); err != nil {
		return nil, nil, err
	}

	return from, to, nil
}

func (s *Server) renameTable(c *call) (int, any, error) {
	var req renameRequest
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	from, to, err := req.idents()
	if err != nil {
		return 0, nil, err
	}
	if _, err := s.cat.RenameTable(c.ctx, from, to); err != nil {
		return 0, nil, err
	}

	return http.StatusNoContent, nil, nil
}

// registerTable adds an existing metadata file as a table. iceberg-go's SQL
// catalog cannot register, so the row is written here (see store.go).
func (s *Server) registerTable(c *call) (int, any, error) {
	ns, err := c.pathNamespace()
	if err != nil {
		return 0, nil, err
	}
	var req struct {
		Name             string `json:"name"`
		MetadataLocation string `json:"metadata-location"`
		Overwrite        bool   `json:"overwrite"`
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
	if _, err := table.NewFromLocation(c.ctx, ident, req.MetadataLocation,
		io.LoadFSFunc(s.props, req.MetadataLocation), s.cat); err != nil {
		return 0, nil, badRequest("cannot read table metadata at %s: %v", req.MetadataLocation, err)
	}
	kind, taken, err := s.rowKind(c.ctx, ident)
	if err != nil {
		return 0, nil, err
	}
	switch {
	case !taken:
		err = s.insertRow(c.ctx, ident, rowTable, req.MetadataLocation)
	case kind == rowTable && req.Overwrite:
		var old string
		if old, err = s.rowLocation(c.ctx, ident, rowTable); err == nil {
			_, err = s.swapLocation(c.ctx, ident, rowTable, old, req.MetadataLocation)
		}
	case kind == rowView:
		err = fmt.Errorf("%w: %s", icecat.ErrViewAlreadyExists, strings.Join(ident, "."))
	default:
		err = fmt.Errorf("%w: %s", icecat.ErrTableAlreadyExists, strings.Join(ident, "."))
	}
	if err != nil {
		return 0, nil, err
	}
	tbl, err := s.cat.LoadTable(c.ctx, ident)
	if err != nil {
		return 0, nil, err
	}

	return http.StatusOK, tableResult(tbl), nil
}
