package icebergidempotency

// Admission: what a keyed mutation must bring before it may reserve its key.
// The key must be a UUID of an allowed version (key_versions: 7 by default),
// the body must fit max_request_size, and the key is
// bound to the operation, the normalized path, the principal and a
// fingerprint of the request, so that a retry is recognised as the same
// request and anything else with the key is refused (422).

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// IdempotencyKeyHeader is the request header defined by the Iceberg REST spec.
const IdempotencyKeyHeader = "Idempotency-Key"

// maxBoundPath is the longest path a key is bound to: what MySQL's TEXT
// column holds. Longer, MariaDB's strict mode refused the reservation (503
// on every retry), and a non-strict sql_mode cut the path short, so that
// the retry of an executed commit no longer matched its record: 422. No
// catalog path comes near it; Go's server takes paths up to 1 MB.
const maxBoundPath = 65535

// admit checks what a keyed mutation brings (its key, its body) and binds
// the key to it, then hands the request to its lifecycle (lifecycle.go). path is the request's
// normalized path, which the key is bound to.
func (h *Handler) admit(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, op, path string) error {
	values := keyHeaderValues(r)
	if len(values) == 0 {
		if h.RequireKey {
			decisionCounters.inc(op, outcomeMissingKey)
			closeUnreadBody(w, r)
			writeError(w, http.StatusBadRequest, typeBadRequest, "Idempotency-Key header is required for "+op, 0)
			return nil
		}
		if c := h.logger.Check(zapcore.DebugLevel, "no key: passing through"); c != nil {
			c.Write(zap.String("operation", op))
		}
		decisionCounters.inc(op, outcomeNoKey)
		return next.ServeHTTP(w, r)
	}
	value := fieldValue(values[0])
	for _, v := range values[1:] {
		if fieldValue(v) != value {
			decisionCounters.inc(op, outcomeInvalidKey)
			closeUnreadBody(w, r)
			writeError(w, http.StatusBadRequest, typeBadRequest, "Idempotency-Key header must have a single value", 0)
			return nil
		}
	}
	key, keyErr := parseKey(value, h.keyVersions)
	otherVersion := false
	if keyErr != nil {
		if key, otherVersion = h.keyOfOtherVersion(value); !otherVersion {
			decisionCounters.inc(op, outcomeInvalidKey)
			closeUnreadBody(w, r)
			writeError(w, http.StatusBadRequest, typeBadRequest, "Invalid Idempotency-Key: "+keyErr.Error(), 0)
			return nil
		}
	}

	if len(path) > maxBoundPath {
		decisionCounters.inc(op, outcomeRejected)
		closeUnreadBody(w, r)
		writeError(w, http.StatusRequestURITooLong, typeURITooLong,
			fmt.Sprintf("request path is %d bytes, more than the %d an Idempotency-Key can be bound to; it was not executed", len(path), maxBoundPath), 0)
		return nil
	}
	if h.pooled != nil {
		// The store stays open across a reload until this request is
		// done, counted from before its body is read: a reload while a
		// large body uploads must not close the store under it.
		h.pooled.use()
		defer h.pooled.done()
	}
	if otherVersion {
		// A valid key of a version key_versions leaves out is refused,
		// unless another node (or this one before a reload) accepted it:
		// its retry is owed the stored answer, and a 400 to a commit
		// tells the client it failed, which leads to the cleanup.
		switch known, lerr := h.keyRecorded(r.Context(), key); {
		case lerr != nil:
			// Logged as every other store failure: counted and alerted
			// on, it had no line saying what failed.
			h.logger.Error("store failed: rejecting request", zap.String("step", "load (a key of a version key_versions leaves out)"),
				zap.String("store", h.storeName()), zap.Error(lerr), zap.String("key", key), zap.String("operation", op))
			decisionCounters.inc(op, outcomeStoreUnavailable)
			closeUnreadBody(w, r)
			writeError(w, http.StatusServiceUnavailable, typeUnavailable,
				"Idempotency store is unavailable; retry with the same Idempotency-Key", h.retryAfterSeconds())
			return nil
		case !known:
			decisionCounters.inc(op, outcomeInvalidKey)
			closeUnreadBody(w, r)
			writeError(w, http.StatusBadRequest, typeBadRequest, "Invalid Idempotency-Key: "+keyErr.Error(), 0)
			return nil
		}
	}
	// A body announced too large is refused before it is read: a client
	// that sent Expect: 100-continue is then not asked to upload it.
	if r.ContentLength > h.MaxRequestSize {
		return h.bodyTooLarge(w, r, op)
	}
	hold := bodyHold{budget: h.bodies}
	defer hold.release()
	body, err := readBody(r, h.MaxRequestSize, &hold)
	if errors.Is(err, errBodyBudget) {
		return h.bodiesFull(w, r, op)
	}
	if errors.Is(err, errBodyOverLimit) {
		return h.bodyTooLarge(w, r, op)
	}
	if err != nil {
		decisionCounters.inc(op, outcomeRejected)
		return bodyUnread(w, r, err)
	}
	principal := h.principalOf(r)
	if principal == "" && h.Principal != DefaultPrincipal {
		// Every sender would share one binding, and could be replayed
		// another's response (vended credentials included). The request
		// is refused, not executed: a 4xx tells the client so.
		h.logger.Error("the configured principal expanded to nothing for a keyed request: refused. "+
			"Does it name something this route sets (forward_auth sets no {http.auth.user.id}: use the header its copy_headers copies), "+
			"and does the authentication run before the directive (basic_auth in a handle block after a site-level directive does not)?",
			zap.String("principal", h.Principal), zap.String("operation", op))
		decisionCounters.inc(op, outcomeNoPrincipal)
		writeError(w, http.StatusForbidden, typeForbidden,
			"The request has no principal for its Idempotency-Key to be bound to (the proxy's principal setting expanded to nothing); it was not executed.", 0)
		return nil
	}
	g := &guarded{
		h: h, w: w, r: r, next: next, key: key,
		parts: requestParts{
			principal: principal,
			method:    boundMethod(r),
			path:      path,
			query:     r.URL.RawQuery,
			body:      body,
		},
	}
	g.body.reset(body)
	r.Body = &g.body
	r.ContentLength = int64(len(body))

	g.own = g.parts.binding(op, h.keys.current)
	g.binding = g.own
	g.sealWith = h.keys.current
	g.outer = activeGuardOf(r.Context())
	// A key of another version got here only on a record the store showed:
	// a store failure from now on must not pass it through under fail_open.
	g.recordShown = otherVersion
	// The share goes with the body: released when dropBody lets it go,
	// or at the latest when the request ends.
	g.hold, hold = hold, bodyHold{}
	defer g.hold.release()
	return g.run()
}

