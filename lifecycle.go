package icebergidempotency

// The life of one admitted keyed request, top to bottom: reserve the key or
// find its record (run), wait for an owner still in flight, replay a final
// record or answer for an abandoned one; as the owner, execute the request
// through the handlers after this one while renewing the lease (execute,
// heartbeat), then finalize, release, or mark the outcome unknown, and answer.

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/google/uuid"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// ReplayedHeader marks a response served from the store.
const ReplayedHeader = "Idempotent-Replayed"

// storeOpTimeout bounds each store call of the background repairs
// (finalizeLater, undoLostReply), on top of the store's own bound.
const storeOpTimeout = 10 * time.Second

// guarded is one keyed mutation on its way through the handler.
type guarded struct {
	h       *Handler
	w       http.ResponseWriter
	r       *http.Request
	next    caddyhttp.Handler
	key     string
	parts   requestParts   // what binding hashes, for matching records written under other secrets
	binding stores.Binding // as stored: under the current secret, or the record's own once bind matched it
	// own is the binding under the current secret: what a new
	// reservation is bound to, whatever record an earlier round adopted.
	own   stores.Binding
	owner string
	// recordShown is set when admission already found the key's record
	// (a key of a version key_versions leaves out, which only a record
	// lets through): run starts with the store having shown the key.
	recordShown bool
	status      int           // the status of the response being finalized, for logs: a sealed response hides it
	hb          heartbeat     // the lease renewals of the execution, then of finalizeLater
	body        requestBody   // the read body, as the handlers after this one get it
	hold        bodyHold      // body's share of max_buffered_bytes, until dropBody
	cw          captureWriter // the execution's response, held until it is stored
	conns       connTrace     // the connections the catalog call took: see howMuchSent
	// executionEnds is when the execution's timeout ends it, set as it
	// starts: records are kept for the lifetime past it (recordTTL).
	executionEnds time.Time
	active        activeGuard // what the request's context carries during its catalog call
	// outer is the guard executing this request in another handler, when
	// it holds this request's key: see passGuarded.
	outer *activeGuard
	// sealWith is the secret this request's answer is sealed under: the
	// one its binding is keyed under (the current one, or for a record
	// adopted under a previous secret, a takeover, that one), or for an
	// adopted unkeyed binding the current one; see bind.
	sealWith *secretKeys
	// detached is the request's context without its cancellation (the
	// replacer and vars travel along): store writes and the execution run
	// under it, so that the client's departure cuts neither short.
	detached context.Context
}

// newOwnerToken is a random (version 4) UUID naming one request's hold on
// a key. uuid.NewString reads through an io.Reader, which moves its array
// to the heap: one allocation more on every keyed request.
func newOwnerToken() string {
	var u uuid.UUID
	_, _ = rand.Read(u[:]) // crypto/rand.Read never fails
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	return u.String()
}

// maxAttempts bounds how often a request goes round reserve → wait when the
// owner keeps releasing; each round waits, so the bound is rarely reached.
const maxAttempts = 5

func (g *guarded) run() error {
	h := g.h
	g.owner = newOwnerToken()
	g.detached = context.WithoutCancel(g.r.Context())
	// The wait's deadline is made when a wait begins: most keyed requests
	// reserve at once and never need its timer.
	var waitCtx context.Context
	// shown is set once the store has shown the key to be another
	// request's: from then on a store failure does not pass the request
	// through under fail_open, since the other one may be executing it
	// (a duplicate woken with this one by a release, say, reserved it),
	// or already executed it (a record admission found).
	shown := g.recordShown

	for attempt := 0; attempt < maxAttempts; attempt++ {
		// A record matched under an older secret in an earlier round
		// (then released) binds nothing here: a record this request
		// creates is its own, bound and sealed under the current secret.
		g.binding, g.sealWith = g.own, h.keys.current
		// A write cut off half-way may commit all the same (drivers
		// give up on the reply, not on the statement), and this request
		// could then no longer tell whether it holds the key: the
		// client's departure is checked after the write instead. The
		// store bounds the call itself.
		sent := time.Now()
		res, err := h.store.Reserve(g.detached, stores.Reservation{
			Key:     g.key,
			Binding: g.binding,
			Owner:   g.owner,
			Lease:   h.executionLease(),
			TTL:     g.recordTTL(h.executionLease()),
		})
		if err != nil {
			// The reservation may have committed with its reply lost,
			// unless the store proves its statement was never sent, or
			// answered: a record it cannot read is somebody else's.
			if !stores.NotSent(err) && !errors.Is(err, stores.ErrUnreadableRecord) {
				g.undoLostReply(releaseReservation)
			}
			if shown {
				return g.storeFailedOnHeldKey("reserve", err)
			}
			return g.storeFailed("reserve", err)
		}
		if own := res.Existing; own != nil && own.State == stores.StateInFlight && !own.Abandoned && own.Owner == g.owner {
			// This request's own record, under a token nobody else has:
			// the store (or its client library) ran a Reserve whose
			// reply was lost again and found what the first run wrote,
			// or a TakeOver that reported false had committed. The key
			// is this request's; waiting for it would be waiting for
			// itself, and then hearing "unknown" for a request never sent.
			res = stores.ReserveResult{Reserved: true, Existing: own}
			// Bound as that write bound it: a takeover of a record matched
			// under a previous secret keeps that record's binding, and its
			// answer must be sealed to open against it.
			g.bind(own.Binding)
		}
		if res.Reserved {
			g.hb.renewedAt = sent // the store measures the lease from no earlier
			took := time.Since(sent)
			if res.Existing != nil {
				// Adopted: its lease was set by that earlier write, a
				// whole call or more before this Reserve was sent.
				// Renewed before the request executes, as after a slow
				// Reserve, so that the heartbeat counts from a lease it
				// knows the start of.
				took = h.executionLease()
			}
			if g.r.Context().Err() != nil {
				// The client left while the key was reserved. Nothing
				// was sent to the catalog, as reverse_proxy sends
				// nothing for a client that is gone: give the key back,
				// so that the client's retry executes.
				g.release(g.detached, "the client left before the request was sent")
				return g.requestEnded()
			}
			switch held, err := g.slowLeaseRenewed(took); {
			case err != nil:
				// Released, the key may go to a duplicate waiting on it:
				// this request must not then pass through as well.
				g.release(g.detached, "its lease could not be renewed")
				return g.storeFailedOnHeldKey("extend lease", err)
			case !held:
				shown = true
				continue // taken over meanwhile: see what the new owner makes of it
			}
			return g.execute()
		}
		rec := res.Existing
		shown = true
		if rec.State == stores.StateInFlight && g.outer.holds(g.key, rec.Owner) {
			return g.passGuarded()
		}
		if msg := g.bind(rec.Binding); msg != "" {
			return g.refuse(rec, msg)
		}
		if rec.State == stores.StateInFlight && !rec.Abandoned {
			g.log(zapcore.DebugLevel, "key in flight: waiting for its owner", zap.String("outcome", "wait"))
			if waitCtx == nil {
				wait := g.inFlightWait()
				if wait <= 0 {
					return g.stillInFlight()
				}
				var cancel context.CancelFunc
				waitCtx, cancel = context.WithTimeout(g.r.Context(), wait)
				defer cancel()
			}
			waitedOn := rec.Owner
			rec, err = h.store.Await(waitCtx, g.key)
			switch {
			case g.r.Context().Err() != nil:
				return g.requestEnded()
			case errors.Is(err, context.DeadlineExceeded):
				return g.stillInFlight()
			case err != nil:
				return g.storeFailedOnHeldKey("await", err)
			case rec == nil:
				continue // the owner released the key: try to reserve it
			case rec.Abandoned && rec.Owner != waitedOn:
				// Not the reservation this request waits on: its owner
				// released it and another reservation since lapsed, or it
				// was taken over. The next round reads the key afresh before
				// anything is answered; before, a healthy reservation's
				// waiter could hear "unknown" from a stale read.
				continue
			}
			// The owner may have released and another request taken the
			// key since Reserve: bind against what is there now.
			if msg := g.bind(rec.Binding); msg != "" {
				return g.refuse(rec, msg)
			}
		}
		switch {
		case rec.State == stores.StateFinal:
			return g.replay(rec)
		case h.Abandoned == abandonedReexecute || rerunnable(g.binding.Operation):
			sent := time.Now()
			ok, err := h.store.TakeOver(g.detached, g.key, rec.Owner, g.owner, h.executionLease(), g.recordTTL(h.executionLease()))
			if err != nil {
				if !stores.NotSent(err) {
					g.undoLostReply(abandonTakeOver)
				}
				return g.storeFailedOnHeldKey("take over", err)
			}
			if ok && g.r.Context().Err() != nil {
				// The client left during the takeover: leave the record
				// abandoned, as it was, for its retry to take over.
				g.markUnknown(g.detached, nil)
				return g.requestEnded()
			}
			if ok {
				g.hb.renewedAt = sent
				switch held, err := g.slowLeaseRenewed(time.Since(sent)); {
				case err != nil:
					g.markUnknown(g.detached, nil) // abandoned again, as it was
					return g.storeFailedOnHeldKey("extend lease", err)
				case !held:
					continue
				}
				g.log(zapcore.WarnLevel, "abandoned key taken over: executing again", zap.String("outcome", "takeover"))
				return g.execute()
			}
			// Somebody else took it over first; see what they made of it.
		default:
			g.log(zapcore.WarnLevel, "abandoned key: outcome unknown", zap.String("outcome", "abandoned"))
			g.count(outcomeAbandoned)
			writeError(g.w, http.StatusInternalServerError, typeCommitStateUnknown,
				abandonedMessage, 0)
			return nil
		}
	}
	return g.stillInFlight()
}

