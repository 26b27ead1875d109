package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"

	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"github.com/apache/iceberg-go"
	icecat "github.com/apache/iceberg-go/catalog"
	"github.com/apache/iceberg-go/catalog/rest"
	"github.com/apache/iceberg-go/table"
	"github.com/google/uuid"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/catalog"
)

// Report is what the walk-through observed; the demo's test checks it.
type Report struct {
	Lifetime string // idempotency-key-lifetime advertised by the proxy

	NamespaceStatus, TableStatus int
	NamespaceExecutions          int
	TableExecutions              int

	CommitKey        string
	LostStatus       int  // the catalog's answer the client never saw
	RetryStatus      int  // the answer to the resent commit
	RetryReplayed    bool // Idempotent-Replayed: true on the retry
	RetryBodySame    bool // retry body byte-identical to the lost one
	CommitExecutions int  // catalog executions of updateTable
	CommitErr        error
	SnapshotsBefore  int
	SnapshotsAfter   int
}

// Exchange is one request and its answer as seen on the wire.
type exchange struct {
	Key    string
	Status int
	Header http.Header
	Body   []byte
}

func (e exchange) replayed() bool { return e.Header.Get("Idempotent-Replayed") == "true" }

// demoTransport gives every mutation a fresh UUIDv7 Idempotency-Key (as the
// Iceberg Java client does; iceberg-go does not yet) and remembers the last
// answer. When armed, it loses the answer to the next table commit: it
// reads and discards it, then resends the very same request with the same
// key, the way a client's HTTP retry does after a dropped connection.
type demoTransport struct {
	base http.RoundTripper

	mu     sync.Mutex
	last   exchange
	armed  bool
	onLost func(lost exchange) // called between the lost answer and the resend
	lost   exchange
}

func (d *demoTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method == http.MethodGet || req.Method == http.MethodHead {
		return d.base.RoundTrip(req)
	}
	key, err := uuid.NewV7()
	if err != nil {
		return nil, err
	}
	var body []byte
	if req.Body != nil {
		if body, err = io.ReadAll(req.Body); err != nil {
			return nil, err
		}
		_ = req.Body.Close()
	}
	send := func() (*http.Response, exchange, error) {
		r := req.Clone(req.Context())
		r.Header.Set("Idempotency-Key", key.String())
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
		resp, err := d.base.RoundTrip(r)
		if err != nil {
			return nil, exchange{}, err
		}
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil {
			return nil, exchange{}, err
		}
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return resp, exchange{Key: key.String(), Status: resp.StatusCode, Header: resp.Header.Clone(), Body: b}, nil
	}

	d.mu.Lock()
	lose := d.armed && isTableCommit(req)
	if lose {
		d.armed = false
	}
	d.mu.Unlock()
	if lose {
		_, lost, err := send()
		if err != nil {
			return nil, err
		}
		d.mu.Lock()
		d.lost = lost
		d.mu.Unlock()
		if d.onLost != nil {
			d.onLost(lost)
		}
	}
	resp, ex, err := send()
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.last = ex
	d.mu.Unlock()
	return resp, nil
}

func (d *demoTransport) lastExchange() exchange {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.last
}

// isTableCommit matches updateTable: POST .../namespaces/{ns}/tables/{table}.
func isTableCommit(r *http.Request) bool {
	segs := strings.Split(strings.Trim(r.URL.EscapedPath(), "/"), "/")
	n := len(segs)
	return r.Method == http.MethodPost && n >= 5 && segs[0] == "v1" && segs[n-4] == "namespaces" && segs[n-2] == "tables"
}

