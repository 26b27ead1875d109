package icebergidempotency

import (
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// An authentication handler after a directive whose principal names
// {http.auth.*} is warned of at start: there every keyed request is refused
// 403, while the same request without a key is served. Found by an audit
// with basic_auth in a handle_path block under a site-level directive, where
// only a log line per refused request told, until the build after b35c62e.
func TestAuthenticationAfterTheDirectiveIsWarnedOf(t *testing.T) {
	const auth = "basic_auth {\n\t\talice $2a$14$K3LbTnYuUbg8FiKnyCroa.m0g94OZHUAluGlEWWYJQef/gd/xT.s.\n\t}\n"
	const byUser = "iceberg_idempotency {\n\t\tprincipal {http.auth.user.id}\n\t\tbase_path /api/catalog\n\t}\n"
	for _, tt := range []struct {
		name, site string
		warned     bool
	}{
		{"basic_auth in handle_path under the directive", byUser + "handle_path /api/catalog/* {\n" + auth + "reverse_proxy 127.0.0.1:2\n}\n", true},
		{"basic_auth in a route after the directive", "route {\n" + byUser + auth + "reverse_proxy 127.0.0.1:2\n}\n", true},
		{"basic_auth at site level", auth + byUser + "handle_path /api/catalog/* {\nreverse_proxy 127.0.0.1:2\n}\n", false},
		{"the directive in the block after basic_auth", "handle_path /api/catalog/* {\n" + auth + "iceberg_idempotency {\n\t\tprincipal {http.auth.user.id}\n\t}\nreverse_proxy 127.0.0.1:2\n}\n", false},
		{"the default principal", "iceberg_idempotency\nhandle {\n" + auth + "reverse_proxy 127.0.0.1:2\n}\n", false},
		// Each site a terminal route on one server: the first site's
		// directive does not run before the second's basic_auth.
		{"two sites on one port, each in order", "http://a.example:8089 {\n" + auth + byUser + "reverse_proxy 127.0.0.1:2\n}\nhttp://b.example:8089 {\n" + auth + byUser + "reverse_proxy 127.0.0.1:3\n}\n", false},
		{"another handle block of the group", "handle /v1/* {\n" + byUser + "reverse_proxy 127.0.0.1:2\n}\nhandle {\n" + auth + "reverse_proxy 127.0.0.1:3\n}\n", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			caddyfile := ":8089 {\n" + tt.site + "}\n"
			if strings.HasPrefix(tt.site, "http://") {
				caddyfile = tt.site
			}
			warnAuthenticationAfterGuards(provisionedHTTPApp(t, caddyfile), zap.New(core))
			if warned := logs.FilterMessageSnippet("runs after an iceberg_idempotency directive").Len() > 0; warned != tt.warned {
				t.Fatalf("warned %v, want %v: %v", warned, tt.warned, logs.All())
			}
		})
	}
}