// slowLeaseRenewed renews, before the request executes, the lease of a
// Reserve or TakeOver that took renewalInterval or more to come back
// (took): the store set the lease from the moment its statement began (on
// PostgreSQL from its transaction's start, which a combined batch shares),
// so a write held up by a lock or a busy server can return with its lease
// nearly, or already, run out, and another node could take the key over
// while this one executes. held is false when the key is not this
// request's any more; err, when the store could not tell.
func (g *guarded) slowLeaseRenewed(took time.Duration) (held bool, err error) {
	lease := g.h.executionLease()
	if took < renewalInterval(lease) {
		return true, nil
	}
	start := time.Now()
	err = g.h.store.ExtendLease(g.detached, g.key, g.owner, lease, g.recordTTL(lease))
	if err == nil {
		g.hb.renewedAt = start
	} else if !stores.NotSent(err) && !errors.Is(err, stores.ErrNotOwner) {
		// Its reply lost, it may commit after the key is marked unknown
		// and make the record read as in flight: abandoned again then,
		// as the heartbeat's lost renewals are (abandonAfterLostRenewal).
		g.hb.lostAt = time.Now()
	}
	if errors.Is(err, stores.ErrNotOwner) {
		g.log(zapcore.WarnLevel, "the key's lease ran out before its reservation came back: not executing",
			zap.Duration("took", took), zap.Duration("lease", lease))
		return false, nil
	}
	return err == nil, err
}

// refuse answers a request whose binding differs from its key's record
// with 422 and msg. A final record sealed under a secret that is no longer
// configured is the exception: its binding was keyed under that secret
// too, so no comparison can tell a retry from another request, and the
// answer is the one for a record that cannot be read.
//
// A record not final yet carries no key id. When neither its principal nor
// its fingerprint matches this request under any configured secret (or
// unkeyed), it may be this very request's record written under a secret
// no longer configured, as well as another principal's with another body:
// a 422 would tell a commit client its commit failed, when it may have
// happened. Such a record gets the answer a duplicate of it would get: in
// flight, the in-flight answer (at once: waiting would end in a record this
// request cannot read either); abandoned, outcome unknown.
//
// A final record whose seal does not open under its own stored binding was
// altered (its principal, fingerprint or path rewritten in the database):
// the answer for a record that cannot be read too, as its own retry would
// get, rather than a 422 that tells a commit client its commit failed
// (until the build after b35c62e). The seal is opened only here, on the
// path of a mismatch.
func (g *guarded) refuse(rec *stores.Record, msg string) error {
	if rec.State == stores.StateFinal && rec.Response != nil {
		if id := rec.Response.KeyID; id != "" {
			k := g.h.keys.byID(id)
			if k == nil {
				return g.unreadable(id, errors.New("no configured secret has this key id"))
			}
			if _, err := k.open(g.key, rec.Binding, rec.Response.Body); err != nil {
				return g.unreadable(id, fmt.Errorf("%w: %w", errSealBroken, err))
			}
		} else if g.clearRefused() {
			return g.unreadable("", errClearRefused)
		}
	}
	if rec.State != stores.StateFinal && g.nothingMatches(rec.Binding) {
		g.log(zapcore.WarnLevel, "the key's record matches this request under no configured secret: written under a secret no longer "+
			"configured (keep it in previous_secrets), or reused by another principal with another body; answered as if it were this request's")
		if !rec.Abandoned {
			return g.stillInFlight()
		}
		g.count(outcomeAbandoned)
		writeError(g.w, http.StatusInternalServerError, typeCommitStateUnknown,
			abandonedMessage, 0)
		return nil
	}
	g.log(zapcore.DebugLevel, "key reused for another request", zap.String("outcome", "mismatch"))
	g.count(outcomeMismatch)
	writeError(g.w, http.StatusUnprocessableEntity, typeUnprocessable, msg, 0)
	return nil
}

// errClearRefused is why a response in clear is not replayed under
// require_secret.
var errClearRefused = errors.New("a response in clear, where require_secret has every response sealed: the record was altered, " +
	"or written before the secret was set (add require_secret only once such records have expired)")

// clearRefused reports whether a stored response in clear is to be taken
// for an altered one: with require_secret and a secret, every node seals
// what it stores, so a clear response can only come from a writer of the
// database without the secret, who knows a request's principal and body
// and rewrote its sealed record as one stored before the secret was set.
// Without require_secret such records still replay, so that turning a
// secret on loses none.
func (g *guarded) clearRefused() bool {
	return g.h.RequireSecret && g.h.keys.current != nil
}

// nothingMatches reports whether stored differs from this request in both
// principal and fingerprint under the current secret and under each
// alternative (previous secrets, unkeyed): it is called only for a record
// already refused, so the extra hashing costs nothing on the common path.
func (g *guarded) nothingMatches(stored stores.Binding) bool {
	if stored.Principal == g.own.Principal || stored.Fingerprint == g.own.Fingerprint {
		return false
	}
	for _, k := range g.h.keys.alternatives() {
		if g.parts.principalHash(k) == stored.Principal || g.parts.fingerprint(k) == stored.Fingerprint {
			return false
		}
	}
	return true
}

