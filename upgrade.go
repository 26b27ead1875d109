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
	return hideHeaders(r, "Upgrade", "Http2-Settings")
}

// hideHeaders takes the named (canonical) headers off r's header and
// returns the function that puts them back.
func hideHeaders(r *http.Request, names ...string) (restore func()) {
	var hidden http.Header
	for _, name := range names {
		if vals, ok := r.Header[name]; ok {
			if hidden == nil {
				hidden = make(http.Header, len(names))
			}
			hidden[name] = vals
			delete(r.Header, name)
		}
	}
	if hidden == nil {
		return func() {}
	}
	return func() {
		for name, vals := range hidden {
			r.Header[name] = vals
		}
	}
}
