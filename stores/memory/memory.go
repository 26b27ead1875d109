// Package memory is the embedded, single-node idempotency store: final
// records in an LRU bounded by a number of records and by bytes, in-flight
// records beside it, each record with its own expiry.
//
// It is correct for one Caddy process only; several nodes behind a load
// balancer need a shared SQL store.
package memory

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Defaults for the zero values of Options.
const (
	// DefaultMaxBytes bounds the final records' counted bytes (bodies,
	// headers, keys, bindings and a per-record overhead). It is the real
	// bound: with responses up to max_response_size (16 MiB by default) a
	// record count alone says nothing about memory.
	DefaultMaxBytes int64 = 256 << 20

	// DefaultMaxEntries is where the two bounds meet for the smallest
	// records: a bodiless answer (a 204 drop) counts about 1 KiB with its
	// key and binding (and takes about that much heap, see
	// TestCountedBytesTrackHeap), so 250,000 of them fill about
	// DefaultMaxBytes. Any answer with a body hits max_bytes first. A
	// larger default would never bind; a smaller one would evict while
	// memory sits unused, as 10,000, the former default, did: it held
	// about 4 s of keys at 2,600 keyed requests/s, where this holds ~95 s.
	DefaultMaxEntries = 250_000
)

// EvictReason says which bound pushed a final record out.
type EvictReason string

// Eviction reasons.
const (
	ReasonEntries EvictReason = "entries" // max_entries
	ReasonBytes   EvictReason = "bytes"   // max_bytes
)

// Limits bounds the final records a Store holds.
type Limits struct {
	// MaxEntries bounds the number of final records, and on its own the
	// number of records whose outcome is unknown (see ErrTooManyUnknown).
	// Default DefaultMaxEntries.
	MaxEntries int
	// MaxBytes bounds the final records' counted bytes (see recordSize).
	// A single response that does not fit is refused with
	// stores.ErrResponseTooLarge. Default DefaultMaxBytes.
	MaxBytes int64
	// KeepUnexpired refuses what would evict a final record that has not
	// expired, instead of evicting it (whose key would execute again on
	// retry): a Reserve while the bounds are reached fails with ErrFull,
	// and a Finalize that does not fit with stores.ErrResponseTooLarge.
	// Expired records still make room. Shrinking the bounds (Resize)
	// evicts all the same.
	KeepUnexpired bool
}

// ErrTooManyUnknown is Reserve's error when the records whose outcome is
// unknown (abandoned: kept until they expire, since a retry must not
// execute what may have executed) number MaxEntries or more. None of them
// may be evicted, and without a bound a catalog that left every commit's
// outcome unknown (500 to updateTable) grew the store by about 530 bytes
// a key for the records' whole lifetime, outside max_bytes. The
// reservation was not made. Records of requests still executing do not
// count: the requests running bound them.
var ErrTooManyUnknown = errors.New("memory store holds max_entries records whose outcome is unknown, kept until they expire")

// unknownScanGap is how long a count of the records whose outcome is
// unknown stands: the count walks every record that is not final, under
// the store's lock, and is taken only while those (executing ones
// included) number max_entries. Resize drops the count.
const unknownScanGap = time.Second

// ErrFull is Reserve's error when the store keeps unexpired records
// (Limits.KeepUnexpired) and its bounds are reached: the reservation was
// not made.
var ErrFull = errors.New("memory store is full of records that have not expired (when_full refuse)")

// WithDefaults returns l with unset bounds defaulted, or an error for a
// negative one. It is the one place where the bounds are defaulted and
// checked; the Caddy module calls it too.
func (l Limits) WithDefaults() (Limits, error) {
	if l.MaxEntries == 0 {
		l.MaxEntries = DefaultMaxEntries
	}
	if l.MaxBytes == 0 {
		l.MaxBytes = DefaultMaxBytes
	}
	if l.MaxEntries < 0 || l.MaxBytes < 0 {
		return l, fmt.Errorf("memory store bounds must be positive, got max_entries %d, max_bytes %d", l.MaxEntries, l.MaxBytes)
	}
	return l, nil
}

// Eviction describes a final record pushed out by a bound before it
// expired: its key would execute again on retry, so the bound is too small
// for the traffic.
type Eviction struct {
	Reason EvictReason
	Limits Limits // the bounds in force
}

