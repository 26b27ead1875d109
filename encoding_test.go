package icebergidempotency

import (
	"bytes"
	"compress/gzip"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

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
	catalog := gzipCatalog(t, answer, false)
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

// A compressed answer stored within max_response_size can decode to more
// than it (metadata JSON compresses ten times and more): a retry that does
// not accept the coding gets it decoded all the same, as it is written.
// Before, the decoding gave up at max_response_size and the retry got the
// gzip body it had not asked for.
func TestReplayDecodesPastMaxResponseSize(t *testing.T) {
	answer := `{"metadata":"` + strings.Repeat("snapshot ", 8<<10) + `"}` // 72 KiB, a few hundred bytes in gzip
	catalog := gzipCatalog(t, answer, false)
	h := newTestHandler(t, newMemoryStore(t))
	h.MaxResponseSize = 32 << 10
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	first := serve(t, h, proxy, "POST", "/v1/namespaces", key, nsBody, "Accept-Encoding", "gzip")
	if first.code() != http.StatusOK || first.header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("first: %d, Content-Encoding %q", first.code(), first.header.Get("Content-Encoding"))
	}
	retry := serve(t, h, proxy, "POST", "/v1/namespaces", key, nsBody, "Accept-Encoding", "identity")
	if retry.header.Get(ReplayedHeader) != "true" || retry.header.Get("Content-Encoding") != "" || retry.body != answer {
		t.Fatalf("retry accepting identity: replayed %q, Content-Encoding %q, %d bytes; want the %d-byte answer decoded",
			retry.header.Get(ReplayedHeader), retry.header.Get("Content-Encoding"), len(retry.body), len(answer))
	}
	if n := catalog.executed.Load(); n != 1 {
		t.Fatalf("the catalog executed %d times, want 1", n)
	}
}

// The catalog is asked only for codings a replay can decode: a first
// request that takes zstd or br gets gzip (or identity), which is stored,
// so that a retry that takes neither can still be given a body it reads.
func TestCatalogAskedOnlyForDecodableCodings(t *testing.T) {
	var asked []string
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		ae := r.Header.Get("Accept-Encoding")
		asked = append(asked, ae)
		w.Header().Set("Content-Type", "application/json")
		if strings.Contains(ae, "zstd") {
			w.Header().Set("Content-Encoding", "zstd")
			_, _ = io.WriteString(w, "\x28\xb5\x2f\xfd not really zstd")
			return
		}
		_, _ = io.WriteString(w, `{"namespace":["z"]}`)
	})
	h := newTestHandler(t, newMemoryStore(t))
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	first := serve(t, h, proxy, "POST", "/v1/namespaces", key, nsBody, "Accept-Encoding", "zstd, br;q=0.9, *;q=0.1")
	if first.code() != http.StatusOK || first.header.Get("Content-Encoding") != "" || first.body != `{"namespace":["z"]}` {
		t.Fatalf("first: %d, Content-Encoding %q, body %q", first.code(), first.header.Get("Content-Encoding"), first.body)
	}
	retry := serve(t, h, proxy, "POST", "/v1/namespaces", key, nsBody, "Accept-Encoding", "gzip")
	if retry.header.Get(ReplayedHeader) != "true" || retry.body != `{"namespace":["z"]}` {
		t.Fatalf("retry: replayed %q, body %q", retry.header.Get(ReplayedHeader), retry.body)
	}
	if len(asked) != 1 || strings.Contains(asked[0], "zstd") || strings.Contains(asked[0], "br") || strings.Contains(asked[0], "*") {
		t.Fatalf("the catalog was asked for %q", asked)
	}
}

