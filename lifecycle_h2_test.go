package icebergidempotency

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// Keyed mutations over HTTP/2 (`versions 2` over TLS, or `h2c`), chiefly
// body-less ones (dropTable, dropView, dropNamespace, cancelPlanning,
// unregisterTable). reverse_proxy hands Go's
// transport such a request with no body, and a transport may resend a
// body-less request by itself after some stream resets. Which resets is a
// property of the HTTP/2 transport reverse_proxy runs: golang.org/x/net's
// (http2.ConfigureTransport, for `versions 2` and `h2c` alike), which this
// module requires at v0.60.0 or later. Go 1.26's own copy in net/http also
// resends after a RST_STREAM with PROTOCOL_ERROR, which proves nothing
// about processing; x/net's does not, and these tests keep it so (with the
// PROTOCOL_ERROR resend put back into x/net, the first one fails: the
// catalog executes twice and the first answer is the second run's 200).
// Built with Go 1.27 or later, x/net's ConfigureTransport hands HTTP/2 to
// net/http's own code, which there no longer resends after PROTOCOL_ERROR;
// CI runs these tests under Go 1.27 as well.
//
// No Go HTTP/2 server resets a stream after running its handler on
// purpose; a load balancer in front of a catalog can. The catalog here is
// x/net's framer on a raw connection, which answers as each case tells.

// h2FirstStream is what h2Catalog does with the first request of the
// tested method.
type h2FirstStream int

const (
	h2ExecuteThenResetProtocol h2FirstStream = iota // counted as executed, then RST_STREAM PROTOCOL_ERROR
	h2RefuseUnprocessed                             // not executed: RST_STREAM REFUSED_STREAM
	h2GoAwayUnprocessed                             // not executed: GOAWAY below the stream
)

// h2Catalog is an HTTP/2 server (h2c, or h2 over TLS) that executes every
// request; the first request of method it treats as first says. The
// others get 200 with a JSON body.
type h2Catalog struct {
	addr     string
	executed atomic.Int32 // requests of method executed
	streams  atomic.Int32 // HEADERS of method received
}

func newH2Catalog(t *testing.T, overTLS bool, method string, first h2FirstStream) *h2Catalog {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var cfg *tls.Config
	if overTLS {
		certSrc := httptest.NewUnstartedServer(nil)
		certSrc.StartTLS()
		cfg = &tls.Config{Certificates: certSrc.TLS.Certificates, NextProtos: []string{"h2"}}
		certSrc.Close()
	}
	c := &h2Catalog{addr: ln.Addr().String()}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	var conns sync.Map
	t.Cleanup(func() {
		conns.Range(func(k, _ any) bool { k.(net.Conn).Close(); return true })
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Store(conn, nil)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer conn.Close()
				if cfg != nil {
					tc := tls.Server(conn, cfg)
					if tc.Handshake() != nil {
						return
					}
					conn = tc
				}
				c.serveConn(conn, method, first)
			}()
		}
	}()
	return c
}

// serveH2Frames reads the client's preface from conn, sends the server's
// settings, acknowledges the client's, and hands every other frame to
// handle, headers decoded, until the connection ends or handle says stop.
func serveH2Frames(conn net.Conn, handle func(fr *http2.Framer, f http2.Frame) (more bool)) {
	if _, err := io.ReadFull(conn, make([]byte, len(http2.ClientPreface))); err != nil {
		return
	}
	fr := http2.NewFramer(conn, conn)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	_ = fr.WriteSettings()
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		if s, ok := f.(*http2.SettingsFrame); ok {
			if !s.IsAck() {
				_ = fr.WriteSettingsAck()
			}
			continue
		}
		if !handle(fr, f) {
			return
		}
	}
}

