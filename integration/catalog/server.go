// Package catalog is a small but real Apache Iceberg REST catalog server for
// tests and demos of the Idempotency-Key proxy. It serves the REST spec's
// routes on top of iceberg-go's SQL catalog (SQLite through sqliteshim, pure
// Go) with a file warehouse, and adds test hooks (execution counts, stalls,
// injected 503s) so that tests can observe exactly what reached the catalog.
package catalog

import (
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/apache/iceberg-go"
	sqlcat "github.com/apache/iceberg-go/catalog/sql"
	"github.com/uptrace/bun/driver/sqliteshim"
)

// Options configures a Server.
type Options struct {
	// WarehouseDir is the local directory that holds table and view files and
	// the SQLite database of the catalog. It must be set; it is created if
	// missing. Reusing a directory reopens the catalog it holds.
	WarehouseDir string

	// Prefix, when set, is advertised to clients as the "prefix" override in
	// GET /v1/config, and is the only prefix accepted in /v1/{prefix}/...
	// paths. When empty, any single-segment prefix is accepted and ignored.
	// Unprefixed /v1/... paths are served either way.
	Prefix string

	// Name is the catalog name stored with every row; default "catalog".
	Name string
}

// Server is an Iceberg REST catalog. Create it with New, serve Handler and
// release it with Close.
type Server struct {
	opts      Options
	warehouse string // file:// URL of WarehouseDir
	props     iceberg.Properties
	db        *sql.DB
	cat       *sqlcat.Catalog
	routes    []route
	mux       *http.ServeMux

	// mu serialises mutations (write lock) against each other and against
	// reads (read lock). It makes requirement checks and the commit that
	// follows one atomic step, and keeps SQLite free of writer contention.
	mu sync.RWMutex

	faults    *faults
	closed    chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// New opens (or creates) the catalog in opts.WarehouseDir.
func New(opts Options) (*Server, error) {
	if opts.WarehouseDir == "" {
		return nil, errors.New("catalog: Options.WarehouseDir is required")
	}
	if strings.Contains(opts.Prefix, "/") {
		return nil, fmt.Errorf("catalog: prefix %q must be a single path segment", opts.Prefix)
	}
	if opts.Name == "" {
		opts.Name = "catalog"
	}
	dir, err := filepath.Abs(opts.WarehouseDir)
	if err != nil {
		return nil, fmt.Errorf("catalog: warehouse dir: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("catalog: warehouse dir: %w", err)
	}

	// WAL and a busy timeout let the SQL catalog's own read transactions run
	// beside a writer without "database is locked" errors.
	dsn := "file:" + filepath.Join(dir, "catalog.db") +
		"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)"
	db, err := sql.Open(sqliteshim.ShimName, dsn)
	if err != nil {
		return nil, fmt.Errorf("catalog: open sqlite: %w", err)
	}

	warehouse := (&url.URL{Scheme: "file", Path: filepath.ToSlash(dir)}).String()
	props := iceberg.Properties{"warehouse": warehouse}
	cat, err := sqlcat.NewCatalog(opts.Name, db, sqlcat.SQLite, props)
	if err != nil {
		_ = db.Close()

		return nil, fmt.Errorf("catalog: init sql catalog: %w", err)
	}

	s := &Server{
		opts:      opts,
		warehouse: warehouse,
		props:     props,
		db:        db,
		cat:       cat,
		faults:    newFaults(),
		closed:    make(chan struct{}),
	}
	s.routes = s.routeTable()
	s.mux = s.buildMux()

	return s, nil
}

// Handler returns the HTTP handler serving the REST API.
func (s *Server) Handler() http.Handler { return s }

// WarehouseURL is the file:// location under which tables are created.
func (s *Server) WarehouseURL() string { return s.warehouse }

// Close releases pending stalls and closes the catalog and its database.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		close(s.closed)
		s.mu.Lock()
		defer s.mu.Unlock()
		s.closeErr = errors.Join(s.cat.Close(), s.db.Close())
	})

	return s.closeErr
}