// execute runs the request as the key's owner, then finalizes, releases, or
// marks the outcome unknown.
func (g *guarded) execute() error {
	h := g.h
	g.log(zapcore.DebugLevel, "key reserved: executing", zap.String("outcome", "execute"))
	g.count(outcomeExecuted)

	// Detached from the client: a commit must not be cut off half-way
	// because the client gave up, nor the store calls after it (the store
	// bounds each one itself).
	detached := g.detached
	g.executionEnds = time.Now().Add(time.Duration(h.ExecutionTimeout))
	ctx, cancel := context.WithDeadline(detached, g.executionEnds)
	defer cancel()
	hb := &g.hb
	if !h.inProcessLeases {
		hb = g.startHeartbeat(ctx, false)
	}

	g.cw = captureWriter{w: g.w, limit: h.MaxResponseSize}
	cw := &g.cw
	var err error
	g.active = activeGuard{key: g.key, owner: g.owner, parent: g.outer}
	err = g.callUpstream(cw, g.r.WithContext(context.WithValue(g.conns.attach(ctx), guardCtxKey{}, &g.active)), detached)
	hb.stop()
	if g.conns.askedAfterAnswer.Load() {
		g.warnAskedAfterAnswer()
	}
	if g.conns.resent.Load() {
		switch {
		case transportReplays(g.r):
			g.warnOverrideResent()
		case proxyRetried(g.r):
			g.warnResent()
		}
	}

	if err != nil {
		status := errorStatus(err)
		switch howMuchSent(g.r, err, &g.conns) {
		case sentNothing:
			// A handler before reverse_proxy failed: its error is the
			// answer, as without this module.
			g.release(detached, "rejected before reaching the catalog")
			return err
		case sentNoConnection:
			// Provably nothing reached the catalog: a retry must be able
			// to execute.
			g.log(zapcore.ErrorLevel, "catalog unreachable: key released", zap.Int("status", status), zap.Error(err))
			g.release(detached, "catalog unreachable")
			writeError(g.w, status, typeFor(status),
				"The catalog could not be reached; the request was not sent to it. Retry with the same Idempotency-Key.",
				retryAfterFor(status, g.retryAfterSeconds()))
			return nil
		case sentUnprocessed:
			g.log(zapcore.ErrorLevel, "the catalog did not process the request (HTTP/2 GOAWAY or REFUSED_STREAM, or nothing written on a closing connection): key released",
				zap.Int("status", status), zap.Error(err))
			g.warnStaleConnection(err)
			g.release(detached, "not processed by the catalog")
			// A directive around this one (nested) sees only the 502
			// written below, after a connection: this tells it the
			// catalog did not process the request either.
			g.outer.markAround(markUnprocessed)
			writeError(g.w, status, typeFor(status),
				"The catalog did not process the request (it refused it, or the connection closed before it was sent). Retry with the same Idempotency-Key.",
				retryAfterFor(status, g.retryAfterSeconds()))
			return nil
		}
		if answer, ok := g.soleAnswer(); ok && answer < 500 && !h.shouldFinalize(answer) {
			// The catalog answered once, with a status that says it did
			// not execute (401, 403, 429, ...), and a handle_response
			// route turned the answer into an error: the key is released
			// and the error goes on to handle_errors, as without this
			// module. A 5xx is not released here: its body, which may
			// say CommitStateUnknownException, is gone.
			g.release(detached, "status "+strconv.Itoa(answer)+" turned into an error")
			return err
		}
		// The request may have reached the catalog: it may have
		// committed. This client gets Caddy's status (502, 504) with an
		// Iceberg error saying so; a retry gets the abandoned policy's
		// answer at once.
		g.warnStaleConnection(err)
		g.markUnknown(detached, err)
		if rerunnable(g.binding.Operation) {
			writeError(g.w, status, typeFor(status),
				"The request reached the catalog but no response came back; it changes nothing, so retry with the same Idempotency-Key.",
				retryAfterFor(status, g.retryAfterSeconds()))
			return nil
		}
		writeError(g.w, status, typeCommitStateUnknown,
			"The request reached the catalog but no response came back; its outcome is unknown. Check the catalog's state before retrying.", 0)
		return nil
	}
	if !cw.wroteHeader && cw.buf.Len() == 0 && upstreamChosen(g.r) {
		// reverse_proxy sent the request, and a handle_response route
		// that writes nothing let the answer fall through: the catalog
		// may well have executed, and its answer is gone.
		g.log(zapcore.ErrorLevel, "reverse_proxy reached the catalog but no response was written (a handle_response route that writes nothing?): "+
			"the key's outcome is unknown")
		g.markUnknown(detached, nil)
		writeError(g.w, http.StatusBadGateway, typeCommitStateUnknown,
			"The request reached the catalog but the proxy wrote no response from its answer; its outcome is unknown. Check the catalog's state before retrying.", 0)
		return nil
	}
	if !cw.wroteHeader && cw.buf.Len() == 0 {
		// Nothing after this handler wrote a response, and no upstream
		// was chosen: most likely no reverse_proxy follows it. That is
		// not a final response, and nothing reached the catalog.
		g.log(zapcore.ErrorLevel, "the handlers after iceberg_idempotency wrote no response: is reverse_proxy missing after it? "+
			"(Inside a route block the written order rules.) Key released")
		g.release(detached, "no response")
		writeError(g.w, http.StatusBadGateway, typeServiceFailure,
			"The proxy produced no response for this request; it was not sent to the catalog. Retry with the same Idempotency-Key.", 0)
		return nil
	}
	status := cw.finalStatus()
	// What the catalog itself answered, which replace_status or a
	// handle_response route may have rewritten into status.
	answer, ok := catalogStatus(g.r)
	if !ok {
		answer = status
	}
	stateUnknown := func(code int) bool {
		return commitStateUnknown(g.binding.Operation, code, g.w.Header().Get("Content-Encoding"), cw.buf.Bytes(), !cw.overflowed)
	}
	switch {
	case g.conns.sentAgain(g.r) && status/100 != 2:
		// An earlier attempt was written and may have executed: this
		// answer may be the catalog refusing the commit it already made
		// (409), which must neither be stored nor reach a client that
		// would clean up after it.
		g.log(zapcore.ErrorLevel, "the request was sent to the catalog again after an attempt was sent (reverse_proxy's lb_retry_match or retry_match retrying mutations, "+
			"its lb_retries or lb_try_duration retrying a GET, or Go's transport resending a body-less GET, HEAD, OPTIONS or TRACE behind request_buffers): "+
			"its answer is not delivered nor stored; the key's outcome is unknown", zap.Int("status", status))
		g.markUnknown(detached, nil)
		if cw.overflowed {
			return nil
		}
		takeTrailers(g.w.Header())
		dropEntityHeaders(g.w.Header())
		writeError(g.w, http.StatusBadGateway, typeCommitStateUnknown,
			"The proxy sent the request to the catalog again after an earlier attempt; its outcome is unknown. Check the catalog's state before retrying.", 0)
		return nil
	case g.mayHaveReachedCatalog() && (stateUnknown(status) || answer != status && stateUnknown(answer)):
		g.log(zapcore.WarnLevel, "the answer says the commit's state is unknown: delivered, not stored, not released; the key's outcome is unknown",
			zap.Int("status", status), zap.Int("catalog_status", answer))
		g.markUnknown(detached, nil)
		if cw.overflowed {
			return nil
		}
	case !h.shouldFinalize(status) && answer != status && h.shouldFinalize(answer) && g.mayHaveReachedCatalog():
		// The catalog executed, or refused for good, and a handler
		// after this one rewrote its answer into one that is released:
		// a retry would execute the commit again.
		g.log(zapcore.WarnLevel, "the catalog's final answer was rewritten (replace_status, handle_response) into one that is not stored: "+
			"delivered, not released; the key's outcome is unknown", zap.Int("status", status), zap.Int("catalog_status", answer))
		g.markUnknown(detached, nil)
	case status >= 500 && !cw.overflowed && g.mayHaveReachedCatalog() && answerCutShort(g.w.Header(), status, cw.buf.Bytes()):
		// A 5xx whose body broke off before it could say what it is:
		// one that says CommitStateUnknownException leaves the key
		// unknown, and this one may have said so (until the build
		// after c861d98 it was released, and its retry executed).
		g.answerCut(status, cw)
	case !h.shouldFinalize(status):
		g.release(detached, "status "+strconv.Itoa(status))
	case status == http.StatusConflict && g.active.marked(markInFlightAnswer):
		// Another iceberg_idempotency handler after this one answered
		// that the key is in flight elsewhere, without the catalog: a
		// retry must be able to hear the outcome, not this 409 again.
		g.release(detached, "in flight behind another handler")
	case cw.overflowed:
		// The catalog executed and answered; only the answer cannot be
		// kept. Releasing the key would let a retry (or a duplicate
		// already waiting) execute the commit again and hear 409.
		g.log(zapcore.WarnLevel, "response larger than max_response_size: delivered, not stored; the key's outcome is unknown",
			zap.Int("status", status), zap.Int64("max_response_size", h.MaxResponseSize))
		g.markUnknown(detached, nil)
		return nil
	case answerCutShort(g.w.Header(), status, cw.buf.Bytes()):
		// The catalog executed and its answer broke off where nothing
		// in HTTP shows it (no length, no chunks). Stored, every retry
		// would be replayed the part as the whole.
		g.answerCut(status, cw)
	default:
		resp := stores.Response{Status: status, Header: g.replayHeaders(), Body: cw.buf.Bytes()}
		g.status = status
		if k := g.sealWith; k != nil {
			sealed, err := k.seal(g.key, g.binding, resp)
			if err != nil {
				// Nothing can be stored in clear once a secret is set.
				g.log(zapcore.ErrorLevel, "sealing the response failed: delivered, not stored; the key's outcome is unknown", zap.Error(err))
				g.markUnknown(detached, nil)
				g.dropBody()
				cw.deliver()
				return nil
			}
			resp = sealed
		}
		g.finalize(detached, resp)
	}
	g.dropBody()
	cw.deliver()
	return nil
}

// callUpstream runs the handlers after this one, counted in the executing
// gauge for as long as they run, with the key's header out of the sight of
// Go's HTTP transport (see hideKeyFromTransport), Accept-Encoding
// narrowed to what a replay can decode (narrowAcceptEncoding), and no ask
// to switch protocols (hideUpgrade).
//
// If they panic (reverse_proxy panics with http.ErrAbortHandler when the
// catalog's answer breaks off after its status line, or when the execution
// timeout cuts its body short), the catalog may well have executed: the key
// is marked unknown before the panic goes on to Caddy's server, which
// recovers from it. Left alone, the record would stay in flight under a
// lease nobody renews, and its retries would wait for the lease to lapse.
// Only an answer the key is released for, cut off by its client leaving,
// releases it (see releasedAnswerCutOffByClient).
func (g *guarded) callUpstream(w http.ResponseWriter, r *http.Request, detached context.Context) error {
	executing.Inc()
	defer executing.Dec()
	defer hideKeyFromTransport(r).restore()
	defer unrewindableBody(r).restore()
	defer narrowAcceptEncoding(r)()
	defer hideUpgrade(r)()
	// The body is read already; a catalog's 100 Continue would only be
	// one more answer that is not the final one.
	defer hideHeaders(r, "Expect")()
	// howMuchSent reads the upstream reverse_proxy chose from the
	// replacer, and execute the catalog's status; those of a call before
	// this one (forward_auth is a reverse_proxy too) say nothing about
	// this request's catalog.
	if repl := replacerOf(r); repl != nil {
		repl.Delete(upstreamVar)
		repl.Delete(catalogStatusVar)
		repl.Delete(retriesVar)
	}
	defer func() {
		if v := recover(); v != nil {
			g.hb.stop()
			switch {
			case !upstreamChosen(r):
				// A handler before reverse_proxy broke the request off
				// (Caddy's abort): nothing reached the catalog.
				g.release(detached, "broken off before reaching the catalog")
			case g.releasedAnswerCutOffByClient():
				g.release(detached, "status "+strconv.Itoa(g.cw.status)+", its delivery cut off by the client")
			default:
				g.markUnknown(detached, fmt.Errorf("the handlers after iceberg_idempotency panicked: %v", v))
			}
			panic(v)
		}
	}()
	return g.next.ServeHTTP(w, r)
}

// releasedAnswerCutOffByClient reports whether the handlers after this one
// broke off because the client went away while the catalog's answer was
// streamed to it (one over max_response_size, which is not captured), and
// that answer is one its key is released for: the catalog's own status,
// not rewritten, its one answer, not a commit's 500, 502 or 504. Had the
// client stayed, execute would have released the key (an answer that
// large is not read for a CommitStateUnknownException body); marked
// unknown instead, every retry heard "outcome unknown" for the key's
// lifetime where the catalog had said it did not execute (found by the
// handler model: a 503 with a large body whose client left).
func (g *guarded) releasedAnswerCutOffByClient() bool {
	cw := &g.cw
	if !cw.overflowed || !cw.clientGone || g.conns.sentAgain(g.r) {
		return false
	}
	answer, ok := g.soleAnswer()
	return ok && answer == cw.status && !g.h.shouldFinalize(answer) &&
		!commitStateUnknown(g.binding.Operation, answer, "", nil, false)
}

// mayHaveReachedCatalog reports whether the answer being delivered may
// come from beyond this handler's catalog call: an upstream was chosen,
// and unless the transport reports none (another transport), a connection
// was had. A 502 that a nested guard wrote after its dial failed, or that
// a handler after this one wrote without asking any upstream, proves
// nothing reached the catalog, whatever its status says; so does a 502
// a nested guard wrote for a request the catalog refused unprocessed.
func (g *guarded) mayHaveReachedCatalog() bool {
	return upstreamChosen(g.r) && !(g.conns.askedConn.Load() && !g.conns.gotConn.Load()) &&
		!g.active.marked(markUnprocessed)
}

// warnAskedAfterAnswer says, once per handler, that a catalog call asked
// an upstream again after an answer had come back: a forward_auth (or
// another reverse_proxy whose handle_response hands the request on) runs
// after this handler, or lb_retry_match resends the request after an
// answer. Either way the first upstream's connection counts as the
// catalog's (see connTrace), and a resent commit may execute twice.
func (g *guarded) warnAskedAfterAnswer() {
	g.warnOnce(&g.h.askedAfterAnswerWarned, "a keyed request went to an upstream again after an answer came back: "+
		"forward_auth (or a reverse_proxy with handle_response) after iceberg_idempotency, or lb_retry_match resending after an answer. "+
		"The first upstream's connection counts as the catalog's, so a catalog that cannot be reached leaves the key unknown "+
		"instead of released; put forward_auth before iceberg_idempotency, and do not retry mutations in reverse_proxy")
}

