package icebergidempotency

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// handlerFront serves a handler on the memory store and then reverse_proxy
// to catalog through Go's own HTTP server, whose framing (chunked or not,
// trailers or none, a switch of protocols) is what a client of Caddy sees.
func handlerFront(t *testing.T, catalog *countingCatalog) *httptest.Server {
	t.Helper()
	h := newTestHandler(t, newMemoryStore(t))
	proxy := newReverseProxy(t, catalog.addr())
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r = caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, &caddyhttp.Server{})
		if err := h.ServeHTTP(w, r, proxy); err != nil {
			t.Errorf("handler: %v", err)
		}
	}))
	t.Cleanup(front.Close)
	return front
}

// Trailers the catalog sends after a config document whose lifetime the
// handler advertises reach the client as trailers, as through plain
// reverse_proxy and as the captured answer to a keyed request does
// (TestTrailersStayTrailers). Before, the rewritten answer went out with
// a Content-Length and the trailers still in its header: over HTTP/1 the
// client read "Trailer: X-Checksum" announced and no trailer, over HTTP/2
// the trailer arrived as a header.
func TestConfigAnswerTrailersStayTrailers(t *testing.T) {
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Checksum")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{"defaults":{},"overrides":{}}`)
		w.Header().Set("X-Checksum", "42")
	})
	front := handlerFront(t, catalog)
	res, err := http.Get(front.URL + "/v1/config")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body) // trailers are read with the body's end
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(body, &cfg); err != nil || cfg[LifetimeField] != "PT30M" {
		t.Fatalf("config %q (%v), want the lifetime advertised", body, err)
	}
	if res.Header.Get("X-Checksum") != "" || res.Trailer.Get("X-Checksum") != "42" {
		t.Fatalf("header X-Checksum %q, trailer X-Checksum %q; want none, 42",
			res.Header.Get("X-Checksum"), res.Trailer.Get("X-Checksum"))
	}
}

// A GET /v1/config that sends trailers after a chunked body (a client's
// checksum, say) reaches the catalog with their values, as through plain
// reverse_proxy. Before, the handler sent the catalog a copy of the
// request to drop its Accept-Encoding: Go's server writes the trailers
// into the original request once its body is read, and the catalog got
// the trailer's name announced, with no value.
func TestConfigRequestTrailersReachTheCatalog(t *testing.T) {
	got := make(chan http.Header, 1)
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		got <- r.Trailer.Clone()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"defaults":{},"overrides":{}}`)
	})
	front := handlerFront(t, catalog)
	req, _ := http.NewRequest("GET", front.URL+"/v1/config", io.NopCloser(strings.NewReader(`{}`)))
	req.ContentLength = -1 // chunked, which trailers need over HTTP/1
	req.Header.Set("Accept-Encoding", "gzip")
	req.Trailer = http.Header{"X-Checksum": {"42"}}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, res.Body)
	res.Body.Close()
	if trailer := <-got; trailer.Get("X-Checksum") != "42" {
		t.Fatalf("the catalog got the trailers %v, want X-Checksum: 42", trailer)
	}
}