// activeGuard is the guard executing the request right now, if any, as the
// request's context carries it during its catalog call (guardCtxKey), so
// that a second iceberg_idempotency handler on the request (one at site
// level, one inside a handle block) can tell that the record it finds in
// flight is this very request's: the key it holds, the owner token it holds
// it under, and the guard executing around it, if any (with three handlers
// on two stores, the innermost one must recognise the outermost one's
// record, not only the nearest guard's).
//
// It lives in a context made for the call, not in Caddy's request
// variables: those are a plain map, which reverse_proxy's dialer reads from
// Go's transport's dial goroutine, and that goroutine can outlive the call
// (a dial that lost to an idle connection, or was cut off by the execution
// timeout). A write to the map once the call is over raced with it, and a
// concurrent map read and write is a fatal error of the whole process. The
// context, gone with the call, also leaves no mark behind it: handle_errors,
// after the call, guards as any handler.
type activeGuard struct {
	key, owner string
	parent     *activeGuard
	// hiddenKey is the Idempotency-Key this guard's call took off the
	// header of a request without a body (hideKeyFromTransport), for
	// the handlers nested in the call to read (keyHeaderValues).
	hiddenKey []string
	// marks are set by a guard nested in this one's call and read once it
	// is over (nestedMark).
	marks atomic.Uint32
}