// warnOnce logs msg as a warning with the request's key and operation, the
// first time for the handler's flag.
func (g *guarded) warnOnce(flag *int32, msg string) {
	if atomic.CompareAndSwapInt32(flag, 0, 1) {
		g.log(zapcore.WarnLevel, msg)
	}
}

// warnResent says, once per handler, that a catalog call was sent again
// after an attempt that was written and never answered (see connTrace):
// the catalog may execute a mutation twice within the one request.
func (g *guarded) warnResent() {
	g.warnOnce(&g.h.resentWarned, "a keyed request was sent to the catalog again after an attempt that got no answer: "+
		"lb_retry_match retrying mutations after a transport error makes the catalog execute them twice, which no key can stop. "+
		"Do not retry POST or DELETE in reverse_proxy; such answers other than 2xx are not stored and the key's outcome is unknown")
}

// warnOverrideResent says, once per handler, that a keyed GET, HEAD,
// OPTIONS or TRACE (a commit that X-HTTP-Method-Override names) was sent
// to the catalog again after an attempt that got no answer. Two causes
// send it so, which the trace does not tell apart, as one request may meet
// both: reverse_proxy's lb_retries or lb_try_duration, which retry a GET
// after a transport error unless lb_retry_match says otherwise, and Go's
// transport, which resends such a request by itself behind
// reverse_proxy's request_buffers (see transportReplays).
func (g *guarded) warnOverrideResent() {
	g.warnOnce(&g.h.overrideResentWarned, "a keyed GET, HEAD, OPTIONS or TRACE (a mutation X-HTTP-Method-Override names) was sent to the catalog again "+
		"after an attempt that got no answer, so the catalog may have executed it twice: reverse_proxy's lb_retries or lb_try_duration retry a GET "+
		"after a transport error unless lb_retry_match says otherwise (give it one that leaves out requests with an X-HTTP-Method-Override header), "+
		"and Go's HTTP transport resends such a request by itself behind request_buffers (Remove request_buffers from the catalog's reverse_proxy). "+
		"Such answers other than 2xx are not stored and the key's outcome is unknown")
}

// warnStaleConnection names the likely cause, and its remedy, of a catalog
// call that failed with err on a keep-alive connection that had idled a
// second or more (see connTrace.staleConnection): whether the key is then
// unknown (a reset or an EOF after the request went out) or released (an
// HTTP/2 GOAWAY, the way such a server closes an idle connection, or an
// HTTP/1 write that sent nothing), the client saw a 502 that a shorter
// keepalive avoids.
func (g *guarded) warnStaleConnection(err error) {
	if idle, ok := g.conns.staleConnection(err); ok {
		g.log(zapcore.WarnLevel, "the keyed request failed on a keep-alive connection that had idled a second or more (idle_for): "+
			"if the catalog, or a load balancer before it, closes idle connections sooner, "+
			"set reverse_proxy's `transport http { keepalive <duration> }` below its idle timeout",
			zap.Duration("idle_for", idle))
	}
}

// soleAnswer is the status of the catalog's one answer to this request,
// when exactly one came back and nothing was sent after it.
func (g *guarded) soleAnswer() (int, bool) {
	if !g.conns.answered.Load() || g.conns.askedAfterAnswer.Load() || g.conns.resent.Load() {
		return 0, false
	}
	return catalogStatus(g.r)
}

func replacerOf(r *http.Request) *caddy.Replacer {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	return repl
}

// hideKeyFromTransport takes the Idempotency-Key (and X-Idempotency-Key)
// header off a request without a body for the upstream call; restore puts
// it back, for the handlers and logs after the call. Go's HTTP transport
// takes a request without a body that carries either header as safe to
// replay, and resends it by itself on a new connection when a reused one
// breaks before the answer: after the catalog may have executed it, so a
// keyed DELETE (dropTable, dropNamespace, dropView) could run twice.
// reverse_proxy sends every body-less request with a nil body, so nothing
// else stops that. Renaming the header is not enough: reverse_proxy
// rebuilds the header map under canonical names whenever it has header
// rules (header_up, or the Host rule of an HTTPS upstream). A request with
// a body keeps its key: its body cannot be rewound, so the transport never
// resends it. The catalog does not need the key of a body-less request:
// the deduplication is done here.
func hideKeyFromTransport(r *http.Request) (hidden hiddenKey) {
	if r.ContentLength != 0 {
		return hiddenKey{}
	}
	for i, name := range transportReplayHeaders {
		if v, ok := r.Header[name]; ok {
			hidden.values[i], hidden.any = v, true
			delete(r.Header, name)
		}
	}
	hidden.header = r.Header
	if a := activeGuardOf(r.Context()); a != nil {
		// Another iceberg_idempotency handler after this one still reads
		// the key: see keyHeaderValues.
		a.hiddenKey = hidden.values[0]
	}
	return hidden
}

// unrewindableBody gives a guarded GET, HEAD, OPTIONS or TRACE without a
// body, for the upstream call, an empty body that Go's HTTP transport
// cannot rewind; restore takes it off again. The transport takes a
// body-less request of these methods as safe to replay, key or not
// (net/http.Request.isReplayable), and resends it by itself on a new
// connection when a reused one breaks before the answer. Guarded, such a
// request is a commit that X-HTTP-Method-Override names (a Javalin
// catalog executes "GET …/tables/t" with "POST" as one), and the resend
// executed it twice until the build after a467ca3. reverse_proxy sends a
// request whose length is 0 with a nil body, which is why the length is
// made unknown (-1); the transport then finds the body empty before it
// writes the request, which goes out as before, without a body. The
// transport's resends of requests it never wrote go too: such a request's
// error is one the handler releases the key for (nothing was sent), and
// the client's retry executes it. reverse_proxy's request_buffers reads
// the body and sets the length back to 0 first: behind it, the resend
// stays. So did it behind a client's "Incremental: ?1", for which
// reverse_proxy gives a request of these methods whose length is unknown
// a nil body (its normalizeIncrementalRequest): the header is taken off for
// the call too (until the build after d4fe47c the commit ran twice), and
// put back with the body. A request without a body has nothing to forward
// incrementally.
func unrewindableBody(r *http.Request) (swapped swappedBody) {
	if r.ContentLength != 0 || !transportReplays(r) {
		return swappedBody{}
	}
	swapped = swappedBody{r: r, body: r.Body}
	if v, ok := r.Header[incrementalHeader]; ok {
		swapped.incremental = v
		delete(r.Header, incrementalHeader)
	}
	r.Body, r.ContentLength = emptyUnrewindable{}, -1
	return swapped
}

// incrementalHeader asks intermediaries to forward a message as it comes
// (caddyhttp.IsIncremental).
const incrementalHeader = "Incremental"

// swappedBody is what unrewindableBody took off a request.
type swappedBody struct {
	r           *http.Request
	body        io.ReadCloser
	incremental []string
}

func (s swappedBody) restore() {
	if s.r != nil {
		s.r.Body, s.r.ContentLength = s.body, 0
		if s.incremental != nil {
			s.r.Header[incrementalHeader] = s.incremental
		}
	}
}

// emptyUnrewindable is an empty request body without GetBody, so that
// the transport may not resend the request (see unrewindableBody).
type emptyUnrewindable struct{}

func (emptyUnrewindable) Read([]byte) (int, error) { return 0, io.EOF }
func (emptyUnrewindable) Close() error             { return nil }

// keyHeaderValues are r's Idempotency-Key values: from its header or,
// while a handler before this one hid them from the transport (a request
// without a body, in that handler's catalog call or fail_open pass), from
// the activeGuard its context carries. Without it a second handler on the
// request would take a keyed DELETE for one without a key.
func keyHeaderValues(r *http.Request) []string {
	// The header's name is canonical, as are the names of received
	// headers: indexing saves Values its canonicalization.
	if values := r.Header[IdempotencyKeyHeader]; len(values) > 0 {
		return values
	}
	// Whatever the body now: a handler in between (request_body's set)
	// may have given the request one since the key was hidden.
	for a := activeGuardOf(r.Context()); a != nil; a = a.parent {
		if a.hiddenKey != nil {
			return a.hiddenKey
		}
	}
	return nil
}

// hiddenKey is what hideKeyFromTransport took off a request's header.
type hiddenKey struct {
	header http.Header
	values [len(transportReplayHeaders)][]string
	any    bool
}

func (k hiddenKey) restore() {
	if !k.any {
		return
	}
	for i, name := range transportReplayHeaders {
		if v := k.values[i]; v != nil {
			k.header[name] = v
		}
	}
}

// transportReplayHeaders are the headers that make net/http's transport
// replay a request (net/http.Request.isReplayable).
var transportReplayHeaders = [...]string{IdempotencyKeyHeader, "X-Idempotency-Key"}

// errorStatus is the status Caddy would answer err with.
func errorStatus(err error) int {
	var herr caddyhttp.HandlerError
	if errors.As(err, &herr) && herr.StatusCode >= 400 {
		return herr.StatusCode
	}
	return http.StatusBadGateway
}

func typeFor(status int) string {
	if status == http.StatusServiceUnavailable {
		return typeUnavailable
	}
	return typeServiceFailure
}

// retryAfterFor adds Retry-After to a 503, which is what makes the Iceberg
// Java client retry a POST.
func retryAfterFor(status, seconds int) int {
	if status == http.StatusServiceUnavailable {
		return seconds
	}
	return 0
}

