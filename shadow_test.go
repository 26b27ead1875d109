package icebergidempotency

import (
	"encoding/json"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/rewrite"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// shadowedIn on route lists shaped as the Caddyfile adapter builds them
// (integration's TestCoreReverseProxyBeforeTheDirectiveIsWarnedOf runs the
// real ones): a reverse_proxy that answers before the handler shadows it,
// unless handle blocks of one group or matchers on both keep them apart, or
// it is forward_auth's, which hands the request on.
func TestShadowedHandlers(t *testing.T) {
	proxy := func() caddyhttp.MiddlewareHandler { return &reverseproxy.Handler{} }
	forwardAuth := func() caddyhttp.MiddlewareHandler {
		return &reverseproxy.Handler{Rewrite: &rewrite.Rewrite{Method: "GET"}, HandleResponse: []caddyhttp.ResponseHandler{{}}}
	}
	// A page of its own for the catalog's 503 (or a replace_status):
	// the request goes to the catalog all the same.
	pageFor503 := func() caddyhttp.MiddlewareHandler {
		return &reverseproxy.Handler{HandleResponse: []caddyhttp.ResponseHandler{{}}}
	}
	invoke := func() caddyhttp.MiddlewareHandler { return &caddyhttp.Invoke{Name: "catalog"} }
	named := map[string]*caddyhttp.Route{
		"catalog": {Handlers: []caddyhttp.MiddlewareHandler{proxy()}},
		"loopA":   {Handlers: []caddyhttp.MiddlewareHandler{&caddyhttp.Invoke{Name: "loopB"}, proxy()}},
		"loopB":   {Handlers: []caddyhttp.MiddlewareHandler{&caddyhttp.Invoke{Name: "loopA"}}},
	}
	guard := func() caddyhttp.MiddlewareHandler { return &Handler{} }
	route := func(hs ...caddyhttp.MiddlewareHandler) caddyhttp.Route { return caddyhttp.Route{Handlers: hs} }
	sub := func(routes ...caddyhttp.Route) caddyhttp.MiddlewareHandler {
		return &caddyhttp.Subroute{Routes: routes}
	}
	matched := func(r caddyhttp.Route) caddyhttp.Route {
		r.MatcherSetsRaw = caddyhttp.RawMatcherSets{{"path": json.RawMessage(`["/v1/*"]`)}}
		return r
	}
	grouped := func(r caddyhttp.Route) caddyhttp.Route { r.Group = "group0"; return r }
	for _, tt := range []struct {
		name   string
		routes caddyhttp.RouteList
		want   int
	}{
		{"guard first", caddyhttp.RouteList{route(guard()), matched(route(sub(route(proxy()))))}, 0},
		// order iceberg_idempotency before reverse_proxy: after the handle.
		{"handle block first", caddyhttp.RouteList{matched(route(sub(route(proxy())))), route(guard())}, 1},
		{"one route, proxy first", caddyhttp.RouteList{route(proxy(), guard())}, 1},
		{"one route, guard first", caddyhttp.RouteList{route(guard(), proxy())}, 0},
		{"handle blocks of one group", caddyhttp.RouteList{
			grouped(matched(route(sub(route(proxy()))))), grouped(route(sub(route(guard(), proxy()))))}, 0},
		{"matchers on both", caddyhttp.RouteList{matched(route(proxy())), matched(route(guard(), proxy()))}, 0},
		{"forward_auth first", caddyhttp.RouteList{route(forwardAuth()), route(guard()), route(proxy())}, 0},
		{"nested under an earlier proxy", caddyhttp.RouteList{route(sub(route(proxy()))), route(sub(route(sub(route(guard())))))}, 1},
		// Until the build after 068a81b these two were not warned of.
		{"proxy with handle_response first", caddyhttp.RouteList{route(pageFor503(), guard())}, 1},
		{"invoke first", caddyhttp.RouteList{route(invoke(), guard())}, 1},
		{"invoke in an earlier route", caddyhttp.RouteList{route(sub(route(invoke()))), route(guard())}, 1},
		{"invoke after the guard", caddyhttp.RouteList{route(guard(), invoke())}, 0},
		// Named routes that invoke each other: "loopB" reaches the
		// proxy through "loopA" (a cache of the first answer found
		// while the cycle was open took it for none).
		{"invoke of a route that reaches a proxy through a cycle", caddyhttp.RouteList{
			matched(route(&caddyhttp.Invoke{Name: "loopA"})), matched(route(&caddyhttp.Invoke{Name: "loopB"}, guard()))}, 1},
	} {
		w := newShadowWalk(named)
		if got := w.shadowedIn(tt.routes, false); got != tt.want {
			t.Errorf("%s: %d shadowed, want %d", tt.name, got, tt.want)
		}
	}
}

// On a provisioned http app, as App.Start sees it: Caddy empties a route's
// MatcherSetsRaw as it loads its matchers. Two sites on one server, the
// catalog's with the directive first, warned before: the host matchers
// that keep them apart were not seen. (Caddy sorts the sites: "another"
// comes first, its reverse_proxy before the catalog's directive.)
func TestShadowedHandlersOnAProvisionedApp(t *testing.T) {
	for _, tt := range []struct {
		name, caddyfile string
		warned          bool
	}{
		{"two sites on one server", "http://another.localhost:8089 {\n\treverse_proxy 127.0.0.1:1\n}\n" +
			"http://catalog.localhost:8089 {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"order line", "{\n\torder iceberg_idempotency before reverse_proxy\n}\n" +
			":8089 {\n\ticeberg_idempotency\n\thandle /v1/* {\n\t\treverse_proxy 127.0.0.1:2\n\t}\n}\n", true},
		// The audit's layouts: unguarded, and not warned of until the
		// build after 068a81b.
		{"order line, invoke", "{\n\torder iceberg_idempotency before reverse_proxy\n}\n&(catalog) {\n\treverse_proxy 127.0.0.1:2\n}\n" +
			":8089 {\n\ticeberg_idempotency\n\tinvoke catalog\n}\n", true},
		{"route, invoke first", "&(catalog) {\n\treverse_proxy 127.0.0.1:2\n}\n" +
			":8089 {\n\troute {\n\t\tinvoke catalog\n\t\ticeberg_idempotency\n\t}\n}\n", true},
		{"order line, handle_response", "{\n\torder iceberg_idempotency before reverse_proxy\n}\n" +
			":8089 {\n\ticeberg_idempotency\n\thandle {\n\t\treverse_proxy 127.0.0.1:2 {\n\t\t\t@bad status 502 503\n\t\t\thandle_response @bad {\n\t\t\t\trespond \"down\" 503\n\t\t\t}\n\t\t}\n\t}\n}\n", true},
		{"route, replace_status first", ":8089 {\n\troute {\n\t\treverse_proxy 127.0.0.1:2 {\n\t\t\t@e status 500\n\t\t\treplace_status @e 503\n\t\t}\n\t\ticeberg_idempotency\n\t}\n}\n", true},
		{"forward_auth first", ":8089 {\n\tforward_auth 127.0.0.1:3 {\n\t\turi /auth\n\t}\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:2\n}\n", false},
		{"invoke after the directive", "&(catalog) {\n\treverse_proxy 127.0.0.1:2\n}\n:8089 {\n\ticeberg_idempotency\n\tinvoke catalog\n}\n", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			warnShadowedHandlers(provisionedHTTPApp(t, tt.caddyfile), zap.New(core))
			if warned := logs.Len() > 0; warned != tt.warned {
				t.Fatalf("warned %v, want %v: %v", warned, tt.warned, logs.All())
			}
		})
	}
}

