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
		w := &shadowWalk{named: srv.NamedRoutes}
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
	named   map[string]*caddyhttp.Route // the server's, for invoke
	invokes int                         // invokes being walked: a named route may invoke itself
}

// invoked is the named route an invoke runs, or nil when it names none or
// the walk is maxInvokeDepth invokes deep already.
func (w *shadowWalk) invoked(h *caddyhttp.Invoke) caddyhttp.RouteList {
	if r := w.named[h.Name]; r != nil && w.invokes < maxInvokeDepth {
		return caddyhttp.RouteList{*r}
	}
	return nil
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
				if named := w.invoked(h); named != nil {
					w.invokes++
					n += w.shadowedIn(named, proxied)
					proxied = proxied || w.proxiesIn(named)
					w.invokes--
				}
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
// request on (see sendsRequestOn), at any depth. One with handle_response
// routes does too, whatever it then does with the answer: until the build
// after 068a81b such a one (a page of its own for the catalog's 5xx, a
// replace_status) was taken for forward_auth's, which sends a GET of its
// own and hands the request on, and a guard after it was not warned of.
func (w *shadowWalk) proxiesIn(routes caddyhttp.RouteList) bool {
	for _, route := range routes {
		for _, h := range route.Handlers {
			switch h := h.(type) {
			case *reverseproxy.Handler:
				if sendsRequestOn(h) {
					return true
				}
			case *caddyhttp.Subroute:
				if w.proxiesIn(h.Routes) {
					return true
				}
			case *caddyhttp.Invoke:
				if named := w.invoked(h); named != nil {
					w.invokes++
					found := w.proxiesIn(named)
					w.invokes--
					if found {
						return true
					}
				}
			}
		}
	}
	return false
}