// nestedMark is what a guard nested in another's call tells the guards
// around it about the answer they see.
type nestedMark uint32

const (
	markUnprocessed    nestedMark = 1 << iota // the catalog refused the request unprocessed (sentUnprocessed)
	markInFlightAnswer                        // the nested guard answered 409 "still in flight" itself
)

// marked reports whether a guard nested in a's call set m.
func (a *activeGuard) marked(m nestedMark) bool { return a.marks.Load()&uint32(m) != 0 }

// guardCtxKey is the context key of the activeGuard executing a request.
type guardCtxKey struct{}

// activeGuardOf returns the guard executing the request of ctx, or nil.
func activeGuardOf(ctx context.Context) *activeGuard {
	a, _ := ctx.Value(guardCtxKey{}).(*activeGuard)
	return a
}

// holds reports whether a guard executing this request, a or one around
// it, holds key under owner.
func (a *activeGuard) holds(key, owner string) bool {
	for ; a != nil; a = a.parent {
		if a.key == key && a.owner == owner {
			return true
		}
	}
	return false
}

// markAround sets m on a and every guard executing around it: each of them
// sees only what the nested guard wrote.
func (a *activeGuard) markAround(m nestedMark) {
	for ; a != nil; a = a.parent {
		a.marks.Or(uint32(m))
	}
}

// String keeps a log of the context from printing the owner token.
func (*activeGuard) String() string { return "guarded" }

// passGuarded hands on a request whose key's record, found in flight, is
// held by another iceberg_idempotency handler executing this very request
// (at site level, say, with this one inside a handle block), once this
// handler's own checks passed. Guarding it again, this handler would wait
// on that record until in_flight_wait ran out: every keyed request would
// end 503. With another store the two cannot meet, and both guard; once
// the other handler's call is over (handle_errors runs after it), this one
// guards as any.
func (g *guarded) passGuarded() error {
	h := g.h
	if atomic.CompareAndSwapInt32(&h.nestedWarned, 0, 1) {
		h.logger.Warn("another iceberg_idempotency handler on the same records executes this request: passed through, "+
			"after this handler's own checks. Keep one iceberg_idempotency per route",
			zap.String("operation", g.own.Operation))
	}
	return g.next.ServeHTTP(g.w, g.r)
}

// bodyTooLarge answers a keyed request whose body exceeds MaxRequestSize.
// Plain reverse_proxy would have passed it on, so the operator is told
// once which limit refused it: a catalog whose commits are that large needs
// the limit raised, and the 413 alone reads as the catalog's.
func (h *Handler) bodyTooLarge(w http.ResponseWriter, r *http.Request, op string) error {
	decisionCounters.inc(op, outcomeRejected)
	if atomic.CompareAndSwapInt32(&h.tooLargeWarned, 0, 1) {
		h.logger.Warn("keyed request refused with 413: its body exceeds max_request_size; raise it if the catalog's "+
			"requests are that large (counted in requests_total{outcome=\"rejected\"}; warned once per handler)",
			zap.String("operation", op), zap.Int64("max_request_size", h.MaxRequestSize),
			zap.Int64("content_length", r.ContentLength))
	}
	closeUnreadBody(w, r)
	writeError(w, http.StatusRequestEntityTooLarge, typeTooLarge,
		fmt.Sprintf("request body exceeds %d bytes, the largest accepted with an Idempotency-Key", h.MaxRequestSize), 0)
	return nil
}

// bodiesFull answers a keyed request whose body would take the bodies held
// past max_buffered_bytes: before anything is reserved, so its retry, once
// others are done, executes.
func (h *Handler) bodiesFull(w http.ResponseWriter, r *http.Request, op string) error {
	decisionCounters.inc(op, outcomeOverloaded)
	if atomic.CompareAndSwapInt32(&h.bodiesFullWarned, 0, 1) {
		h.logger.Warn("keyed requests refused with 503: the bodies held by requests in progress fill max_buffered_bytes "+
			"(counted in requests_total{outcome=\"overloaded\"}; warned once per handler)", zap.String("operation", op))
	}
	closeUnreadBody(w, r)
	writeError(w, http.StatusServiceUnavailable, typeUnavailable,
		"The proxy holds as many request bodies as it may; the request was not executed. Retry with the same Idempotency-Key.", h.retryAfterSeconds())
	return nil
}

