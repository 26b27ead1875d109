package icebergidempotency

import (
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// reverse_proxy's HTTP/3 transport (`versions 3`) is quic-go's, not Go's:
// its own errors, its own resends, and its own httptrace calls. These tests
// run real reverse_proxy against a real quic-go HTTP/3 server, whose handler
// misbehaves on purpose where a case needs it.

// h3Catalog is an HTTP/3 catalog on a UDP port of 127.0.0.1 with a
// self-signed certificate. It counts the requests it executes: those
// answer passes to it after reading the body.
type h3Catalog struct {
	addr     string
	executed atomic.Int32
}

func newH3Catalog(t *testing.T, answer func(c *h3Catalog, w http.ResponseWriter, r *http.Request)) *h3Catalog {
	t.Helper()
	// httptest's certificate, for 127.0.0.1.
	certSrc := httptest.NewUnstartedServer(nil)
	certSrc.StartTLS()
	cert := certSrc.TLS.Certificates[0]
	certSrc.Close()

	conn, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &h3Catalog{addr: conn.LocalAddr().String()}
	srv := &http3.Server{
		TLSConfig: http3.ConfigureTLSConfig(&tls.Config{Certificates: []tls.Certificate{cert}}),
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			answer(c, w, r)
		}),
	}
	go func() { _ = srv.Serve(conn) }()
	t.Cleanup(func() {
		_ = srv.Close()
		_ = conn.Close()
	})
	return c
}

// execute reads the request's body and counts it as executed.
func (c *h3Catalog) execute(r *http.Request) {
	_, _ = io.ReadAll(r.Body)
	c.executed.Add(1)
}

// executeOK executes the request and answers like a catalog that committed.
func executeOK(c *h3Catalog, w http.ResponseWriter, r *http.Request) {
	c.execute(r)
	answerOK(w, r)
}

// overH3 makes reverse_proxy speak HTTP/3, configured as cfg.
func overH3(cfg reverseproxy.TLSConfig) func(*reverseproxy.Handler) {
	return func(rp *reverseproxy.Handler) {
		rp.TransportRaw = caddyconfig.JSONModuleObject(&reverseproxy.HTTPTransport{TLS: &cfg, Versions: []string{"3"}}, "protocol", "http", nil)
	}
}

var insecureH3 = overH3(reverseproxy.TLSConfig{InsecureSkipVerify: true})

// resetStream takes the request's stream over and resets both of its
// directions with code, as a catalog's HTTP/3 server does when it fails a
// request or, with H3_REQUEST_REJECTED, turns it away unprocessed.
func resetStream(w http.ResponseWriter, code http3.ErrCode) {
	str := w.(http3.HTTPStreamer).HTTPStream()
	str.CancelRead(quic.StreamErrorCode(code))
	str.CancelWrite(quic.StreamErrorCode(code))
}

// Over HTTP/3 a commit executes once and its retry is replayed.
func TestHTTP3CommitExecutesOnceAndReplays(t *testing.T) {
	catalog := newH3Catalog(t, executeOK)
	h := newTestHandler(t, newMemoryStore(t))
	rp := newReverseProxy(t, catalog.addr, insecureH3)
	key := storetest.NewKey(t)
	first := serve(t, h, rp, http.MethodPost, commitPath, key, commitBody)
	retry := serve(t, h, rp, http.MethodPost, commitPath, key, commitBody)
	if first.code() != http.StatusOK || retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "true" ||
		retry.body != first.body || catalog.executed.Load() != 1 {
		t.Fatalf("first = %d %q, retry = %d %q (replayed %q), catalog executed %d; want 200, a replay of it, one execution",
			first.code(), first.body, retry.code(), retry.body, retry.header.Get(ReplayedHeader), catalog.executed.Load())
	}
}

// A catalog that executes and then resets the stream (H3_INTERNAL_ERROR)
// may have committed: the outcome is unknown, and the retry does not
// execute again.
func TestHTTP3StreamResetAfterExecutingIsUnknown(t *testing.T) {
	catalog := newH3Catalog(t, func(c *h3Catalog, w http.ResponseWriter, r *http.Request) {
		c.execute(r)
		resetStream(w, http3.ErrCodeInternalError)
	})
	h := newTestHandler(t, newMemoryStore(t))
	rp := newReverseProxy(t, catalog.addr, insecureH3)
	key := storetest.NewKey(t)
	first := serve(t, h, rp, http.MethodPost, commitPath, key, commitBody)
	retry := serve(t, h, rp, http.MethodPost, commitPath, key, commitBody)
	if first.errorType() != typeCommitStateUnknown || retry.errorType() != typeCommitStateUnknown || catalog.executed.Load() != 1 {
		t.Fatalf("first = %d %q, retry = %d %q, catalog executed %d; want outcome unknown twice and one execution",
			first.code(), first.body, retry.code(), retry.body, catalog.executed.Load())
	}
}

