package icebergidempotency

import "sync/atomic"

// bodyBudget bounds the bytes of keyed request bodies the handlers of a
// config hold in memory at once. Each body must be held whole, to hash it
// and to send it on; without a bound, N concurrent keyed requests hold N ×
// max_request_size (60 with 16 MiB bodies held 1.3 GiB), where plain
// reverse_proxy streams them. Buffers are counted as they grow, so a
// client that announces much and sends little takes only what it sent.
type bodyBudget struct {
	max  int64
	held atomic.Int64
}

// take reserves n bytes, or reports that they would exceed the budget.
func (b *bodyBudget) take(n int64) bool {
	for {
		cur := b.held.Load()
		if cur+n > b.max {
			return false
		}
		if b.held.CompareAndSwap(cur, cur+n) {
			return true
		}
	}
}

// bodyHold is one request's share of a bodyBudget; a nil budget is no
// bound.
type bodyHold struct {
	budget *bodyBudget
	n      int64
}

func (h *bodyHold) take(n int64) bool {
	if h.budget == nil {
		return true
	}
	if !h.budget.take(n) {
		return false
	}
	h.n += n
	return true
}

// give returns n bytes of the request's share: a buffer it let go.
func (h *bodyHold) give(n int64) {
	if h.budget != nil {
		h.budget.held.Add(-n)
		h.n -= n
	}
}

// release gives the request's share back, once the body is no longer held.
func (h *bodyHold) release() {
	h.give(h.n)
}