func (c *h2Catalog) serveConn(conn net.Conn, method string, first h2FirstStream) {
	answer := func(fr *http2.Framer, id uint32) {
		var block bytes.Buffer
		enc := hpack.NewEncoder(&block)
		_ = enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
		_ = enc.WriteField(hpack.HeaderField{Name: "content-type", Value: "application/json"})
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block.Bytes(), EndHeaders: true})
		_ = fr.WriteData(id, true, []byte(`{"metadata-location":"s3://w/t/metadata/00001.json"}`))
	}
	misbehave := func(fr *http2.Framer, id uint32) {
		switch first {
		case h2ExecuteThenResetProtocol:
			c.executed.Add(1)
			_ = fr.WriteRSTStream(id, http2.ErrCodeProtocol)
		case h2RefuseUnprocessed:
			_ = fr.WriteRSTStream(id, http2.ErrCodeRefusedStream)
		case h2GoAwayUnprocessed:
			// The connection stays open until the client, done with
			// it, closes it: closed at once, it could end before the
			// GOAWAY is read, which proves nothing.
			_ = fr.WriteGoAway(id-1, http2.ErrCodeNo, nil)
		}
	}
	// Each request is acted on once it is whole, as a catalog does. An
	// answer or reset while the transport still writes the body has the
	// transport close the body as Caddy's reverse_proxy (v2.11.9) reads
	// it, and its wrapper's count of bytes read is no atomic: a data race
	// of Caddy's own, which -race reports.
	waiting := map[uint32]func(*http2.Framer, uint32){}
	serveH2Frames(conn, func(fr *http2.Framer, f http2.Frame) bool {
		switch f := f.(type) {
		case *http2.DataFrame:
			if act, ok := waiting[f.StreamID]; ok && f.StreamEnded() {
				delete(waiting, f.StreamID)
				act(fr, f.StreamID)
			}
		case *http2.MetaHeadersFrame:
			act := answer
			if f.PseudoValue("method") == method {
				if c.streams.Add(1) == 1 {
					act = misbehave
				} else {
					c.executed.Add(1)
				}
			}
			if f.StreamEnded() {
				act(fr, f.StreamID)
			} else {
				waiting[f.StreamID] = act
			}
		}
		return true
	})
}

// runOverH2cAndTLS runs f as the subtests name/h2c and name/h2 over TLS.
func runOverH2cAndTLS(t *testing.T, name string, f func(t *testing.T, overTLS bool)) {
	t.Run(name+"/h2c", func(t *testing.T) { f(t, false) })
	t.Run(name+"/h2 over TLS", func(t *testing.T) { f(t, true) })
}

// h2Refusals are the two ways an HTTP/2 server proves it did not process
// a stream.
var h2Refusals = []struct {
	name  string
	first h2FirstStream
}{
	{"REFUSED_STREAM", h2RefuseUnprocessed},
	{"GOAWAY", h2GoAwayUnprocessed},
}

// overHTTP2 makes reverse_proxy speak HTTP/2 to the catalog: h2c, or h2
// over TLS (a self-signed certificate) with the default versions.
func overHTTP2(overTLS bool) func(*reverseproxy.Handler) {
	ht := &reverseproxy.HTTPTransport{Versions: []string{"h2c"}}
	if overTLS {
		ht = &reverseproxy.HTTPTransport{TLS: &reverseproxy.TLSConfig{InsecureSkipVerify: true}}
	}
	return func(rp *reverseproxy.Handler) {
		rp.TransportRaw = caddyconfig.JSONModuleObject(ht, "protocol", "http", nil)
	}
}