// H3_REQUEST_REJECTED is HTTP/3's proof that the catalog did not process
// the request (RFC 9114, 4.1.1 and 8.1: the client may treat it as never
// sent); a catalog's HTTP/3 server answers it to requests that arrive
// during its graceful shutdown. quic-go resends only a request whose body
// it can rewind, which a body this handler read is not: the key is
// released, and the retry executes. The catalog here rejects the first
// commit on purpose (the real server's shutdown rejects only requests that
// race its GOAWAY, which a test cannot time).
func TestHTTP3RejectedRequestReleasesTheKey(t *testing.T) {
	var rejected atomic.Bool
	catalog := newH3Catalog(t, func(c *h3Catalog, w http.ResponseWriter, r *http.Request) {
		if rejected.CompareAndSwap(false, true) {
			resetStream(w, http3.ErrCodeRequestRejected)
			return
		}
		executeOK(c, w, r)
	})
	h := newTestHandler(t, newMemoryStore(t))
	rp := newReverseProxy(t, catalog.addr, insecureH3)
	key := storetest.NewKey(t)
	first := serve(t, h, rp, http.MethodPost, commitPath, key, commitBody)
	if first.errorType() == typeCommitStateUnknown || catalog.executed.Load() != 0 {
		t.Fatalf("first = %d %q, catalog executed %d; want a retryable error: the catalog rejected the request unprocessed",
			first.code(), first.body, catalog.executed.Load())
	}
	retry := serve(t, h, rp, http.MethodPost, commitPath, key, commitBody)
	if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "" || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %q (replayed %q), catalog executed %d; want it to execute once",
			retry.code(), retry.body, retry.header.Get(ReplayedHeader), catalog.executed.Load())
	}
}

// A handshake that fails (a certificate not trusted) sends nothing over
// HTTP/3 either: the key is released, and the retry executes.
func TestHTTP3FailedHandshakeReleasesTheKey(t *testing.T) {
	catalog := newH3Catalog(t, executeOK)
	h := newTestHandler(t, newMemoryStore(t))
	key := storetest.NewKey(t)
	first := serve(t, h, newReverseProxy(t, catalog.addr, overH3(reverseproxy.TLSConfig{})), http.MethodPost, commitPath, key, commitBody)
	if first.errorType() == typeCommitStateUnknown || catalog.executed.Load() != 0 {
		t.Fatalf("first = %d %q, catalog executed %d; want a retryable error and nothing executed",
			first.code(), first.body, catalog.executed.Load())
	}
	retry := serve(t, h, newReverseProxy(t, catalog.addr, insecureH3), http.MethodPost, commitPath, key, commitBody)
	if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "" || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %q (replayed %q), catalog executed %d; want it to execute once",
			retry.code(), retry.body, retry.header.Get(ReplayedHeader), catalog.executed.Load())
	}
}

// execution_timeout while the QUIC handshake still waits for a catalog
// that never answers it (a UDP socket that swallows every packet: a fake,
// as a real catalog stalls so only when it hangs) sent nothing: the key
// is released, and the retry executes.
func TestHTTP3TimeoutDuringTheHandshakeReleasesTheKey(t *testing.T) {
	silent, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = silent.Close() })
	go func() {
		buf := make([]byte, 2048)
		for {
			if _, _, err := silent.ReadFrom(buf); err != nil {
				return
			}
		}
	}()
	h := newTestHandler(t, newMemoryStore(t))
	h.ExecutionTimeout = caddy.Duration(400 * time.Millisecond)
	key := storetest.NewKey(t)
	first := serve(t, h, newReverseProxy(t, silent.LocalAddr().String(), insecureH3), http.MethodPost, commitPath, key, commitBody)
	if first.errorType() == typeCommitStateUnknown {
		t.Fatalf("first = %d %q: the handshake never completed, nothing was sent, yet the outcome is unknown", first.code(), first.body)
	}
	catalog := newH3Catalog(t, executeOK)
	retry := serve(t, h, newReverseProxy(t, catalog.addr, insecureH3), http.MethodPost, commitPath, key, commitBody)
	if retry.code() != http.StatusOK || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %q, catalog executed %d; want it to execute once", retry.code(), retry.body, catalog.executed.Load())
	}
}
