package integration_test

// Shared pieces of the tests that drive real Iceberg clients (iceberg-go,
// iceberg-js) through a real Caddy with the module, in front of a real
// Iceberg REST catalog (integration/catalog over iceberg-go's SQL catalog).
// Every response the proxy returns to the Go clients is validated against
// the REST spec (see specvalidate) and a non-conforming one fails the test.

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"github.com/apache/iceberg-go"
	icecat "github.com/apache/iceberg-go/catalog"
	"github.com/apache/iceberg-go/catalog/rest"
	"github.com/apache/iceberg-go/table"
	"github.com/google/uuid"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/catalog"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/specvalidate"
)

// stackPrefix is the catalog prefix the stacks advertise in /v1/config, so
// clients use the spec's canonical /v1/{prefix}/... paths.
const stackPrefix = "wh"

// icebergStack is catalog ← httptest ← Caddy, with the Go clients' traffic
// validated against the spec.
type icebergStack struct {
	Catalog  *catalog.Server
	Upstream *httptest.Server
	Caddy    *caddyproc.Instance
	Spec     *specvalidate.Transport
}

// startIcebergStack starts a fresh catalog and a Caddy in front of it: with
// `iceberg_idempotency` before `reverse_proxy` when guarded, plain
// `reverse_proxy` otherwise. Caddy logs at debug level so tests can see
// what the guard decided.
func startIcebergStack(t *testing.T, guarded bool) *icebergStack {
	t.Helper()
	cat, err := catalog.New(catalog.Options{WarehouseDir: t.TempDir(), Prefix: stackPrefix})
	if err != nil {
		t.Fatalf("catalog.New: %v", err)
	}
	up := httptest.NewServer(cat.Handler())
	t.Cleanup(func() {
		up.Close()
		if err := cat.Close(); err != nil {
			t.Errorf("catalog Close: %v", err)
		}
	})
	site := "reverse_proxy " + strings.TrimPrefix(up.URL, "http://")
	if guarded {
		site = "iceberg_idempotency\n" + site
	}
	inst := caddyproc.Start(t, caddyproc.Caddyfile("debug", site))
	st := &icebergStack{
		Catalog:  cat,
		Upstream: up,
		Caddy:    inst,
		Spec:     &specvalidate.Transport{Base: newHTTPTransport(), Validator: specValidator(t)},
	}
	t.Cleanup(func() { st.checkSpec(t) })
	return st
}

// checkSpec fails the test for every response that did not validate.
func (st *icebergStack) checkSpec(t *testing.T) {
	t.Helper()
	for _, f := range st.Spec.Failures() {
		t.Errorf("response does not conform to the REST spec: %s", f)
	}
	t.Logf("spec validation: %d responses checked, %d failures", st.Spec.Checked(), len(st.Spec.Failures()))
}

func newHTTPTransport() *http.Transport {
	// No compression, so that bodies are compared byte for byte as sent.
	return &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 16}
}

var (
	specOnce sync.Once
	specVal  *specvalidate.Validator
	specErr  error
)

// specValidator loads the REST spec once per test process.
func specValidator(t *testing.T) *specvalidate.Validator {
	t.Helper()
	specOnce.Do(func() {
		var path string
		if path, specErr = specvalidate.SpecPath(); specErr == nil {
			specVal, specErr = specvalidate.Load(path, specAllowances...)
		}
	})
	if specErr != nil {
		t.Fatalf("loading the REST spec: %v", specErr)
	}
	return specVal
}

// specAllowances are the spec inconsistencies tolerated in validation; see
// specvalidate.Allowance. Empty: every response must conform.
var specAllowances []specvalidate.Allowance

// newIcebergGoClient points iceberg-go's REST client at the proxy through
// the given transport (which must end in the stack's Spec transport).
func newIcebergGoClient(t *testing.T, st *icebergStack, rt http.RoundTripper) *rest.Catalog {
	t.Helper()
	cat, err := rest.NewCatalog(context.Background(), "proxy", st.Caddy.URL(), rest.WithCustomTransport(rt))
	if err != nil {
		t.Fatalf("rest.NewCatalog: %v", err)
	}
	t.Cleanup(func() { _ = cat.Close() })
	return cat
}

// isMutation reports whether a request may carry an Idempotency-Key: every
// method but GET and HEAD. The proxy decides itself which of those are spec
// mutations and ignores the key on the rest.
func isMutation(r *http.Request) bool {
	return r.Method != http.MethodGet && r.Method != http.MethodHead
}

// keyingTransport gives every mutation a fresh UUIDv7 Idempotency-Key, as
// the Iceberg Java client does once /v1/config advertises a lifetime
// (iceberg-go v0.7.0 does not send keys itself).
type keyingTransport struct {
	base  http.RoundTripper
	keyed atomic.Int64 // mutations sent with a key
	final atomic.Int64 // of those, answered with a status the module stores by default
}

// storedByDefault reports whether the module, with its default
// finalize_statuses and release_statuses, stores an answer of status.
func storedByDefault(status int) bool {
	switch status {
	case 401, 403, 408, 419, 421, 425, 429, 499:
		return false
	}
	return status >= 200 && status < 500
}