// closeUnreadBody has the connection closed after an answer written while
// (some of) r's body is still unread. Otherwise net/http reads up to 256 KiB
// of the body before it sends the answer (Caddy's read timeouts wrap the
// body, so net/http cannot tell that an Expect: 100-continue client was
// never asked for it), and a client that waits for the answer before it
// uploads hears nothing until the idle timeout drops the connection. HTTP/2
// and HTTP/3 end the stream instead, and take no Connection header.
func closeUnreadBody(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 1 && r.ContentLength != 0 {
		w.Header().Set("Connection", "close")
	}
}

// bodyUnread answers a keyed request whose body could not be read, before
// anything was reserved or sent: 413 when a limit before this handler
// (request_body's max_size) cut it off, 408 when the server's read timeout
// did, 400 for a broken body (framing, a connection that failed), all as
// Iceberg errors. Nothing was reserved or sent, so the answer is the same
// whether or not the client is still there: Go's HTTP/1 server cancels the
// request at the client's FIN, and a client that half-closed after a body
// cut short still reads; it got an empty 400 from Caddy until the build
// after 0c49220, where HTTP/2 got this one.
func bodyUnread(w http.ResponseWriter, r *http.Request, err error) error {
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		// The server's read timeout (servers { timeouts { read_body } })
		// ended the body. Go's HTTP/1 server then takes the client for
		// gone, but it is still there to read an answer: 408, which the
		// Java client retries with the same key from the release after
		// 1.11 (apache/iceberg#17947), rather than a bare 400 it takes
		// for a bad request.
		closeUnreadBody(w, r)
		writeError(w, http.StatusRequestTimeout, typeRequestTimeout,
			"The request body did not arrive within the server's read timeout; the request was not executed. Retry with the same Idempotency-Key.", 0)
		return nil
	}
	closeUnreadBody(w, r)
	var maxBytes *http.MaxBytesError
	var herr caddyhttp.HandlerError
	if errors.As(err, &maxBytes) || errors.As(err, &herr) && herr.StatusCode == http.StatusRequestEntityTooLarge {
		writeError(w, http.StatusRequestEntityTooLarge, typeTooLarge, "The request body exceeds the size this server accepts.", 0)
		return nil
	}
	writeError(w, http.StatusBadRequest, typeBadRequest, "The request body could not be read: "+err.Error(), 0)
	return nil
}

// requestBody is the request body as read, handed on to the handlers after
// this one; a part of guarded, so that handing it on allocates nothing.
// (reverse_proxy wraps any body it is given, so the transport would not see
// a *bytes.Reader, which it writes with the headers, either way.) Reads are
// locked: Go's transport may still be reading it after the catalog's answer
// came back (HTTP/1's writeLoop, HTTP/2's body writer, when the catalog
// answered before the body was all sent) while dropBody lets it go.
type requestBody struct {
	mu  sync.Mutex
	r   bytes.Reader
	all []byte // what the reader reads
}

// Read implements io.Reader.
func (b *requestBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.r.Read(p)
}

// reset makes b read all of body.
func (b *requestBody) reset(body []byte) {
	b.mu.Lock()
	b.r.Reset(body)
	b.all = body
	b.mu.Unlock()
}

// unread is the whole body when none of it has been read yet: an
// iceberg_idempotency handler after this one (a nested guard) then takes
// it as it is, neither copying it nor counting it against the budget again.
func (b *requestBody) unread() ([]byte, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.all, b.r.Len() == len(b.all)
}

// Close implements io.Closer: the real body is closed by the server.
func (*requestBody) Close() error { return nil }

// principalOf expands the principal placeholder for r. A principal that is
// one request header placeholder, as the default
// {http.request.header.Authorization} is, is read from the header the way
// Caddy's replacer reads it (the values joined with commas), without
// parsing the placeholder on every request; the principal is hashed into
// the binding of stored records, so the two must give the same string.
func (h *Handler) principalOf(r *http.Request) string {
	if h.principalHeader != "" {
		return strings.Join(r.Header[h.principalHeader], ",")
	}
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	return repl.ReplaceAll(h.Principal, "")
}

