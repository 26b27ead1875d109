package icebergidempotency

import (
	"encoding/json"
	"iter"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/intercept"
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
		found, guarded, afterAnswer := map[string]bool{}, map[string]bool{}, map[string]bool{}
		walk := func(routes caddyhttp.RouteList) *bypassWalk {
			w := &bypassWalk{named: newNamedWalk[invokedWith](srv.NamedRoutes)}
			w.walkReach(routes, reach{unguarded: true})
			maps.Copy(guarded, w.guardedAny)
			maps.Copy(afterAnswer, w.afterAnswer)
			for dial := range w.guardedUnderMatcher {
				if w.unguarded[dial] {
					found[dial] = true
				}
			}
			// The other way round: a route under such a matcher takes
			// requests to the upstream unguarded, and the guard is
			// elsewhere ("method GET HEAD" takes "GET" with
			// "X-HTTP-Method-Override: POST" past a catch-all guard).
			for dial := range w.unguardedUnderMatcher {
				if w.guardedAny[dial] {
					found[dial] = true
				}
			}
			return w
		}
		// A terminal route (a Caddyfile site) ends the requests it
		// matches: one site's requests never reach another's handlers
		// (two sites apart by host share no request). Each is walked on
		// its own, after the routes before it that let requests through,
		// and after the sites before it with a path (":8080/v1/*") that
		// may share its host: those are handle blocks by another name,
		// and what their path misses goes on to the next site.
		var through, pathSites caddyhttp.RouteList
		for _, r := range srv.Routes {
			if !r.Terminal {
				through = append(through, r)
				continue
			}
			routes := slices.Clip(through)
			for _, p := range pathSites {
				if mayShareHost(p, r) {
					routes = append(routes, p)
				}
			}
			walk(append(routes, r))
			if hasMissableMatcher(r) {
				pathSites = append(pathSites, r)
			}
		}
		walk(through)
		var errorRoutes *bypassWalk
		if srv.Errors != nil {
			errorRoutes = walk(srv.Errors.Routes)
		}
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
		// intercept comes before the directive (Caddy orders it so),
		// and its handle_response routes run once the guarded request
		// was answered, its key finalized or released: a reverse_proxy
		// there to a guarded upstream sends the keyed request to the
		// catalog again, unguarded (an audit measured a drop answered
		// 503, sent again there, and its retry: two executions).
		if exposed := slices.Sorted(maps.Keys(keysIn(afterAnswer, guarded))); len(exposed) > 0 {
			logger.Warn("iceberg_idempotency guards an upstream that a reverse_proxy in intercept's handle_response reaches unguarded: "+
				"those routes run after the guarded request was answered and its key finalized or released, so a keyed request "+
				"is sent to the catalog again there with no guard, and its retry executes again. Put iceberg_idempotency in the "+
				"handle_response block too, before its reverse_proxy, or move intercept into a handle block after the directive",
				zap.String("server", name), zap.Strings("upstreams", exposed))
		}
		if errorRoutes == nil {
			continue
		}
		// The error routes (handle_errors) run with the request a handler
		// failed: one after the directive (which released the key), one
		// before it, or a handle_response route that turned the
		// catalog's 429 into an error. A reverse_proxy there to an
		// upstream the directive guards sends a keyed mutation to it
		// unguarded, and its retry, guarded again, executes once more.
		if exposed := slices.Sorted(maps.Keys(keysIn(errorRoutes.unguarded, guarded))); len(exposed) > 0 {
			logger.Warn("iceberg_idempotency guards an upstream that a reverse_proxy in handle_errors reaches unguarded: "+
				"a keyed request whose handler failed (a handler after the directive, which released its key, one before it, "+
				"or a handle_response route that turned the catalog's answer into an error) is sent to the catalog there "+
				"with no guard, and its retry executes again. Put iceberg_idempotency in the handle_errors block too, "+
				"before its reverse_proxy",
				zap.String("server", name), zap.Strings("upstreams", exposed))
		}
	}
}

// keysIn is the keys of a that b holds too.
func keysIn(a, b map[string]bool) map[string]bool {
	both := map[string]bool{}
	for k := range a {
		if b[k] {
			both[k] = true
		}
	}
	return both
}