func (k *keyingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if !isMutation(req) {
		return k.base.RoundTrip(req)
	}
	key, err := uuid.NewV7()
	if err != nil {
		return nil, err
	}
	req = req.Clone(req.Context())
	req.Header.Set("Idempotency-Key", key.String())
	k.keyed.Add(1)
	resp, err := k.base.RoundTrip(req)
	if err == nil && storedByDefault(resp.StatusCode) {
		k.final.Add(1)
	}
	return resp, err
}

// countingTransport counts mutations, for the run without keys.
type countingTransport struct {
	base      http.RoundTripper
	mutations atomic.Int64
}

func (c *countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if isMutation(req) {
		c.mutations.Add(1)
	}
	return c.base.RoundTrip(req)
}

// exchange is one request/response pair seen on the wire.
type exchange struct {
	Key    string
	Status int
	Header http.Header
	Body   []byte
}

// lostResponseTransport simulates a connection cut right after the proxy
// answered the first request that match selects: it sends that request
// (with an Idempotency-Key), reads and throws the answer away, then sends
// the very same bytes with the same key again — what the Iceberg Java
// client's HTTP retry does — and hands the second answer to the client.
type lostResponseTransport struct {
	base  http.RoundTripper
	match func(*http.Request) bool

	mu     sync.Mutex
	fired  bool
	lost   exchange // the answer the client never saw
	resent exchange // the answer to the retry, which the client got
}

func (l *lostResponseTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	l.mu.Lock()
	fire := !l.fired && l.match(req)
	if fire {
		l.fired = true
	}
	l.mu.Unlock()
	if !fire {
		return l.base.RoundTrip(req)
	}

	var body []byte
	if req.Body != nil {
		var err error
		if body, err = io.ReadAll(req.Body); err != nil {
			return nil, err
		}
		_ = req.Body.Close()
	}
	key := req.Header.Get("Idempotency-Key")
	if key == "" {
		k, err := uuid.NewV7()
		if err != nil {
			return nil, err
		}
		key = k.String()
	}
	attempt := func() (*http.Response, exchange, error) {
		r := req.Clone(req.Context())
		r.Header.Set("Idempotency-Key", key)
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
		r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
		resp, err := l.base.RoundTrip(r)
		if err != nil {
			return nil, exchange{}, err
		}
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil {
			return nil, exchange{}, err
		}
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return resp, exchange{Key: key, Status: resp.StatusCode, Header: resp.Header.Clone(), Body: b}, nil
	}

	_, lost, err := attempt()
	if err != nil {
		return nil, err
	}
	resp, resent, err := attempt()
	l.mu.Lock()
	l.lost, l.resent = lost, resent
	l.mu.Unlock()
	return resp, err
}

func (l *lostResponseTransport) exchanges() (lost, resent exchange, fired bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lost, l.resent, l.fired
}

// isTableCommit matches updateTable: POST /v1/{prefix}/namespaces/{ns}/tables/{table}.
func isTableCommit(r *http.Request) bool {
	if r.Method != http.MethodPost {
		return false
	}
	segs := strings.Split(strings.Trim(r.URL.EscapedPath(), "/"), "/")
	n := len(segs)
	return n >= 5 && segs[0] == "v1" && segs[n-4] == "namespaces" && segs[n-2] == "tables"
}

// demoSchema is the schema of the tables the tests commit to. Optional
// fields keep the Arrow side simple (nullable columns).
var demoSchema = iceberg.NewSchema(0,
	iceberg.NestedField{ID: 1, Name: "id", Type: iceberg.PrimitiveTypes.Int64},
	iceberg.NestedField{ID: 2, Name: "data", Type: iceberg.PrimitiveTypes.String},
)

// createDemoTable creates namespace ns and table ns.name with iceberg-go's
// own commit retries off: the scenario is about the proxy, not about the
// client papering over a conflict by re-committing.
func createDemoTable(ctx context.Context, cat icecat.Catalog, ns, name string) (*table.Table, error) {
	if err := cat.CreateNamespace(ctx, table.Identifier{ns}, nil); err != nil {
		return nil, err
	}
	return cat.CreateTable(ctx, table.Identifier{ns, name}, demoSchema,
		icecat.WithProperties(iceberg.Properties{table.CommitNumRetriesKey: "0"}))
}

// appendRows commits one snapshot that appends a small Parquet file.
func appendRows(ctx context.Context, tbl *table.Table) (*table.Table, error) {
	sc, err := table.SchemaToArrowSchema(tbl.Schema(), nil, false, false)
	if err != nil {
		return nil, err
	}
	rows, err := array.TableFromJSON(memory.DefaultAllocator, sc,
		[]string{`[{"id": 1, "data": "first"}, {"id": 2, "data": "second"}]`})
	if err != nil {
		return nil, err
	}
	defer rows.Release()
	txn := tbl.NewTransaction()
	if err := txn.AppendTable(ctx, rows, 1024, nil); err != nil {
		return nil, err
	}
	return txn.Commit(ctx)
}

// testContext bounds a test's client calls.
func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}
