package icebergidempotency

import (
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/caddyauth"
	"go.uber.org/zap"
)

// warnAuthenticationAfterGuards logs, once per config, each server where
// an authentication handler (basic_auth, or any provider of Caddy's
// authentication module) runs after an iceberg_idempotency handler whose
// principal names {http.auth.*}: when the directive runs, the placeholder
// is still empty, and every keyed request is refused 403 while the same
// request without a key is served. The common layout is the directive at
// site level (it orders itself before handle blocks) and basic_auth inside
// a handle or handle_path block. Until the build after b35c62e only the
// 403s' log lines told, request by request.
func warnAuthenticationAfterGuards(app *caddyhttp.App, logger *zap.Logger) {
	for name, srv := range app.Servers {
		w := authOrderWalk{invoked: newNamedWalk[bool](srv.NamedRoutes)}
		_, n := w.walk(srv.Routes, false)
		if srv.Errors != nil {
			_, k := w.walk(srv.Errors.Routes, false)
			n += k
		}
		if n > 0 {
			logger.Warn("an authentication handler (basic_auth) runs after an iceberg_idempotency directive whose principal names "+
				"{http.auth.*}: the principal is empty when the directive runs, and every keyed request is refused with 403. "+
				"Put the authentication before the directive: at site level, or the directive inside the block after it",
				zap.String("server", name), zap.Int("authentication_handlers", n))
		}
	}
}

// authOrderWalk walks one server's routes for
// warnAuthenticationAfterGuards.
type authOrderWalk struct {
	invoked namedWalk[bool]
}

// walk goes through routes in the order they run; guarded is whether a
// directive that needs the authentication's user ran before them. It
// returns whether one has run by their end, and how many authentication
// handlers run after one. A later route does not follow an earlier one of
// the same group (exclusive handle blocks) nor a terminal one (a site of
// its own on a shared port: a review saw two sites laid out as the README
// says warned of).
func (w *authOrderWalk) walk(routes caddyhttp.RouteList, guarded bool) (bool, int) {
	n := 0
	ends := make([]bool, len(routes))
	after := guarded
	for i, route := range routes {
		cur := guarded
		for j, earlier := range routes[:i] {
			if ends[j] && !earlier.Terminal && (earlier.Group == "" || earlier.Group != route.Group) {
				cur = true
			}
		}
		for _, h := range route.Handlers {
			switch h := h.(type) {
			case *Handler:
				cur = cur || strings.Contains(h.Principal, "{http.auth.")
			case *caddyauth.Authentication:
				if cur {
					n++
				}
			case *caddyhttp.Subroute:
				sub, k := w.walk(h.Routes, cur)
				n += k
				cur = cur || sub
			case *caddyhttp.Invoke:
				if named := w.invoked.enter(h.Name, cur); named != nil {
					sub, k := w.walk(named, cur)
					n += k
					cur = cur || sub
				}
			}
		}
		ends[i] = cur
		after = after || cur
	}
	return after, n
}
