package memory

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// fixture is a store on a fake clock that records its evictions.
type fixture struct {
	t       *testing.T
	s       *Store
	clock   *storetest.FakeClock
	evicted map[EvictReason]int
}

func newFixture(t *testing.T, maxEntries int, maxBytes int64) *fixture {
	t.Helper()
	f := &fixture{t: t, clock: storetest.NewFakeClock(), evicted: map[EvictReason]int{}}
	s, err := New(Options{MaxEntries: maxEntries, MaxBytes: maxBytes, Now: f.clock.Now,
		OnEvict: func(e Eviction) { f.evicted[e.Reason]++ }})
	if err != nil {
		t.Fatal(err)
	}
	f.s = s
	return f
}

// reserve reserves a fresh key and returns it with its owner token.
func (f *fixture) reserve() (key, owner string) {
	f.t.Helper()
	r := storetest.Reservation(storetest.NewKey(f.t), time.Minute, time.Hour)
	res, err := f.s.Reserve(f.t.Context(), r)
	if err != nil || !res.Reserved {
		f.t.Fatalf("Reserve = %+v, %v", res, err)
	}
	return r.Key, r.Owner
}

// final stores a final record with a body of n bytes under a fresh key.
func (f *fixture) final(n int) string {
	f.t.Helper()
	key, owner := f.reserve()
	if err := f.s.Finalize(f.t.Context(), key, owner, stores.Response{Status: 200, Body: make([]byte, n)}); err != nil {
		f.t.Fatal(err)
	}
	return key
}

func (f *fixture) load(key string) *stores.Record {
	f.t.Helper()
	rec, err := f.s.Load(f.t.Context(), key)
	if err != nil {
		f.t.Fatal(err)
	}
	return rec
}

// retained sums the capacity of the bodies of keys' records still held: the
// memory they pin, whatever the store counts.
func (f *fixture) retained(keys []string) (held int, bodyBytes int) {
	for _, k := range keys {
		if rec := f.load(k); rec != nil && rec.Response != nil {
			held++
			bodyBytes += cap(rec.Response.Body)
		}
	}
	return held, bodyBytes
}

// A flood of large final responses stays within max_bytes, both as counted
// by the store and as body memory actually pinned; the newest survive.
func TestMaxBytesBoundsFloodOfLargeFinals(t *testing.T) {
	const maxBytes = 8 << 20
	f := newFixture(t, 1000, maxBytes)
	var keys []string
	for range 100 {
		keys = append(keys, f.final(1<<20))
		if st := f.s.Stats(); st.Bytes > maxBytes {
			t.Fatalf("counted bytes %d exceed max_bytes %d with %d records", st.Bytes, maxBytes, st.Final)
		}
	}
	held, body := f.retained(keys)
	if body > maxBytes || held == 0 {
		t.Fatalf("%d records pin %d body bytes; max_bytes %d", held, body, maxBytes)
	}
	if f.load(keys[len(keys)-1]) == nil {
		t.Fatal("the newest record was evicted")
	}
	if f.evicted[ReasonBytes] != 100-held || f.evicted[ReasonEntries] != 0 {
		t.Fatalf("evictions %v, want %d by bytes", f.evicted, 100-held)
	}
	t.Logf("%d of 100 records of 1 MiB held, %d counted bytes", held, f.s.Stats().Bytes)
}

// A 1 KiB answer captured in a buffer that grew to 64 KiB is stored in 1 KiB
// of its own; one in a buffer of exactly its size is kept without a copy
// (Finalize's contract: the caller does not change it afterwards).
func TestFinalizeStoresExactlySizedBody(t *testing.T) {
	f := newFixture(t, 10, 1<<20)
	key, owner := f.reserve()
	grown := make([]byte, 1024, 64<<10)
	copy(grown, "answer")
	if err := f.s.Finalize(t.Context(), key, owner, stores.Response{Status: 200, Header: http.Header{}, Body: grown}); err != nil {
		t.Fatal(err)
	}
	grown[0] = 'X'
	body := f.load(key).Response.Body
	if len(body) != 1024 || cap(body) != len(body) {
		t.Fatalf("stored body len %d cap %d, want len == cap == 1024", len(body), cap(body))
	}
	if !bytes.HasPrefix(body, []byte("answer")) {
		t.Fatalf("stored body changed with the caller's grown buffer: %q", body[:6])
	}

	key, owner = f.reserve()
	exact := make([]byte, 1024)
	if err := f.s.Finalize(t.Context(), key, owner, stores.Response{Status: 200, Header: http.Header{}, Body: exact}); err != nil {
		t.Fatal(err)
	}
	if body := f.load(key).Response.Body; &body[0] != &exact[0] {
		t.Fatal("an exactly sized body was copied, want it kept as it is")
	}
}