// walkthrough drives iceberg-go's REST client through the proxy: create a
// namespace and a table, then a commit whose answer is lost and resent. It
// narrates to out and returns what it saw.
func walkthrough(ctx context.Context, s *stack, out io.Writer) (*Report, error) {
	rep := &Report{}
	p := func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }

	p("Iceberg REST catalog (bundled, SQLite + file warehouse): %s", s.CatalogURL)
	p("Caddy with iceberg_idempotency in front of it:           %s", s.ProxyURL)
	p("")

	// 1. What a client learns from the proxy.
	lifetime, err := advertisedLifetime(ctx, s.ProxyURL)
	if err != nil {
		return rep, err
	}
	rep.Lifetime = lifetime
	p("1. GET /v1/config through the proxy")
	p("   idempotency-key-lifetime: %s  (added by the proxy: clients may send Idempotency-Key)", lifetime)
	p("")

	tr := &demoTransport{base: &http.Transport{DisableCompression: true}}
	cat, err := rest.NewCatalog(ctx, "demo", s.ProxyURL, rest.WithCustomTransport(tr))
	if err != nil {
		return rep, fmt.Errorf("connecting iceberg-go to the proxy: %w", err)
	}
	defer cat.Close()

	// 2. Namespace.
	ns := table.Identifier{"demo"}
	if err := cat.CreateNamespace(ctx, ns, nil); err != nil {
		return rep, fmt.Errorf("creating namespace: %w", err)
	}
	ex := tr.lastExchange()
	rep.NamespaceStatus = ex.Status
	rep.NamespaceExecutions = s.Catalog.Executions(catalog.OpCreateNamespace)
	p("2. Create namespace %q   (Idempotency-Key %s)", "demo", ex.Key)
	p("   -> %d    catalog executions of createNamespace: %d", ex.Status, rep.NamespaceExecutions)
	p("")

	// 3. Table; iceberg-go's own commit retries stay off so that what
	// happens below is the proxy's doing alone.
	ident := table.Identifier{"demo", "events"}
	schema := iceberg.NewSchema(0,
		iceberg.NestedField{ID: 1, Name: "id", Type: iceberg.PrimitiveTypes.Int64},
		iceberg.NestedField{ID: 2, Name: "data", Type: iceberg.PrimitiveTypes.String},
	)
	tbl, err := cat.CreateTable(ctx, ident, schema,
		icecat.WithProperties(iceberg.Properties{table.CommitNumRetriesKey: "0"}))
	if err != nil {
		return rep, fmt.Errorf("creating table: %w", err)
	}
	ex = tr.lastExchange()
	rep.TableStatus = ex.Status
	rep.TableExecutions = s.Catalog.Executions(catalog.OpCreateTable)
	rep.SnapshotsBefore = len(tbl.Metadata().Snapshots())
	p("3. Create table demo.events   (Idempotency-Key %s)", ex.Key)
	p("   -> %d    catalog executions of createTable: %d    snapshots: %d", ex.Status, rep.TableExecutions, rep.SnapshotsBefore)
	p("")

	// 4. The commit whose answer is lost.
	p("4. Append two rows: one table commit (updateTable), whose answer gets lost")
	tr.mu.Lock()
	tr.armed = true
	tr.onLost = func(lost exchange) {
		p("   commit sent with Idempotency-Key %s", lost.Key)
		p("   -> the catalog answered %d and committed (executions of updateTable: %d)",
			lost.Status, s.Catalog.Executions(catalog.OpUpdateTable))
		p("   xx the connection drops: the client never sees that answer")
		p("   client resends the very same request with the same key ...")
	}
	tr.mu.Unlock()
	_, rep.CommitErr = appendRows(ctx, tbl)

	tr.mu.Lock()
	lost := tr.lost
	tr.mu.Unlock()
	retry := tr.lastExchange()
	rep.CommitKey = lost.Key
	rep.LostStatus = lost.Status
	rep.RetryStatus = retry.Status
	rep.RetryReplayed = retry.replayed()
	rep.RetryBodySame = lost.Status != 0 && bytes.Equal(lost.Body, retry.Body)
	rep.CommitExecutions = s.Catalog.Executions(catalog.OpUpdateTable)
	p("   -> %d    Idempotent-Replayed: %v    body identical to the lost answer: %v",
		retry.Status, rep.RetryReplayed, yesNo(rep.RetryBodySame))
	p("   catalog executions of updateTable: %d", rep.CommitExecutions)
	if rep.CommitErr != nil {
		p("   iceberg-go says: commit FAILED: %v", rep.CommitErr)
	} else {
		p("   iceberg-go says: commit succeeded")
	}

	reloaded, err := cat.LoadTable(ctx, ident)
	if err != nil {
		return rep, fmt.Errorf("reloading table: %w", err)
	}
	rep.SnapshotsAfter = len(reloaded.Metadata().Snapshots())
	p("   snapshots: %d before, %d after", rep.SnapshotsBefore, rep.SnapshotsAfter)
	p("")
	p("Without iceberg_idempotency the resent commit reaches the catalog again and gets")
	p("409 CommitFailedException (the table moved on because of the first attempt):")
	p("the client reports a failure for a commit that is in the table.")
	if rep.CommitErr != nil {
		return rep, fmt.Errorf("the commit failed: %w", rep.CommitErr)
	}
	return rep, nil
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// advertisedLifetime reads idempotency-key-lifetime from GET /v1/config.
func advertisedLifetime(ctx context.Context, proxyURL string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, proxyURL+"/v1/config", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("GET /v1/config: %w", err)
	}
	defer resp.Body.Close()
	var cfg struct {
		Lifetime string `json:"idempotency-key-lifetime"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&cfg); err != nil {
		return "", fmt.Errorf("GET /v1/config: %s: %w", resp.Status, err)
	}
	if cfg.Lifetime == "" {
		return "", errors.New("GET /v1/config: no idempotency-key-lifetime: is the module in front of the catalog?")
	}
	return cfg.Lifetime, nil
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
