package icebergidempotency

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// How much of a request reached the catalog, as far as an error from the
// handlers after this one proves.
const (
	sentMaybe        = iota // the request may have reached the catalog
	sentNothing             // no upstream was chosen: a handler before reverse_proxy failed
	sentNoConnection        // reverse_proxy chose an upstream but had no connection to send it on, or had none
	sentUnprocessed         // one attempt had a connection, and the transport's error proves the catalog did not process it
)

// howMuchSent tells how much of the request err proves did not reach the
// catalog. reverse_proxy sets the upstream placeholders just before it
// sends, so without them no upstream was even chosen; "no upstreams
// available" means none was chosen either; a call whose transport asked
// for a connection and never got one, or that ended in a dial error, had
// no connection to send on (see connTrace). Any other error (connection
// broken after sending, the execution timeout after a connection) leaves
// the outcome unknown, and so does any error once the call had a
// connection: with lb_retry_match retrying POSTs after a transport error,
// reverse_proxy may end with a dial error after an earlier attempt reached
// the catalog.
func howMuchSent(r *http.Request, err error, conns *connTrace) int {
	var herr caddyhttp.HandlerError
	if errors.As(err, &herr) && herr.Err != nil && herr.Err.Error() == "no upstreams available" && !conns.gotConn.Load() {
		return sentNoConnection
	}
	if !upstreamChosen(r) {
		return sentNothing
	}
	if conns.gotConn.Load() {
		// Attempts reverse_proxy made before (lb_retries after dial
		// errors) had no connection: each one handed over counts.
		if conns.soleUnansweredAttempt() && unprocessed(err) {
			return sentUnprocessed
		}
		return sentMaybe
	}
	// No attempt got a connection, whatever ended the call: a dial refused
	// or timed out, a TLS handshake that failed (also one that runs in
	// reverse_proxy's own dialer, for a tls_server_name with placeholders
	// or proxy_protocol, whose errors arrive as plain errors), a forward
	// proxy that refused the CONNECT, a name that did not resolve, a QUIC
	// dial that another request began and that failed (quic-go dials once
	// per host and reports the handshake to that request only), or the
	// execution timeout while the transport still waited for a connection
	// (lb_try_duration past execution_timeout, a dial_timeout longer than
	// it, a pool at max_conns_per_host). Nothing was written.
	var dialErr reverseproxy.DialError
	if conns.askedConn.Load() || errors.As(err, &dialErr) {
		return sentNoConnection
	}
	return sentMaybe
}

// connTrace follows the connections Go's HTTP transport takes for one
// catalog call (reverse_proxy's own trace composes with it). A request is
// written only on a connection the transport handed it, which it reports
// with GotConn first: Go's transport for HTTP/1 (persistConn's write loop
// runs after getConn reported it) and HTTP/2, over TLS and h2c (its
// RoundTripOpt reports each connection it takes from the pool before the
// stream's first frame), and quic-go's for HTTP/3 (before the request's
// stream opens, also on a 0-RTT connection). So a call that asked for a
// connection (GetConn) and got none (no GotConn) sent nothing, whatever
// its error says; tests over each of the four hold a catalog that breaks
// off after executing to "unknown", which a transport writing before
// GotConn would turn into a release.
//
// The hooks may run after the call returned (a dial the transport goes on
// with in the background), hence the atomics.
//
// The trace cannot tell the catalog's connections from those of another
// reverse_proxy after this handler: forward_auth placed after it (inside
// the handle block) asks the auth server on the same context and then hands
// the request on. Its connection then counts as the catalog call's, the
// safe side, but a catalog that cannot be dialled leaves the key unknown
// where it should be released. What the trace can see is an upstream asked
// after an answer came back within one call (askedAfterAnswer), which the
// handler reports once: see warnAskedAfterAnswer.
//
// An upstream asked after a request was written and before its final answer
// began (pending; a 1xx is no final answer) is a resend of that request:
// reverse_proxy's lb_retry_match retrying a mutation after a transport
// error, or Go's transport retrying a write the server reset (HTTP/2's
// REFUSED_STREAM or a GOAWAY, a body-less request whose bytes never left).
// The trace cannot tell these apart; reverse_proxy's count of its retries
// can (see sentAgain).
type connTrace struct {
	askedConn, gotConn         atomic.Bool
	conns                      atomic.Int32 // connections handed to the call's attempts
	answered, askedAfterAnswer atomic.Bool
	pending, resent            atomic.Bool
	idleFor                    atomic.Int64 // how long the last connection handed over had idled in the pool, in ns
	trace                      httptrace.ClientTrace
}