// headerPlaceholder returns the canonical header name of a principal that
// is exactly one {http.request.header.*} placeholder, or "".
func headerPlaceholder(principal string) string {
	inner, ok := strings.CutPrefix(principal, "{http.request.header.")
	if !ok {
		return ""
	}
	name, ok := strings.CutSuffix(inner, "}")
	if !ok || name == "" || strings.ContainsAny(name, "{}") {
		return ""
	}
	return textproto.CanonicalMIMEHeaderKey(name)
}

// readBody reads r's body, at most limit bytes of it, into a buffer grown
// as bytes arrive, so that a client that announces much and sends little
// holds only what it sent: doubling from the announced length or
// presizedBody, whichever is less, and never past the announced length (a
// 16 MiB body sat in 32 MiB) or limit. hold takes each growth from the
// budget of held bodies; errBodyBudget when it is spent. A body of unknown
// length that fills limit is probed for one more byte, outside the
// buffer: errBodyOverLimit if there is one. A body shorter than announced
// fails as io.ReadFull fails it.
func readBody(r *http.Request, limit int64, hold *bodyHold) ([]byte, error) {
	if outer, ok := r.Body.(*requestBody); ok {
		if body, whole := outer.unread(); whole {
			return body, nil
		}
	}
	n := r.ContentLength
	// The limit, not one byte past it: a buffer full at a limit of 64 KiB
	// times a power of two grew to limit+1 while the full one was still
	// counted, 2×limit+1 in all, which a max_buffered_bytes of exactly
	// twice max_request_size (the least allowed) never holds. Every
	// chunked body of exactly the limit, and every larger one, got 503
	// for ever, where it should have been executed or refused with 413.
	ceiling := limit
	if n >= 0 && n <= limit {
		ceiling = n
	}
	eof := false
	first := min(ceiling, presizedBody)
	if !hold.take(first) {
		return nil, errBodyBudget
	}
	body := make([]byte, 0, first)
	for int64(len(body)) < ceiling {
		if len(body) == cap(body) {
			// While it is copied, the old buffer is held too.
			grown := min(2*int64(cap(body)), ceiling)
			if !hold.take(grown) {
				return nil, errBodyBudget
			}
			old := int64(cap(body))
			body = append(make([]byte, 0, grown), body...)
			hold.give(old)
		}
		m, err := r.Body.Read(body[len(body):cap(body)])
		body = body[:len(body)+m]
		if err == io.EOF {
			eof = true
			break
		}
		if err != nil {
			return nil, err
		}
	}
	if n >= 0 && n <= limit {
		if int64(len(body)) < n {
			return nil, io.ErrUnexpectedEOF
		}
		return body, nil
	}
	if !eof && int64(len(body)) == limit {
		var one [1]byte
		switch _, err := io.ReadFull(r.Body, one[:]); err {
		case nil:
			return nil, errBodyOverLimit
		case io.EOF:
		default:
			return nil, err
		}
	}
	return body, nil
}

// errBodyBudget is readBody's error when the budget of held bodies is spent.
var errBodyBudget = errors.New("the bodies of keyed requests in progress fill max_buffered_bytes")

// errBodyOverLimit is readBody's error for a body longer than its limit.
var errBodyOverLimit = errors.New("the body is larger than max_request_size")

// presizedBody is the largest buffer allocated before the body arrives: a
// body announced up to it is read into one of its size, a larger (or
// chunked) one starts there and grows as bytes arrive. Iceberg commits
// are mostly smaller.
const presizedBody = 64 << 10

// maxSize bounds max_request_size and max_response_size, as the Caddyfile
// does: a limit one byte beyond which is read must stay an int64.
const maxSize = 1 << 40