// shouldFinalize reports whether a response with this status is stored and
// replayed. Release wins over finalize, and a status in neither list (1xx,
// 3xx) is released: only what the spec calls final is ever replayed.
func (h *Handler) shouldFinalize(status int) bool {
	return !h.releaseSet.has(status) && h.finalizeSet.has(status)
}

// replayHeaders picks the headers worth replaying from the response.
func (g *guarded) replayHeaders() http.Header {
	src := g.w.Header()
	out := make(http.Header, len(g.h.replayHdrs)+1)
	for _, name := range g.h.replayHdrs {
		if vals, ok := src[name]; ok {
			out[name] = append([]string(nil), vals...)
		}
	}
	return out
}

// defaultFinalizeWindow bounds how long a Finalize that keeps failing is
// retried in the background, with the lease renewed, before the key is left
// "unknown". A store outage of a few seconds must not turn answered commits
// into unknown ones.
const defaultFinalizeWindow = 2 * time.Minute

// finalizeResult is what one Finalize try settled.
type finalizeResult int

const (
	finalizeDone  finalizeResult = iota // stored, released or given up: nothing more to do
	finalizeRetry                       // failed in a way a later try may fix
)

// finalize stores the final response before the client sees it. It never
// releases for a store failure: the catalog did execute. When the store
// fails, the response is delivered all the same and Finalize is retried in
// the background (see finalizeLater); meanwhile a retry of the key waits
// for it as for any request in flight.
//
// The lease is renewed while Finalize runs, as during the execution: a
// Finalize can take a statement_timeout or two (queued behind a busy
// combined_writes slot, then a batch that times out) before it fails, and
// another node must not read the record, whose answer this request holds,
// as abandoned meanwhile.
func (g *guarded) finalize(ctx context.Context, resp stores.Response) {
	if !g.h.inProcessLeases {
		g.startHeartbeat(g.detached, true)
	}
	res := g.tryFinalize(ctx, resp, 1)
	g.hb.stop()
	if res == finalizeRetry {
		g.finalizeLater(resp)
	}
}

// tryFinalize makes one Finalize try; attempt counts them, from 1.
func (g *guarded) tryFinalize(ctx context.Context, resp stores.Response, attempt int) finalizeResult {
	err := g.h.store.Finalize(ctx, g.key, g.owner, resp)
	switch {
	case err == nil:
	case errors.Is(err, stores.ErrResponseTooLarge):
		// As for a response over max_response_size: executed, not kept.
		g.log(zapcore.WarnLevel, "response too large for the store: delivered, not stored; the key's outcome is unknown",
			zap.Int("status", g.status), zap.Int("bytes", len(resp.Body)), zap.Error(err))
		g.markUnknown(ctx, nil)
		return finalizeDone
	case errors.Is(err, stores.ErrNotOwner):
		if g.storedAlready(ctx, resp) {
			// An earlier try committed, but its reply was lost; or the
			// store's client resent this one after it committed.
			break
		}
		// Taken over (abandoned reexecute) or expired: the key is not
		// this request's to finalize any more.
		g.log(zapcore.ErrorLevel, "finalize refused: the key is no longer owned by this request; response delivered, not stored",
			zap.Int("status", g.status), zap.Error(err))
		executionCounters.inc(g.binding.Operation, resultRefused)
		return finalizeDone
	default:
		// Logged once a request: retried every 2 s for the finalize
		// window, a store outage logged a line every 2 s for each request
		// that was executing when it began (4,000 lines a second from
		// 8,000 of them). Its end is logged either way.
		level := zapcore.WarnLevel
		if attempt > 1 {
			level = zapcore.DebugLevel
		}
		g.log(level, "finalize failed: will retry", zap.Int("attempt", attempt), zap.Error(err))
		return finalizeRetry
	}
	executionCounters.inc(g.binding.Operation, resultFinalized)
	g.log(zapcore.DebugLevel, "response finalized", zap.String("outcome", "finalize"), zap.Int("status", g.status))
	return finalizeDone
}

// finalizeLater keeps trying to store resp after the client has it, with
// the lease renewed, for up to the finalize window; then it leaves the key
// "unknown". The store stays open for it across a reload.
func (g *guarded) finalizeLater(resp stores.Response) {
	leave := func() {}
	if g.h.pooled != nil {
		leave = g.h.pooled.enter()
	}
	go func() {
		defer leave()
		window := g.h.finalizeWindow
		ctx, cancel := context.WithTimeout(context.Background(), window)
		defer cancel()
		// The first try's heartbeat has stopped: its state is reused, and
		// its last renewal sets when the next one is due.
		hb := g.startHeartbeat(ctx, true)
		defer hb.stop()
		for attempt, wait := 2, 100*time.Millisecond; ; attempt, wait = attempt+1, min(2*wait, 2*time.Second) {
			select {
			case <-time.After(wait):
			case <-ctx.Done():
				// The catalog executed but the store does not know its
				// answer: a retry must hear "unknown", not execute again.
				g.log(zapcore.ErrorLevel, "finalize failed for good: response delivered but not stored; the key's outcome is unknown",
					zap.Int("status", g.status), zap.Duration("retried_for", window))
				abandonCtx, abandonCancel := context.WithTimeout(context.Background(), storeOpTimeout)
				g.markUnknown(abandonCtx, nil)
				abandonCancel()
				return
			}
			tryCtx, tryCancel := context.WithTimeout(ctx, storeOpTimeout)
			res := g.tryFinalize(tryCtx, resp, attempt)
			tryCancel()
			if res == finalizeDone {
				return
			}
		}
	}()
}

// storedAlready reports whether the key's record is final with this
// request's response: a Finalize whose reply was lost may have committed.
func (g *guarded) storedAlready(ctx context.Context, resp stores.Response) bool {
	rec, err := g.h.store.Load(ctx, g.key)
	return err == nil && rec != nil && rec.State == stores.StateFinal && rec.Binding == g.binding &&
		rec.Response != nil && rec.Response.Status == resp.Status && rec.Response.KeyID == resp.KeyID &&
		bytes.Equal(rec.Response.Body, resp.Body)
}

// markUnknown ends the key's lease now, so its record reads as abandoned and
// a retry gets the abandoned policy's answer at once, the same way as when
// the owner's node died. An Abandon that fails is tried again in the
// background, as a failed Release is (undoLostReply), whether or not it was
// sent: left alone, the record read as in flight under a lease nobody
// renews, and every retry heard 503 until the lease lapsed (a whole lease;
// found by the handler model with faults on the store link).
func (g *guarded) markUnknown(ctx context.Context, cause error) {
	// A renewal landing after the Abandon would make the record read as
	// in flight again for a whole lease.
	lostRenewal := g.hb.stop()
	if rerunnable(g.binding.Operation) {
		if cause != nil {
			g.log(zapcore.WarnLevel, "the request may have reached the catalog but no response came back: key released, as "+
				g.binding.Operation+" changes nothing and a retry runs it again", zap.Error(cause))
		}
		g.release(ctx, "outcome unknown, but "+g.binding.Operation+" changes nothing")
		return
	}
	executionCounters.inc(g.binding.Operation, resultUnknown)
	if cause != nil {
		g.log(zapcore.WarnLevel, "the request may have reached the catalog but no response came back: outcome unknown",
			zap.String("outcome", "unknown"), zap.Error(cause))
	}
	if err := g.h.store.Abandon(ctx, g.key, g.owner); err != nil && !errors.Is(err, stores.ErrNotOwner) {
		g.log(zapcore.ErrorLevel, "marking the key abandoned failed: retrying in the background", zap.Error(err))
		g.undoLostReply(abandonTakeOver)
	}
	if !lostRenewal.IsZero() {
		g.abandonAfterLostRenewal(lostRenewal)
	}
}

// abandonAfterLostRenewal marks the key abandoned once more when the settle
// window has passed since a renewal whose reply was lost (at lost): its
// statement may still commit after markUnknown's Abandon, and give the
// record a live lease again, under which every retry hears "still in
// flight" for a whole lease instead of the outcome. stop waits for the
// renewal call, not for a statement the store lost track of. The Abandon
// matches only this request's owner token, so it cannot touch a record
// another request took over meanwhile; on a record already abandoned it
// changes nothing. A store failing then gets the tries of undoLostReply.
func (g *guarded) abandonAfterLostRenewal(lost time.Time) {
	wait := time.Until(lost.Add(g.h.settleWindow))
	if wait <= 0 {
		return
	}
	leave := func() {}
	if g.h.pooled != nil {
		leave = g.h.pooled.enter()
	}
	store, key, owner := g.h.store, g.key, g.owner
	time.AfterFunc(wait, func() {
		defer leave()
		ctx, cancel := context.WithTimeout(context.Background(), storeOpTimeout)
		err := store.Abandon(ctx, key, owner)
		cancel()
		if err != nil && !errors.Is(err, stores.ErrNotOwner) {
			g.undoLostReply(abandonTakeOver)
		}
	})
}

// release gives the key back: nothing was executed, or nothing final came
// of it. A Release that fails is retried in the background as a lost
// reply is (undoLostReply): left in flight, the record's lease would lapse
// and every retry of a request that provably did not commit would hear
// "outcome unknown" for the rest of the key's lifetime.
func (g *guarded) release(ctx context.Context, why string) {
	executionCounters.inc(g.binding.Operation, resultReleased)
	if err := g.h.store.Release(ctx, g.key, g.owner); err != nil {
		if errors.Is(err, stores.ErrNotOwner) {
			g.log(zapcore.ErrorLevel, "release refused: the key is no longer owned by this request", zap.String("reason", why), zap.Error(err))
			return
		}
		g.log(zapcore.ErrorLevel, "release failed: retrying in the background", zap.String("reason", why), zap.Error(err))
		g.undoLostReply(releaseReservation)
		return
	}
	g.log(zapcore.DebugLevel, "key released", zap.String("outcome", "release"), zap.String("reason", why))
}

