package icebergidempotency

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// execute runs the request as the key's owner, then finalizes or releases.
func (g *guarded) execute() error {
	h := g.h
	g.log(zapcore.DebugLevel, "key reserved: executing", zap.String("outcome", "execute"))
	g.count(outcomeExecuted)

	// Detached from the client: a commit must not be cut off half-way
	// because the client gave up. The replacer and vars travel along.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(g.r.Context()), time.Duration(h.ExecutionTimeout))
	defer cancel()
	stopHeartbeat := g.heartbeat(ctx)

	cw := newCaptureWriter(g.w, h.MaxResponseSize)
	err := g.next.ServeHTTP(cw, g.r.WithContext(ctx))
	stopHeartbeat()

	storeCtx, storeCancel := context.WithTimeout(context.WithoutCancel(g.r.Context()), storeOpTimeout)
	defer storeCancel()

	if err != nil {
		// Nothing was written (reverse_proxy could not reach the upstream):
		// no final response exists, so a retry must be able to execute.
		g.release(storeCtx, "handler error")
		return err
	}
	status := cw.finalStatus()
	switch {
	case cw.overflowed:
		g.log(zapcore.WarnLevel, "response larger than max_response_size: delivered, not stored, key released",
			zap.Int("status", status), zap.Int64("max_response_size", h.MaxResponseSize))
		g.release(storeCtx, "oversize")
		return nil
	case !h.shouldFinalize(status):
		g.release(storeCtx, "status "+strconv.Itoa(status))
	default:
		resp := stores.Response{Status: status, Header: g.replayHeaders(), Body: cw.buf.Bytes()}
		if err := h.store.Finalize(storeCtx, g.key, g.owner, resp); err != nil {
			// Never release here: the upstream did execute. The record stays
			// in flight until its lease lapses and a retry hears "unknown".
			g.log(zapcore.ErrorLevel, "finalize failed: response delivered but not stored", zap.Int("status", status), zap.Error(err))
		} else {
			executions.WithLabelValues(g.binding.Operation, "finalized").Inc()
			g.log(zapcore.DebugLevel, "response finalized", zap.String("outcome", "finalize"), zap.Int("status", status))
		}
	}
	cw.deliver()
	return nil
}

func (g *guarded) release(ctx context.Context, why string) {
	executions.WithLabelValues(g.binding.Operation, "released").Inc()
	if err := g.h.store.Release(ctx, g.key, g.owner); err != nil {
		g.log(zapcore.ErrorLevel, "release failed", zap.String("reason", why), zap.Error(err))
		return
	}
	g.log(zapcore.DebugLevel, "key released", zap.String("outcome", "release"), zap.String("reason", why))
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

// heartbeat renews the lease every third of it until stopped, so that other
// nodes can tell a long upstream call from a dead owner.
func (g *guarded) heartbeat(ctx context.Context) (stop func()) {
	lease := time.Duration(g.h.Lease)
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		ticker := time.NewTicker(lease / 3)
		defer ticker.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-ticker.C:
				err := g.h.store.ExtendLease(ctx, g.key, g.owner, lease)
				if errors.Is(err, stores.ErrNotOwner) {
					g.log(zapcore.WarnLevel, "lost ownership of key while executing", zap.Error(err))
					return
				}
				if err != nil {
					g.log(zapcore.ErrorLevel, "lease renewal failed", zap.Error(err))
				}
			}
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}