// provisionedHTTPApp is the http app of caddyfile, adapted and provisioned
// as App.Start sees it.
func provisionedHTTPApp(t *testing.T, caddyfile string) *caddyhttp.App {
	t.Helper()
	adapted, err := adapt(t, caddyfile)
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Apps map[string]json.RawMessage `json:"apps"`
	}
	if err := json.Unmarshal(adapted, &cfg); err != nil {
		t.Fatal(err)
	}
	mod, err := runningCaddyContext(t).LoadModuleByID("http", cfg.Apps["http"])
	if err != nil {
		t.Fatal(err)
	}
	return mod.(*caddyhttp.App)
}

// A named route that invokes itself is walked once per state, not once
// per path through its invokes: with twelve invokes of itself before a
// guard and a reverse_proxy, the walks before the build after 1253b3f
// followed every path up to 8 invokes deep, about 24^8 of them, and held up
// the config's load (six took seconds). The guard after the invokes is
// shadowed (the route proxies); the walks end.
func TestSelfInvokingNamedRouteIsWalkedOnce(t *testing.T) {
	var handlers []caddyhttp.MiddlewareHandler
	for range 12 {
		handlers = append(handlers, &caddyhttp.Invoke{Name: "loop"})
	}
	handlers = append(handlers, &Handler{}, &reverseproxy.Handler{Upstreams: reverseproxy.UpstreamPool{{Dial: "127.0.0.1:2"}}})
	named := map[string]*caddyhttp.Route{"loop": {Handlers: handlers}}
	routes := caddyhttp.RouteList{{Handlers: []caddyhttp.MiddlewareHandler{&caddyhttp.Invoke{Name: "loop"}}}}
	w := newShadowWalk(named)
	if n := w.shadowedIn(routes, false); n == 0 {
		t.Fatal("the guard after the route's invokes of itself, which proxy, not found shadowed")
	}
	if len(w.invoked.entered) > 2 {
		t.Fatalf("the named route was entered %d times, want once per state (2 at most)", len(w.invoked.entered))
	}
	b := &bypassWalk{named: newNamedWalk[invokedWith](named)}
	b.walkReach(routes, reach{unguarded: true})
	if !b.guardedAny["localhost:2"] || len(b.named.entered) > 2 {
		t.Fatalf("bypass walk: guarded %v, named route entered %d times; want the upstream reached guarded, the route entered once per state",
			b.guardedAny, len(b.named.entered))
	}
}
