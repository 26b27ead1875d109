package icebergidempotency

import (
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A call whose transport asked for a connection and never got one wrote
// nothing, whatever error ended it: the key is released and the retry
// executes. Before, only a dial error, a handshake the transport reported
// as failed, or a context error proved it; every other error of a call
// without a connection marked the key unknown for lifetime + grace, where
// without the module the retry would simply have run. (The tests that
// hold a catalog breaking off after executing to "unknown", over HTTP/1,
// HTTP/2, h2c and HTTP/3, show that no transport writes before it reports
// the connection.)

// releasedOverTLS sends a keyed commit to an HTTPS catalog through a
// reverse_proxy configured by failing, which gets no connection to it, and
// fails t unless the key is released (the module's own 502/504
// ServiceFailureException, nothing executed) and a retry over a working
// transport executes once.
func releasedOverTLS(t *testing.T, failing func(*reverseproxy.Handler)) {
	t.Helper()
	catalog := newCountingCatalogTLS(t, answerOK)
	h := newTestHandler(t, newMemoryStore(t))
	key := storetest.NewKey(t)
	first := serve(t, h, newReverseProxy(t, catalog.addr(), failing), http.MethodPost, commitPath, key, commitBody)
	if first.errorType() != typeServiceFailure || catalog.executed.Load() != 0 {
		t.Fatalf("first = %d %q %v, catalog executed %d; want %s and nothing executed",
			first.code(), first.body, first.err, catalog.executed.Load(), typeServiceFailure)
	}
	retry := serve(t, h, newReverseProxy(t, catalog.addr(), overTLS), http.MethodPost, commitPath, key, commitBody)
	if retry.code() != http.StatusOK || retry.header.Get(ReplayedHeader) != "" || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %q (replayed %q), catalog executed %d; want it to execute once",
			retry.code(), retry.body, retry.header.Get(ReplayedHeader), catalog.executed.Load())
	}
}

// An HTTPS catalog behind a forward proxy that refuses the CONNECT (as a
// proxy answers when the catalog is down, or not allowed): Go's transport
// returns the proxy's status text as a plain error. The proxy is a stand-in
// that refuses every request, as a real one does only in that state.
func TestRefusedConnectReleasesTheKey(t *testing.T) {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusBadGateway)
	}))
	t.Cleanup(proxy.Close)
	releasedOverTLS(t, func(rp *reverseproxy.Handler) {
		rp.TransportRaw = caddyconfig.JSONModuleObject(&reverseproxy.HTTPTransport{
			TLS:             &reverseproxy.TLSConfig{InsecureSkipVerify: true},
			ForwardProxyURL: proxy.URL,
		}, "protocol", "http", nil)
	})
}

// A tls_server_name with placeholders makes reverse_proxy run the TLS
// handshake in its own dialer, whose failure (here a certificate not
// trusted) the transport does not report as a handshake: it arrives as a
// plain error.
func TestFailedHandshakeInReverseProxysDialerReleasesTheKey(t *testing.T) {
	releasedOverTLS(t, withTLS(reverseproxy.TLSConfig{ServerName: "{http.request.host}"}))
}

// Over HTTP/3 a catalog name that does not resolve fails in quic-go
// before any handshake, with no dial error of Caddy's (its dialer is
// TCP's).
func TestHTTP3UnresolvableCatalogReleasesTheKey(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	key := storetest.NewKey(t)
	first := serve(t, h, newReverseProxy(t, "catalog.invalid:8443", insecureH3), http.MethodPost, commitPath, key, commitBody)
	if first.errorType() != typeServiceFailure {
		t.Fatalf("first = %d %q %v; want %s: the name did not resolve", first.code(), first.body, first.err, typeServiceFailure)
	}
	catalog := newH3Catalog(t, executeOK)
	retry := serve(t, h, newReverseProxy(t, catalog.addr, insecureH3), http.MethodPost, commitPath, key, commitBody)
	if retry.code() != http.StatusOK || catalog.executed.Load() != 1 {
		t.Fatalf("retry = %d %q, catalog executed %d; want it to execute once", retry.code(), retry.body, catalog.executed.Load())
	}
}

// quic-go dials a host once: a request that arrives while another's dial
// is under way waits for it, and when the dial fails it gets the dial's
// error with no event of its own (the handshake is reported to the request
// that began the dial). Here the catalog never answers the handshake (a
// UDP socket that swallows every packet: a fake, as a real catalog stalls
// so only when it hangs), and quic-go gives up after its 5 s handshake
// timeout, within execution_timeout. During an outage every keyed request
// but the one that began each dial was marked unknown.
func TestHTTP3RequestJoiningAFailedDialReleasesTheKey(t *testing.T) {
	silent, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = silent.Close() })
	dialing := make(chan struct{})
	go func() {
		buf := make([]byte, 2048)
		var once sync.Once
		for {
			if _, _, err := silent.ReadFrom(buf); err != nil {
				return
			}
			once.Do(func() { close(dialing) })
		}
	}()
	h := newTestHandler(t, newMemoryStore(t))
	down := newReverseProxy(t, silent.LocalAddr().String(), insecureH3)
	keys := []string{storetest.NewKey(t), storetest.NewKey(t)}
	firsts := make([]result, len(keys))
	var wg sync.WaitGroup
	for i, key := range keys {
		if i > 0 {
			select {
			case <-dialing: // the first request's dial is under way
			case <-time.After(5 * time.Second):
				t.Fatal("the first request's QUIC dial never reached the catalog")
			}
		}
		wg.Go(func() { firsts[i] = serve(t, h, down, http.MethodPost, commitPath, key, commitBody) })
	}
	wg.Wait()
	catalog := newH3Catalog(t, executeOK)
	up := newReverseProxy(t, catalog.addr, insecureH3)
	for i, key := range keys {
		if firsts[i].errorType() != typeServiceFailure {
			t.Errorf("request %d = %d %q %v; want %s: the dial never completed", i+1, firsts[i].code(), firsts[i].body, firsts[i].err, typeServiceFailure)
		}
		if retry := serve(t, h, up, http.MethodPost, commitPath, key, commitBody); retry.code() != http.StatusOK {
			t.Errorf("retry of request %d = %d %q; want it to execute", i+1, retry.code(), retry.body)
		}
	}
	if n := catalog.executed.Load(); n != int32(len(keys)) {
		t.Fatalf("the catalog executed %d retries, want %d", n, len(keys))
	}
}