// undoLostReply undoes, in the background, a store write whose reply was
// lost: the statement may have committed although the call failed. After a
// Reserve (or a Release that failed), the reservation is released, so that
// the client, told to retry with the same key, does not then hear "unknown"
// for a request that never reached the catalog. After a TakeOver, the record is marked abandoned again,
// as it was. The owner token is this request's alone, so neither can touch
// anybody else's record. It keeps trying for a while, since a store that just
// failed is often briefly unreachable.
//
// ErrNotOwner (nothing under this owner) settles it only once the settle
// window has passed since the failure: before that, the lost statement may
// still be on its way to its commit (it waited for a lock, or for the log
// flush, when the connection failed), and would then hold the key for a
// request nobody executes.
//
// A write the store proves it never sent (stores.NotSent) has nothing to
// undo and gets none: while the database is down every keyed request fails
// so, and 500 of them against an unreachable PostgreSQL left 500 goroutines
// sending 250 Releases a second for two minutes, all at once at the
// database the moment it came back.
func (g *guarded) undoLostReply(undo func(ctx context.Context, s stores.Store, key, owner string) error) {
	store, key, owner := g.h.store, g.key, g.owner
	settle, repair := g.h.settleWindow, g.h.repairWindow
	leave := func() {}
	if g.h.pooled != nil {
		leave = g.h.pooled.enter()
	}
	g.h.repairs.add(&repairJob{undo: undo, store: store, key: key, owner: owner,
		failed: time.Now(), settle: settle, repair: repair, wait: 100 * time.Millisecond, leave: leave})
}

func releaseReservation(ctx context.Context, s stores.Store, key, owner string) error {
	return s.Release(ctx, key, owner)
}

func abandonTakeOver(ctx context.Context, s stores.Store, key, owner string) error {
	return s.Abandon(ctx, key, owner)
}

// undoRetryGap is the longest pause between two tries of undoLostReply.
// The undo of a lost Reserve has to land before the reservation's lease
// lapses, or a retry meeting the lapsed record hears "unknown" for a request
// never sent; with 2 s between tries, one try failing just after the store
// came back pushed the next past the lease (CI, a 3 s database outage under
// a 6 s lease). The undos are few (only writes whose reply was lost, not
// those never sent), so trying twice a second costs the store little.
const undoRetryGap = 500 * time.Millisecond

// lostReplyWindow bounds the background repair of a store write whose reply
// was lost.
const lostReplyWindow = 2 * time.Minute

// defaultSettleWindow is the least time after a store write failed that
// its statement is taken as possibly still committing; a SQL store
// lengthens it to twice its statement_timeout (see writeSettler). Past it,
// a write that left nothing behind never committed.
const defaultSettleWindow = 10 * time.Second

// recordTTL is how long the record is to live past the end of a lease of
// length lease taken now: the lifetime advertised to clients, plus the
// grace, counted from the latest moment the execution may still run. An
// owner whose renewals fail keeps executing (up to execution_timeout) while
// its lease lapses, and a node that dies leaves its lease to lapse: either
// way the record must read as abandoned to the client's retries until the
// execution cannot be running any more, and for the lifetime after, also
// when the lifetime is shorter than the execution. The memory store's lease
// already spans the execution (see executionLease).
func (g *guarded) recordTTL(lease time.Duration) time.Duration {
	ttl := time.Duration(g.h.Lifetime + *g.h.Grace)
	if g.h.retention != nil {
		// A lifetime this process advertised for the store before a
		// reload lowered it, while clients may still count on it.
		ttl = max(ttl, g.h.retention.get())
	}
	ends := g.executionEnds
	if ends.IsZero() { // not started yet: it starts now at the latest
		ends = time.Now().Add(time.Duration(g.h.ExecutionTimeout))
	}
	if more := time.Until(ends) - lease; more > 0 {
		ttl += more
	}
	return ttl
}

// executionLease is the lease a request takes when it reserves or takes
// over a key. Other nodes tell a long upstream call from a dead owner by a
// lease the owner renews (startHeartbeat). The memory store's records are
// held only by this process's requests, each of which ends its record
// (finalize, release, or unknown: a panic too) within execution_timeout;
// if the process dies, the records die with it. Its lease is taken for the
// whole execution at once, one lease more for margin, and never renewed:
// no timer per request.
func (h *Handler) executionLease() time.Duration {
	if h.inProcessLeases {
		return time.Duration(h.ExecutionTimeout + h.Lease)
	}
	return time.Duration(h.Lease)
}

// startHeartbeat renews the lease every renewalInterval until stopped, so
// that other nodes can tell a long upstream call (or a slow Finalize:
// finalizing) from a dead owner. A renewal is due renewalInterval after the last
// one began (the store measures the lease from then), also across a stop
// and a restart: a heartbeat started again (for Finalize, then for
// finalizeLater) keeps the rhythm, where one that began counting afresh
// could leave the lease to lapse in between. It is a timer, not a
// goroutine: most executions end long before the first renewal is due,
// and then the heartbeat costs one timer, started and stopped. stop waits
// for a renewal under way, so none lands after the key is released or
// marked unknown (where it could only fail and be counted as a lost
// lease). The state lives in g (g.hb), so a heartbeat allocates only its
// timer and the function the timer calls; one must be stopped before the
// next starts, and a generation tells a late tick of the old one apart.
func (g *guarded) startHeartbeat(ctx context.Context, finalizing bool) *heartbeat {
	hb := &g.hb
	hb.mu.Lock()
	defer hb.mu.Unlock()
	hb.g, hb.ctx, hb.lease, hb.stopped, hb.finalizing = g, ctx, time.Duration(g.h.Lease), false, finalizing
	hb.gen++
	gen := hb.gen
	hb.timer = time.AfterFunc(hb.untilDue(), func() { hb.beat(gen) })
	return hb
}

// heartbeat is the state of one execution's lease renewals.
type heartbeat struct {
	mu    sync.Mutex
	g     *guarded
	ctx   context.Context
	lease time.Duration
	// renewedAt is when the lease this request holds was last taken: the
	// start of its Reserve, TakeOver or latest successful renewal.
	renewedAt time.Time
	// finalizing is set while Finalize may be committing: a renewal then
	// refused as not the owner's most likely lost to that commit.
	finalizing bool
	// failing is set from a failed renewal to the next one that succeeds.
	failing bool
	// lostAt is when the latest renewal whose reply was lost failed: its
	// statement may yet commit (see abandonAfterLostRenewal).
	lostAt   time.Time
	gen      int // of the heartbeat started last; its timer's ticks carry it
	stopped  bool
	renewing sync.WaitGroup
	timer    *time.Timer
}

// untilDue is how long until the next renewal is due. Caller holds hb.mu.
func (hb *heartbeat) untilDue() time.Duration {
	return max(0, renewalInterval(hb.lease)-time.Since(hb.renewedAt))
}

// renewalInterval is how often a lease is renewed: a quarter of it. A
// store call may take its whole timeout T, at most a quarter of the lease
// (checkLease), so the last renewal's reply came back by the time the next
// is due, however slow it was. A renewal that takes T and fails, followed
// by the retry's pause (retryAfterFailedRenewal) and a retry that takes T
// too, then ends by 1/4 + 1/4 + 1/30 + 1/4 = 0.78 of the lease: in time.
// Renewed every third, the two calls alone filled the two thirds left, and
// any pause let the lease lapse under a live owner.
func renewalInterval(lease time.Duration) time.Duration {
	return lease / 4
}

// beat renews the lease for the heartbeat of generation gen, unless it was
// stopped, and schedules the next renewal.
func (hb *heartbeat) beat(gen int) {
	hb.mu.Lock()
	if hb.stopped || hb.gen != gen || hb.ctx.Err() != nil {
		hb.mu.Unlock()
		return
	}
	g, ctx, lease, finalizing := hb.g, hb.ctx, hb.lease, hb.finalizing
	hb.renewing.Add(1)
	hb.mu.Unlock()
	defer hb.renewing.Done()
	start := time.Now()
	// Not cut off by the execution's end: a renewal cancelled once its
	// statement was sent may still commit, after stop returned and the
	// key was marked unknown, and make the record read as in flight for a
	// whole lease more. stop waits for it instead; the store bounds it.
	callCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), storeOpTimeout)
	err := g.h.store.ExtendLease(callCtx, g.key, g.owner, lease, g.recordTTL(lease))
	cancel()
	if errors.Is(err, stores.ErrNotOwner) && finalizing {
		return // the key is most likely final: Finalize committed meanwhile
	}
	if err != nil && ctx.Err() == nil {
		// Counted unless the execution itself ended (its timeout):
		// then nothing needs the lease any more.
		leaseRenewalsFailed.Inc()
	}
	if errors.Is(err, stores.ErrNotOwner) {
		g.log(zapcore.WarnLevel, "lost ownership of key while executing", zap.Error(err))
		return
	}
	hb.mu.Lock()
	defer hb.mu.Unlock()
	if err != nil && !stores.NotSent(err) {
		hb.lostAt = time.Now()
	}
	if err == nil {
		hb.renewedAt = start
		hb.failing = false
	} else if ctx.Err() == nil {
		// Logged once a streak: retried every retryAfterFailedRenewal,
		// a store outage would log a line a second per request. One cut
		// off by the execution's end is no failure.
		level := zapcore.ErrorLevel
		if hb.failing {
			level = zapcore.DebugLevel
		}
		hb.failing = true
		g.log(level, "lease renewal failed: retrying", zap.Error(err))
	}
	if !hb.stopped && hb.gen == gen {
		next := hb.untilDue()
		if err != nil {
			next = retryAfterFailedRenewal(lease)
		}
		hb.timer.Reset(next)
	}
}

