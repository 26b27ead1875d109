package catalog

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
)

// Operation ids, spelled as the REST spec's operationId. They name the
// operations in Executions, Requests, FailNext and StallNext.
const (
	OpGetConfig             = "getConfig"
	OpListNamespaces        = "listNamespaces"
	OpCreateNamespace       = "createNamespace"
	OpLoadNamespaceMetadata = "loadNamespaceMetadata"
	OpNamespaceExists       = "namespaceExists"
	OpDropNamespace         = "dropNamespace"
	OpUpdateProperties      = "updateProperties"
	OpListTables            = "listTables"
	OpCreateTable           = "createTable"
	OpRegisterTable         = "registerTable"
	OpLoadTable             = "loadTable"
	OpUpdateTable           = "updateTable"
	OpDropTable             = "dropTable"
	OpTableExists           = "tableExists"
	OpRenameTable           = "renameTable"
	OpCommitTransaction     = "commitTransaction"
	OpListViews             = "listViews"
	OpCreateView            = "createView"
	OpLoadView              = "loadView"
	OpReplaceView           = "replaceView"
	OpDropView              = "dropView"
	OpViewExists            = "viewExists"
	OpRenameView            = "renameView"
	OpRegisterView          = "registerView"
)

// maxBodyBytes bounds request bodies; table commits are small JSON documents.
const maxBodyBytes = 16 << 20

// handlerFunc serves one operation. It returns the success status and body
// (nil for no content) or an error that writeError maps to the spec's model.
type handlerFunc func(c *call) (int, any, error)

// route binds an operation to its method and path below /v1/{prefix}.
type route struct {
	method  string
	path    string // e.g. "/namespaces/{namespace}/tables/{table}"
	op      string
	mutates bool
	h       handlerFunc
}

func (s *Server) routeTable() []route {
	return []route{
		{http.MethodGet, "/namespaces", OpListNamespaces, false, s.listNamespaces},
		{http.MethodPost, "/namespaces", OpCreateNamespace, true, s.createNamespace},
		{http.MethodGet, "/namespaces/{namespace}", OpLoadNamespaceMetadata, false, s.loadNamespace},
		{http.MethodHead, "/namespaces/{namespace}", OpNamespaceExists, false, s.namespaceExists},
		{http.MethodDelete, "/namespaces/{namespace}", OpDropNamespace, true, s.dropNamespace},
		{http.MethodPost, "/namespaces/{namespace}/properties", OpUpdateProperties, true, s.updateProperties},

		{http.MethodGet, "/namespaces/{namespace}/tables", OpListTables, false, s.listTables},
		{http.MethodPost, "/namespaces/{namespace}/tables", OpCreateTable, true, s.createTable},
		{http.MethodPost, "/namespaces/{namespace}/register", OpRegisterTable, true, s.registerTable},
		{http.MethodGet, "/namespaces/{namespace}/tables/{table}", OpLoadTable, false, s.loadTable},
		{http.MethodHead, "/namespaces/{namespace}/tables/{table}", OpTableExists, false, s.tableExists},
		{http.MethodPost, "/namespaces/{namespace}/tables/{table}", OpUpdateTable, true, s.updateTable},
		{http.MethodDelete, "/namespaces/{namespace}/tables/{table}", OpDropTable, true, s.dropTable},
		{http.MethodPost, "/tables/rename", OpRenameTable, true, s.renameTable},
		{http.MethodPost, "/transactions/commit", OpCommitTransaction, true, s.commitTransaction},

		{http.MethodGet, "/namespaces/{namespace}/views", OpListViews, false, s.listViews},
		{http.MethodPost, "/namespaces/{namespace}/views", OpCreateView, true, s.createView},
		{http.MethodPost, "/namespaces/{namespace}/register-view", OpRegisterView, true, s.registerView},
		{http.MethodGet, "/namespaces/{namespace}/views/{view}", OpLoadView, false, s.loadView},
		{http.MethodHead, "/namespaces/{namespace}/views/{view}", OpViewExists, false, s.viewExists},
		{http.MethodPost, "/namespaces/{namespace}/views/{view}", OpReplaceView, true, s.replaceView},
		{http.MethodDelete, "/namespaces/{namespace}/views/{view}", OpDropView, true, s.dropView},
		{http.MethodPost, "/views/rename", OpRenameView, true, s.renameView},
	}
}