// Options configures a Store.
type Options struct {
	// MaxEntries, MaxBytes and KeepUnexpired are the initial bounds; see
	// Limits.
	MaxEntries    int
	MaxBytes      int64
	KeepUnexpired bool
	// OnEvict, if set, is called for every final record evicted before its
	// expiry, with the store locked: it must be cheap and must not call
	// back into the store.
	OnEvict func(Eviction)
	// Now is the clock; time.Now when nil. Tests move it.
	Now func() time.Time
}

// entry is a record in flight; a final record is a finalEntry.
type entry struct {
	rec        stores.Record
	leaseUntil time.Time
}

// Store is an in-memory stores.Store. The zero value is not usable; use New.
//
// In-flight records live in their own map, outside the bounds: evicting one
// would let its duplicate execute again, and those whose outcome is
// unknown (abandoned) must survive until they expire. Those are bounded by
// MaxEntries on their own (at it, Reserve refuses new keys), the others by
// the requests running. Only final records compete for max_entries and
// max_bytes, so a flood of reservations (even ones that end released,
// storing nothing) never evicts anything.
type Store struct {
	mu       sync.Mutex
	inflight map[string]*entry
	final    map[string]*finalEntry
	lru      finalList
	expiry   expiryIndex
	bytes    int64 // counted bytes of the final records
	limits   Limits
	changed  map[string]*change // a key's waiters, woken when its record changes state
	now      func() time.Time
	onEvict  func(Eviction)
	// countedAt is when the records whose outcome is unknown were last
	// counted, and unknownFull whether they reached MaxEntries then (see
	// tooManyUnknown).
	countedAt   time.Time
	unknownFull bool
}

var _ stores.Store = (*Store)(nil)

// New returns an empty Store.
func New(opts Options) (*Store, error) {
	limits, err := Limits{MaxEntries: opts.MaxEntries, MaxBytes: opts.MaxBytes, KeepUnexpired: opts.KeepUnexpired}.WithDefaults()
	if err != nil {
		return nil, err
	}
	s := &Store{
		inflight: make(map[string]*entry),
		final:    make(map[string]*finalEntry),
		expiry:   newExpiryIndex(),
		limits:   limits,
		changed:  make(map[string]*change),
		now:      opts.Now,
		onEvict:  opts.OnEvict,
	}
	if s.now == nil {
		s.now = time.Now
	}
	return s, nil
}

// change wakes the waiters of one key.
type change struct {
	ch chan struct{} // closed when the key's record changes state
	// final is the record Finalize made, for waiters that run only after
	// it was evicted (a full store, other keys finalized meanwhile): they
	// replay it rather than find the key free and execute it again.
	final *stores.Record
}

// notify wakes every Await on key. Caller holds s.mu.
func (s *Store) notify(key string) {
	if c, ok := s.changed[key]; ok {
		close(c.ch)
		delete(s.changed, key)
	}
}

// notifyFinal wakes every Await on key with the final record f. Caller
// holds s.mu.
func (s *Store) notifyFinal(key string, f *finalEntry) {
	if c, ok := s.changed[key]; ok {
		c.final = f.snapshot()
	}
	s.notify(key)
}

// live returns key's unexpired record, in flight (e) or final (f), dropping
// an expired one. A final record read becomes the most recently used.
// Caller holds s.mu.
func (s *Store) live(key string, now time.Time) (e *entry, f *finalEntry) {
	if e, ok := s.inflight[key]; ok {
		if !e.rec.ExpiresAt.After(now) {
			delete(s.inflight, key)
			s.notify(key)
			return nil, nil
		}
		return e, nil
	}
	if f, ok := s.final[key]; ok {
		if f.expiredAt(now) {
			s.dropFinal(f)
			return nil, nil
		}
		s.lru.moveToFront(f)
		return nil, f
	}
	return nil, nil
}

// snapshot copies a record for a caller: e's or f's, nil when both are.
// Response bodies are shared: stored responses are never mutated.
func snapshot(e *entry, f *finalEntry, now time.Time) *stores.Record {
	if f != nil {
		return f.snapshot()
	}
	if e == nil {
		return nil
	}
	r := e.rec
	r.Abandoned = !e.leaseUntil.After(now)
	return &r
}