// sentAgain reports whether reverse_proxy sent r again after an attempt
// had been written: resent unanswered (lb_retry_match after a transport
// error), or asked after an answer (a retry_match on the answer's
// status). The catalog may then have executed an earlier attempt, and the
// answer at hand may be its refusal of what that attempt did.
// reverse_proxy's own count of its retries tells these from an upstream
// asked again for other reasons: Go's transport resending what the server
// provably did not process (HTTP/2's REFUSED_STREAM or GOAWAY, an HTTP/1
// write that sent nothing), or forward_auth after the handler, whose
// answer came before the catalog's.
//
// A resend of a request the transport itself may replay after writing it
// (transportReplays) counts too, retried by reverse_proxy or not: Go's
// transport resent the request after the connection broke, not knowing
// whether the catalog had executed it.
func (c *connTrace) sentAgain(r *http.Request) bool {
	return (c.resent.Load() || c.askedAfterAnswer.Load()) && proxyRetried(r) ||
		c.resent.Load() && transportReplays(r)
}

// transportReplays reports whether Go's HTTP transport may resend r by
// itself after writing it, when a reused connection breaks before the
// answer: a GET, HEAD, OPTIONS or TRACE with a nil body
// (net/http.Request.isReplayable). Guarded, such a request is a commit
// that X-HTTP-Method-Override names. unrewindableBody keeps the transport
// from it, except behind reverse_proxy's request_buffers, which reads the
// body first and sends an empty one as nil: the first attempt may have
// executed, and the answer at hand may be the catalog refusing the commit
// it already made. The method is the one reverse_proxy sends (its
// `method` option aside), and the trace cannot see whether the body went
// as nil, so any resend of these methods counts: the safe side, also for
// an HTTP/2 resend after REFUSED_STREAM, which proves nothing executed.
func transportReplays(r *http.Request) bool {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// retriesVar is where reverse_proxy notes how often it retried a request.
const retriesVar = "http.reverse_proxy.retries"

// proxyRetried reports whether reverse_proxy noted a retry of r; without
// a replacer it cannot tell, and says yes.
func proxyRetried(r *http.Request) bool {
	repl := replacerOf(r)
	if repl == nil {
		return true
	}
	n, _ := repl.Get(retriesVar)
	retries, _ := n.(int)
	return retries > 0
}

// attach returns ctx with the trace's hooks, composed with any trace ctx
// already carries.
func (c *connTrace) attach(ctx context.Context) context.Context {
	c.trace = httptrace.ClientTrace{
		GetConn: func(string) {
			c.askedConn.Store(true)
			if c.pending.Load() {
				c.resent.Store(true)
			} else if c.answered.Load() {
				c.askedAfterAnswer.Store(true)
			}
		},
		WroteRequest: func(info httptrace.WroteRequestInfo) {
			if info.Err == nil {
				c.pending.Store(true)
			}
		},
		GotConn: func(info httptrace.GotConnInfo) {
			c.gotConn.Store(true)
			c.conns.Add(1)
			var idle time.Duration
			if info.WasIdle {
				idle = info.IdleTime
			}
			c.idleFor.Store(int64(idle))
		},
		GotFirstResponseByte: func() {
			c.answered.Store(true)
			c.pending.Store(false)
		},
		// Reported after GotFirstResponseByte, which does not come again
		// for the final answer: the request stays pending until the call
		// ends. A later ask then counts as a resend, the safe side.
		Got1xxResponse: func(int, textproto.MIMEHeader) error {
			c.pending.Store(true)
			return nil
		},
	}
	return httptrace.WithClientTrace(ctx, &c.trace)
}

// staleIdle is how long a keep-alive connection must have idled before a
// request it broke under is taken for one the catalog was closing: catalogs
// close idle connections after seconds (gunicorn 2 s, uvicorn and Node 5 s,
// Tomcat 20 s, Jetty 30 s), while under steady traffic Caddy's connections
// idle for milliseconds.
const staleIdle = time.Second

// staleConnection reports how long the call's one attempt's connection had
// idled, when that attempt broke with no answer (err is the transport's,
// not the execution timeout) on a keep-alive connection that had idled
// staleIdle or longer: most likely a catalog closing idle connections
// sooner than Caddy's transport lets them idle, as the request went out.
func (c *connTrace) staleConnection(err error) (time.Duration, bool) {
	idle := time.Duration(c.idleFor.Load())
	if idle < staleIdle || !c.soleUnansweredAttempt() ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return 0, false
	}
	return idle, true
}