// A body-less keyed mutation the catalog (or a load balancer before it)
// executed and then reset with PROTOCOL_ERROR: the transport must not
// resend it, and the key's outcome is unknown. Were it resent, the drop
// or unregister would run twice, and every retry would be replayed the
// second run's answer (404 NoSuchTable, where the first run's 200 carried
// the unregistered table's metadata location).
func TestBodylessKeyedMutationIsNotResentAfterAnHTTP2Reset(t *testing.T) {
	for _, c := range []struct {
		name, method, path string
	}{
		{"dropTable", http.MethodDelete, commitPath},
		{"unregisterTable", http.MethodPost, commitPath + "/unregister"},
	} {
		runOverH2cAndTLS(t, c.name, func(t *testing.T, tlsOn bool) {
			catalog := newH2Catalog(t, tlsOn, c.method, h2ExecuteThenResetProtocol)
			h := newTestHandler(t, newMemoryStore(t))
			proxy := newReverseProxy(t, catalog.addr, overHTTP2(tlsOn))
			key := storetest.NewKey(t)
			first := serve(t, h, proxy, c.method, c.path, key, "")
			if first.code() != http.StatusBadGateway || first.errorType() != typeCommitStateUnknown {
				t.Fatalf("first answer = %d %q %v, want 502 %s", first.code(), first.body, first.err, typeCommitStateUnknown)
			}
			retry := serve(t, h, proxy, c.method, c.path, key, "")
			if retry.code() != http.StatusInternalServerError || retry.errorType() != typeCommitStateUnknown {
				t.Fatalf("retry = %d %q, want 500 %s", retry.code(), retry.body, typeCommitStateUnknown)
			}
			if n, s := catalog.executed.Load(), catalog.streams.Load(); n != 1 || s != 1 {
				t.Fatalf("the catalog got the keyed %s %d times and executed it %d times, want 1 and 1", c.method, s, n)
			}
		})
	}
}

// A body-less keyed mutation the catalog provably did not process
// (REFUSED_STREAM, or a GOAWAY that left its stream out) is resent by the
// transport itself, on another stream or connection: it executes once,
// its answer is stored, and a retry is replayed it.
func TestBodylessKeyedMutationRefusedOverHTTP2RunsOnce(t *testing.T) {
	for _, c := range h2Refusals {
		runOverH2cAndTLS(t, c.name, func(t *testing.T, tlsOn bool) {
			catalog := newH2Catalog(t, tlsOn, http.MethodDelete, c.first)
			h := newTestHandler(t, newMemoryStore(t))
			proxy := newReverseProxy(t, catalog.addr, overHTTP2(tlsOn))
			key := storetest.NewKey(t)
			first := serve(t, h, proxy, http.MethodDelete, commitPath, key, "")
			if first.code() != http.StatusOK {
				t.Fatalf("first answer = %d %q %v, want 200", first.code(), first.body, first.err)
			}
			retry := serve(t, h, proxy, http.MethodDelete, commitPath, key, "")
			if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "true" {
				t.Fatalf("retry = %d %q %v, want a replayed 200", retry.code(), retry.header, retry.body)
			}
			if n, s := catalog.executed.Load(), catalog.streams.Load(); n != 1 || s != 2 {
				t.Fatalf("the catalog got the keyed DELETE %d times and executed it %d times, want 2 and 1", s, n)
			}
		})
	}
}

// A keyed commit with a body that the catalog provably did not process
// (REFUSED_STREAM, or a GOAWAY that left its stream out): the transport
// cannot resend it, as the handler gives it no way to rewind the body, so
// its error comes back; the handler reads it as unprocessed and releases
// the key, and the retry executes once. TestUnprocessedErrors reads the
// errors of net/http's HTTP/2; this reads those of the one reverse_proxy
// runs (x/net's, or from Go 1.27 on net/http's, which x/net hands HTTP/2
// to), whose texts the handler must recognise as well.
func TestKeyedCommitRefusedOverHTTP2IsReleased(t *testing.T) {
	for _, c := range h2Refusals {
		runOverH2cAndTLS(t, c.name, func(t *testing.T, tlsOn bool) {
			catalog := newH2Catalog(t, tlsOn, http.MethodPost, c.first)
			h := newTestHandler(t, newMemoryStore(t))
			proxy := newReverseProxy(t, catalog.addr, overHTTP2(tlsOn))
			key := storetest.NewKey(t)
			first := serve(t, h, proxy, http.MethodPost, commitPath, key, commitBody)
			if first.code() != http.StatusBadGateway || first.errorType() == typeCommitStateUnknown {
				t.Fatalf("first answer = %d %q %v, want 502 saying the catalog did not process it", first.code(), first.body, first.err)
			}
			if n := catalog.executed.Load(); n != 0 {
				t.Fatalf("the catalog executed the refused commit %d times", n)
			}
			retry := serve(t, h, proxy, http.MethodPost, commitPath, key, commitBody)
			if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "" {
				t.Fatalf("retry = %d %v %q, want 200 executed", retry.code(), retry.header, retry.body)
			}
			if n, s := catalog.executed.Load(), catalog.streams.Load(); n != 1 || s != 2 {
				t.Fatalf("the catalog got the keyed POST %d times and executed it %d times, want 2 and 1", s, n)
			}
		})
	}
}

