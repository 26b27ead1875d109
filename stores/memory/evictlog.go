package memory

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// EvictionLogInterval is the least time between two eviction warnings.
const EvictionLogInterval = 10 * time.Second

// EvictionLog turns evictions into warnings, at most one per interval, each
// with the count since the previous one. A warning per eviction would flood
// the log exactly when the store is under pressure (a 20 s overload once
// wrote 42,547 lines); the first eviction is reported at once, the rest of a
// burst when the interval has passed.
type EvictionLog struct {
	every time.Duration
	now   func() time.Time
	after func(time.Duration, func()) (stop func() bool)

	mu      sync.Mutex
	logger  *zap.Logger
	last    time.Time // when the last warning was written
	pending map[EvictReason]int
	limits  Limits      // bounds at the latest eviction
	stop    func() bool // cancels the scheduled warning; nil when none
	closed  bool
}

// NewEvictionLog returns an EvictionLog writing to logger. now and after
// default to the real clock (time.Now, time.AfterFunc); tests pass fakes.
func NewEvictionLog(logger *zap.Logger, now func() time.Time, after func(time.Duration, func()) (stop func() bool)) *EvictionLog {
	if now == nil {
		now = time.Now
	}
	if after == nil {
		after = func(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }
	}
	return &EvictionLog{every: EvictionLogInterval, now: now, after: after, logger: logger, pending: map[EvictReason]int{}}
}

// Record counts one eviction; it fits Options.OnEvict (cheap, never calls
// the store).
func (l *EvictionLog) Record(e Eviction) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.pending[e.Reason]++
	l.limits = e.Limits
	now := l.now()
	if l.last.IsZero() || now.Sub(l.last) >= l.every {
		l.writeLocked(now)
		return
	}
	if l.stop == nil && !l.closed {
		l.stop = l.after(l.last.Add(l.every).Sub(now), l.Flush)
	}
}

// Flush writes the pending count, if any, now.
func (l *EvictionLog) Flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stop != nil {
		l.stop()
		l.stop = nil
	}
	if len(l.pending) > 0 {
		l.writeLocked(l.now())
	}
}

// Close flushes and schedules nothing more.
func (l *EvictionLog) Close() {
	l.mu.Lock()
	l.closed = true
	l.mu.Unlock()
	l.Flush()
}

// SetLogger directs later warnings to logger (a reload's new one).
func (l *EvictionLog) SetLogger(logger *zap.Logger) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.logger = logger
}

func (l *EvictionLog) writeLocked(now time.Time) {
	byEntries, byBytes := l.pending[ReasonEntries], l.pending[ReasonBytes]
	clear(l.pending)
	l.last = now
	l.logger.Warn("idempotency records evicted before expiry: their keys would execute again on retry; raise max_bytes or max_entries",
		zap.Int("evicted", byEntries+byBytes),
		zap.Int("by_max_entries", byEntries), zap.Int("by_max_bytes", byBytes),
		zap.Int("max_entries", l.limits.MaxEntries), zap.Int64("max_bytes", l.limits.MaxBytes))
}
