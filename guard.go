package icebergidempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/google/uuid"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// IdempotencyKeyHeader is the request header defined by the Iceberg REST spec.
const IdempotencyKeyHeader = "Idempotency-Key"

// ReplayedHeader marks a response served from the store.
const ReplayedHeader = "Idempotent-Replayed"

// storeOpTimeout bounds store calls made after the client may have left
// (finalize, release): they must not hang forever on a dead database.
const storeOpTimeout = 10 * time.Second

// guard runs one mutation under its Idempotency-Key. path is the request's
// normalized path, which the key is bound to.
func (h *Handler) guard(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, op, path string) error {
	values := r.Header.Values(IdempotencyKeyHeader)
	if len(values) == 0 {
		if h.RequireKey {
			writeError(w, http.StatusBadRequest, typeBadRequest, "Idempotency-Key header is required for "+op, 0)
			return nil
		}
		h.debug("no key: passing through", zap.String("operation", op))
		decisions.WithLabelValues(op, outcomeNoKey).Inc()
		return next.ServeHTTP(w, r)
	}
	for _, v := range values[1:] {
		if v != values[0] {
			decisions.WithLabelValues(op, outcomeInvalidKey).Inc()
			writeError(w, http.StatusBadRequest, typeBadRequest, "Idempotency-Key header must have a single value", 0)
			return nil
		}
	}
	key, err := parseKey(values[0])
	if err != nil {
		decisions.WithLabelValues(op, outcomeInvalidKey).Inc()
		writeError(w, http.StatusBadRequest, typeBadRequest, "Invalid Idempotency-Key: "+err.Error(), 0)
		return nil
	}

	body, err := io.ReadAll(io.LimitReader(r.Body, h.MaxRequestSize+1))
	if err != nil {
		return caddyhttp.Error(http.StatusBadRequest, fmt.Errorf("reading request body: %w", err))
	}
	if int64(len(body)) > h.MaxRequestSize {
		writeError(w, http.StatusRequestEntityTooLarge, typeTooLarge,
			fmt.Sprintf("request body exceeds %d bytes, the largest accepted with an Idempotency-Key", h.MaxRequestSize), 0)
		return nil
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))

	if h.pooled != nil {
		// The store stays open across a reload until this request is done.
		defer h.pooled.enter()()
	}
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	g := &guarded{
		h: h, w: w, r: r, next: next, key: key,
		binding: stores.Binding{
			Operation:   op,
			Path:        path,
			Principal:   sha256Hex([]byte(repl.ReplaceAll(h.Principal, ""))),
			Fingerprint: requestFingerprint(r.Method, path, r.URL.RawQuery, body),
		},
	}
	return g.run()
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// requestFingerprint hashes what makes two requests "the same request".
// Lengths prefix every part so no two different requests share an input.
func requestFingerprint(method, path, query string, body []byte) string {
	hash := sha256.New()
	for _, part := range [][]byte{[]byte(method), []byte(path), []byte(query), body} {
		_, _ = fmt.Fprintf(hash, "%d:", len(part))
		hash.Write(part)
	}
	return hex.EncodeToString(hash.Sum(nil))
}

// guarded is one keyed mutation on its way through the handler.
type guarded struct {
	h       *Handler
	w       http.ResponseWriter
	r       *http.Request
	next    caddyhttp.Handler
	key     string
	binding stores.Binding
	owner   string
}

// maxAttempts bounds how often a request goes round reserve → wait when the
// owner keeps releasing; each round waits, so the bound is rarely reached.
const maxAttempts = 5

