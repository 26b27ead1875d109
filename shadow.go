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
		n := shadowedIn(srv.Routes, false)
		for _, r := range srv.NamedRoutes {
			if r != nil {
				n += shadowedIn(caddyhttp.RouteList{*r}, false)
			}
		}
		if srv.Errors != nil {
			n += shadowedIn(srv.Errors.Routes, false)
		}
		if n > 0 {
			logger.Warn("iceberg_idempotency comes after a reverse_proxy that can answer first: the requests it answers pass unguarded, "+
				"and a retry executes them again. Remove any global 'order iceberg_idempotency' line (the directive orders itself "+
				"before handle, route and invoke); inside route, write the directive before reverse_proxy",
				zap.String("server", name), zap.Int("handlers", n))
		}
	}
}

// shadowedIn counts the iceberg_idempotency handlers in routes that a
// reverse_proxy can answer before them: earlier in their own route's
// handlers, or in an earlier route of the same list that can match the
// same requests (see answersBefore); after is whether one around routes
// already can.
func shadowedIn(routes caddyhttp.RouteList, after bool) int {
	n := 0
	for i, route := range routes {
		proxied := after
		for _, earlier := range routes[:i] {
			proxied = proxied || answersBefore(earlier, route)
		}
		for _, h := range route.Handlers {
			switch h := h.(type) {
			case *Handler:
				if proxied {
					n++
				}
			case *reverseproxy.Handler:
				proxied = proxied || answers(h)
			case *caddyhttp.Subroute:
				n += shadowedIn(h.Routes, proxied)
				proxied = proxied || proxiesIn(h.Routes)
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
func answersBefore(earlier, later caddyhttp.Route) bool {
	if earlier.Group != "" && earlier.Group == later.Group {
		return false
	}
	if hasMatchers(earlier) && hasMatchers(later) {
		return false
	}
	return proxiesIn(caddyhttp.RouteList{earlier})
}

// answers reports whether rp answers the requests it gets. One with
// handle_response routes may hand them on instead: forward_auth, which the
// README's layouts put before the directive, copies the auth server's
// headers on a 2xx and lets the request go on.
func answers(rp *reverseproxy.Handler) bool {
	return len(rp.HandleResponse) == 0
}

// hasMatchers reports whether route has matchers: provisioned (Caddy
// empties MatcherSetsRaw as it loads them, so a route of a running config
// has only MatcherSets) or not.
func hasMatchers(route caddyhttp.Route) bool {
	return len(route.MatcherSets) > 0 || len(route.MatcherSetsRaw) > 0
}

// proxiesIn reports whether routes hold a reverse_proxy that answers, at
// any depth.
func proxiesIn(routes caddyhttp.RouteList) bool {
	for _, route := range routes {
		for _, h := range route.Handlers {
			switch h := h.(type) {
			case *reverseproxy.Handler:
				if answers(h) {
					return true
				}
			case *caddyhttp.Subroute:
				if proxiesIn(h.Routes) {
					return true
				}
			}
		}
	}
	return false
}