// buildMux registers every route on its canonical, unprefixed path. ServeHTTP
// strips any prefix first: registering both /v1/{prefix}/x and /v1/x on one
// ServeMux is impossible because the patterns overlap ambiguously.
func (s *Server) buildMux() *http.ServeMux {
	mux := http.NewServeMux()
	for _, rt := range s.routes {
		mux.Handle(rt.method+" /v1"+rt.path, s.wrap(rt))
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, newAPIError(http.StatusNotFound, typeNotFound, "no route for %s %s", r.Method, r.URL.Path))
	})

	return mux
}

// collections are the first path segments of unprefixed routes; any other
// first segment after /v1/ is taken as a prefix.
var collections = map[string]bool{"namespaces": true, "tables": true, "views": true, "transactions": true}

// ServeHTTP serves GET /v1/config and dispatches everything else after
// removing the optional {prefix} segment.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	escaped := r.URL.EscapedPath()
	if escaped == "/v1/config" {
		s.serveConfig(w, r)

		return
	}
	rest, ok := strings.CutPrefix(escaped, "/v1/")
	if !ok {
		writeError(w, newAPIError(http.StatusNotFound, typeNotFound, "no route for %s %s", r.Method, r.URL.Path))

		return
	}
	first, remainder, _ := strings.Cut(rest, "/")
	if !collections[first] {
		prefix, err := url.PathUnescape(first)
		if err != nil || (s.opts.Prefix != "" && prefix != s.opts.Prefix) {
			writeError(w, newAPIError(http.StatusNotFound, typeNotFound, "unknown prefix %q", first))

			return
		}
		rest = remainder
	}
	canonical := "/v1/" + rest
	path, err := url.PathUnescape(canonical)
	if err != nil {
		writeError(w, badRequest("malformed path: %v", err))

		return
	}
	r2 := new(http.Request)
	*r2 = *r
	u := *r.URL
	u.Path, u.RawPath = path, canonical
	r2.URL = &u
	s.mux.ServeHTTP(w, r2)
}

// serveConfig answers GET /v1/config with the spec's CatalogConfig. It adds no
// idempotency-key-lifetime: advertising that is the proxy's job.
func (s *Server) serveConfig(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		writeError(w, newAPIError(http.StatusMethodNotAllowed, typeBadRequest, "method %s not allowed on /v1/config", r.Method))

		return
	}
	s.faults.arrive(OpGetConfig)
	overrides := map[string]string{}
	if s.opts.Prefix != "" {
		overrides["prefix"] = s.opts.Prefix
	}
	endpoints := make([]string, 0, len(s.routes))
	for _, rt := range s.routes {
		endpoints = append(endpoints, rt.method+" /v1/{prefix}"+rt.path)
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"defaults":  map[string]string{},
		"overrides": overrides,
		"endpoints": endpoints,
	})
}

// call is the per-request state handed to a handlerFunc.
type call struct {
	r   *http.Request
	ctx context.Context
	// skipCount is set by handlers that succeed without mutating (a staged
	// create), so they are not counted as executions.
	skipCount bool
}

// decode reads the JSON body into v; malformed JSON is the client's fault.
func (c *call) decode(v any) error {
	dec := json.NewDecoder(io.LimitReader(c.r.Body, maxBodyBytes))
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			return badRequest("request body is required")
		}

		return badRequest("malformed request body: %v", err)
	}

	return nil
}

// DropConnection closes the request's connection without an answer; SO_LINGER
// 0 turns the close into a TCP reset. Where the connection cannot be taken
// over, aborting the handler still leaves the caller without a response.
func DropConnection(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = conn.Close()
}

// wrap applies the test hooks and locking around a handler. Order matters:
// a stall holds the request before anything else (and without any lock), an
// injected 503 is answered before the catalog is touched, and an execution is
// counted only after the mutation succeeded.
func (s *Server) wrap(rt route) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if st := s.faults.takeStall(rt.op); st != nil {
			if err := st.wait(r.Context(), s.closed); err != nil {
				return // the client is gone; nothing to answer
			}
		}
		if s.faults.arrive(rt.op) {
			writeError(w, newAPIError(http.StatusServiceUnavailable, typeServiceUnavailable,
				"injected failure for %s before commit", rt.op))

			return
		}

		c := &call{r: r, ctx: r.Context()}
		if rt.mutates {
			s.mu.Lock()
		} else {
			s.mu.RLock()
		}
		status, body, err := rt.h(c)
		if rt.mutates {
			s.mu.Unlock()
		} else {
			s.mu.RUnlock()
		}
		if err != nil {
			writeError(w, err)

			return
		}
		if rt.mutates && !c.skipCount && s.faults.executed(rt.op, r.Header.Get("Idempotency-Key")) {
			DropConnection(w)

			return
		}
		if body == nil {
			w.WriteHeader(status)

			return
		}
		writeJSON(w, status, body)
	}
}