func (g *guarded) run() error {
	h := g.h
	g.owner = uuid.NewString()
	waitCtx, cancel := context.WithTimeout(g.r.Context(), time.Duration(h.InFlightWait))
	defer cancel()

	for attempt := 0; attempt < maxAttempts; attempt++ {
		res, err := h.store.Reserve(g.r.Context(), stores.Reservation{
			Key:     g.key,
			Binding: g.binding,
			Owner:   g.owner,
			Lease:   time.Duration(h.Lease),
			TTL:     time.Duration(h.Lifetime + *h.Grace),
		})
		if err != nil {
			// The reservation may have committed with its reply lost.
			g.undoLostReply(releaseReservation)
			return g.storeFailed("reserve", err)
		}
		if res.Reserved {
			return g.execute()
		}
		rec := res.Existing
		if msg := mismatch(rec.Binding, g.binding); msg != "" {
			g.log(zapcore.DebugLevel, "key reused for another request", zap.String("outcome", "mismatch"))
			g.count(outcomeMismatch)
			writeError(g.w, http.StatusUnprocessableEntity, typeUnprocessable, msg, 0)
			return nil
		}
		if rec.State == stores.StateInFlight && !rec.Abandoned {
			g.log(zapcore.DebugLevel, "key in flight: waiting for its owner", zap.String("outcome", "wait"))
			rec, err = h.store.Await(waitCtx, g.key)
			switch {
			case g.r.Context().Err() != nil:
				return nil // the client left while waiting; nothing to answer
			case errors.Is(err, context.DeadlineExceeded):
				return g.stillInFlight()
			case err != nil:
				return g.storeFailed("await", err)
			case rec == nil:
				continue // the owner released the key: try to reserve it
			}
			// The owner may have released and another request taken the
			// key since Reserve: bind against what is there now.
			if msg := mismatch(rec.Binding, g.binding); msg != "" {
				g.count(outcomeMismatch)
				writeError(g.w, http.StatusUnprocessableEntity, typeUnprocessable, msg, 0)
				return nil
			}
		}
		switch {
		case rec.State == stores.StateFinal:
			return g.replay(rec)
		case h.Abandoned == abandonedReexecute:
			ok, err := h.store.TakeOver(g.r.Context(), g.key, rec.Owner, g.owner, time.Duration(h.Lease))
			if err != nil {
				g.undoLostReply(abandonTakeOver)
				return g.storeFailed("take over", err)
			}
			if ok {
				g.log(zapcore.WarnLevel, "abandoned key taken over: executing again", zap.String("outcome", "takeover"))
				return g.execute()
			}
			// Somebody else took it over first; see what they made of it.
		default:
			g.log(zapcore.WarnLevel, "abandoned key: outcome unknown", zap.String("outcome", "abandoned"))
			g.count(outcomeAbandoned)
			writeError(g.w, http.StatusInternalServerError, typeCommitStateUnknown,
				"The original request with this Idempotency-Key was interrupted before it finished; its outcome is unknown. Check the catalog's state before retrying with a new key.", 0)
			return nil
		}
	}
	return g.stillInFlight()
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

func (g *guarded) retryAfterSeconds() int {
	return int(math.Ceil(time.Duration(g.h.RetryAfter).Seconds()))
}

func (g *guarded) stillInFlight() error {
	g.log(zapcore.DebugLevel, "key still in flight after waiting", zap.String("outcome", "in_flight"))
	g.count(outcomeInFlight)
	msg := "A request with this Idempotency-Key is still being processed; retry with the same key"
	if g.h.InFlightStatus == http.StatusConflict {
		writeError(g.w, http.StatusConflict, typeConflict, msg, 0)
		return nil
	}
	writeError(g.w, http.StatusServiceUnavailable, typeUnavailable, msg, g.retryAfterSeconds())
	return nil
}

// storeFailed fails closed (503 + Retry-After) unless fail_open is set.
func (g *guarded) storeFailed(step string, err error) error {
	if g.r.Context().Err() != nil {
		// The client left and took the store call with it: not a failure
		// of the store, and nobody is there to answer.
		g.log(zapcore.DebugLevel, "client left during a store call", zap.String("step", step))
		return nil
	}
	if g.h.FailOpen {
		g.log(zapcore.ErrorLevel, "store failed: passing through unguarded (fail_open)", zap.String("step", step), zap.Error(err))
		g.count(outcomeFailOpen)
		return g.next.ServeHTTP(g.w, g.r)
	}
	g.log(zapcore.ErrorLevel, "store failed: rejecting request", zap.String("step", step), zap.Error(err))
	g.count(outcomeStoreUnavailable)
	writeError(g.w, http.StatusServiceUnavailable, typeUnavailable,
		"Idempotency store is unavailable; retry with the same Idempotency-Key", g.retryAfterSeconds())
	return nil
}

// replay answers with a stored final response.
func (g *guarded) replay(rec *stores.Record) error {
	g.log(zapcore.DebugLevel, "replaying stored response", zap.String("outcome", "replay"), zap.Int("status", rec.Response.Status))
	g.count(outcomeReplayed)
	hdr := g.w.Header()
	for name, vals := range rec.Response.Header {
		hdr[name] = append([]string(nil), vals...)
	}
	hdr.Set(ReplayedHeader, "true")
	hdr.Set("Content-Length", strconv.Itoa(len(rec.Response.Body)))
	g.w.WriteHeader(rec.Response.Status)
	_, _ = g.w.Write(rec.Response.Body)
	return nil
}

func (g *guarded) log(level zapcore.Level, msg string, fields ...zap.Field) {
	if c := g.h.logger.Check(level, msg); c != nil {
		c.Write(append(fields, zap.String("key", g.key), zap.String("operation", g.binding.Operation))...)
	}
}

func (g *guarded) count(outcome string) {
	decisions.WithLabelValues(g.binding.Operation, outcome).Inc()
}

func (h *Handler) debug(msg string, fields ...zap.Field) {
	if c := h.logger.Check(zapcore.DebugLevel, msg); c != nil {
		c.Write(fields...)
	}
}