// mayShareHost reports whether a request may match both a's and b's host
// matchers: one of them takes any host (a matcher set without a host
// matcher), or they name a host in common.
func mayShareHost(a, b caddyhttp.Route) bool {
	ha, anyA := routeHosts(a)
	hb, anyB := routeHosts(b)
	return anyA || anyB || slices.ContainsFunc(ha, func(h string) bool { return slices.Contains(hb, h) })
}

// routeHosts is the hosts route's host matchers name (lower case), and
// whether it takes any host: it has no matchers, or a matcher set without
// a host matcher.
func routeHosts(route caddyhttp.Route) (hosts []string, anyHost bool) {
	if !hasMatchers(route) {
		return nil, true
	}
	for _, set := range route.MatcherSetsRaw {
		var hs []string
		if set["host"] == nil || json.Unmarshal(set["host"], &hs) != nil {
			return nil, true
		}
		hosts = append(hosts, hs...)
	}
	for _, set := range route.MatcherSets {
		var hs []string
		for _, m := range set {
			switch m := m.(type) {
			case caddyhttp.MatchHost:
				hs = append(hs, m...)
			case *caddyhttp.MatchHost:
				hs = append(hs, *m...)
			}
		}
		if hs == nil {
			return nil, true
		}
		hosts = append(hosts, hs...)
	}
	for i, h := range hosts {
		hosts[i] = strings.ToLower(h)
	}
	return hosts, false
}

// bypassWalk gathers, for one server, the upstreams that a guard under a
// path or method matcher proxies to, and those that requests reach with
// no guard.
type bypassWalk struct {
	guardedUnderMatcher   map[string]bool
	unguarded             map[string]bool
	unguardedUnderMatcher map[string]bool        // reached unguarded under such a matcher
	guardedAny            map[string]bool        // reached guarded, under a matcher or not
	named                 namedWalk[invokedWith] // the server's, for invoke
	// afterAnswer: reached unguarded from an intercept's handle_response
	// routes, which run once the request was answered (see walkReach).
	afterAnswer map[string]bool
	intercepts  int // intercepts' handle_response routes being walked
}

// invokedWith is what the walk of a named route depends on: the requests
// that reach the invoke, and whether it runs once they were answered.
type invokedWith struct {
	reach
	afterAnswer bool
}

