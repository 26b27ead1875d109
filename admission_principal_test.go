package icebergidempotency

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The principal read straight from a header is the very string Caddy's
// replacer gives for the placeholder, whatever the request carries: it is
// hashed into stored bindings, so a retry must hash the same bytes as the
// request before it did, before and after this fast path. Principals that
// are not a lone header placeholder still go through the replacer.
func TestPrincipalMatchesTheReplacer(t *testing.T) {
	headers := []http.Header{
		{},
		{"Authorization": {"Bearer abc"}},
		{"Authorization": {"Bearer abc", "Basic xyz"}},
		{"Authorization": {""}},
		{"X-Tenant-Id": {"t1"}, "Authorization": {"Bearer a,b"}},
	}
	for _, principal := range []string{
		DefaultPrincipal,
		"{http.request.header.authorization}",
		"{http.request.header.X-Tenant-Id}",
		"{http.request.header.x-tenant-id}",
		"{http.request.header.Authorization}{http.request.header.X-Tenant-Id}",
		"{http.auth.user.id}",
		"static",
		"{http.request.header.}",
	} {
		h := &Handler{Principal: principal}
		if err := h.prepare(); err != nil {
			t.Fatal(err)
		}
		for _, hdr := range headers {
			req := httptest.NewRequest(http.MethodPost, "/v1/namespaces", nil)
			req.Header = hdr.Clone()
			repl := caddy.NewReplacer()
			req = caddyhttp.PrepareRequest(req, repl, httptest.NewRecorder(), &caddyhttp.Server{})
			if got, want := h.principalOf(req), repl.ReplaceAll(principal, ""); got != want {
				t.Errorf("principal %q with headers %v = %q, the replacer gives %q", principal, hdr, got, want)
			}
		}
	}
	for principal, want := range map[string]string{
		DefaultPrincipal:                                 "Authorization",
		"{http.request.header.x-tenant-id}":              "X-Tenant-Id",
		"{http.request.header.A}{http.request.header.B}": "",
		"{http.auth.user.id}":                            "",
		"{http.request.header.}":                         "",
	} {
		if got := headerPlaceholder(principal); got != want {
			t.Errorf("headerPlaceholder(%q) = %q, want %q", principal, got, want)
		}
	}
}