// Reserve implements stores.Store. It never evicts: the new record is in
// flight, outside the bounds, until Finalize.
func (s *Store) Reserve(_ context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if e, f := s.live(r.Key, now); e != nil || f != nil {
		return stores.ReserveResult{Existing: snapshot(e, f, now)}, nil
	}
	if len(s.inflight) >= s.limits.MaxEntries && s.tooManyUnknown(now) {
		// Whatever when_full says: evicting one would let its retry
		// execute again. Nothing was reserved.
		return stores.ReserveResult{}, stores.MarkNotSent(ErrTooManyUnknown)
	}
	e := &entry{
		rec: stores.Record{
			Key:       r.Key,
			Binding:   r.Binding,
			State:     stores.StateInFlight,
			Owner:     r.Owner,
			CreatedAt: now,
			ExpiresAt: now.Add(r.RecordTTL()),
		},
		leaseUntil: now.Add(r.Lease),
	}
	if s.limits.KeepUnexpired && !s.makeRoom(s.roomFor(&e.rec), now) {
		// Nothing was reserved: the request may be retried, or passed
		// on by fail_open.
		return stores.ReserveResult{}, stores.MarkNotSent(ErrFull)
	}
	s.inflight[r.Key] = e
	return stores.ReserveResult{Reserved: true}, nil
}

// roomFor is the room a reservation asks for under KeepUnexpired (when_full
// refuse): its record with an answer as large as the final records' on
// average, and never less than the record without one. Asking for a byte,
// as until the build after b35c62e, admitted keys into a store full by
// max_bytes: each executed, and its answer found no room at Finalize (the
// key's outcome unknown, its retry answered 500) where the request should
// have been refused before it executed. The average is not capped: a cap
// (an eighth of max_bytes, tried) admitted keys whose answers, as large as
// the stored ones, could not fit, and refusing a key that would have fit
// costs a retry, where admitting one that does not costs an unknown
// outcome. A few records much larger than the rest thus ask much of each
// new key in a store not many times larger than them. Requests executing
// at once can still find the room taken by the time they finalize. s.mu is
// held.
func (s *Store) roomFor(rec *stores.Record) int64 {
	need := recordSize(rec)
	if n := int64(len(s.final)); n > 0 {
		need = max(need, s.bytes/n)
	}
	return need
}

// tooManyUnknown reports whether the records whose outcome is unknown
// number MaxEntries or more, counting them at most once an unknownScanGap;
// the count drops the records that are not final and have expired, as the
// purge would at its next run. s.mu is held.
func (s *Store) tooManyUnknown(now time.Time) bool {
	if since := now.Sub(s.countedAt); !s.countedAt.IsZero() && since >= 0 && since < unknownScanGap {
		return s.unknownFull
	}
	unknown := 0
	for key, e := range s.inflight {
		switch {
		case !e.rec.ExpiresAt.After(now):
			delete(s.inflight, key)
			s.notify(key)
		case !e.leaseUntil.After(now):
			unknown++
		}
	}
	s.countedAt, s.unknownFull = now, unknown >= s.limits.MaxEntries
	return s.unknownFull
}

// Load implements stores.Store.
func (s *Store) Load(_ context.Context, key string) (*stores.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	e, f := s.live(key, now)
	return snapshot(e, f, now), nil
}

// Await implements stores.Store. It needs no polling: Finalize, Release,
// Abandon, TakeOver and eviction wake it, and a timer covers the lease
// lapsing.
func (s *Store) Await(ctx context.Context, key string) (*stores.Record, error) {
	for {
		s.mu.Lock()
		now := s.now()
		e, f := s.live(key, now)
		if e == nil || !e.leaseUntil.After(now) { // gone, final or abandoned
			rec := snapshot(e, f, now)
			s.mu.Unlock()
			return rec, nil
		}
		c, ok := s.changed[key]
		if !ok {
			c = &change{ch: make(chan struct{})}
			s.changed[key] = c
		}
		lapse := e.leaseUntil.Sub(now)
		s.mu.Unlock()

		timer := time.NewTimer(lapse)
		select {
		case <-c.ch:
			if c.final != nil {
				// Finalized while this waited: that answer is the one,
				// whatever the key holds by the time this runs. Evicted
				// meanwhile (a full store), the key may be free, or
				// reserved again by a retry that may yet be released:
				// looked up again, it read as free, and this waiter's
				// request executed a second time.
				timer.Stop()
				return c.final, nil
			}
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		}
		timer.Stop()
	}
}