// reach is which requests can arrive at a point of a route list: with no
// guard before them, after a guard under a path or method matcher, after
// one under neither; underMatcher says such a matcher is around the point.
// underTaker says one around it may take such requests to a route of its
// own (any of them but a path matcher with exact paths only: no spelling
// of a mutation matches "/healthz").
type reach struct{ unguarded, guardedUnderMatcher, guarded, underMatcher, underTaker bool }

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
		w.unguardedUnderMatcher, w.guardedAny = map[string]bool{}, map[string]bool{}
		w.afterAnswer = map[string]bool{}
	}
	for _, route := range routes {
		in := st
		missable := hasMissableMatcher(route)
		in.underMatcher = in.underMatcher || missable
		in.underTaker = in.underTaker || missable && !exactPathsOnly(route)
		guardedHere := false
		for _, h := range route.Handlers {
			switch h := h.(type) {
			case *Handler:
				in, guardedHere = in.guard(), true
			case *reverseproxy.Handler:
				if !sendsRequestOn(h) {
					continue
				}
				for _, up := range h.Upstreams {
					if up == nil {
						continue
					}
					dial := upstreamKey(up.Dial)
					if in.unguarded {
						w.unguarded[dial] = true
						if in.underTaker {
							w.unguardedUnderMatcher[dial] = true
						}
						if w.intercepts > 0 {
							w.afterAnswer[dial] = true
						}
					}
					if in.guarded || in.guardedUnderMatcher {
						w.guardedAny[dial] = true
					}
					if in.guardedUnderMatcher {
						w.guardedUnderMatcher[dial] = true
					}
				}
			case *caddyhttp.Subroute:
				w.walkReach(h.Routes, in)
			case *caddyhttp.Invoke:
				if named := w.named.enter(h.Name, invokedWith{in, w.intercepts > 0}); named != nil {
					w.walkReach(named, in)
				}
			case *intercept.Intercept:
				// Its handle_response routes run once the handlers
				// after it answered, with the request as it reached
				// the intercept: before any guard after it.
				w.intercepts++
				for _, rh := range h.HandleResponse {
					w.walkReach(rh.Routes, in)
				}
				w.intercepts--
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

// upstreamKey is the catalog an upstream's dial address names, in one
// spelling, so that two reverse_proxy handlers to it are known for the
// same: its {env.*} placeholders expanded, and its host lower-cased, an
// IPv4-mapped IPv6 address written as IPv4, and "localhost", an empty host,
// the unspecified addresses and every loopback address as one. Compared
// as written, a catch-all to "localhost:8181" beside a guarded
// "127.0.0.1:8181" (or "{env.CATALOG}", or "[::ffff:127.0.0.1]:8181") took
// "/v1;x/…" to the catalog unguarded without a warning until the build
// after a95b973. Another DNS name of the same host, or dynamic upstreams,
// are not known for it.
func upstreamKey(dial string) string {
	dial = caddy.NewReplacer().ReplaceKnown(dial, "")
	network, host, port, err := caddy.SplitNetworkAddress(dial)
	if err != nil || port == "" {
		return dial
	}
	host = strings.ToLower(host)
	if host == "" {
		host = "localhost" // ":8181" dials this host
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		ip = ip.Unmap()
		host = ip.String()
		if ip.IsLoopback() || ip.IsUnspecified() { // Go dials 0.0.0.0 and [::] on this host
			host = "localhost"
		}
	}
	if network != "" && network != "tcp" {
		return network + "/" + net.JoinHostPort(host, port)
	}
	return net.JoinHostPort(host, port)
}

// sendsRequestOn reports whether rp sends the requests it gets to its
// upstreams with their own method: every reverse_proxy but forward_auth,
// which sends a GET of its own. One with handle_response routes (a page of
// its own for the catalog's 5xx) sends them on all the same, whatever it
// does with the response: until the build after 521c3b1 the walk skipped
// it as it skips forward_auth, and a catch-all written so
// took "/v1;x/…" to the catalog unguarded without a warning.
func sendsRequestOn(rp *reverseproxy.Handler) bool {
	return rp.Rewrite == nil || rp.Rewrite.Method == ""
}

// hasMissableMatcher reports whether route has a matcher that misses
// requests a catalog may execute as the mutations it takes (see
// warnBypassableHandlers): path, path_regexp, url_pattern or method, or a CEL
// expression, vars or vars_regexp matcher that reads the method, path or
// URI, provisioned or not.
// Under "not" they miss the other way, which is as bad: "not method GET
// HEAD" misses "GET" with "X-HTTP-Method-Override: POST", a commit on
// Javalin.
func hasMissableMatcher(route caddyhttp.Route) bool {
	return rawMissable(route.MatcherSetsRaw) || setsMissable(route.MatcherSets)
}

// exactPathsOnly reports whether route's matcher sets are all path
// matchers of exact paths (no "*"), the one way a matcher cannot take a
// mutation spelled otherwise to a route of its own.
func exactPathsOnly(route caddyhttp.Route) bool {
	exact := func(paths []string) bool {
		return len(paths) > 0 && !slices.ContainsFunc(paths, func(p string) bool { return strings.Contains(p, "*") })
	}
	for _, set := range route.MatcherSetsRaw {
		var paths []string
		if len(set) != 1 || set["path"] == nil || json.Unmarshal(set["path"], &paths) != nil || !exact(paths) {
			return false
		}
	}
	for _, set := range route.MatcherSets {
		if len(set) != 1 {
			return false
		}
		switch m := set[0].(type) {
		case caddyhttp.MatchPath:
			if !exact(m) {
				return false
			}
		case *caddyhttp.MatchPath:
			if !exact(*m) {
				return false
			}
		default:
			return false
		}
	}
	return len(route.MatcherSetsRaw)+len(route.MatcherSets) > 0
}

// rawMissable is hasMissableMatcher of matcher sets not yet provisioned.
func rawMissable(sets []caddy.ModuleMap) bool {
	for _, set := range sets {
		if set["path"] != nil || set["path_regexp"] != nil || set["url_pattern"] != nil || set["method"] != nil {
			return true
		}
		if raw := set["expression"]; raw != nil && readsMethodOrPath(rawExpression(raw)) {
			return true
		}
		if rawVarsReadMethodOrPath(set["vars"]) || rawVarsReadMethodOrPath(set["vars_regexp"]) {
			return true
		}
		if raw := set["not"]; raw != nil && rawMissable(rawNot(raw)) {
			return true
		}
	}
	return false
}

// setsMissable is hasMissableMatcher of provisioned matcher sets.
func setsMissable(sets []caddyhttp.MatcherSet) bool {
	for _, set := range sets {
		for _, m := range set {
			switch m := m.(type) {
			case caddyhttp.MatchPath, *caddyhttp.MatchPath, *caddyhttp.MatchPathRE, *caddyhttp.MatchURLPattern, caddyhttp.MatchMethod, *caddyhttp.MatchMethod:
				return true
			case *caddyhttp.MatchExpression:
				if readsMethodOrPath(m.Expr) {
					return true
				}
			case caddyhttp.VarsMatcher:
				if keysReadMethodOrPath(maps.Keys(m)) {
					return true
				}
			case *caddyhttp.VarsMatcher:
				if keysReadMethodOrPath(maps.Keys(*m)) {
					return true
				}
			case caddyhttp.MatchVarsRE:
				if keysReadMethodOrPath(maps.Keys(m)) {
					return true
				}
			case *caddyhttp.MatchVarsRE:
				if keysReadMethodOrPath(maps.Keys(*m)) {
					return true
				}
			case *caddyhttp.MatchNot:
				if setsMissable(m.MatcherSets) || rawMissable(m.MatcherSetsRaw) {
					return true
				}
			}
		}
	}
	return false
}

// rawNot is the matcher sets of a not matcher's JSON: an array of them,
// or one.
func rawNot(raw json.RawMessage) []caddy.ModuleMap {
	var sets []caddy.ModuleMap
	if json.Unmarshal(raw, &sets) == nil {
		return sets
	}
	var one caddy.ModuleMap
	if json.Unmarshal(raw, &one) == nil {
		return []caddy.ModuleMap{one}
	}
	return nil
}

// readsMethodOrPath reports whether a CEL expression may read the method
// or the path: a placeholder of either ({method}, {path}, {path.0},
// {http.request.uri…}, also as caddyPlaceholder names it) or a matcher
// function (method(), path(), path_regexp(), url_pattern()). A word alone is no read: a
// host name may hold "uri" or "path" ({host} == 'security.example.com').
func readsMethodOrPath(expr string) bool {
	expr = strings.ToLower(expr)
	return slices.ContainsFunc(methodOrPathReads, func(r string) bool { return strings.Contains(expr, r) })
}

// methodOrPathReads are the texts by which an expression reads the method
// or the path.
var methodOrPathReads = []string{
	"{method}", "{path}", "{path.", "{uri}", "{dir}", "{file}", "{file.base}", "{file.ext}",
	"http.request.method", "http.request.orig_method", "http.request.uri", "http.request.orig_uri",
	"method(", "path(", "path_regexp(", "url_pattern(", "url_pattern_request_string(",
}

// rawVarsReadMethodOrPath reports whether a vars or vars_regexp
// matcher's JSON, an object keyed by variable names and placeholders,
// compares a placeholder of the method or the path ("vars {method} POST").
func rawVarsReadMethodOrPath(raw json.RawMessage) bool {
	var m map[string]json.RawMessage
	return raw != nil && json.Unmarshal(raw, &m) == nil && keysReadMethodOrPath(maps.Keys(m))
}

// keysReadMethodOrPath reports whether any of a vars matcher's keys is a
// placeholder of the method or the path.
func keysReadMethodOrPath(keys iter.Seq[string]) bool {
	for k := range keys {
		if readsMethodOrPath(k) {
			return true
		}
	}
	return false
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
