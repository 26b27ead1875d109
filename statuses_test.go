package icebergidempotency

import (
	"bytes"
	"compress/gzip"
	"io"
	"net/http"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestShouldFinalizeDefaults(t *testing.T) {
	h := &Handler{}
	h.setDefaults()
	var err error
	if h.finalizeSet, err = parseStatusSet(h.FinalizeStatuses); err != nil {
		t.Fatal(err)
	}
	if h.releaseSet, err = parseStatusSet(h.ReleaseStatuses); err != nil {
		t.Fatal(err)
	}
	finalized := []int{200, 201, 204, 400, 404, 409, 422}
	released := []int{500, 502, 503, 504, 401, 403, 408, 419, 425, 429, 499, 301, 304, 101}
	for _, s := range finalized {
		if !h.shouldFinalize(s) {
			t.Errorf("status %d released, want finalized", s)
		}
	}
	for _, s := range released {
		if h.shouldFinalize(s) {
			t.Errorf("status %d finalized, want released", s)
		}
	}
}

func TestShouldFinalizeConfigured(t *testing.T) {
	h := &Handler{}
	var err error
	if h.finalizeSet, err = parseStatusSet([]string{"2XX", "409"}); err != nil {
		t.Fatal(err)
	}
	if h.releaseSet, err = parseStatusSet([]string{"5xx", "201"}); err != nil {
		t.Fatal(err)
	}
	for s, want := range map[int]bool{200: true, 201: false, 409: true, 404: false, 500: false} {
		if got := h.shouldFinalize(s); got != want {
			t.Errorf("shouldFinalize(%d) = %v, want %v", s, got, want)
		}
	}
	for _, bad := range []string{"6xx", "abc", "99", "600", "x"} {
		if _, err := parseStatusSet([]string{bad}); err == nil {
			t.Errorf("parseStatusSet(%q) accepted", bad)
		}
	}
}

// An answer that says the commit may have landed (a gateway's 504 or the
// catalog's 500 to a commit, or a CommitStateUnknownException body on any
// mutation) leaves the key's outcome unknown: the client gets the answer,
// and its retry is told the outcome is unknown instead of executing again.
// Before, every 5xx released the key, and the retry committed a second
// time (or heard 409 and deleted files the first commit still used).
// Other 5xx still release it.
func TestCommitStateUnknownAnswers(t *testing.T) {
	gzipped := func(s string) []byte {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		_, _ = io.WriteString(zw, s)
		_ = zw.Close()
		return b.Bytes()
	}
	const unknownBody = `{"error":{"message":"metastore timed out","type":"CommitStateUnknownException","code":500}}`
	const failedBody = `{"error":{"message":"boom","type":"ServerErrorException","code":500}}`
	for _, tt := range []struct {
		name, method, path string
		status             int
		encoding           string
		body               []byte
		unknown            bool
	}{
		{"gateway 504 to a commit", "POST", commitPath, 504, "", []byte("<html>gateway timeout</html>"), true},
		{"502 to a commit", "POST", commitPath, 502, "", nil, true},
		{"500 to a transaction", "POST", "/v1/wh/transactions/commit", 500, "", []byte(failedBody), true},
		{"CommitStateUnknownException to createNamespace", "POST", "/v1/wh/namespaces", 500, "", []byte(unknownBody), true},
		{"gzipped CommitStateUnknownException to dropTable", "DELETE", "/v1/wh/namespaces/ns/tables/t", 503, "gzip", gzipped(unknownBody), true},
		{"503 to a commit", "POST", commitPath, 503, "", nil, false},
		{"500 to createNamespace", "POST", "/v1/wh/namespaces", 500, "", []byte(failedBody), false},
		{"504 to dropTable", "DELETE", "/v1/wh/namespaces/ns/tables/t", 504, "", nil, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				if tt.encoding != "" {
					w.Header().Set("Content-Encoding", tt.encoding)
				}
				w.WriteHeader(tt.status)
				_, _ = w.Write(tt.body)
			})
			h := newTestHandler(t, newMemoryStore(t))
			proxy := newReverseProxy(t, catalog.addr())
			key := storetest.NewKey(t)
			body := commitBody
			if tt.method == "DELETE" {
				body = ""
			}
			var extra []string
			if tt.encoding != "" {
				// Asked by the client, the coding reaches the handler as
				// the catalog sent it (Go's transport decodes only what
				// it asked for itself).
				extra = []string{"Accept-Encoding", tt.encoding}
			}
			if first := serve(t, h, proxy, tt.method, tt.path, key, body, extra...); first.code() != tt.status {
				t.Fatalf("first = %d, want the catalog's %d passed on", first.code(), tt.status)
			}
			retry := serve(t, h, proxy, tt.method, tt.path, key, body, extra...)
			switch n := catalog.executed.Load(); {
			case tt.unknown && (n != 1 || retry.code() != http.StatusInternalServerError || retry.errorType() != typeCommitStateUnknown):
				t.Fatalf("retry = %d %q, catalog executed %d times; want 500 %s and one execution", retry.code(), retry.body, n, typeCommitStateUnknown)
			case !tt.unknown && n != 2:
				t.Fatalf("retry = %d %q, catalog executed %d times; want the key released and executed again", retry.code(), retry.body, n)
			}
		})
	}
}

// A 502 to a commit that provably did not come from the catalog leaves
// the key released, as before: a nested guard (another store) whose dial
// failed answers 502 "not sent", and a handler after the directive that
// asks no upstream may answer 502 itself. Marking those unknown would
// leave the retries of a commit that never ran hearing 500 for good.
func TestCommitAnswersThatDidNotReachTheCatalogRelease(t *testing.T) {
	t.Run("nested guard whose dial failed", func(t *testing.T) {
		outer, inner := newTestHandler(t, newMemoryStore(t)), newTestHandler(t, newMemoryStore(t))
		proxy := newReverseProxy(t, deadAddr(t))
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return inner.ServeHTTP(w, r, proxy) })
		key := storetest.NewKey(t)
		for i := range 2 {
			if res := serve(t, outer, next, "POST", commitPath, key, commitBody); res.code() != http.StatusBadGateway || res.errorType() != typeServiceFailure {
				t.Fatalf("try %d = %d %q; want 502 %s (not sent) each time", i+1, res.code(), res.body, typeServiceFailure)
			}
		}
	})
	t.Run("502 written without an upstream", func(t *testing.T) {
		h := newTestHandler(t, newMemoryStore(t))
		up := answering(http.StatusBadGateway, `{"error":{"message":"maintenance","type":"ServiceFailureException","code":502}}`)
		key := storetest.NewKey(t)
		serve(t, h, up, "POST", commitPath, key, commitBody)
		if res := serve(t, h, up, "POST", commitPath, key, commitBody); res.code() != http.StatusBadGateway || up.calls.Load() != 2 {
			t.Fatalf("retry = %d %q, handler called %d times; want the key released and the retry run", res.code(), res.body, up.calls.Load())
		}
	})
}