// An in-flight record survives any number of other reservations held at the
// same time, then released: its duplicate must keep waiting for it, not
// execute again.
func TestInFlightNeverEvicted(t *testing.T) {
	f := newFixture(t, 10, 1<<20)
	key, owner := f.reserve()
	type held struct{ key, owner string }
	var others []held
	for range 1000 {
		k, o := f.reserve()
		others = append(others, held{k, o})
	}
	for _, h := range others {
		if err := f.s.Release(t.Context(), h.key, h.owner); err != nil {
			t.Fatal(err)
		}
	}
	rec := f.load(key)
	if rec == nil || rec.State != stores.StateInFlight || rec.Owner != owner {
		t.Fatalf("in-flight record = %+v after a flood of reservations", rec)
	}
	if err := f.s.Finalize(t.Context(), key, owner, stores.Response{Status: 200}); err != nil {
		t.Fatalf("owner cannot finalize: %v", err)
	}
}

// Requests that store nothing (reserved, then released, e.g. 401s) never
// push out a final record, however many run at once.
func TestReleasedReservationsNeverEvictFinals(t *testing.T) {
	f := newFixture(t, 10, 1<<20)
	kept := f.final(100)
	var owners, keys []string
	for range 1000 {
		k, o := f.reserve()
		keys, owners = append(keys, k), append(owners, o)
	}
	for i := range keys {
		if err := f.s.Release(t.Context(), keys[i], owners[i]); err != nil {
			t.Fatal(err)
		}
	}
	if rec := f.load(kept); rec == nil || rec.State != stores.StateFinal {
		t.Fatalf("final record = %+v after 1000 released reservations", rec)
	}
	if len(f.evicted) != 0 {
		t.Fatalf("evictions %v, want none", f.evicted)
	}
}

// Final records beyond max_entries push out the least recently used one; a
// read counts as a use. Deliberate removals are not evictions.
func TestMaxEntriesEvictsLeastRecentlyUsedFinal(t *testing.T) {
	f := newFixture(t, 2, 1<<20)
	a, b := f.final(1), f.final(1)
	f.load(a) // b is now the least recently used
	c := f.final(1)
	if f.load(b) != nil || f.load(a) == nil || f.load(c) == nil {
		t.Fatal("want b evicted, a and c kept")
	}
	if f.evicted[ReasonEntries] != 1 {
		t.Fatalf("evictions %v, want 1 by entries", f.evicted)
	}
	key, owner := f.reserve()
	if err := f.s.Release(t.Context(), key, owner); err != nil {
		t.Fatal(err)
	}
	f.clock.Advance(2 * time.Hour)
	if n, err := f.s.PurgeExpired(t.Context(), 100); err != nil || n != 2 {
		t.Fatalf("PurgeExpired = %d, %v; want 2", n, err)
	}
	if f.evicted[ReasonEntries] != 1 || len(f.evicted) != 1 {
		t.Fatalf("removals reported as evictions: %v", f.evicted)
	}
	if st := f.s.Stats(); st.Final != 0 || st.Bytes != 0 {
		t.Fatalf("after purge: %+v, want empty", st)
	}
}

// Expired records pushed out to make room are not reported: nothing was
// lost that a retry could still have used.
func TestExpiredRecordsEvictedQuietly(t *testing.T) {
	f := newFixture(t, 1, 1<<20)
	f.final(1)
	f.clock.Advance(2 * time.Hour)
	f.final(1)
	if len(f.evicted) != 0 {
		t.Fatalf("evictions %v, want none", f.evicted)
	}
}

