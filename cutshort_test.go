package icebergidempotency

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"net/http"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestJSONCloses(t *testing.T) {
	for _, c := range []struct {
		body string
		want bool
	}{
		{`{"metadata-location":"s3://w/t/metadata/00001.json"}`, true},
		{" \n[1,{\"a\":[2]}]\n", true},
		{`{"a":"}]\"{"}`, true},
		{`{"a":"}]\"{"`, false},
		{`{"metadata-location":"s3://w/t/meta`, false},
		{`{"a":{"b":1}`, false},
		{`{"a":{"b":1}}`, true},
		{`[`, false},
		{`{"a":"\\"}`, true},
		{`{"a":"\"}`, false},
		{`{"a":"\`, false},
		{`"a string"`, true}, // a cut cannot be told
		{`not json`, true},
	} {
		if got := jsonCloses([]byte(c.body)); got != c.want {
			t.Errorf("jsonCloses(%q) = %v, want %v", c.body, got, c.want)
		}
	}
}

func gzipped(t *testing.T, s string) []byte {
	t.Helper()
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	_, _ = zw.Write([]byte(s))
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// A catalog answer delimited by the close of its connection (HTTP/1, no
// Content-Length, not chunked: what a server that sends "Connection: close"
// or speaks HTTP/1.0 may send) cannot show where it broke off, and Go's
// transport reads a connection that broke mid-answer as its end. Before,
// the part was stored: the first client got it as a whole 200, and every
// retry was replayed it with Idempotent-Replayed. Now a JSON body that
// does not close, or a gzip body that does not decode to its end, leaves
// the key unknown with the client's connection broken off, as an answer
// the transport sees break off does. The catalog is a raw listener (Go's
// own server sends a length or chunks), and cuts its answer on purpose.
func TestAnswerCutWithoutALengthIsUnknown(t *testing.T) {
	answer := `{"metadata-location":"s3://w/t/metadata/00001.json","metadata":{"format-version":2}}`
	for _, c := range []struct {
		name    string
		header  string
		body    []byte
		request []string
		cut     bool
	}{
		{"json cut", "Content-Type: application/json\r\n", []byte(answer[:40]), nil, true},
		{"gzip cut", "Content-Type: application/json\r\nContent-Encoding: gzip\r\n",
			gzipped(t, answer)[:30], []string{"Accept-Encoding", "gzip"}, true},
		{"json whole", "Content-Type: application/json\r\n", []byte(answer), nil, false},
		{"gzip whole", "Content-Type: application/json\r\nContent-Encoding: gzip\r\n",
			gzipped(t, answer), []string{"Accept-Encoding", "gzip"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
				conn, buf, err := http.NewResponseController(w).Hijack()
				if err != nil {
					t.Error(err)
					return
				}
				defer conn.Close()
				fmt.Fprintf(buf, "HTTP/1.1 200 OK\r\nConnection: close\r\n%s\r\n", c.header)
				_, _ = buf.Write(c.body)
				_ = buf.Flush()
			})
			h := newTestHandler(t, newMemoryStore(t))
			proxy := newReverseProxy(t, catalog.addr())
			key := storetest.NewKey(t)
			var first result
			var panicked any
			func() {
				defer func() { panicked = recover() }()
				first = serve(t, h, proxy, http.MethodPost, commitPath, key, commitBody, c.request...)
			}()
			retry := serve(t, h, proxy, http.MethodPost, commitPath, key, commitBody, c.request...)
			if n := catalog.executed.Load(); n != 1 {
				t.Fatalf("the catalog executed %d times, want 1", n)
			}
			if c.cut {
				if panicked != http.ErrAbortHandler {
					t.Fatalf("the first request ended with %d %q (panic %v), want its connection broken off (http.ErrAbortHandler)", first.code(), first.body, panicked)
				}
				if retry.code() != http.StatusInternalServerError || retry.errorType() != typeCommitStateUnknown {
					t.Fatalf("retry = %d %q (replayed %q), want 500 %s", retry.code(), retry.body, retry.header.Get(ReplayedHeader), typeCommitStateUnknown)
				}
				return
			}
			if panicked != nil || first.code() != http.StatusOK || first.body != string(c.body) {
				t.Fatalf("the first request ended with %d %q (panic %v), want the whole answer", first.code(), first.body, panicked)
			}
			if retry.code() != http.StatusOK || retry.body != string(c.body) || retry.header.Get(ReplayedHeader) != "true" {
				t.Fatalf("retry = %d %q (replayed %q), want the answer replayed", retry.code(), retry.body, retry.header.Get(ReplayedHeader))
			}
		})
	}
}