// retryAfterFailedRenewal is how soon a failed renewal is tried again: soon,
// since it has what is left of the lease to land in (see renewalInterval);
// the short pause keeps a store that fails at once (connection refused)
// from being asked in a loop.
func retryAfterFailedRenewal(lease time.Duration) time.Duration {
	return lease / 30
}

// stop ends the heartbeat; one never started (executionLease) has no timer.
// It returns when the latest renewal whose reply was lost failed (zero if
// none was), once any renewal under way has ended.
func (hb *heartbeat) stop() (lostAt time.Time) {
	hb.mu.Lock()
	hb.stopped = true
	if hb.timer != nil {
		hb.timer.Stop()
	}
	hb.mu.Unlock()
	hb.renewing.Wait()
	hb.mu.Lock()
	defer hb.mu.Unlock()
	return hb.lostAt
}

// replay answers with a stored final response, opening it first when it
// was sealed.
func (g *guarded) replay(rec *stores.Record) error {
	g.dropBody()
	resp := rec.Response
	if resp.KeyID == "" && rec.Binding.Principal != g.parts.principalHash(nil) {
		// A response under a binding keyed by a secret is sealed (by that
		// secret or the current one), whether a secret is set now or only
		// kept in previous_secrets; one in clear is legitimate only in a
		// record whose principal is unkeyed. A clear response under a keyed
		// binding was written by someone who cannot seal, into the row of
		// a request that was: replaying it would hand out their body.
		return g.unreadable("", errors.New("a response in clear under a binding keyed by a secret: the record was altered"))
	}
	if resp.KeyID == "" && g.clearRefused() {
		return g.unreadable("", errClearRefused)
	}
	if resp.KeyID != "" {
		k := g.h.keys.byID(resp.KeyID)
		if k == nil {
			return g.unreadable(resp.KeyID, errors.New("no configured secret has this key id"))
		}
		opened, err := k.open(g.key, rec.Binding, resp.Body)
		if err != nil {
			return g.unreadable(resp.KeyID, fmt.Errorf("%w: %w", errSealBroken, err))
		}
		resp = opened
	}
	g.log(zapcore.DebugLevel, "replaying stored response", zap.String("outcome", "replay"), zap.Int("status", resp.Status))
	g.count(outcomeReplayed)
	body, decoded, stream := g.acceptableBody(resp)
	hdr := g.w.Header()
	for name, vals := range resp.Header {
		if decoded && name == "Content-Encoding" {
			continue
		}
		hdr[name] = append([]string(nil), vals...)
	}
	if enc := resp.Header.Get("Content-Encoding"); enc != "" {
		// The answer depends on the retry's Accept-Encoding, as the
		// first one did; decoded, it is no longer the representation a
		// strong ETag that encode suffixed with its coding names.
		if !strings.Contains(strings.ToLower(strings.Join(hdr["Vary"], ",")), "accept-encoding") {
			hdr.Add("Vary", "Accept-Encoding") // unless replay_headers kept the catalog's
		}
		if decoded {
			if etag := hdr.Get("Etag"); !strings.HasPrefix(etag, "W/") && strings.HasSuffix(etag, "-"+enc+`"`) {
				hdr.Set("Etag", strings.TrimSuffix(etag, "-"+enc+`"`)+`"`)
			}
		}
	}
	hdr.Set(ReplayedHeader, "true")
	if stream != nil {
		// body is what was decoded so far; the rest is decoded as it is
		// written, its length not known before.
		defer stream.Close()
		g.w.WriteHeader(resp.Status)
		_, _ = g.w.Write(body)
		src := &readErrors{r: stream}
		if _, err := io.Copy(g.w, src); err != nil && src.err != nil {
			// The status line is out: only breaking the connection off
			// (or the HTTP/2 stream) keeps the client from taking what
			// came for the whole answer.
			g.log(zapcore.WarnLevel, "decoding the stored response broke off while replaying it: connection aborted", zap.Error(src.err))
			panic(http.ErrAbortHandler)
		} else if err != nil {
			g.log(zapcore.DebugLevel, "the client left during a replay", zap.Error(err))
		}
		return nil
	}
	hdr.Set("Content-Length", strconv.Itoa(len(body)))
	g.w.WriteHeader(resp.Status)
	_, _ = g.w.Write(body)
	return nil
}

// acceptableBody is the stored body in a form this request accepts. The
// catalog compressed it as the first request allowed (its Accept-Encoding
// went through); a retry or a waiting duplicate that does not accept that
// coding gets it decoded (gzip, deflate), decoded true: at once, or, when
// it decodes to more than max_response_size (a compressed answer stored
// within the limit can be ten times that and more), its first part in body
// and the rest as stream, to be decoded while it is written. A coding this
// handler cannot decode goes as stored.
func (g *guarded) acceptableBody(resp *stores.Response) (body []byte, decoded bool, stream io.ReadCloser) {
	enc := resp.Header.Get("Content-Encoding")
	if enc == "" || acceptsEncoding(g.r.Header, enc) {
		return resp.Body, false, nil
	}
	rd, err := newDecoder(enc, resp.Body)
	if err == nil {
		limit := max(g.h.MaxResponseSize, int64(len(resp.Body)))
		if body, err = io.ReadAll(io.LimitReader(rd, limit+1)); err == nil {
			if int64(len(body)) > limit {
				return body, true, rd
			}
			_ = rd.Close()
			return body, true, nil
		}
		_ = rd.Close()
	}
	g.log(zapcore.WarnLevel, "the stored response is in a content coding the retry does not accept, and cannot be decoded: replayed as stored",
		zap.String("content_encoding", enc), zap.Error(err))
	return resp.Body, false, nil
}

// readErrors passes r's reads on and keeps the error one ended with
// (io.EOF aside), so that a copy's error can be told to be the source's,
// not the destination's.
type readErrors struct {
	r   io.Reader
	err error
}

func (e *readErrors) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if err != nil && err != io.EOF {
		e.err = err
	}
	return n, err
}

// unreadable answers for a final record whose sealed response cannot be
// opened: its secret was removed from the configuration, or the row was
// corrupted or moved onto another key. The catalog did execute the request,
// so it is never executed again (not even under abandoned reexecute) and
// never replayed as garbage: the client hears that the outcome is unknown,
// like a duplicate of an abandoned request. The log names the key and the
// key id, never what the record holds.
func (g *guarded) unreadable(keyID string, cause error) error {
	msg := "stored response cannot be decrypted: answering outcome unknown; is the secret it was sealed under missing from secret and previous_secrets?"
	switch {
	case errors.Is(cause, stores.ErrUnreadableRecord):
		msg = "the key's record cannot be read by this build (written by a newer build, or altered): answering outcome unknown"
	case keyID == "" && !errors.Is(cause, stores.ErrUnreadableRecord):
		// Nothing to decrypt: a response in clear where it must be sealed.
		msg = "stored response is in clear where this handler takes only sealed ones: answering outcome unknown; " +
			"the record was altered in the store, or stored by a node without secret"
	case errors.Is(cause, errSealBroken):
		msg = "stored response does not open under the secret its key id names: answering outcome unknown; " +
			"the record was altered or moved onto another key, or sealed by a build whose layout this one does not read"
	}
	g.log(zapcore.ErrorLevel, msg, zap.String("outcome", outcomeUnreadable), zap.String("key_id", keyID), zap.Error(cause))
	g.count(outcomeUnreadable)
	writeError(g.w, http.StatusInternalServerError, typeCommitStateUnknown,
		"The stored response for this Idempotency-Key cannot be read; the original request's outcome is unknown. Check the catalog's state before retrying with a new key.", 0)
	return nil
}

// errSealBroken marks a sealed response that does not open under the
// configured secret its key id names.
var errSealBroken = errors.New("the seal does not open")

// inFlightWait is how long a duplicate waits for the request that holds its
// key: in_flight_wait, cut short so that its answer goes out before the
// server's write_timeout (servers { timeouts { write } }) breaks the
// connection off, with a tenth of it, and at least half a second, left to
// write. A duplicate waiting past it heard nothing at all (HTTP/1: the
// connection closed; HTTP/2: the stream reset), where 503 + Retry-After
// tells it to come back. The timeout runs from the request's start, as
// Caddy noted it, not from this handler's: forward_auth before it takes
// its share.
func (g *guarded) inFlightWait() time.Duration {
	wait := time.Duration(g.h.InFlightWait)
	srv, _ := g.r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if srv == nil || srv.WriteTimeout <= 0 {
		return wait
	}
	start, ok := caddyhttp.GetVar(g.r.Context(), startTimeVar).(time.Time)
	if !ok {
		start = time.Now()
	}
	timeout := time.Duration(srv.WriteTimeout)
	left := time.Until(start.Add(timeout - max(timeout/10, 500*time.Millisecond)))
	return min(wait, left)
}

// startTimeVar is where Caddy notes when it began serving a request.
const startTimeVar = "start_time"

func (g *guarded) stillInFlight() error {
	g.log(zapcore.DebugLevel, "key still in flight after waiting", zap.String("outcome", "in_flight"))
	g.count(outcomeInFlight)
	msg := "A request with this Idempotency-Key is still being processed; retry with the same key"
	if g.h.InFlightStatus == http.StatusConflict {
		// A 4xx, which a guard around this handler would store and
		// replay for good: the mark tells it this one is for now only.
		g.outer.markAround(markInFlightAnswer)
		writeError(g.w, http.StatusConflict, typeConflict, msg, 0)
		return nil
	}
	writeError(g.w, http.StatusServiceUnavailable, typeUnavailable, msg, g.retryAfterSeconds())
	return nil
}

