package icebergidempotency

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/encode"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/encode/gzip"

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
		{"\xef\xbb\xbf{\"a\":1}", true},
		{"\xef\xbb\xbf \n{\"a\":", false}, // behind a byte order mark: never checked until the build after d4fe47c
	} {
		if got := jsonCloses([]byte(c.body)); got != c.want {
			t.Errorf("jsonCloses(%q) = %v, want %v", c.body, got, c.want)
		}
	}
}

// Complete bodies in the codings servers send are never taken as cut: a
// raw deflate body under "deflate" (RFC 9110 says zlib; some servers send
// raw), a gzip body with a newline after it. A review found both judged
// cut in the first version, whose keys were left unknown with their
// clients' connections broken off, where plain reverse_proxy delivers them.
func TestAnswerCutShortCodings(t *testing.T) {
	answer := `{"metadata-location":"s3://w/t/metadata/00001.json","metadata":{"format-version":2}}`
	var raw, zl bytes.Buffer
	fw, _ := flate.NewWriter(&raw, flate.DefaultCompression)
	_, _ = fw.Write([]byte(answer))
	_ = fw.Close()
	zw := zlib.NewWriter(&zl)
	_, _ = zw.Write([]byte(answer))
	_ = zw.Close()
	gz := gzipped(t, answer)
	// Two members, as a server that compresses what it writes in parts
	// sends: decoders read every member.
	members := append(gzipped(t, answer[:30]), gzipped(t, answer[30:])...)
	second := len(gzipped(t, answer[:30]))
	// A JSON text cut short and compressed whole: what Caddy's encode,
	// between this handler and reverse_proxy, makes of an answer the
	// catalog broke off.
	cutText := answer[:40]
	var rawCut, zlCut bytes.Buffer
	fw, _ = flate.NewWriter(&rawCut, flate.DefaultCompression)
	_, _ = fw.Write([]byte(cutText))
	_ = fw.Close()
	zw = zlib.NewWriter(&zlCut)
	_, _ = zw.Write([]byte(cutText))
	_ = zw.Close()
	// Past maxCheckedDecode nothing is judged (a review found raw
	// deflate judged cut there in the first version of the JSON check).
	var huge bytes.Buffer
	fw, _ = flate.NewWriter(&huge, flate.BestSpeed)
	_, _ = fw.Write([]byte("["))
	_, _ = fw.Write(make([]byte, maxCheckedDecode))
	_ = fw.Close()
	hugeRaw := huge.Bytes()
	for _, c := range []struct {
		name, coding string
		body         []byte
		want         bool
	}{
		{"gzip", "gzip", gz, false},
		{"gzip and a newline", "gzip", append(append([]byte{}, gz...), '\n'), false},
		{"gzip in two members", "gzip", members, false},
		{"gzip cut in its second member", "gzip", members[:len(members)-15], true},
		// A member's header cut short reads as bytes after the body, as
		// Java's GZIPInputStream takes them: what the members before it
		// decode to is a JSON text cut short.
		{"gzip cut in its second member's header", "gzip", members[:second+4], true},
		{"gzip and a stray 0x1f", "gzip", append(append([]byte{}, gz...), 0x1f), false},
		{"gzip and 0x1f 0x8b", "gzip", append(append([]byte{}, gz...), 0x1f, 0x8b), false},
		{"raw deflate decoding to more than is checked", "deflate", hugeRaw, false},
		{"gzip whole around JSON cut short", "gzip", gzipped(t, cutText), true},
		{"zlib whole around JSON cut short", "deflate", zlCut.Bytes(), true},
		{"raw deflate whole around JSON cut short", "deflate", rawCut.Bytes(), true},
		{"gzip cut", "gzip", gz[:len(gz)-4], true},
		{"gzip header cut", "gzip", gz[:5], true},
		{"not gzip at all", "gzip", []byte("hello, this is not gzip"), false},
		{"zlib", "deflate", zl.Bytes(), false},
		{"zlib cut", "deflate", zl.Bytes()[:zl.Len()-3], true},
		{"raw deflate", "deflate", raw.Bytes(), false},
		{"raw deflate cut", "deflate", raw.Bytes()[:raw.Len()/2], true},
		{"br, not checked", "br", []byte{1, 2, 3}, false},
	} {
		h := http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {c.coding}}
		if got := answerCutShort(h, http.StatusOK, c.body); got != c.want {
			t.Errorf("%s: cut = %v, want %v", c.name, got, c.want)
		}
	}
	// A body not of a JSON type is judged by its coding alone.
	h := http.Header{"Content-Type": {"text/plain"}, "Content-Encoding": {"gzip"}}
	if answerCutShort(h, http.StatusOK, gzipped(t, cutText)) {
		t.Error("a whole gzip body of text/plain was judged cut by its JSON")
	}
	// With a length, or empty, or a 204, nothing is judged.
	h = http.Header{"Content-Type": {"application/json"}, "Content-Length": {"20"}}
	if answerCutShort(h, http.StatusOK, []byte(`{"a":`)) {
		t.Error("an answer with a Content-Length was judged")
	}
	if answerCutShort(http.Header{"Content-Type": {"application/json; charset=utf-8"}}, http.StatusNoContent, []byte(`{`)) {
		t.Error("a 204 was judged")
	}
	if !answerCutShort(http.Header{"Content-Type": {"application/json; charset=utf-8"}}, http.StatusOK, []byte(`{"a":`)) {
		t.Error("a cut JSON body with a charset was not judged cut")
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
// the transport sees break off does. So does a 5xx whose JSON broke off
// before it could say what it is: one saying CommitStateUnknownException
// leaves the key unknown, and before, the cut one was released and its
// retry executed again. The catalog is a raw listener (Go's own server
// sends a length or chunks), and cuts its answer on purpose.
func TestAnswerCutWithoutALengthIsUnknown(t *testing.T) {
	answer := `{"metadata-location":"s3://w/t/metadata/00001.json","metadata":{"format-version":2}}`
	unknown := `{"error":{"message":"the commit may have landed; a long explanation","type":"CommitStateUnknownException","code":503}}`
	// Longer than encode's minimum_length (512 bytes) where they are cut.
	longAnswer := `{"metadata-location":"s3://w/t/metadata/00001.json","metadata":{"format-version":2,"properties":{"p":"` + strings.Repeat("x", 1200) + `"}}}`
	longUnknown := `{"error":{"message":"the commit may have landed","stack":["` + strings.Repeat("at org.apache.iceberg.Frame(Frame.java:1)", 20) +
		`"],"type":"CommitStateUnknownException","code":503}}`
	for _, c := range []struct {
		name    string
		status  string // "200 OK" when empty
		header  string
		body    []byte
		request []string
		cut     bool
		encode  bool // Caddy's encode between the handler and reverse_proxy
	}{
		{"503 cut before its type", "503 Service Unavailable", "Content-Type: application/json\r\n", []byte(unknown[:60]), nil, true, false},
		{"json cut", "", "Content-Type: application/json\r\n", []byte(answer[:40]), nil, true, false},
		{"gzip cut", "", "Content-Type: application/json\r\nContent-Encoding: gzip\r\n",
			gzipped(t, answer)[:30], []string{"Accept-Encoding", "gzip"}, true, false},
		{"json whole", "", "Content-Type: application/json\r\n", []byte(answer), nil, false, false},
		{"gzip whole", "", "Content-Type: application/json\r\nContent-Encoding: gzip\r\n",
			gzipped(t, answer), []string{"Accept-Encoding", "gzip"}, false, false},
		// encode compresses the part it got into a whole gzip body, and
		// drops any length: until the build after d4fe47c the part was
		// stored, and the 503 released (its retry executed again).
		{"json cut, compressed by encode", "", "Content-Type: application/json\r\n", []byte(longAnswer[:900]), []string{"Accept-Encoding", "gzip"}, true, true},
		{"503 cut before its type, compressed by encode", "503 Service Unavailable", "Content-Type: application/json\r\n",
			[]byte(longUnknown[:700]), []string{"Accept-Encoding", "gzip"}, true, true},
		{"json whole, compressed by encode", "", "Content-Type: application/json\r\n", []byte(longAnswer), []string{"Accept-Encoding", "gzip"}, false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
				conn, buf, err := http.NewResponseController(w).Hijack()
				if err != nil {
					t.Error(err)
					return
				}
				defer conn.Close()
				status := c.status
				if status == "" {
					status = "200 OK"
				}
				fmt.Fprintf(buf, "HTTP/1.1 %s\r\nConnection: close\r\n%s\r\n", status, c.header)
				_, _ = buf.Write(c.body)
				_ = buf.Flush()
			})
			h := newTestHandler(t, newMemoryStore(t))
			proxy := newReverseProxy(t, catalog.addr())
			if c.encode {
				proxy = encodeGzip(t, proxy)
			}
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
			if c.encode {
				// Compare what the body decodes to.
				first.body, retry.body = gunzipped(t, first), gunzipped(t, retry)
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

// encodeGzip is Caddy's encode handler, gzip only, in front of next.
func encodeGzip(t *testing.T, next caddyhttp.Handler) caddyhttp.Handler {
	t.Helper()
	enc := &encode.Encode{EncodingsRaw: caddy.ModuleMap{"gzip": json.RawMessage(`{}`)}}
	if err := enc.Provision(runningCaddyContext(t)); err != nil {
		t.Fatalf("provisioning encode: %v", err)
	}
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		return enc.ServeHTTP(w, r, next)
	})
}

// gunzipped is res's body, decoded when it came with Content-Encoding gzip.
func gunzipped(t *testing.T, res result) string {
	t.Helper()
	if res.header.Get("Content-Encoding") != "gzip" {
		return res.body
	}
	zr, err := gzip.NewReader(strings.NewReader(res.body))
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(zr)
	if err != nil {
		t.Fatalf("the gzip body does not decode: %v", err)
	}
	return string(b)
}
