package icebergidempotency

import "net/http"

// hideUpgrade takes a request's ask to switch protocols (Upgrade, and h2c's
// HTTP2-Settings) off its header while the handlers after this one run,
// and returns the function that puts it back.
//
// The JDK's HTTP client asks for h2c on http:// by default, and curl
// --http2 does too. reverse_proxy passes the ask on, and on a 101 hands the
// client's connection to the catalog: the catalog's answer then travels in
// the new protocol, which the handler can neither capture, store nor
// replay. The catalog has executed the request by then, yet its key would
// be released (1xx is no final answer), and a retry would execute it again.
// Without the ask, the catalog answers in HTTP/1.1, as a client that
// cannot upgrade gets it.
func hideUpgrade(r *http.Request) (restore func()) {
	up, hasUp := r.Header["Upgrade"]
	settings, hasSettings := r.Header["Http2-Settings"]
	if !hasUp && !hasSettings {
		return func() {}
	}
	delete(r.Header, "Upgrade")
	delete(r.Header, "Http2-Settings")
	return func() {
		if hasUp {
			r.Header["Upgrade"] = up
		}
		if hasSettings {
			r.Header["Http2-Settings"] = settings
		}
	}
}
