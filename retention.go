package icebergidempotency

import (
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// retentionFloors keeps, per place where records are kept (a store's
// backend and table or key prefix), the longest lifetime + grace that a
// config of this process advertised for it, for as long as a client may
// still count on it: while that config runs, and for that long after it
// was unloaded. A record's TTL is at least that floor.
//
// Without it, a reload that lowered lifetime gave the next records the new,
// shorter life at once, while clients that had read the old lifetime from
// /v1/config went on retrying within it: a retry past the new life executed
// the commit again. Keyed by place, not by pool: a reload that also changes
// the pool's options (max_conns) opens a new pool on the same table.
var retentionFloors = struct {
	sync.Mutex
	m map[string]*retentionFloor
}{m: map[string]*retentionFloor{}}

// retentionEpoch is what the floors' times count from, on the monotonic
// clock: a wall clock stepped forward must not end a hold early.
var retentionEpoch = time.Now()

// retentionFloor is one place's floor.
type retentionFloor struct {
	holds []*retentionHold // under retentionFloors' lock

	// floor is the longest hold in force, in nanoseconds, and
	// validUntil (since retentionEpoch) when a released hold that counts
	// ends and floor must be worked out again; reads take no lock.
	floor      atomic.Int64
	validUntil atomic.Int64
}

// retentionHold is one config's lifetime + grace on a place.
type retentionHold struct {
	d     time.Duration
	until time.Duration // since retentionEpoch; 0 while the config runs
}

// placeOf is where a store key's records are kept: the key without its
// options' hash (storeKey's backend/table/hash, or "memory").
func placeOf(storeKey string) string {
	if i := strings.LastIndexByte(storeKey, '/'); i > 0 {
		return storeKey[:i]
	}
	return storeKey
}

// holdRetention raises the place's floor to d while the config runs; the
// returned release keeps it there for d more, as the config's clients may
// retry for that long after it stopped advertising d.
func holdRetention(place string, d time.Duration) (*retentionFloor, func()) {
	retentionFloors.Lock()
	defer retentionFloors.Unlock()
	f := retentionFloors.m[place]
	if f == nil {
		f = &retentionFloor{}
		retentionFloors.m[place] = f
	}
	h := &retentionHold{d: d}
	f.holds = append(f.holds, h)
	f.recompute(time.Since(retentionEpoch))
	var once sync.Once
	return f, func() {
		once.Do(func() {
			retentionFloors.Lock()
			defer retentionFloors.Unlock()
			now := time.Since(retentionEpoch)
			h.until = now + d
			f.recompute(now)
		})
	}
}

// recompute drops the holds that ended and sets floor and validUntil;
// under retentionFloors' lock.
func (f *retentionFloor) recompute(now time.Duration) {
	var floor time.Duration
	next := time.Duration(math.MaxInt64)
	kept := f.holds[:0]
	for _, h := range f.holds {
		if h.until != 0 && h.until <= now {
			continue
		}
		kept = append(kept, h)
		floor = max(floor, h.d)
		if h.until != 0 {
			next = min(next, h.until)
		}
	}
	clear(f.holds[len(kept):])
	f.holds = kept
	f.floor.Store(int64(floor))
	f.validUntil.Store(int64(next))
}

// get returns the floor now.
func (f *retentionFloor) get() time.Duration {
	now := time.Since(retentionEpoch)
	if int64(now) < f.validUntil.Load() {
		return time.Duration(f.floor.Load())
	}
	retentionFloors.Lock()
	defer retentionFloors.Unlock()
	f.recompute(now)
	return time.Duration(f.floor.Load())
}
