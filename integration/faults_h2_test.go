package integration_test

// A catalog spoken to over HTTP/2 that refuses a commit without processing
// it: a GOAWAY whose last stream ID is below the commit's (a catalog
// shutting down gracefully, a load balancer draining its connections), or
// a RST_STREAM with REFUSED_STREAM. No catalog refuses on cue, so the
// first connection is served by x/net's framer, which does exactly that;
// every later one by Go's own HTTP/2 server, which counts executions.

import (
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/net/http2"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
)

// connQueue is a net.Listener of the connections handed to it.
type connQueue struct {
	conns chan net.Conn
	addr  net.Addr
	once  sync.Once
	done  chan struct{}
}

func (q *connQueue) Accept() (net.Conn, error) {
	select {
	case c := <-q.conns:
		return c, nil
	case <-q.done:
		return nil, net.ErrClosed
	}
}

func (q *connQueue) Close() error {
	q.once.Do(func() { close(q.done) })
	return nil
}

func (q *connQueue) Addr() net.Addr { return q.addr }

// refusingH2Catalog listens for h2c; it answers the first connection's
// first stream with goAway (GOAWAY, last stream 0) or a REFUSED_STREAM,
// and serves every later connection, counting the POSTs it executes.
func refusingH2Catalog(t *testing.T, goAway bool) (addr string, executed *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	executed = new(atomic.Int32)
	q := &connQueue{conns: make(chan net.Conn), addr: ln.Addr(), done: make(chan struct{})}
	srv := &http.Server{Protocols: new(http.Protocols), Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		if r.Method == http.MethodPost {
			executed.Add(1)
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"metadata-location":"s3://wh/t/metadata/00001.json","metadata":{}}`)
	})}
	srv.Protocols.SetUnencryptedHTTP2(true)
	go func() { _ = srv.Serve(q) }()
	t.Cleanup(func() { ln.Close(); srv.Close() })
	go func() {
		first := true
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			if !first {
				select {
				case q.conns <- conn:
				case <-q.done:
					conn.Close()
				}
				continue
			}
			first = false
			go refuseFirstStream(conn, goAway)
		}
	}()
	return ln.Addr().String(), executed
}

func refuseFirstStream(conn net.Conn, goAway bool) {
	defer conn.Close()
	if _, err := io.ReadFull(conn, make([]byte, len(http2.ClientPreface))); err != nil {
		return
	}
	fr := http2.NewFramer(conn, conn)
	_ = fr.WriteSettings()
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = fr.WriteSettingsAck()
			}
		case *http2.HeadersFrame:
			if goAway {
				_ = fr.WriteGoAway(0, http2.ErrCodeNo, nil)
				// Read on until Caddy closes: a close right after the
				// GOAWAY could reset it before it is read.
				continue
			}
			_ = fr.WriteRSTStream(f.StreamID, http2.ErrCodeRefusedStream)
			// No new streams here: the retry goes on a new connection.
			_ = fr.WriteGoAway(f.StreamID, http2.ErrCodeNo, nil)
		}
	}
}

// A commit the catalog refused unprocessed is released, its key free: the
// client hears 502 ServiceFailureException, and its retry executes, once.
// Before, the connection it had taken left the key unknown: 502
// CommitStateUnknownException, and every retry 500 for the key's lifetime,
// on each graceful restart of a catalog behind HTTP/2.
//
// Nested: a site-level directive on the memory store around one on
// PostgreSQL (one node's cache in front of the shared store). The inner one
// releases its key; the outer one, which sees only the inner one's 502
// after a connection, used to leave its own key unknown.
func TestFaultH2CatalogRefusesUnprocessed(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		goAway bool
		nested bool
	}{{"GOAWAY", true, false}, {"REFUSED_STREAM", false, false}, {"REFUSED_STREAM nested", false, true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			addr, executed := refusingH2Catalog(t, c.goAway)
			site := "iceberg_idempotency\nreverse_proxy h2c://" + addr
			if c.nested {
				dsn := postgresDB.dsn(t)
				table := postgresDB.newTable(t, dsn)
				site = "iceberg_idempotency\nhandle /v1/* {\niceberg_idempotency {\n" + postgresDB.storeBlock(dsn, table) +
					"\n}\nreverse_proxy h2c://" + addr + "\n}"
			}
			inst := caddyproc.Start(t, caddyproc.Caddyfile("", site))
			const path = "/v1/namespaces/faults/tables/refused"
			key := newKey(t)
			first := send(t, "POST", inst.URL()+path, faultCommitBody, keyHeader, key)
			wantIcebergError(t, "a commit the catalog refused unprocessed", first, http.StatusBadGateway, "ServiceFailureException")
			if n := executed.Load(); n != 0 {
				t.Fatalf("the catalog executed %d times before the retry", n)
			}
			retry := send(t, "POST", inst.URL()+path, faultCommitBody, keyHeader, key)
			wantStatus(t, "the retry of a refused commit", retry, http.StatusOK)
			wantExecuted(t, "the retry of a refused commit", retry)
			wantReplayOf(t, "the retry's retry", send(t, "POST", inst.URL()+path, faultCommitBody, keyHeader, key), retry)
			if n := executed.Load(); n != 1 {
				t.Fatalf("the catalog executed %d times, want once", n)
			}
		})
	}
}