func TestNarrowAcceptEncoding(t *testing.T) {
	for in, want := range map[string]string{
		"gzip, x-gzip, deflate":     "gzip, x-gzip, deflate", // the Java client's, untouched
		"zstd, gzip;q=0.8":          "gzip;q=0.8",
		"br, zstd":                  "", // none left: dropped
		"*":                         "",
		"identity, br":              "identity",
		"GZIP;q=1.0, Zstd;q=0.9, *": "GZIP;q=1.0",
		// Nothing left that the client takes: dropped, as if empty (a
		// strict catalog would answer "identity;q=0" with 406, where
		// plain reverse_proxy gets br).
		"identity;q=0, br":               "",
		"gzip;q=0, identity; Q=0.000, *": "",
		"gzip;q=0, br":                   "", // Caddy's transport decodes the gzip it asks for
		"identity;q=0.001, br":           "identity;q=0.001",
	} {
		r, _ := http.NewRequest("POST", "/", nil)
		r.Header.Set("Accept-Encoding", in)
		restore := narrowAcceptEncoding(r)
		if got := r.Header.Get("Accept-Encoding"); got != want {
			t.Errorf("%q narrowed to %q, want %q", in, got, want)
		}
		restore()
		if got := r.Header.Get("Accept-Encoding"); got != in {
			t.Errorf("%q restored as %q", in, got)
		}
	}
}

// A stored body that breaks off while it is decoded for a replay (the
// catalog's own compressed answer was cut short: stored as it came) ends
// the replay with a broken connection, never a clean end: the client must
// not take the part for the whole. Before, the replay ended as if complete.
func TestReplayBrokenOffWhileDecodedIsAborted(t *testing.T) {
	var whole bytes.Buffer
	zw := gzip.NewWriter(&whole)
	_, _ = zw.Write(make([]byte, 200_000))
	_ = zw.Close()
	cut := whole.Bytes()[:whole.Len()/2]
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		_, _ = w.Write(cut)
	})
	h := newTestHandler(t, newMemoryStore(t))
	h.MaxResponseSize = 1024
	proxy := newReverseProxy(t, catalog.addr())
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r = caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, &caddyhttp.Server{})
		_ = h.ServeHTTP(w, r, proxy)
	}))
	defer front.Close()
	key := storetest.NewKey(t)
	send := func(accept string) (*http.Response, []byte, error) {
		req, _ := http.NewRequest("POST", front.URL+"/v1/namespaces", strings.NewReader(nsBody))
		req.Header.Set(IdempotencyKeyHeader, key)
		req.Header.Set("Accept-Encoding", accept) // set by hand: the client's transport decodes nothing
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, nil, err
		}
		defer res.Body.Close()
		body, err := io.ReadAll(res.Body)
		return res, body, err
	}
	if res, body, err := send("gzip"); err != nil || !bytes.Equal(body, cut) {
		t.Fatalf("first = %v, %d bytes; want the catalog's %d bytes as they came", err, len(body), len(cut))
	} else if res.StatusCode != http.StatusOK {
		t.Fatalf("first = %d", res.StatusCode)
	}
	if res, body, err := send("identity"); err == nil {
		t.Fatalf("replay decoded from a broken body = %d, %d bytes, and a clean end; want the connection broken off", res.StatusCode, len(body))
	}
}

// A replay of a compressed answer says that it varies with
// Accept-Encoding, as the first answer did, and one decoded for the retry
// drops the coding's suffix that encode gives a strong ETag: it is no
// longer that representation. Before, a decoded replay kept "e1-gzip" and
// no replay carried Vary.
func TestReplayOfACompressedAnswerVaries(t *testing.T) {
	const answer = `{"namespace":["a"],"properties":{}}`
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Etag", `"e1-gzip"`) // as encode suffixes a strong ETag
		w.Header().Set("Vary", "Accept-Encoding")
		w.Header().Set("Content-Encoding", "gzip")
		zw := gzip.NewWriter(w)
		_, _ = io.WriteString(zw, answer)
		_ = zw.Close()
	})
	h := newTestHandler(t, newMemoryStore(t))
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	serve(t, h, proxy, "POST", "/v1/namespaces", key, nsBody, "Accept-Encoding", "gzip")
	for _, c := range []struct{ accept, etag string }{{"identity", `"e1"`}, {"gzip", `"e1-gzip"`}} {
		retry := serve(t, h, proxy, "POST", "/v1/namespaces", key, nsBody, "Accept-Encoding", c.accept)
		if retry.header.Get(ReplayedHeader) != "true" || retry.header.Get("Etag") != c.etag || retry.header.Get("Vary") != "Accept-Encoding" {
			t.Fatalf("retry accepting %s: replayed %q, ETag %q, Vary %q; want ETag %s, Vary Accept-Encoding",
				c.accept, retry.header.Get(ReplayedHeader), retry.header.Get("Etag"), retry.header.Get("Vary"), c.etag)
		}
	}
}