// fieldValue is a header field's value without the spaces and tabs around
// it, which are no part of it (RFC 9110, 5.5). Go's HTTP/1 server takes
// them off as it reads the header; its HTTP/2 server and quic-go's HTTP/3
// server leave them on. Read as sent, " <key>" over HTTP/2 was refused
// (400) where plain reverse_proxy executes it and the same header over
// HTTP/1 was guarded, and a retry that came over the other protocol was
// refused instead of replayed.
func fieldValue(v string) string { return strings.Trim(v, " \t") }

// parseKey checks that s is a UUID in the 36-character hyphenated form the
// spec requires, of a version in allowed, with the RFC 9562 variant, and
// returns it in lower case. Any letter case is accepted: the spec's own
// example is upper case.
func parseKey(s string, allowed keyVersionSet) (string, error) {
	if len(s) != 36 {
		return "", keyLengthError(s)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if i == 8 || i == 13 || i == 18 || i == 23 {
			if c != '-' {
				return "", fmt.Errorf("must be hyphenated as 8-4-4-4-12 hex digits")
			}
			continue
		}
		if !isHex(c) {
			return "", fmt.Errorf("must contain only hex digits and hyphens")
		}
	}
	if v := hexValue(s[14]); !allowed.has(v) {
		return "", fmt.Errorf("must be a %s UUID, got version %d", allowed, v)
	}
	switch s[19] {
	case '8', '9', 'a', 'b', 'A', 'B':
	default:
		return "", errors.New("must have the RFC 9562 variant (10xx)")
	}
	return strings.ToLower(s), nil
}

// keyLengthError says why s, not 36 bytes long, is no key, naming the
// mistakes a count alone hides: a quoted key (as the IETF draft's examples
// write one), several keys in one header line.
func keyLengthError(s string) error {
	switch {
	case strings.Contains(s, ","):
		return errors.New("must be one UUID, got several values separated by commas")
	case len(s) == 38 && s[0] == '"' && s[37] == '"':
		return errors.New("must be the UUID itself, without quotes")
	}
	return fmt.Errorf("must be a UUID of 36 characters in its hyphenated form, got %d bytes", len(s))
}

// keyOfOtherVersion returns s as a key, if it is a valid one of a version
// key_versions leaves out.
func (h *Handler) keyOfOtherVersion(s string) (string, bool) {
	key, err := parseKey(s, anyKeyVersion)
	return key, err == nil
}

// keyRecorded reports whether the store holds a record for key.
func (h *Handler) keyRecorded(ctx context.Context, key string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, storeOpTimeout)
	defer cancel()
	rec, err := h.store.Load(ctx, key)
	if errors.Is(err, stores.ErrUnreadableRecord) {
		// A record, if one this build cannot read: the request goes
		// on, to be answered as unreadable, not 503 until it expires.
		return true, nil
	}
	return rec != nil, err
}

// anyKeyVersion is every version RFC 9562 defines (key_versions any).
const anyKeyVersion keyVersionSet = 1<<(maxKeyVersion+1) - 1<<minKeyVersion

// keyVersionSet is a set of UUID versions, one bit per version: the
// versions an Idempotency-Key may have (key_versions).
type keyVersionSet uint16

// keyVersionsSpec is what the Iceberg REST spec asks clients to send.
const keyVersionsSpec keyVersionSet = 1 << 7

// Versions RFC 9562 defines, which key_versions may name.
const (
	minKeyVersion = 1
	maxKeyVersion = 8
)

func newKeyVersionSet(versions []int) keyVersionSet {
	var set keyVersionSet
	for _, v := range versions {
		if v >= minKeyVersion && v <= maxKeyVersion {
			set |= 1 << v
		}
	}
	return set
}

func (set keyVersionSet) has(v int) bool { return v >= 0 && v < 16 && set&(1<<v) != 0 }

// String names the versions for error messages: "version 7",
// "version 4 or 7", "version 1, 2 or 3".
func (set keyVersionSet) String() string {
	var names []string
	for v := minKeyVersion; v <= maxKeyVersion; v++ {
		if set.has(v) {
			names = append(names, strconv.Itoa(v))
		}
	}
	if len(names) == 0 {
		return "version (none allowed)"
	}
	return "version " + joinWords(names, "or")
}