// Two catalog nodes behind lb_retries (whose default retries dial errors
// only), as in a rolling restart: the first pick is down (nothing sent),
// the second refuses the stream unprocessed. No catalog processed the
// commit, so the key is released. Before, reverse_proxy's count of its
// retries (the dial error's) made the refusal "unknown", and every retry
// with the key heard 500 CommitStateUnknownException for the key's life.
func TestRefusedAfterADialErrorIsReleased(t *testing.T) {
	for _, c := range h2Refusals {
		runOverH2cAndTLS(t, c.name, func(t *testing.T, tlsOn bool) {
			catalog := newH2Catalog(t, tlsOn, http.MethodPost, c.first)
			h := newTestHandler(t, newMemoryStore(t))
			proxy := newReverseProxy(t, catalog.addr, overHTTP2(tlsOn), func(rp *reverseproxy.Handler) {
				// round_robin picks the pool's second upstream first.
				rp.Upstreams = reverseproxy.UpstreamPool{{Dial: catalog.addr}, {Dial: deadAddr(t)}}
				rp.LoadBalancing = &reverseproxy.LoadBalancing{
					Retries:            1,
					SelectionPolicyRaw: json.RawMessage(`{"policy":"round_robin"}`),
				}
			})
			key := storetest.NewKey(t)
			first := serve(t, h, proxy, http.MethodPost, commitPath, key, commitBody)
			if first.code() != http.StatusBadGateway || first.errorType() == typeCommitStateUnknown {
				t.Fatalf("first answer = %d %q %v, want 502 saying the catalog did not process it", first.code(), first.body, first.err)
			}
			if n, s := catalog.executed.Load(), catalog.streams.Load(); n != 0 || s != 1 {
				t.Fatalf("the catalog got the keyed POST %d times and executed it %d times, want 1 and 0", s, n)
			}
			retry := serve(t, h, proxy, http.MethodPost, commitPath, key, commitBody)
			if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "" {
				t.Fatalf("retry = %d %v %q, want 200 executed", retry.code(), retry.header, retry.body)
			}
			if n := catalog.executed.Load(); n != 1 {
				t.Fatalf("the catalog executed the commit %d times, want 1", n)
			}
		})
	}
}

// An HTTP/2 catalog closes an idle connection with a GOAWAY; a commit sent
// on it as it does is refused unprocessed: released, and the client hears
// 502. When the connection had idled a second or more, the warning names
// keepalive, as for the HTTP/1 connection that breaks
// (TestStaleKeepAliveConnectionIsNamed).
func TestRefusalOnAnIdleHTTP2ConnectionIsNamed(t *testing.T) {
	catalog := newH2Catalog(t, true, http.MethodPost, h2GoAwayUnprocessed)
	core, logs := observer.New(zapcore.WarnLevel)
	h := newTestHandler(t, newMemoryStore(t))
	h.logger = zap.New(core)
	proxy := newReverseProxy(t, catalog.addr, overHTTP2(true))
	if r := serve(t, h, proxy, http.MethodGet, commitPath, "", ""); r.code() != http.StatusOK {
		t.Fatalf("warm-up read = %d %v", r.code(), r.err)
	}
	idle := staleIdle + 200*time.Millisecond
	time.Sleep(idle)
	first := serve(t, h, proxy, http.MethodPost, commitPath, storetest.NewKey(t), commitBody)
	if first.code() != http.StatusBadGateway || first.errorType() == typeCommitStateUnknown {
		t.Fatalf("first answer = %d %q %v, want 502 saying the catalog did not process it", first.code(), first.body, first.err)
	}
	named := logs.FilterMessageSnippet("keepalive").All()
	if len(named) != 1 {
		t.Fatalf("warnings naming keepalive: %d, want 1; all: %v", len(named), logs.All())
	}
	if got, _ := named[0].ContextMap()["idle_for"].(time.Duration); got < idle-100*time.Millisecond {
		t.Fatalf("idle_for = %v, want about %v", got, idle)
	}
}