// storeFailed fails closed (503 + Retry-After) unless fail_open is set.
// A SQL store whose table is behind this build's schema is no outage: it
// cannot serve until someone migrates the table, and fail_open would pass
// every keyed request unguarded for as long, beside nodes of the older
// build that guard them (a rolling upgrade whose migration a DBA runs): a
// commit whose answer it lost was executed again by the retry another node
// took. Nor is a store whose user the database refuses a statement or
// command the store needs (a grant missing): the records it holds answer
// the retries of commits that landed, which fail_open would execute again
// until someone makes the grant. (Nor is a memory store full of unknown
// outcomes: see storeError.)
func (g *guarded) storeFailed(step string, err error) error {
	var schemaErr *sqlstore.SchemaError
	var accessErr *sqlstore.AccessError
	return g.storeError(step, err, g.h.FailOpen && !errors.As(err, &schemaErr) && !errors.As(err, &accessErr))
}

// storeFailedOnHeldKey is storeFailed for a key the store has shown to be
// another request's: in flight, or abandoned with its outcome unknown.
// fail_open does not apply. It trades the guarantee for availability
// while the store cannot tell anything, but here the store told: passing
// the request through would execute it beside, or after, the one that
// holds the key.
func (g *guarded) storeFailedOnHeldKey(step string, err error) error {
	return g.storeError(step, err, false)
}

func (g *guarded) storeError(step string, err error, failOpen bool) error {
	if g.r.Context().Err() != nil {
		// The client left and took the store call with it: not a failure
		// of the store, and nobody is there to answer.
		g.log(zapcore.DebugLevel, "the request ended during a store call", zap.String("step", step))
		return g.requestEnded()
	}
	if errors.Is(err, stores.ErrUnreadableRecord) {
		// The store answered: the key has a record, which may stand for
		// a commit that landed. Neither fail_open nor a 503 that the
		// client would retry until the record expires.
		return g.unreadable("", err)
	}
	if errors.Is(err, memory.ErrTooManyUnknown) {
		// Whatever fail_open says: the store answers, and refuses only new
		// keys until records expire. fail_open passed every keyed request
		// through unguarded for as long (36.5 minutes by default), logged
		// and alerted as a store failure, on a healthy store.
		return g.unknownFull()
	}
	if failOpen {
		g.log(zapcore.ErrorLevel, "store failed: passing through unguarded (fail_open)", zap.String("step", step), zap.String("store", g.h.storeName()), zap.Error(err))
		g.count(outcomeFailOpen)
		// Unguarded, but not replayed by the transport behind the
		// client's back either (see hideKeyFromTransport), nor answered
		// in another protocol (hideUpgrade), as a guarded request.
		// A guard that holds no key carries the hidden one to the
		// handlers nested in the pass.
		g.active = activeGuard{parent: g.outer}
		r := g.r.WithContext(context.WithValue(g.r.Context(), guardCtxKey{}, &g.active))
		defer hideKeyFromTransport(r).restore()
		defer unrewindableBody(r).restore()
		defer hideUpgrade(r)()
		return g.next.ServeHTTP(g.w, r)
	}
	g.log(zapcore.ErrorLevel, "store failed: rejecting request", zap.String("step", step), zap.String("store", g.h.storeName()), zap.Error(err))
	g.count(outcomeStoreUnavailable)
	writeError(g.w, http.StatusServiceUnavailable, typeUnavailable,
		"Idempotency store is unavailable; retry with the same Idempotency-Key", g.retryAfterSeconds())
	return nil
}

// unknownFull answers a new key while the memory store holds max_entries
// records whose outcome is unknown (memory.ErrTooManyUnknown): nothing was
// reserved or sent. The store is healthy, so neither the log line nor the
// outcome of an outage: a catalog that left a burst of commits unknown
// had every later one logged at error level and counted as
// store_unavailable, for as long as the records lived (36.5 minutes by
// default), sending whoever was paged to look at the store.
func (g *guarded) unknownFull() error {
	g.count(outcomeUnknownFull)
	// Seconds in 32 bits, from 1: 64-bit atomics need an alignment a field
	// of the Handler is not promised on 32-bit platforms.
	now := int32(time.Since(warnEpoch)/time.Second) + 1
	if last := atomic.LoadInt32(&g.h.unknownFullWarned); (last == 0 || now-last >= 60) && atomic.CompareAndSwapInt32(&g.h.unknownFullWarned, last, now) {
		g.log(zapcore.WarnLevel, "keyed requests refused with 503: the memory store holds max_entries records whose outcome is unknown, "+
			"kept until they expire (counted in requests_total{outcome=\"unknown_full\"}; warned once a minute)")
	}
	writeError(g.w, http.StatusServiceUnavailable, typeUnavailable,
		"The proxy holds as many keys of unknown outcome as it may; the request was not executed. Retry with the same Idempotency-Key.",
		g.retryAfterSeconds())
	return nil
}

// warnEpoch is what the handlers' 32-bit warning times count from.
var warnEpoch = time.Now()

func (g *guarded) retryAfterSeconds() int { return g.h.retryAfterSeconds() }

// dropBody lets the request body go before a captured or stored answer is
// written, once the handler is sure to return nil: a client reading a large
// answer slowly (a full receive window, a stalled HTTP/2 stream) held its
// body's share of max_buffered_bytes until Caddy's write timeout, so that a
// few such clients had every other keyed request refused. The bytes are let
// go with the share, for the garbage collector to take back. Not on a path
// that returns an error: handle_errors then runs with the request, and a
// directive or reverse_proxy in it reads the body again.
func (g *guarded) dropBody() {
	g.parts.body = nil
	g.body.reset(nil)
	g.hold.release()
}

// requestEnded answers a request whose context ended before it was sent to
// the catalog, or while it waited for a duplicate. Cancelled, its client
// left: abortForGoneClient. Past its deadline, it runs inside the catalog
// call of another iceberg_idempotency around this one (a nested directive),
// whose execution_timeout passed: its client is still there, and hears 503
// + Retry-After, on which the outer guard gives its key back.
func (g *guarded) requestEnded() error {
	if errors.Is(g.r.Context().Err(), context.Canceled) {
		abortForGoneClient()
	}
	g.log(zapcore.WarnLevel, "the execution_timeout of an iceberg_idempotency around this one ran out before the request was sent to the catalog")
	writeError(g.w, http.StatusServiceUnavailable, typeUnavailable,
		"The proxy's time for this request ran out before it was sent to the catalog; retry with the same Idempotency-Key.", g.retryAfterSeconds())
	return nil
}

// answerCut ends a request whose catalog answer (status, captured by cw)
// broke off where nothing in HTTP shows it (answerCutShort). Delivered,
// its client would take the part for the whole. The client's connection
// is broken off instead, as reverse_proxy breaks it when the transport
// sees an answer break off, and the key's outcome is unknown: its retry
// hears so.
func (g *guarded) answerCut(status int, cw *captureWriter) {
	g.log(zapcore.ErrorLevel, "the catalog's answer had no length and ended before its body did (its connection closed mid-answer, or the catalog sent it malformed): "+
		"not stored, not delivered, the client's connection broken off; the key's outcome is unknown",
		zap.Int("status", status), zap.Int("received_bytes", cw.buf.Len()))
	g.markUnknown(g.detached, nil)
	g.dropBody()
	panic(http.ErrAbortHandler)
}

// abandonedMessage answers a retry of a key whose outcome is unknown. The
// record does not say why: the call broke off or timed out, its answer
// was too large to keep or did not say whether the commit landed, or the
// node died during it. "Interrupted" alone misled where the answer had
// been delivered whole and only could not be stored.
const abandonedMessage = "The original request with this Idempotency-Key may have been executed by the catalog, " +
	"but no answer to it was stored (its call broke off or timed out, or its answer could not be kept); its outcome is unknown. " +
	"Check the catalog's state before retrying with a new key."

// abortForGoneClient ends a request whose client left before anything was
// written, with the connection broken off and no answer. Returning without
// writing would not do: Go's HTTP/1 server also cancels the request when
// the client only half-closed its connection (shut down its sending side,
// still reading), and then answers a handler that wrote nothing with an
// empty 200, which the client takes for a commit that succeeded, while its
// key was given back unexecuted or another request's execution of it may
// still fail. Nor would an error status: a client still reading a 4xx to a
// commit cleans up, while the request it waited on may commit. A broken
// connection tells it nothing, and its retry gets the truth. Caddy's abort
// does the same (http.ErrAbortHandler is not logged as a panic).
func abortForGoneClient() {
	panic(http.ErrAbortHandler)
}

// storeName names the handler's store for the log lines of its failures:
// with several handlers, each on its own store, the error text alone does
// not always tell which one failed. It is the store's pool key, as the
// admin API shows it (the backend, the table, and a hash that holds no
// secret). It reads storeLabel, which only Provision writes: storeKey,
// which Cleanup clears, would race with the requests still draining.
func (h *Handler) storeName() string {
	if h.storeLabel != "" {
		return h.storeLabel
	}
	return "other"
}

// retryAfterSeconds is retry_after in whole seconds, rounded up, for a
// Retry-After header.
func (h *Handler) retryAfterSeconds() int {
	return int(math.Ceil(time.Duration(h.RetryAfter).Seconds()))
}

// log writes msg with fields and the request's key and operation, if level
// is enabled. fields is copied, never kept: a variadic slice that escaped
// would cost every caller an allocation, on every request, for debug lines
// that are almost always off.
func (g *guarded) log(level zapcore.Level, msg string, fields ...zap.Field) {
	if c := g.h.logger.Check(level, msg); c != nil {
		all := make([]zap.Field, 0, len(fields)+2)
		all = append(append(all, fields...), zap.String("key", g.key), zap.String("operation", g.binding.Operation))
		c.Write(all...)
	}
}

func (g *guarded) count(outcome string) {
	decisionCounters.inc(g.binding.Operation, outcome)
}