// A response larger than max_bytes on its own is refused; the record stays
// in flight under its owner (who releases it) and nothing is evicted for it.
func TestFinalizeTooLargeLeavesRecordInFlight(t *testing.T) {
	f := newFixture(t, 10, 64<<10)
	kept := f.final(1000)
	key, owner := f.reserve()
	err := f.s.Finalize(t.Context(), key, owner, stores.Response{Status: 200, Body: make([]byte, 64<<10)})
	if !errors.Is(err, stores.ErrResponseTooLarge) {
		t.Fatalf("Finalize = %v, want ErrResponseTooLarge", err)
	}
	if rec := f.load(key); rec == nil || rec.State != stores.StateInFlight {
		t.Fatalf("record = %+v, want still in flight", rec)
	}
	if f.load(kept) == nil || len(f.evicted) != 0 {
		t.Fatalf("a refused response evicted records: %v", f.evicted)
	}
	if err := f.s.Release(t.Context(), key, owner); err != nil {
		t.Fatalf("owner cannot release: %v", err)
	}
}

// Resize keeps the records; shrinking evicts the least recently used finals
// (in-flight ones never) and reports them.
func TestResizeKeepsRecords(t *testing.T) {
	f := newFixture(t, 100, 1<<20)
	var finals []string
	for range 10 {
		finals = append(finals, f.final(10))
	}
	key, owner := f.reserve()
	if n, err := f.s.Resize(Limits{MaxEntries: 200, MaxBytes: 2 << 20}); err != nil || n != 0 {
		t.Fatalf("growing Resize = %d, %v", n, err)
	}
	if held, _ := f.retained(finals); held != 10 {
		t.Fatalf("%d of 10 records kept after growing", held)
	}
	if n, err := f.s.Resize(Limits{MaxEntries: 4, MaxBytes: 2 << 20}); err != nil || n != 6 {
		t.Fatalf("shrinking Resize = %d, %v; want 6 evicted", n, err)
	}
	if held, _ := f.retained(finals[6:]); held != 4 {
		t.Fatalf("%d of the 4 newest records kept", held)
	}
	if rec := f.load(key); rec == nil || rec.Owner != owner {
		t.Fatal("shrinking evicted an in-flight record")
	}
	if f.evicted[ReasonEntries] != 6 {
		t.Fatalf("evictions %v, want 6 by entries", f.evicted)
	}
	if _, err := f.s.Resize(Limits{MaxEntries: -1}); err == nil {
		t.Fatal("negative bound accepted")
	}
	if got := f.s.Limits(); got.MaxEntries != 4 {
		t.Fatalf("a refused Resize changed the limits: %+v", got)
	}
}

// A bound drops expired final records before it evicts a live one. Handlers
// with different lifetimes share the store, and a read moves a record to
// the front, so the least recently used record need not be the one that
// expired: before, the live one was evicted (and its retry executed again)
// while the dead one kept its place.
func TestBoundDropsExpiredBeforeLive(t *testing.T) {
	clock := storetest.NewFakeClock()
	evicted := 0
	s, err := New(Options{MaxEntries: 2, Now: clock.Now, OnEvict: func(Eviction) { evicted++ }})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	fin := func(ttl time.Duration) string {
		r := storetest.Reservation(storetest.NewKey(t), time.Minute, ttl)
		if _, err := s.Reserve(ctx, r); err != nil {
			t.Fatal(err)
		}
		if err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200}); err != nil {
			t.Fatal(err)
		}
		return r.Key
	}
	long := fin(24 * time.Hour)    // a handler with lifetime 24h
	short := fin(time.Minute)      // another with 1m
	clock.Advance(3 * time.Minute) // short: past its lease, then its TTL
	newest := fin(time.Hour)
	for _, k := range []string{long, newest} {
		if rec, _ := s.Load(ctx, k); rec == nil {
			t.Fatalf("a live record was evicted (%d evictions counted) while an expired one was there", evicted)
		}
	}
	if rec, _ := s.Load(ctx, short); rec != nil || evicted != 0 {
		t.Fatalf("the expired record: %+v, %d evictions counted; want it dropped, uncounted", rec, evicted)
	}
}

