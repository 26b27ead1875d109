package icebergidempotency

import (
	"context"
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
	return startH3Catalog(t, 0, answer)
}

// newH3CatalogResettingFirst is an h3Catalog that resets the stream of
// the first request it gets, in both directions with code, once the whole
// request has arrived and before any answer, as a server failing a
// request does, or turning it away unprocessed with H3_REQUEST_REJECTED.
// quic-go's handler can reset a stream only after its HTTPStream has
// flushed a 200 header, which the client may read before the reset:
// reverse_proxy then has an answer whose body breaks off.
func newH3CatalogResettingFirst(t *testing.T, code http3.ErrCode, answer func(c *h3Catalog, w http.ResponseWriter, r *http.Request)) *h3Catalog {
	t.Helper()
	return startH3Catalog(t, code, answer)
}

// startH3Catalog serves HTTP/3 connection by connection through quic-go's
// RawServerConn, which lets the test take a request stream before the
// handler does; resetFirst 0 resets none.
func startH3Catalog(t *testing.T, resetFirst http3.ErrCode, answer func(c *h3Catalog, w http.ResponseWriter, r *http.Request)) *h3Catalog {
	// httptest's certificate, for 127.0.0.1.
	certSrc := httptest.NewUnstartedServer(nil)
	certSrc.StartTLS()
	cert := certSrc.TLS.Certificates[0]
	certSrc.Close()

	udp, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tr := &quic.Transport{Conn: udp}
	ln, err := tr.ListenEarly(http3.ConfigureTLSConfig(&tls.Config{Certificates: []tls.Certificate{cert}}), nil)
	if err != nil {
		t.Fatal(err)
	}
	c := &h3Catalog{addr: udp.LocalAddr().String()}
	srv := &http3.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		answer(c, w, r)
	})}
	var reset atomic.Bool
	reset.Store(resetFirst == 0)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		for {
			conn, err := ln.Accept(ctx)
			if err != nil {
				return
			}
			raw, err := srv.NewRawServerConn(conn)
			if err != nil {
				_ = conn.CloseWithError(0, "")
				continue
			}
			go func() {
				for {
					str, err := conn.AcceptUniStream(ctx)
					if err != nil {
						return
					}
					go raw.HandleUnidirectionalStream(str)
				}
			}()
			go func() {
				for {
					str, err := conn.AcceptStream(ctx)
					if err != nil {
						return
					}
					if reset.CompareAndSwap(false, true) {
						go func() {
							_, _ = io.Copy(io.Discard, str) // the request, whole
							str.CancelRead(quic.StreamErrorCode(resetFirst))
							str.CancelWrite(quic.StreamErrorCode(resetFirst))
						}()
						continue
					}
					go raw.HandleRequestStream(str)
				}
			}()
		}
	}()
	t.Cleanup(func() {
		cancel()
		_ = ln.Close()
		_ = tr.Close()
		_ = udp.Close()
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
	catalog := newH3Catalog(t, func(c *h3Catalog, _ http.ResponseWriter, r *http.Request) {
		c.execute(r)
		// quic-go resets the stream of a handler that panics, with
		// H3_INTERNAL_ERROR, and sends no header first.
		panic(http.ErrAbortHandler)
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
	catalog := newH3CatalogResettingFirst(t, http3.ErrCodeRequestRejected, executeOK)
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
