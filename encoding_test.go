package icebergidempotency

import (
	"bytes"
	"compress/gzip"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestAcceptsEncoding(t *testing.T) {
	for _, c := range []struct {
		accept string // "" sends no header
		coding string
		want   bool
	}{
		{"gzip", "gzip", true},
		{"gzip, deflate, br", "deflate", true},
		{"GZIP;q=0.5", "gzip", true},
		{"gzip;q=0", "gzip", false},
		{"identity", "gzip", false},
		{"*", "gzip", true},
		{"*;q=0", "gzip", false},
		{"*, gzip;q=0", "gzip", false},
		{"x-gzip", "gzip", true},
		{"gzip", "x-gzip", true},
		{"br", "gzip", false},
		{"", "gzip", false},
	} {
		h := http.Header{}
		if c.accept != "" {
			h.Set("Accept-Encoding", c.accept)
		}
		if got := acceptsEncoding(h, c.coding); got != c.want {
			t.Errorf("Accept-Encoding %q, coding %q: %v, want %v", c.accept, c.coding, got, c.want)
		}
	}
}

// The catalog compresses as the first request allows; a retry that does
// not accept that coding gets the stored answer decoded, one that does
// gets it as stored.
func TestReplayInACodingTheRetryAccepts(t *testing.T) {
	const answer = `{"namespace":["a"],"properties":{}}`
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if !strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
			_, _ = io.WriteString(w, answer)
			return
		}
		w.Header().Set("Content-Encoding", "gzip")
		zw := gzip.NewWriter(w)
		_, _ = io.WriteString(zw, answer)
		_ = zw.Close()
	})
	h := newTestHandler(t, newMemoryStore(t))
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	first := serve(t, h, proxy, "POST", "/v1/namespaces", key, nsBody, "Accept-Encoding", "gzip")
	if first.code() != http.StatusOK || first.header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("first: %d, Content-Encoding %q", first.code(), first.header.Get("Content-Encoding"))
	}
	for _, accept := range []string{"identity", "br", ""} {
		var extra []string
		if accept != "" {
			extra = []string{"Accept-Encoding", accept}
		}
		retry := serve(t, h, proxy, "POST", "/v1/namespaces", key, nsBody, extra...)
		if retry.header.Get(ReplayedHeader) != "true" || retry.header.Get("Content-Encoding") != "" || retry.body != answer ||
			retry.header.Get("Content-Length") != "35" {
			t.Fatalf("retry accepting %q: replayed %q, Content-Encoding %q, Content-Length %q, body %q; want the answer decoded",
				accept, retry.header.Get(ReplayedHeader), retry.header.Get("Content-Encoding"), retry.header.Get("Content-Length"), retry.body)
		}
	}
	retry := serve(t, h, proxy, "POST", "/v1/namespaces", key, nsBody, "Accept-Encoding", "gzip, deflate")
	if retry.header.Get("Content-Encoding") != "gzip" || !bytes.Equal([]byte(retry.body), []byte(first.body)) {
		t.Fatalf("retry accepting gzip: Content-Encoding %q; want the stored gzip body", retry.header.Get("Content-Encoding"))
	}
	if n := catalog.executed.Load(); n != 1 {
		t.Fatalf("the catalog executed %d times, want 1", n)
	}
}