// PurgeExpired drops exactly the expired final records, whatever their
// lifetimes and the order they were read in.
func TestPurgeFindsEveryExpiredRecord(t *testing.T) {
	clock := storetest.NewFakeClock()
	s, err := New(Options{Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	expires := map[string]time.Time{}
	for range 2000 {
		ttl := time.Duration(1+rng.IntN(600)) * 100 * time.Millisecond
		r := storetest.Reservation(storetest.NewKey(t), 50*time.Millisecond, ttl) // a lease within the lifetime
		if _, err := s.Reserve(ctx, r); err != nil {
			t.Fatal(err)
		}
		if err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200}); err != nil {
			t.Fatal(err)
		}
		expires[r.Key] = clock.Now().Add(r.Lease + ttl)
		clock.Advance(time.Duration(rng.IntN(20)) * time.Millisecond)
	}
	for step := 0; len(expires) > 0; step++ {
		clock.Advance(time.Duration(rng.IntN(1500)) * time.Millisecond)
		now := clock.Now()
		want := 0
		for _, at := range expires {
			if !at.After(now) {
				want++
			}
		}
		got := 0
		for {
			n, err := s.PurgeExpired(ctx, 1+rng.IntN(50))
			if err != nil {
				t.Fatal(err)
			}
			if n == 0 {
				break
			}
			got += n
		}
		if got != want {
			t.Fatalf("step %d: purged %d records, %d had expired", step, got, want)
		}
		for k, at := range expires {
			if !at.After(now) {
				delete(expires, k)
			} else if rng.IntN(4) == 0 {
				_, _ = s.Load(ctx, k) // reads reorder the recency list
			}
		}
		if s.Len() != len(expires) {
			t.Fatalf("step %d: %d records held, %d live", step, s.Len(), len(expires))
		}
	}
}

// With KeepUnexpired (when_full refuse) a full store evicts no record
// that has not expired: a new reservation is refused (not sent: nothing
// was reserved), a response that does not fit is refused as too large,
// and expired records still make room. Without it, the records a flood of
// others' requests pushed out executed again on retry.
func TestKeepUnexpiredRefusesInsteadOfEvicting(t *testing.T) {
	f := &fixture{t: t, clock: storetest.NewFakeClock(), evicted: map[EvictReason]int{}}
	s, err := New(Options{MaxEntries: 2, MaxBytes: 1 << 20, KeepUnexpired: true, Now: f.clock.Now,
		OnEvict: func(e Eviction) { f.evicted[e.Reason]++ }})
	if err != nil {
		t.Fatal(err)
	}
	f.s = s
	a := f.final(1)
	// Reserved while there was room; its answer finds none.
	key, owner := f.reserve()
	b := f.final(1)
	if err := s.Finalize(t.Context(), key, owner, stores.Response{Status: 200, Body: []byte("{}")}); !errors.Is(err, stores.ErrResponseTooLarge) {
		t.Fatalf("Finalize into a full store = %v, want ErrResponseTooLarge", err)
	}
	r := storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)
	if _, err := s.Reserve(t.Context(), r); !errors.Is(err, ErrFull) || !stores.NotSent(err) {
		t.Fatalf("Reserve into a full store = %v, want ErrFull, not sent", err)
	}
	if f.load(a) == nil || f.load(b) == nil || len(f.evicted) != 0 {
		t.Fatalf("records evicted %v; want both kept", f.evicted)
	}
	f.clock.Advance(2 * time.Hour) // a and b expire
	if res, err := s.Reserve(t.Context(), r); err != nil || !res.Reserved {
		t.Fatalf("Reserve once the records expired = %+v, %v", res, err)
	}
}