func hexValue(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'a' <= c && c <= 'f':
		return int(c-'a') + 10
	case 'A' <= c && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func sha256Hex(b []byte) string {
	return hexSum(sha256.Sum256(b))
}

// hexSum is sum in hex: one allocation, the string.
func hexSum(sum [sha256.Size]byte) string {
	var dst [2 * sha256.Size]byte
	hex.Encode(dst[:], sum[:])
	return string(dst[:])
}

// fingerprintStack bounds the requests whose unkeyed fingerprint is hashed
// from one buffer on the stack: a table commit's parts and body fit.
const fingerprintStack = 2048

// requestFingerprint hashes, unkeyed, what makes two requests "the same
// request". With a secret the same parts are hashed under an HMAC key
// (requestParts.fingerprint). The bytes hashed are fingerprintWith's; a
// request that fits fingerprintStack is hashed in one piece, without a
// hash.Hash or a buffer on the heap.
func requestFingerprint(method, path, query string, body []byte) string {
	var stack [fingerprintStack]byte
	buf := appendFingerprintParts(stack[:0], method, path, query, len(body))
	if len(buf)+len(body) > len(stack) {
		return fingerprintWith(sha256.New(), method, path, query, body)
	}
	return hexSum(sha256.Sum256(append(buf, body...)))
}

// mismatch explains why a request may not use a record's key, or returns "".
// A different principal is checked first and told nothing about the record.
func mismatch(stored, req stores.Binding) string {
	switch {
	case stored.Principal != req.Principal:
		return "Idempotency-Key is already in use by another principal; use a new key"
	case stored.Operation != req.Operation:
		return fmt.Sprintf("Idempotency-Key was first used for operation %s, not %s; use a new key for a different operation", stored.Operation, req.Operation)
	case stored.Path != req.Path:
		return fmt.Sprintf("Idempotency-Key was first used for path %s, not %s; use a new key for a different request", stored.Path, req.Path)
	case stored.Fingerprint != req.Fingerprint:
		return "Idempotency-Key was first used with a different request body or query; use a new key for a different request"
	}
	return ""
}

// bind checks the request against a record's binding, as mismatch does, and
// returns "" when it may use the record. The binding computed under the
// current secret is compared first; only when it differs is the request
// hashed again under each previous secret and, with a secret set, unkeyed,
// so that a record written before a rotation (or before any secret) still
// matches its retry while the common case costs nothing more. On such a
// match the request adopts the stored binding: it is what the record's seal
// is bound to, and what a takeover keeps.
func (g *guarded) bind(stored stores.Binding) string {
	msg := mismatch(stored, g.own)
	if msg == "" {
		g.binding = g.own
		g.sealWith = g.h.keys.current
		return ""
	}
	for _, k := range g.h.keys.alternatives() {
		// The principal is cheap to hash; the fingerprint, over the whole
		// body, is hashed only for a secret whose principal matches.
		if g.parts.principalHash(k) != stored.Principal {
			continue
		}
		alt := stores.Binding{
			Operation:   g.own.Operation,
			Path:        g.own.Path,
			Principal:   stored.Principal,
			Fingerprint: g.parts.fingerprint(k),
		}
		altMsg := mismatch(stored, alt)
		if altMsg == "" {
			g.binding = stored
			// Sealed under the secret the binding is keyed under, so that
			// the record's key id names it: once that secret is dropped,
			// its retries cannot be matched, and a key id no configured
			// secret has makes them the 500 of an unreadable record, not
			// 422. Sealed under B, a record taken over (abandoned
			// reexecute) but still bound under A told them 422, which a
			// commit client reads as a failed commit. An unkeyed binding
			// is sealed under the current secret, if any: the unkeyed
			// reading is never dropped, and an answer is stored in clear
			// only with no secret set.
			g.sealWith = k
			if k == nil {
				g.sealWith = g.h.keys.current
			}
			return ""
		}
		// The same principal under an older secret: its explanation (the
		// body or the path differs) is the true one.
		msg = altMsg
	}
	return msg
}
