package icebergidempotency

import (
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
)

// warnShadowedHandlers logs, once per config, each server where an
// iceberg_idempotency handler comes after a reverse_proxy that can answer
// its requests first: nothing else tells. The usual cause is a global
// "order iceberg_idempotency before reverse_proxy" line, the one most
// plugins ask for, which puts the directive after handle blocks; a
// reverse_proxy in a handle block then answers every catalog request, and
// keyed mutations pass unguarded and execute again on retry, without a
// log line. The other is a route block with the directive written after
// reverse_proxy.
func warnShadowedHandlers(app *caddyhttp.App, logger *zap.Logger) {
	for name, srv := range app.Servers {
		w := newShadowWalk(srv.NamedRoutes)
		n := w.shadowedIn(srv.Routes, false)
		for _, r := range srv.NamedRoutes {
			if r != nil {
				n += w.shadowedIn(caddyhttp.RouteList{*r}, false)
			}
		}
		if srv.Errors != nil {
			n += w.shadowedIn(srv.Errors.Routes, false)
		}
		if n > 0 {
			logger.Warn("iceberg_idempotency comes after a reverse_proxy that can answer first: the requests it answers pass unguarded, "+
				"and a retry executes them again. Remove any global 'order iceberg_idempotency' line (the directive orders itself "+
				"before handle, route and invoke); inside route, write the directive before reverse_proxy",
				zap.String("server", name), zap.Int("handlers", n))
		}
	}
}

// shadowWalk walks one server's routes for warnShadowedHandlers.
type shadowWalk struct {
	invoked namedWalk[bool] // shadowedIn's, by whether a proxy came before
}

func newShadowWalk(named map[string]*caddyhttp.Route) *shadowWalk {
	return &shadowWalk{invoked: newNamedWalk[bool](named)}
}

// namedWalk follows invoke into a server's named routes for the start-up
// walks, entering each named route once per state the walk brings to it:
// what a walk of a route finds depends on nothing else, so entering it
// again (a route that invokes itself, or one invoked from many places)
// would repeat what was found. Until the build after 1253b3f the walks
// followed invoke up to 8 deep instead, and a named route with six
// invokes of itself held up the config's load for seconds.
type namedWalk[S comparable] struct {
	routes  map[string]*caddyhttp.Route
	entered map[namedEntry[S]]bool
}

type namedEntry[S comparable] struct {
	name  string
	state S
}

func newNamedWalk[S comparable](routes map[string]*caddyhttp.Route) namedWalk[S] {
	return namedWalk[S]{routes: routes, entered: map[namedEntry[S]]bool{}}
}

// enter is the named route an invoke of name runs, or nil when there is
// none or it was entered with state before.
func (n namedWalk[S]) enter(name string, state S) caddyhttp.RouteList {
	r := n.routes[name]
	if r == nil || n.entered[namedEntry[S]{name, state}] {
		return nil
	}
	n.entered[namedEntry[S]{name, state}] = true
	return caddyhttp.RouteList{*r}
}

// shadowedIn counts the iceberg_idempotency handlers in routes that a
// reverse_proxy can answer before them: earlier in their own route's
// handlers (an invoked named route's included: until the build after
// 068a81b an "invoke" before the directive was not followed, and its
// reverse_proxy answered every keyed request unwarned), or in an earlier
// route of the same list that can match the same requests (see
// answersBefore); after is whether one around routes already can.
func (w *shadowWalk) shadowedIn(routes caddyhttp.RouteList, after bool) int {
	n := 0
	for i, route := range routes {
		proxied := after
		for _, earlier := range routes[:i] {
			proxied = proxied || w.answersBefore(earlier, route)
		}
		for _, h := range route.Handlers {
			switch h := h.(type) {
			case *Handler:
				if proxied {
					n++
				}
			case *reverseproxy.Handler:
				proxied = proxied || sendsRequestOn(h)
			case *caddyhttp.Subroute:
				n += w.shadowedIn(h.Routes, proxied)
				proxied = proxied || w.proxiesIn(h.Routes)
			case *caddyhttp.Invoke:
				if named := w.invoked.enter(h.Name, proxied); named != nil {
					n += w.shadowedIn(named, proxied)
				}
				proxied = proxied || w.invokedProxies(h.Name, map[string]bool{})
			}
		}
	}
	return n
}

// answersBefore reports whether earlier, which comes first in a route
// list, may answer requests that later would get: it holds a
// reverse_proxy, the two are not exclusive handle blocks of one group,
// and not both of them have matchers (which most often keep paths apart).
// A warning about a layout that does work is the price of the one that
// does not.
func (w *shadowWalk) answersBefore(earlier, later caddyhttp.Route) bool {
	if earlier.Group != "" && earlier.Group == later.Group {
		return false
	}
	if hasMatchers(earlier) && hasMatchers(later) {
		return false
	}
	return w.proxiesIn(caddyhttp.RouteList{earlier})
}

// hasMatchers reports whether route has matchers: provisioned (Caddy
// empties MatcherSetsRaw as it loads them, so a route of a running config
// has only MatcherSets) or not.
func hasMatchers(route caddyhttp.Route) bool {
	return len(route.MatcherSets) > 0 || len(route.MatcherSetsRaw) > 0
}

// proxiesIn reports whether routes hold a reverse_proxy that sends the
// request on (see sendsRequestOn), at any depth, named routes they invoke
// included. One with handle_response routes does too, whatever it then
// does with the answer: until the build after 068a81b such a one (a page
// of its own for the catalog's 5xx, a replace_status) was taken for
// forward_auth's, which sends a GET of its own and hands the request on,
// and a guard after it was not warned of.
func (w *shadowWalk) proxiesIn(routes caddyhttp.RouteList) bool {
	return w.proxiesReached(routes, map[string]bool{})
}

// proxiesReached is proxiesIn, entering each named route once: a route
// reached again, through a cycle of invokes or another path, holds nothing
// the first visit did not find.
func (w *shadowWalk) proxiesReached(routes caddyhttp.RouteList, entered map[string]bool) bool {
	for _, route := range routes {
		for _, h := range route.Handlers {
			switch h := h.(type) {
			case *reverseproxy.Handler:
				if sendsRequestOn(h) {
					return true
				}
			case *caddyhttp.Subroute:
				if w.proxiesReached(h.Routes, entered) {
					return true
				}
			case *caddyhttp.Invoke:
				if w.invokedProxies(h.Name, entered) {
					return true
				}
			}
		}
	}
	return false
}

// invokedProxies is proxiesReached of the named route name, unless it was
// entered already.
func (w *shadowWalk) invokedProxies(name string, entered map[string]bool) bool {
	r := w.invoked.routes[name]
	if r == nil || entered[name] {
		return false
	}
	entered[name] = true
	return w.proxiesReached(caddyhttp.RouteList{*r}, entered)
}
