package icebergidempotency

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
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

// A configured principal that expands to nothing would bind every sender's
// keys to one principal, so that one could be replayed another's response:
// such a keyed request is refused (403, not executed), where the default
// principal, on a catalog without Authorization, is everyone's alike by
// design and executes.
func TestEmptyConfiguredPrincipalIsRefused(t *testing.T) {
	for _, c := range []struct {
		principal string
		header    []string
		status    int
	}{
		{"{http.auth.user.id}", nil, http.StatusForbidden},                                     // forward_auth sets no user id
		{"{http.request.header.Remote-User}", nil, http.StatusForbidden},                       // copy_headers missing
		{"{http.request.header.Remote-User}", []string{"Remote-User", "alice"}, http.StatusOK}, // as copied
		{"", nil, http.StatusOK}, // the default, with no Authorization
	} {
		h := newTestHandler(t, newMemoryStore(t))
		if c.principal != "" {
			h.Principal = c.principal
			if err := h.prepare(); err != nil {
				t.Fatal(err)
			}
		}
		up := answering(http.StatusOK, `{"namespace":["a"]}`)
		res := serve(t, h, up, "POST", "/v1/namespaces", storetest.NewKey(t), nsBody, c.header...)
		executed := up.calls.Load() == 1
		if res.code() != c.status || executed != (c.status == http.StatusOK) ||
			(c.status == http.StatusForbidden && res.errorType() != typeForbidden) {
			t.Errorf("principal %q, headers %v: %d %s, executed %v; want %d", c.principal, c.header, res.code(), res.body, executed, c.status)
		}
	}
}
