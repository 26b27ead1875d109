package integration_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
)

// h2cClient speaks HTTP/2 without TLS (prior knowledge) to Caddy, whose
// HTTP/2 server leaves the spaces and tabs around a header value on, where
// its HTTP/1 server takes them off.
var h2cClient = func() *http.Client {
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{Protocols: p, DisableCompression: true}}
}()

func sendH2C(t *testing.T, method, url, body string, headers ...string) response {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := h2cClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s over h2c: %v", method, url, err)
	}
	defer resp.Body.Close()
	if resp.ProtoMajor != 2 {
		t.Fatalf("%s %s: answered over %s, want HTTP/2", method, url, resp.Proto)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return response{Status: resp.StatusCode, Header: resp.Header, Body: b}
}

// An Idempotency-Key, or an X-HTTP-Method-Override, with a space around
// it, sent over HTTP/2: the key is that key (before: 400, where plain
// reverse_proxy executes it and the same header over HTTP/1 was guarded),
// and the override names its method, as the catalog reads the header that
// Caddy forwards over HTTP/1.1 (before: GET …/tables/t with " POST" passed
// unguarded, and its retry committed again).
func TestCoreHeaderWhitespaceOverH2C(t *testing.T) {
	t.Parallel()
	b := caddyproc.NewBackend(t)
	c := caddyproc.Start(t, caddyproc.Caddyfile("servers {\nprotocols h1 h2c\n}", "iceberg_idempotency\nreverse_proxy "+b.Addr()))
	for _, tt := range []struct {
		name, method, path string
		headers            func(key string) []string
	}{
		{"key", "POST", "/v1/h2ws/namespaces/ns/tables/key", func(key string) []string { return []string{keyHeader, " " + key + " "} }},
		{"override", "GET", "/v1/h2ws/namespaces/ns/tables/override", func(key string) []string {
			return []string{keyHeader, key, "X-HTTP-Method-Override", " POST"}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			const body = `{"updates":[]}`
			headers := tt.headers(newKey(t))
			first := sendH2C(t, tt.method, c.URL()+tt.path, body, headers...)
			wantStatus(t, "first", first, 200)
			wantExecuted(t, "first", first)
			retry := sendH2C(t, tt.method, c.URL()+tt.path, body, headers...)
			wantReplayOf(t, "retry", retry, first)
			wantCount(t, b, tt.path, 1)
		})
	}
}