// owned returns key's record if it is in flight under owner. Caller holds s.mu.
func (s *Store) owned(key, owner string, now time.Time) *entry {
	e, _ := s.live(key, now)
	if e == nil || e.rec.Owner != owner {
		return nil
	}
	return e
}

// Finalize implements stores.Store. The response is copied first, outside
// the lock, so that the store never holds the caller's buffers. The record
// then joins the final records, evicting the least recently used ones to fit
// the bounds; a response that alone exceeds max_bytes is refused with
// stores.ErrResponseTooLarge and the record stays in flight.
func (s *Store) Finalize(_ context.Context, key, owner string, resp stores.Response) error {
	if err := resp.Check(); err != nil {
		return fmt.Errorf("memory finalize %s: %w", key, err)
	}
	stored := exactFit(resp)
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	e := s.owned(key, owner, now)
	if e == nil {
		return stores.ErrNotOwner
	}
	size := recordSize(&stores.Record{Key: key, Binding: e.rec.Binding, Response: &stored})
	if size > s.limits.MaxBytes {
		return fmt.Errorf("%w: %d bytes counted, max_bytes is %d", stores.ErrResponseTooLarge, size, s.limits.MaxBytes)
	}
	if s.limits.KeepUnexpired && !s.makeRoom(size, now) {
		return fmt.Errorf("%w: %d bytes counted, and only records that have not expired hold the rest (when_full refuse)",
			stores.ErrResponseTooLarge, size)
	}
	delete(s.inflight, key)
	f := packFinal(&e.rec, stored, size)
	s.addFinal(f, now)
	s.notifyFinal(key, f)
	return nil
}

// Release implements stores.Store.
func (s *Store) Release(_ context.Context, key, owner string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.owned(key, owner, s.now()) == nil {
		return stores.ErrNotOwner
	}
	delete(s.inflight, key)
	s.notify(key)
	return nil
}

// ExtendLease implements stores.Store.
func (s *Store) ExtendLease(_ context.Context, key, owner string, lease, ttl time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	e := s.owned(key, owner, now)
	if e == nil {
		return stores.ErrNotOwner
	}
	e.leaseUntil = now.Add(lease)
	outlive(e, ttl)
	return nil
}

// outlive keeps an in-flight record for ttl past its lease's end (see
// stores.Reservation.RecordTTL).
func outlive(e *entry, ttl time.Duration) {
	if end := e.leaseUntil.Add(ttl); e.rec.ExpiresAt.Before(end) {
		e.rec.ExpiresAt = end
	}
}

// Abandon implements stores.Store. The abandoned record stays in flight,
// outside the bounds, until it expires or is taken over: its outcome is
// unknown, and forgetting it would let a retry execute again.
func (s *Store) Abandon(_ context.Context, key, owner string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	e := s.owned(key, owner, now)
	if e == nil {
		return stores.ErrNotOwner
	}
	e.leaseUntil = now
	s.notify(key)
	return nil
}

// TakeOver implements stores.Store.
func (s *Store) TakeOver(_ context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	e := s.owned(key, oldOwner, now)
	if e == nil || e.leaseUntil.After(now) {
		return false, nil
	}
	e.rec.Owner = newOwner
	e.leaseUntil = now.Add(lease)
	outlive(e, ttl)
	s.notify(key)
	return true, nil
}

// PurgeExpired implements stores.Store. Expired final records are found
// through the expiry index.
func (s *Store) PurgeExpired(_ context.Context, limit int) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	n := 0
	for key, e := range s.inflight {
		if n >= limit {
			return n, nil
		}
		if !e.rec.ExpiresAt.After(now) {
			delete(s.inflight, key)
			s.notify(key)
			n++
		}
	}
	for n < limit {
		f := s.expiry.expired(now)
		if f == nil {
			break
		}
		s.dropFinal(f)
		n++
	}
	if n < limit {
		for _, f := range s.expiry.inSecond(now) {
			if n >= limit {
				break
			}
			s.dropFinal(f)
			n++
		}
	}
	return n, nil
}

// Len reports how many records are held, in flight and final, expired ones
// included.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.inflight) + len(s.final)
}

// Close implements stores.Store. Memory needs no cleanup.
func (s *Store) Close() error { return nil }