// soleUnansweredAttempt reports whether the call made one attempt on a
// connection, and nothing answered it: the transport's error is then about
// the only request that may have reached the catalog.
func (c *connTrace) soleUnansweredAttempt() bool {
	return c.conns.Load() == 1 && !c.answered.Load() && !c.resent.Load() && !c.askedAfterAnswer.Load()
}

// unprocessed reports whether err, from Go's HTTP transport, proves that
// the catalog did not process the request, although it had a connection:
//   - HTTP/2: a GOAWAY whose last stream ID is below the request's (a
//     catalog shutting down gracefully, a load balancer draining), or a
//     RST_STREAM with REFUSED_STREAM, which RFC 9113 (8.7) defines as
//     "closed prior to any processing". Go resends such a request itself
//     when it can rewind the body, which a body read by this handler is
//     not given a way to; it answers it with these errors instead.
//   - HTTP/1: a write that failed before any byte of the request reached
//     the connection (a keep-alive connection the catalog closed as the
//     request went out), which the transport marks as nothing written.
//   - HTTP/3 (quic-go's transport, `versions 3`): the catalog reset the
//     request's stream with H3_REQUEST_REJECTED, which RFC 9114 (4.1.1)
//     defines as not processed; its server answers so to requests that
//     arrive during a graceful shutdown. quic-go resends such a request
//     only when it can rewind the body, as Go does over HTTP/2. quic-go's
//     errors are types, tested as such; the code must come from the
//     catalog, not be the client's own.
//
// Go exposes neither of its cases as a type or value to test for, so they
// are recognised by the transport's own error texts and type name; should
// a Go release change them, they read as "may have been processed", the
// safe side, and TestUnprocessedErrors fails. A RST_STREAM with
// PROTOCOL_ERROR is not such a proof. (Go 1.26's HTTP/2 code in net/http
// resends a body-less request after one; reverse_proxy's HTTP/2 is x/net's,
// which does not, and from Go 1.27 on x/net hands it to net/http's, which
// no longer does: TestBodylessKeyedMutationIsNotResentAfterAnHTTP2Reset,
// which CI runs under both.)
func unprocessed(err error) bool {
	var streamErr *quic.StreamError
	if errors.As(err, &streamErr) {
		return streamErr.Remote && http3.ErrCode(streamErr.ErrorCode) == http3.ErrCodeRequestRejected
	}
	for e := err; e != nil; e = errors.Unwrap(e) {
		if fmt.Sprintf("%T", e) == "http.nothingWrittenError" {
			return true
		}
	}
	msg := err.Error()
	if strings.Contains(msg, "http2: Transport received GOAWAY from server ErrCode:") {
		// Only for a stream above the GOAWAY's last stream ID.
		return true
	}
	_, inner, ok := strings.Cut(msg, "http2: Transport: cannot retry err [")
	if !ok {
		return false
	}
	inner, _, ok = strings.Cut(inner, "] after Request.Body was written")
	if !ok {
		return false
	}
	if inner == "http2: Transport received Server's graceful shutdown GOAWAY" {
		return true
	}
	// "stream error: stream ID 3; REFUSED_STREAM; received from peer"
	rest, ok := strings.CutPrefix(inner, "stream error: stream ID ")
	if !ok {
		return false
	}
	_, code, _ := strings.Cut(rest, "; ")
	code, _, _ = strings.Cut(code, ";")
	return code == "REFUSED_STREAM"
}

// upstreamVar is where reverse_proxy notes the upstream it chose.
const upstreamVar = "http.reverse_proxy.upstream.address"

// catalogStatusVar is where reverse_proxy notes the status of the
// catalog's answer, before replace_status or a handle_response route
// changes what is written.
const catalogStatusVar = "http.reverse_proxy.status_code"

// catalogStatus is the status the catalog itself answered r with, as
// reverse_proxy noted it during the call; ok is false when it noted none.
func catalogStatus(r *http.Request) (status int, ok bool) {
	repl := replacerOf(r)
	if repl == nil {
		return 0, false
	}
	v, _ := repl.Get(catalogStatusVar)
	status, ok = v.(int)
	return status, ok && status >= 100 && status <= 599
}

// upstreamChosen reports whether reverse_proxy chose an upstream for r
// during the call; without a replacer it cannot tell, and says yes.
func upstreamChosen(r *http.Request) bool {
	repl := replacerOf(r)
	if repl == nil {
		return true
	}
	_, chosen := repl.Get(upstreamVar)
	return chosen
}
