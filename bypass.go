package icebergidempotency

import (
	"encoding/json"
	"maps"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
)

// warnBypassableHandlers logs, once per config, each server where an
// iceberg_idempotency handler sits under a path or method matcher, or an
// expression that reads either (a handle, route or handle_path block, or a
// matcher on the directive) while
// a reverse_proxy to one of the upstreams it guards is reachable without it
// (a catch-all handle, a site-level reverse_proxy). Caddy's path matcher
// does not cut path parameters: "/v1;x/…", "/.;/v1/…" and "/x/..;/v1/…"
// miss "/v1/*" and reach that reverse_proxy unguarded, and a servlet or
// JAX-RS catalog routes them as "/v1/…". Its method matcher compares the
// method as sent: "post", or "GET" with "X-HTTP-Method-Override: POST",
// misses "method POST", and a catalog on Javalin executes either as a
// POST. Either way a keyed retry executes again.
func warnBypassableHandlers(app *caddyhttp.App, logger *zap.Logger) {
	for name, srv := range app.Servers {
		found := map[string]bool{}
		walk := func(routes caddyhttp.RouteList) {
			w := bypassWalk{named: srv.NamedRoutes}
			w.walkReach(routes, reach{unguarded: true})
			for dial := range w.guardedUnderMatcher {
				if w.unguarded[dial] {
					found[dial] = true
				}
			}
		}
		// A terminal route (a Caddyfile site) ends the requests it
		// matches: one site's requests never reach another's handlers
		// (two sites apart by host share no request). Each is walked on
		// its own, after the routes before it that let requests through.
		var through caddyhttp.RouteList
		for _, r := range srv.Routes {
			if r.Terminal {
				walk(append(slices.Clip(through), r))
			} else {
				through = append(through, r)
			}
		}
		walk(through)
		if len(found) > 0 {
			shared := slices.Sorted(maps.Keys(found))
			logger.Warn("iceberg_idempotency guards an upstream only for the requests a path or method matcher gives it, and "+
				"a reverse_proxy to the same upstream takes the requests its matcher misses, unguarded: Caddy's path matcher "+
				"does not cut path parameters (/v1;x/..., /.;/v1/...), which Java catalogs route as /v1/..., and its method "+
				"matcher misses a method in lower case or named by X-HTTP-Method-Override, which Javalin catalogs execute, "+
				"so a keyed retry of such a request executes again. Put the directive at the site level, with no matcher "+
				"(with base_path for a prefix; it passes reads by itself)",
				zap.String("server", name), zap.Strings("upstreams", shared))
		}
	}
}

// bypassWalk gathers, for one server, the upstreams that a guard under a
// path or method matcher proxies to, and those that requests reach with
// no guard.
type bypassWalk struct {
	guardedUnderMatcher map[string]bool
	unguarded           map[string]bool
	named               map[string]*caddyhttp.Route // the server's, for invoke
	invokes             int                         // invokes being walked: a named route may invoke itself
}

// maxInvokeDepth bounds how deep the walk follows invoke.
const maxInvokeDepth = 8

// reach is which requests can arrive at a point of a route list: with no
// guard before them, after a guard under a path or method matcher, after
// one under neither; underMatcher says such a matcher is around the point.
type reach struct{ unguarded, guardedUnderMatcher, guarded, underMatcher bool }

// guard is st after a guard: the requests that reached it unguarded are
// guarded now, under a path or method matcher or not.
func (st reach) guard() reach {
	if st.unguarded {
		st.unguarded = false
		if st.underMatcher {
			st.guardedUnderMatcher = true
		} else {
			st.guarded = true
		}
	}
	return st
}

// walkReach walks routes in order: a handler in a route wraps the routes
// after it (Caddy chains a route list into one middleware chain), but only
// for the requests that route's matchers take.
func (w *bypassWalk) walkReach(routes caddyhttp.RouteList, st reach) {
	if w.guardedUnderMatcher == nil {
		w.guardedUnderMatcher, w.unguarded = map[string]bool{}, map[string]bool{}
	}
	for _, route := range routes {
		in := st
		missable := hasMissableMatcher(route)
		in.underMatcher = in.underMatcher || missable
		guardedHere := false
		for _, h := range route.Handlers {
			switch h := h.(type) {
			case *Handler:
				in, guardedHere = in.guard(), true
			case *reverseproxy.Handler:
				if !answers(h) {
					continue
				}
				for _, up := range h.Upstreams {
					if up == nil {
						continue
					}
					if in.unguarded {
						w.unguarded[up.Dial] = true
					}
					if in.guardedUnderMatcher {
						w.guardedUnderMatcher[up.Dial] = true
					}
				}
			case *caddyhttp.Subroute:
				w.walkReach(h.Routes, in)
			case *caddyhttp.Invoke:
				if r := w.named[h.Name]; r != nil && w.invokes < maxInvokeDepth {
					w.invokes++
					w.walkReach(caddyhttp.RouteList{*r}, in)
					w.invokes--
				}
			}
		}
		if !guardedHere {
			continue
		}
		switch {
		case missable:
			// The requests the matcher takes go on guarded; those it
			// misses, unguarded.
			if st.unguarded {
				st.guardedUnderMatcher = true
			}
		case !hasMatchers(route):
			st = st.guard()
		}
	}
}

// hasMissableMatcher reports whether route has a matcher that misses
// requests a catalog may execute as the mutations it takes (see
// warnBypassableHandlers): path, path_regexp or method, or a CEL
// expression that reads the method, path or URI, provisioned or not.
// Under "not" they miss the other way, and such requests are guarded.
func hasMissableMatcher(route caddyhttp.Route) bool {
	for _, set := range route.MatcherSetsRaw {
		if set["path"] != nil || set["path_regexp"] != nil || set["method"] != nil {
			return true
		}
		if raw := set["expression"]; raw != nil && readsMethodOrPath(rawExpression(raw)) {
			return true
		}
	}
	for _, set := range route.MatcherSets {
		for _, m := range set {
			switch m := m.(type) {
			case caddyhttp.MatchPath, *caddyhttp.MatchPath, *caddyhttp.MatchPathRE, caddyhttp.MatchMethod, *caddyhttp.MatchMethod:
				return true
			case *caddyhttp.MatchExpression:
				if readsMethodOrPath(m.Expr) {
					return true
				}
			}
		}
	}
	return false
}

// readsMethodOrPath reports whether a CEL expression may read the method
// or the path: a placeholder ({method}, {path}, {http.request.uri…}) or a
// matcher function (method(), path(), path_regexp()).
func readsMethodOrPath(expr string) bool {
	expr = strings.ToLower(expr)
	return strings.Contains(expr, "method") || strings.Contains(expr, "path") || strings.Contains(expr, "uri")
}

// rawExpression is the CEL expression of an expression matcher's JSON: a
// string, or an object with expr and name.
func rawExpression(raw json.RawMessage) string {
	var expr string
	if json.Unmarshal(raw, &expr) == nil {
		return expr
	}
	var m struct {
		Expr string `json:"expr"`
	}
	_ = json.Unmarshal(raw, &m)
	return m.Expr
}