// Records whose outcome is unknown are never evicted, so max_entries
// bounds them on their own: at it a new key is refused, not sent, whatever
// when_full says, and room comes back as they expire or are taken over.
// Records of requests executing do not count. Before, a catalog that left
// every commit's outcome unknown grew the store by about 530 bytes a key
// until the records expired, outside max_bytes.
func TestUnknownRecordsBoundedByMaxEntries(t *testing.T) {
	clock := storetest.NewFakeClock()
	s, err := New(Options{MaxEntries: 2, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	reserve := func(ttl time.Duration) stores.Reservation {
		t.Helper()
		r := storetest.Reservation(storetest.NewKey(t), time.Minute, ttl)
		if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
			t.Fatalf("Reserve = %+v, %v", res, err)
		}
		return r
	}
	// More executing than max_entries: all admitted.
	for range 5 {
		reserve(time.Hour)
	}
	soon, late := reserve(time.Hour), reserve(3*time.Hour)
	for _, r := range []stores.Reservation{soon, late} {
		if err := s.Abandon(ctx, r.Key, r.Owner); err != nil {
			t.Fatal(err)
		}
	}
	clock.Advance(unknownScanGap) // the last count, with none unknown, stood a second
	next := storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)
	if _, err := s.Reserve(ctx, next); !errors.Is(err, ErrTooManyUnknown) || !stores.NotSent(err) {
		t.Fatalf("Reserve with max_entries records unknown = %v, want ErrTooManyUnknown, not sent", err)
	}
	// A reload that raises max_entries makes room at once, not when the
	// count taken under the old bound (which stands a second) runs out:
	// until the build after f09fc92 the next second's keys were refused.
	if _, err := s.Resize(Limits{MaxEntries: 3}); err != nil {
		t.Fatal(err)
	}
	raised := storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)
	if res, err := s.Reserve(ctx, raised); err != nil || !res.Reserved {
		t.Fatalf("Reserve after max_entries was raised = %+v, %v", res, err)
	}
	if err := s.Abandon(ctx, raised.Key, raised.Owner); err != nil {
		t.Fatal(err)
	}
	clock.Advance(unknownScanGap)
	if _, err := s.Reserve(ctx, next); !errors.Is(err, ErrTooManyUnknown) {
		t.Fatalf("Reserve with the raised max_entries records unknown = %v, want ErrTooManyUnknown", err)
	}
	// A duplicate of a held key still finds it.
	if res, err := s.Reserve(ctx, late); err != nil || res.Existing == nil || !res.Existing.Abandoned {
		t.Fatalf("duplicate of an unknown key = %+v, %v; want its abandoned record", res, err)
	}
	// One expires: a Reserve drops it, without waiting for the purge.
	clock.Advance(2 * time.Hour)
	if res, err := s.Reserve(ctx, next); err != nil || !res.Reserved {
		t.Fatalf("Reserve once an unknown record expired = %+v, %v", res, err)
	}
	// The walk dropped what had expired (the five executing, soon and
	// raised), as the purge would: left are late and next. Load would not
	// tell, as it hides expired records on its own.
	if n := s.Stats().InFlight; n != 2 {
		t.Fatalf("%d records held after the count, want 2 (late and next)", n)
	}
}

// answerInTurn sends n keys one after the other to a store under
// KeepUnexpired, each answered size bytes, and counts those stored and
// those refused at Reserve; a key admitted whose answer then finds no room
// (executed, its outcome unknown) fails the test.
func answerInTurn(t *testing.T, maxBytes int64, n, size int) (stored, refused int) {
	t.Helper()
	s, err := New(Options{MaxEntries: 1000, MaxBytes: maxBytes, KeepUnexpired: true, Now: storetest.NewFakeClock().Now})
	if err != nil {
		t.Fatal(err)
	}
	for range n {
		r := storetest.Reservation(storetest.NewKey(t), time.Minute, time.Hour)
		res, err := s.Reserve(t.Context(), r)
		if errors.Is(err, ErrFull) {
			refused++
			continue
		}
		if err != nil || !res.Reserved {
			t.Fatalf("Reserve = %+v, %v", res, err)
		}
		if err := s.Finalize(t.Context(), r.Key, r.Owner, stores.Response{Status: 200, Body: make([]byte, size)}); err != nil {
			t.Fatalf("after %d stored: Finalize of a reserved key = %v, want it refused at Reserve instead", stored, err)
		}
		stored++
	}
	return stored, refused
}

// Under KeepUnexpired (when_full refuse), a store full by max_bytes refuses
// a new key before it executes, rather than admitting it for an answer that
// then finds no room: requests one after the other, each answered the same
// 10 KB, never end in ErrResponseTooLarge. Until the build after b35c62e a
// reservation asked for one byte of room, and an audit saw 21 of 30 such
// requests executed and left unknown, none refused.
func TestKeepUnexpiredRefusesKeysByBytesBeforeTheyExecute(t *testing.T) {
	if stored, refused := answerInTurn(t, 100<<10, 30, 10<<10); stored == 0 || refused == 0 || stored+refused != 30 {
		t.Fatalf("%d stored, %d refused; want both", stored, refused)
	}
}

// Answers that are a large share of max_bytes, all alike, are refused
// before they execute once they no longer fit, as small ones are: a cap on
// the room a key asks for (an eighth of max_bytes, in a version a review
// found) admitted 18 of 20 such keys into a 1 MiB store with two 350 KiB
// answers, each executed and left unknown.
func TestKeepUnexpiredRefusesLargeAnswersBeforeTheyExecute(t *testing.T) {
	if stored, refused := answerInTurn(t, 1<<20, 20, 350<<10); stored != 2 || refused != 18 {
		t.Fatalf("%d stored, %d refused; want 2 and 18", stored, refused)
	}
}
