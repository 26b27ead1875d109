package catalog

import (
	"context"
	"net/http/httptest"
	"testing"

	icecat "github.com/apache/iceberg-go/catalog"
	"github.com/apache/iceberg-go/catalog/catalogtest"
	"github.com/apache/iceberg-go/catalog/rest"
)

// newTestServer starts a catalog in a temporary warehouse behind httptest.
func newTestServer(t *testing.T, opts Options) (*Server, *httptest.Server) {
	t.Helper()
	if opts.WarehouseDir == "" {
		opts.WarehouseDir = t.TempDir()
	}
	s, err := New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	hs := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		hs.Close()
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})

	return s, hs
}

// newRESTClient points iceberg-go's own REST client at the server.
func newRESTClient(t *testing.T, uri string) *rest.Catalog {
	t.Helper()
	cat, err := rest.NewCatalog(context.Background(), "test", uri)
	if err != nil {
		t.Fatalf("rest.NewCatalog: %v", err)
	}
	t.Cleanup(func() { _ = cat.Close() })

	return cat
}

// TestConformance runs iceberg-go's catalog conformance suite through its REST
// client against this server, once per catalog as the suite requires.
func TestConformance(t *testing.T) {
	catalogtest.RunCatalogTests(t, catalogtest.Config{
		SupportsNamespaceProperties: true,
		NewCatalog: func(t *testing.T) icecat.Catalog {
			_, hs := newTestServer(t, Options{})

			return newRESTClient(t, hs.URL)
		},
	})
}

// TestConformanceWithPrefix runs the suite again with a configured prefix, so
// every request goes through /v1/{prefix}/... paths.
func TestConformanceWithPrefix(t *testing.T) {
	catalogtest.RunCatalogTests(t, catalogtest.Config{
		SupportsNamespaceProperties: true,
		NewCatalog: func(t *testing.T) icecat.Catalog {
			_, hs := newTestServer(t, Options{Prefix: "wh1"})

			return newRESTClient(t, hs.URL)
		},
	})
}