// A GET that X-HTTP-Method-Override makes a commit, over HTTP/2: reset
// after the catalog executed it, the outcome is unknown and it ran once;
// refused unprocessed, it is released and the retry executes it once. Its
// body is one the transport cannot rewind (unrewindableBody), so the
// transport resends neither itself: a refusal reaches the client as a
// 502 where a body-less request would have been resent unseen, the price
// of the HTTP/1 transport not resending the executed one
// (TestOverriddenReadIsNotResentByTheTransport).
func TestOverriddenReadOverHTTP2(t *testing.T) {
	get := func(t *testing.T, h *Handler, proxy caddyhttp.Handler, key string) result {
		return serve(t, h, proxy, http.MethodGet, commitPath, key, "", methodOverrideHeader, http.MethodPost)
	}
	runOverH2cAndTLS(t, "reset after executing", func(t *testing.T, tlsOn bool) {
		catalog := newH2Catalog(t, tlsOn, http.MethodGet, h2ExecuteThenResetProtocol)
		h := newTestHandler(t, newMemoryStore(t))
		proxy := newReverseProxy(t, catalog.addr, overHTTP2(tlsOn))
		key := storetest.NewKey(t)
		if first := get(t, h, proxy, key); first.code() != http.StatusBadGateway || first.errorType() != typeCommitStateUnknown {
			t.Fatalf("first answer = %d %q %v, want 502 %s", first.code(), first.body, first.err, typeCommitStateUnknown)
		}
		if retry := get(t, h, proxy, key); retry.code() != http.StatusInternalServerError || retry.errorType() != typeCommitStateUnknown {
			t.Fatalf("retry = %d %q, want 500 %s", retry.code(), retry.body, typeCommitStateUnknown)
		}
		if n, s := catalog.executed.Load(), catalog.streams.Load(); n != 1 || s != 1 {
			t.Fatalf("the catalog got the overridden GET %d times and executed it %d times, want 1 and 1", s, n)
		}
	})
	for _, c := range h2Refusals {
		runOverH2cAndTLS(t, c.name, func(t *testing.T, tlsOn bool) {
			catalog := newH2Catalog(t, tlsOn, http.MethodGet, c.first)
			h := newTestHandler(t, newMemoryStore(t))
			proxy := newReverseProxy(t, catalog.addr, overHTTP2(tlsOn))
			key := storetest.NewKey(t)
			if first := get(t, h, proxy, key); first.code() != http.StatusBadGateway || first.errorType() == typeCommitStateUnknown {
				t.Fatalf("first answer = %d %q %v, want 502 saying the catalog did not process it", first.code(), first.body, first.err)
			}
			if retry := get(t, h, proxy, key); retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "" {
				t.Fatalf("retry = %d %v %q, want 200 executed", retry.code(), retry.header, retry.body)
			}
			if n, s := catalog.executed.Load(), catalog.streams.Load(); n != 1 || s != 2 {
				t.Fatalf("the catalog got the overridden GET %d times and executed it %d times, want 2 and 1", s, n)
			}
		})
	}
}
