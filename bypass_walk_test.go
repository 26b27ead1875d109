package icebergidempotency

import (
	"encoding/json"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy/forwardauth" // forward_auth in a layout
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// The bypass warning (warnBypassableHandlers) on provisioned configs: the
// directive under a path or method matcher beside an unguarded
// reverse_proxy to the same upstream is warned of, and so is the other way
// round (such a route to the upstream beside a guarded catch-all); the
// README's layouts, CORS preflights, a read replica and an exact health
// path are not. Until the build after 051e419's review, two sites apart by
// host were warned of, and a catch-all that invokes a named route was
// missed; until the build after 0e5a7a1, a method matcher (or an
// expression on the method or path) was missed; until the one after
// 521c3b1, "not method GET HEAD" (which misses GET with
// X-HTTP-Method-Override: POST), a route under a matcher beside a guarded
// catch-all, a reverse_proxy with handle_response, and a site with a path
// (":8089/v1/*") beside a site without; until the build after 4990b37, a
// vars or vars_regexp matcher on the method or path ("vars {method} POST");
// until the build after 3c21e19, a reverse_proxy in handle_errors to the
// guarded catalog, which takes a keyed request whose handler failed there
// unguarded; until the build after 068a81b, one in intercept's
// handle_response.
func TestBypassableHandlersWalk(t *testing.T) {
	for _, tt := range []struct {
		name, caddyfile string
		warned          bool
	}{
		{"readme site level", ":8089 {\n\ticeberg_idempotency\n\thandle /v1/* {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		{"handle + catch-all", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"matcher on directive", ":8089 {\n\ticeberg_idempotency /v1/*\n\treverse_proxy 127.0.0.1:2\n}\n", true},
		{"handle_path alone + other upstream", ":8089 {\n\thandle_path /api/catalog/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy 127.0.0.1:3\n\t}\n}\n", false},
		{"two sites, host apart", "http://a.localhost:8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\nhttp://b.localhost:8089 {\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"named route", "&(cat) {\n\treverse_proxy 127.0.0.1:2\n}\n:8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\tinvoke cat\n\t}\n\thandle {\n\t\tinvoke cat\n\t}\n}\n", true},
		{"named route guarded", "&(cat) {\n\treverse_proxy 127.0.0.1:2\n}\n:8089 {\n\ticeberg_idempotency\n\thandle /v1/* {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\tinvoke cat\n\t}\n}\n", false},
		{"handle_path + site guard", ":8089 {\n\thandle_path /api/catalog/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle /api/catalog/* {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"method matcher on directive", ":8089 {\n\t@mut method POST DELETE\n\ticeberg_idempotency @mut\n\treverse_proxy 127.0.0.1:2\n}\n", true},
		{"handle by method + catch-all", ":8089 {\n\t@mut method POST DELETE\n\thandle @mut {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"not method", ":8089 {\n\t@mut not method GET HEAD\n\ticeberg_idempotency @mut\n\treverse_proxy 127.0.0.1:2\n}\n", true},
		{"expression on the method", ":8089 {\n\t@mut expression {method} == 'POST'\n\ticeberg_idempotency @mut\n\treverse_proxy 127.0.0.1:2\n}\n", true},
		{"expression path()", ":8089 {\n\t@api expression path('/v1/*')\n\thandle @api {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"vars on the method", ":8089 {\n\t@mut vars {method} POST DELETE\n\ticeberg_idempotency @mut\n\treverse_proxy 127.0.0.1:2\n}\n", true},
		{"vars_regexp on the path + catch-all", ":8089 {\n\t@api vars_regexp {path} ^/v1/\n\thandle @api {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"vars on a tenant variable", ":8089 {\n\tvars tenant a\n\t@a vars tenant a\n\ticeberg_idempotency @a\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"expression on the host", ":8089 {\n\t@a expression {host} == 'a.localhost'\n\ticeberg_idempotency @a\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"handle not method GET HEAD + catch-all", ":8089 {\n\t@mut not method GET HEAD\n\thandle @mut {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"reads by method to the same upstream, guard in the catch-all", ":8089 {\n\t@reads method GET HEAD\n\thandle @reads {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"path route to the same upstream, guard in the catch-all", ":8089 {\n\thandle /api/management/* {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"catch-all reverse_proxy with handle_response", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy 127.0.0.1:2 {\n\t\t\t@err status 5xx\n\t\t\thandle_response @err {\n\t\t\t\trespond \"catalog error\" 502\n\t\t\t}\n\t\t}\n\t}\n}\n", true},
		{"guarded reverse_proxy with handle_response", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2 {\n\t\t\t@err status 5xx\n\t\t\thandle_response @err {\n\t\t\t\trespond \"catalog error\" 502\n\t\t\t}\n\t\t}\n\t}\n\thandle {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"site with a path beside a site without", ":8089/v1/* {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n:8089 {\n\treverse_proxy 127.0.0.1:2\n}\n", true},
		{"host site with a path beside the same host's site", "http://a.localhost:8089/v1/* {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\nhttp://a.localhost:8089 {\n\treverse_proxy 127.0.0.1:2\n}\n", true},
		{"unguarded site with a path beside a guarded site", ":8089/api/management/* {\n\treverse_proxy 127.0.0.1:2\n}\n:8089 {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n", true},
		{"host site with a path beside another host's site", "http://a.localhost:8089/v1/* {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\nhttp://b.localhost:8089 {\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"site with a path beside a site to another upstream", ":8089/v1/* {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n:8089 {\n\treverse_proxy 127.0.0.1:3\n}\n", false},
		{"exact-path health route to the same upstream, guard in the catch-all", ":8089 {\n\thandle /healthz {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		{"forward_auth to the catalog's upstream, guard under a path matcher", ":8089 {\n\tforward_auth 127.0.0.1:2 {\n\t\turi /auth\n\t}\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		{"path route to another upstream, guard in the catch-all", ":8089 {\n\thandle /api/management/* {\n\t\treverse_proxy 127.0.0.1:3\n\t}\n\thandle {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		{"cors preflight + site level", ":8089 {\n\t@options method OPTIONS\n\thandle @options {\n\t\trespond 204\n\t}\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"cors preflight + guard in catch-all", ":8089 {\n\t@options method OPTIONS\n\thandle @options {\n\t\trespond 204\n\t}\n\thandle {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		{"read replica + site level", ":8089 {\n\ticeberg_idempotency\n\t@reads method GET HEAD\n\thandle @reads {\n\t\treverse_proxy 127.0.0.1:3\n\t}\n\thandle {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		{"read replica + guard in catch-all", ":8089 {\n\t@reads method GET HEAD\n\thandle @reads {\n\t\treverse_proxy 127.0.0.1:3\n\t}\n\thandle {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		{"health respond + site level", ":8089 {\n\thandle /healthz {\n\t\trespond 200\n\t}\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"handle_errors to the guarded catalog", ":8089 {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n\thandle_errors {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"handle_errors 4xx rewrites to the guarded catalog", ":8089 {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n\thandle_errors 4xx {\n\t\trewrite * /v1/config\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		{"handle_errors invokes the guarded catalog's named route", "&(cat) {\n\treverse_proxy 127.0.0.1:2\n}\n:8089 {\n\ticeberg_idempotency\n\tinvoke cat\n\thandle_errors {\n\t\tinvoke cat\n\t}\n}\n", true},
		{"handle_errors guarded by its own directive", ":8089 {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n\thandle_errors {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		{"handle_errors to an error page server", ":8089 {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n\thandle_errors {\n\t\treverse_proxy 127.0.0.1:3\n\t}\n}\n", false},
		{"handle_errors sends its own GET to the catalog", ":8089 {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n\thandle_errors {\n\t\treverse_proxy 127.0.0.1:2 {\n\t\t\tmethod GET\n\t\t}\n\t}\n}\n", false},
		{"handle_errors to a catalog nothing guards", ":8089 {\n\treverse_proxy 127.0.0.1:2\n\thandle_errors {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		// intercept runs before the directive, and its handle_response
		// routes once the guarded request was answered (until the
		// build after 068a81b not warned of: a drop answered 503 ran
		// twice).
		{"intercept's handle_response to the guarded catalog", ":8089 {\n\tintercept {\n\t\t@unavail status 503\n\t\thandle_response @unavail {\n\t\t\treverse_proxy 127.0.0.1:2\n\t\t}\n\t}\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n", true},
		{"intercept's handle_response guarded by its own directive", ":8089 {\n\tintercept {\n\t\t@unavail status 503\n\t\thandle_response @unavail {\n\t\t\ticeberg_idempotency\n\t\t\treverse_proxy 127.0.0.1:2\n\t\t}\n\t}\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"intercept inside a handle after the directive", ":8089 {\n\ticeberg_idempotency\n\thandle {\n\t\tintercept {\n\t\t\t@unavail status 503\n\t\t\thandle_response @unavail {\n\t\t\t\treverse_proxy 127.0.0.1:2\n\t\t\t}\n\t\t}\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", false},
		{"intercept's handle_response to an error page server", ":8089 {\n\tintercept {\n\t\t@unavail status 503\n\t\thandle_response @unavail {\n\t\t\treverse_proxy 127.0.0.1:3\n\t\t}\n\t}\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"intercept rewriting the answer only", ":8089 {\n\tintercept {\n\t\t@unavail status 503\n\t\thandle_response @unavail {\n\t\t\trespond \"down\" 503\n\t\t}\n\t}\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		// The same catalog spelt another way (until the build after
		// a95b973 compared as written, and not warned of).
		{"catch-all to localhost, guard to 127.0.0.1", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy localhost:2\n\t}\n}\n", true},
		{"catch-all to an IPv4-mapped address", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 10.0.0.5:2\n\t}\n\thandle {\n\t\treverse_proxy [::ffff:10.0.0.5]:2\n\t}\n}\n", true},
		{"catch-all to an {env.*} upstream", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy Catalog.Example:8181\n\t}\n\thandle {\n\t\treverse_proxy {env.ICEBERG_IDEMPOTENCY_TEST_UPSTREAM}\n\t}\n}\n", true},
		{"catch-all to an empty host", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy :2\n\t}\n}\n", true},
		{"catch-all to the unspecified address", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy 0.0.0.0:2\n\t}\n}\n", true},
		{"catch-all to another port of the same host", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy 127.0.0.1:2\n\t}\n\thandle {\n\t\treverse_proxy localhost:3\n\t}\n}\n", false},
		{"dynamic/no upstreams", ":8089 {\n\thandle /v1/* {\n\t\ticeberg_idempotency\n\t\treverse_proxy {\n\t\t\tdynamic a example.com\n\t\t}\n\t}\n\thandle {\n\t\treverse_proxy\n\t}\n}\n", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("ICEBERG_IDEMPOTENCY_TEST_UPSTREAM", "catalog.example:8181")
			core, logs := observer.New(zapcore.WarnLevel)
			warnBypassableHandlers(provisionedHTTPApp(t, tt.caddyfile), zap.New(core))
			if warned := logs.Len() > 0; warned != tt.warned {
				t.Errorf("warned %v, want %v: %v", warned, tt.warned, logs.All())
			}
		})
	}
}

// Matchers as a config not yet provisioned holds them (MatcherSetsRaw), an
// expression in either of its JSON forms: only what the expression reads
// counts, not the matcher's name.
func TestMissableMatcherRaw(t *testing.T) {
	for _, tt := range []struct {
		raw  string
		want bool
	}{
		{`{"path": ["/v1/*"]}`, true},
		{`{"method": ["POST"]}`, true},
		{`{"not": [{"method": ["GET"]}]}`, true},
		{`{"not": {"path": ["/health"]}}`, true},
		{`{"not": [{"host": ["a.localhost"]}]}`, false},
		{`{"expression": "{http.request.method} == 'POST'"}`, true},
		{`{"expression": {"expr": "path('/v1/*')", "name": "api"}}`, true},
		{`{"expression": {"expr": "{http.request.host} == 'a'", "name": "path_a"}}`, false},
		{`{"host": ["a.localhost"]}`, false},
		{`{"vars": {"{http.request.method}": ["POST"]}}`, true},
		{`{"vars_regexp": {"{http.request.uri.path}": {"pattern": "^/v1/"}}}`, true},
		{`{"not": {"vars": {"{http.request.method}": ["GET"]}}}`, true},
		{`{"vars": {"tenant": ["a"]}}`, false},
		// Caddy 2.11's URLPattern matcher: it misses "/v1;x/…" as path
		// does, and "/V1/…" unless ignore_case; until the build after
		// d4fe47c a layout under it was not warned of.
		{`{"url_pattern": {"pattern": "/v1/*"}}`, true},
		{`{"expression": "url_pattern('/v1/*')"}`, true},
	} {
		var set caddy.ModuleMap
		if err := json.Unmarshal([]byte(tt.raw), &set); err != nil {
			t.Fatal(err)
		}
		route := caddyhttp.Route{MatcherSetsRaw: caddyhttp.RawMatcherSets{set}}
		if got := hasMissableMatcher(route); got != tt.want {
			t.Errorf("hasMissableMatcher(%s) = %v, want %v", tt.raw, got, tt.want)
		}
	}
}

// readsMethodOrPath reads placeholders and function names, not the text
// of string literals, unless caddyPlaceholder names one in a literal.
func TestReadsMethodOrPath(t *testing.T) {
	for _, tt := range []struct {
		expr string
		want bool
	}{
		{"{http.request.method} == 'POST'", true},
		{"{method} in ['POST', 'DELETE']", true},
		{"path('/v1/*')", true},
		{"path_regexp('^/v1/')", true},
		{"method('POST')", true},
		{"url_pattern('/v1/*')", true},
		{"url_pattern_request_string('/v1/*')", true},
		{"{http.request.uri.path}.startsWith('/v1')", true},
		{`caddyPlaceholder(request, "http.request.method") == "POST"`, true},
		{"{host} == 'security.example.com'", false},
		{`{host} == "datapath.example.com" && {remote_host} != 'uri'`, false},
		{`{host} == 'a\'path'`, false},
		{`{host} == '''path'''`, false},
		{"{http.request.host} == 'a' || method('POST')", true},
		{"{host} == 'unterminated path", false},
	} {
		if got := readsMethodOrPath(tt.expr); got != tt.want {
			t.Errorf("readsMethodOrPath(%s) = %v, want %v", tt.expr, got, tt.want)
		}
	}
}
