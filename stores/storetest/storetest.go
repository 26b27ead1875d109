// Package storetest is the conformance suite every stores.Store must pass.
// The memory, PostgreSQL and MySQL stores all run it, so the handler can rely
// on one contract whatever the backend.
package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Harness is one fresh, empty store under test.
type Harness struct {
	Store stores.Store
	// Advance moves the store's clock forward by d. Stores on a real clock
	// (databases) sleep; the durations used by the suite are short.
	Advance func(d time.Duration)
}

// Open returns a fresh, empty store for one subtest.
type Open func(t *testing.T) Harness

// Durations used by the suite. They are short so stores on a real clock can
// let them lapse by sleeping.
const (
	Lease = 1 * time.Second
	TTL   = 2 * time.Second
	Long  = time.Hour
)

// NewKey returns a fresh UUIDv7 string.
func NewKey(t testing.TB) string {
	t.Helper()
	return uuid.Must(uuid.NewV7()).String()
}

func binding(i int) stores.Binding {
	return stores.Binding{
		Operation:   "updateTable",
		Path:        fmt.Sprintf("/v1/namespaces/ns/tables/t%d", i),
		Principal:   "p",
		Fingerprint: fmt.Sprintf("fp%d", i),
	}
}

// Reservation returns a reservation for key with a fresh owner.
func Reservation(key string, lease, ttl time.Duration) stores.Reservation {
	return stores.Reservation{
		Key:     key,
		Binding: binding(1),
		Owner:   uuid.NewString(),
		Lease:   lease,
		TTL:     ttl,
	}
}

func reserve(t *testing.T, s stores.Store, r stores.Reservation) stores.ReserveResult {
	t.Helper()
	res, err := s.Reserve(context.Background(), r)
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	return res
}

func load(t *testing.T, s stores.Store, key string) *stores.Record {
	t.Helper()
	rec, err := s.Load(context.Background(), key)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	return rec
}

var sample = stores.Response{
	Status: 200,
	Header: http.Header{"Content-Type": {"application/json"}, "Etag": {`"abc"`}},
	Body:   []byte("{\"b\":1,  \"a\":[2, 1]}\n\x00\xff"),
}

// sealedSample returns a fresh sealed response: opaque bytes, zero bytes
// and invalid UTF-8 included, as a ciphertext has them.
func sealedSample() stores.Response {
	body := []byte("\x00\x00nonce-ish\xff\xfe\x00ciphertext\x80\x00")
	for i := range 300 {
		body = append(body, byte(i*7))
	}
	return stores.Response{KeyID: "0a1b2c3d", Body: body}
}

// Run runs the whole suite.
func Run(t *testing.T, open Open) {
	ctx := context.Background()

	t.Run("ReserveThenDuplicate", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		first := Reservation(key, Long, Long)
		if res := reserve(t, h.Store, first); !res.Reserved || res.Existing != nil {
			t.Fatalf("first Reserve = %+v, want reserved", res)
		}
		res := reserve(t, h.Store, Reservation(key, Long, Long))
		if res.Reserved || res.Existing == nil {
			t.Fatalf("second Reserve = %+v, want existing record", res)
		}
		got := res.Existing
		if got.Key != key || got.State != stores.StateInFlight || got.Owner != first.Owner || got.Abandoned {
			t.Fatalf("existing = %+v, want in flight owned by first", got)
		}
		if got.Binding != first.Binding {
			t.Fatalf("binding = %+v, want %+v", got.Binding, first.Binding)
		}
		if rec := load(t, h.Store, NewKey(t)); rec != nil {
			t.Fatalf("Load of unknown key = %+v, want nil", rec)
		}
	})

	t.Run("FinalizeOnlyByOwner", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		reserve(t, h.Store, r)
		if err := h.Store.Finalize(ctx, key, "someone-else", sample); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("Finalize by stranger = %v, want ErrNotOwner", err)
		}
		if err := h.Store.Finalize(ctx, key, r.Owner, sample); err != nil {
			t.Fatalf("Finalize: %v", err)
		}
		if err := h.Store.Finalize(ctx, key, r.Owner, stores.Response{Status: 500}); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("second Finalize = %v, want ErrNotOwner", err)
		}
		if err := h.Store.Release(ctx, key, r.Owner); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("Release after Finalize = %v, want ErrNotOwner", err)
		}
		rec := load(t, h.Store, key)
		if rec == nil || rec.State != stores.StateFinal || rec.Response == nil {
			t.Fatalf("record = %+v, want final", rec)
		}
		if rec.Response.Status != sample.Status || string(rec.Response.Body) != string(sample.Body) {
			t.Fatalf("response = %d %q, want %d %q (byte-identical)", rec.Response.Status, rec.Response.Body, sample.Status, sample.Body)
		}
		if rec.Response.Header.Get("Content-Type") != "application/json" || rec.Response.Header.Get("ETag") != `"abc"` {
			t.Fatalf("headers = %v", rec.Response.Header)
		}
		if rec.Binding != r.Binding {
			t.Fatalf("binding = %+v, want %+v", rec.Binding, r.Binding)
		}
		res := reserve(t, h.Store, Reservation(key, Long, Long))
		if res.Reserved || res.Existing == nil || res.Existing.State != stores.StateFinal {
			t.Fatalf("Reserve of a final key = %+v, want the final record", res)
		}
		if string(res.Existing.Response.Body) != string(sample.Body) {
			t.Fatalf("Reserve returned body %q", res.Existing.Response.Body)
		}
	})

	// Every byte value, NUL and 0xFF included, and a body past 1 MiB come
	// back byte for byte, with multi-valued headers and header values of
	// obs-text that is not UTF-8, through Load and through Reserve's replay.
	t.Run("BinaryBodyRoundTrip", func(t *testing.T) {
		h := open(t)
		s := h.Store
		body := make([]byte, 0, 1<<20+512)
		for i := range 512 {
			body = append(body, byte(i)) // every byte value, NUL and 0xFF included
		}
		rng := rand.New(rand.NewPCG(1, 2))
		for len(body) < cap(body) {
			body = append(body, byte(rng.Uint32()))
		}
		body = append(body, 0, 0xff, 0)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
			t.Fatalf("Reserve = %+v, %v", res, err)
		}
		header := http.Header{"Content-Type": {"application/octet-stream"}, "X-Multi": {"a", "b"}, "Etag": {"W/\"caf\xe9\xff\""}}
		resp := stores.Response{Status: 201, Header: header.Clone(), Body: body}
		if err := s.Finalize(ctx, key, r.Owner, resp); err != nil {
			t.Fatal(err)
		}
		rec, err := s.Load(ctx, key)
		if err != nil || rec == nil || !bytes.Equal(rec.Response.Body, body) {
			t.Fatalf("Load: body differs (err %v)", err)
		}
		if !reflect.DeepEqual(rec.Response.Header, header) {
			t.Fatalf("Load: headers = %q, want %q", rec.Response.Header, header)
		}
		res, err := s.Reserve(ctx, Reservation(key, Long, Long))
		if err != nil || res.Existing == nil || !bytes.Equal(res.Existing.Response.Body, body) || res.Existing.Response.Status != 201 {
			t.Fatalf("replay: body differs (err %v)", err)
		}
		if !reflect.DeepEqual(res.Existing.Response.Header, header) {
			t.Fatalf("replay: headers = %q, want %q", res.Existing.Response.Header, header)
		}
	})

	t.Run("EmptyBodyFinal", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		reserve(t, h.Store, r)
		if err := h.Store.Finalize(ctx, key, r.Owner, stores.Response{Status: 204, Header: http.Header{}}); err != nil {
			t.Fatal(err)
		}
		rec := load(t, h.Store, key)
		if rec == nil || rec.Response.Status != 204 || len(rec.Response.Body) != 0 {
			t.Fatalf("record = %+v", rec)
		}
	})

	// A sealed response is opaque to the store: what Finalize was given
	// comes back exactly, through Load, Reserve and Await, and a clear
	// response keeps an empty KeyID.
	t.Run("SealedRoundTrip", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		reserve(t, h.Store, r)
		awaited := make(chan *stores.Record, 1)
		go func() {
			actx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			rec, err := h.Store.Await(actx, key)
			if err != nil {
				t.Errorf("Await: %v", err)
			}
			awaited <- rec
		}()
		given := sealedSample()
		want := sealedSample()
		if err := h.Store.Finalize(ctx, key, r.Owner, given); err != nil {
			t.Fatalf("Finalize of a sealed response: %v", err)
		}
		// The store keeps no reference to the caller's buffer.
		given.Body[0] ^= 0xff
		check := func(how string, rec *stores.Record) {
			t.Helper()
			if rec == nil || rec.State != stores.StateFinal || rec.Response == nil {
				t.Fatalf("%s: record = %+v, want final", how, rec)
			}
			if !reflect.DeepEqual(*rec.Response, want) {
				t.Fatalf("%s: response = %#v, want exactly %#v", how, *rec.Response, want)
			}
			if rec.Binding != r.Binding {
				t.Fatalf("%s: binding = %+v, want %+v", how, rec.Binding, r.Binding)
			}
		}
		check("Await", <-awaited)
		check("Load", load(t, h.Store, key))
		res := reserve(t, h.Store, Reservation(key, Long, Long))
		if res.Reserved {
			t.Fatal("Reserve of a sealed final key reserved it")
		}
		check("Reserve", res.Existing)
		rec, err := h.Store.Await(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		check("Await of a final record", rec)

		clearKey := NewKey(t)
		rc := Reservation(clearKey, Long, Long)
		reserve(t, h.Store, rc)
		if err := h.Store.Finalize(ctx, clearKey, rc.Owner, sample); err != nil {
			t.Fatal(err)
		}
		if rec := load(t, h.Store, clearKey); rec == nil || rec.Response == nil || rec.Response.KeyID != "" || rec.Response.Status != sample.Status {
			t.Fatalf("clear record = %+v, want status %d and no key id", rec, sample.Status)
		}
	})

	// A sealed response that breaks the contract is refused, not stored:
	// the record stays in flight under its owner, who can still finalize.
	t.Run("SealedMalformedRefused", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		reserve(t, h.Store, r)
		ok := sealedSample()
		bad := map[string]stores.Response{
			"clear status":     {KeyID: ok.KeyID, Status: 200, Body: ok.Body},
			"clear header":     {KeyID: ok.KeyID, Header: http.Header{"Etag": {`"x"`}}, Body: ok.Body},
			"long key id":      {KeyID: strings.Repeat("a", stores.MaxKeyIDLen+1), Body: ok.Body},
			"key id with NUL":  {KeyID: "ab\x00cd", Body: ok.Body},
			"key id non-ASCII": {KeyID: "cl\u00e9", Body: ok.Body},
		}
		for name, resp := range bad {
			err := h.Store.Finalize(ctx, key, r.Owner, resp)
			if err == nil || errors.Is(err, stores.ErrNotOwner) {
				t.Fatalf("Finalize with %s = %v, want a refusal", name, err)
			}
			if rec := load(t, h.Store, key); rec == nil || rec.State != stores.StateInFlight || rec.Owner != r.Owner {
				t.Fatalf("after refusing %s: record = %+v, want in flight under its owner", name, rec)
			}
		}
		longest := sealedSample()
		longest.KeyID = strings.Repeat("k", stores.MaxKeyIDLen)
		if err := h.Store.Finalize(ctx, key, r.Owner, longest); err != nil {
			t.Fatalf("Finalize with a %d-byte key id: %v", stores.MaxKeyIDLen, err)
		}
		if rec := load(t, h.Store, key); rec == nil || rec.Response == nil || rec.Response.KeyID != longest.KeyID {
			t.Fatalf("record = %+v, want key id of %d bytes", rec, stores.MaxKeyIDLen)
		}
	})

	t.Run("ReleaseOnlyByOwner", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		reserve(t, h.Store, r)
		if err := h.Store.Release(ctx, key, "someone-else"); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("Release by stranger = %v, want ErrNotOwner", err)
		}
		if rec := load(t, h.Store, key); rec == nil {
			t.Fatal("record vanished after a stranger's Release")
		}
		if err := h.Store.Release(ctx, key, r.Owner); err != nil {
			t.Fatalf("Release: %v", err)
		}
		if rec := load(t, h.Store, key); rec != nil {
			t.Fatalf("record after Release = %+v, want nil", rec)
		}
		if err := h.Store.Release(ctx, key, r.Owner); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("second Release = %v, want ErrNotOwner", err)
		}
		if res := reserve(t, h.Store, Reservation(key, Long, Long)); !res.Reserved {
			t.Fatalf("Reserve after Release = %+v, want reserved", res)
		}
	})

	t.Run("LeaseLapseAndExtension", func(t *testing.T) {
		h := open(t)
		key, kept := NewKey(t), NewKey(t)
		r := Reservation(key, Lease, Long)
		rk := Reservation(kept, Lease, Long)
		reserve(t, h.Store, r)
		reserve(t, h.Store, rk)
		if err := h.Store.ExtendLease(ctx, key, "someone-else", Long, TTL); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("ExtendLease by stranger = %v, want ErrNotOwner", err)
		}
		if err := h.Store.ExtendLease(ctx, kept, rk.Owner, Long, TTL); err != nil {
			t.Fatalf("ExtendLease: %v", err)
		}
		h.Advance(Lease + 200*time.Millisecond)
		if rec := load(t, h.Store, key); rec == nil || !rec.Abandoned || rec.State != stores.StateInFlight {
			t.Fatalf("record past its lease = %+v, want abandoned in-flight", rec)
		}
		if rec := load(t, h.Store, kept); rec == nil || rec.Abandoned {
			t.Fatalf("extended record = %+v, want healthy in-flight", rec)
		}
		// An abandoned record is still there: a duplicate must not execute.
		if res := reserve(t, h.Store, Reservation(key, Long, Long)); res.Reserved || !res.Existing.Abandoned {
			t.Fatalf("Reserve of an abandoned key = %+v, want the abandoned record", res)
		}
	})

	// A record outlives its TTL while its owner renews the lease (or took
	// it over with one that ends later): a lifetime shorter than the
	// execution must not let a duplicate reserve the key as absent and
	// execute it a second time.
	t.Run("LeaseKeepsRecordPastTTL", func(t *testing.T) {
		h := open(t)
		renewed, taken := NewKey(t), NewKey(t)
		rr, rt := Reservation(renewed, Lease, TTL), Reservation(taken, Lease, TTL)
		reserve(t, h.Store, rr)
		reserve(t, h.Store, rt)
		h.Advance(700 * time.Millisecond)
		if err := h.Store.ExtendLease(ctx, renewed, rr.Owner, Lease, TTL); err != nil {
			t.Fatalf("ExtendLease: %v", err)
		}
		h.Advance(800 * time.Millisecond) // taken's lease lapsed, half a second ago (a slow server's Reserve started it late)
		newOwner := uuid.NewString()
		if ok, err := h.Store.TakeOver(ctx, taken, rt.Owner, newOwner, 2*Lease, TTL); err != nil || !ok {
			t.Fatalf("TakeOver = %v, %v; want true", ok, err)
		}
		if err := h.Store.ExtendLease(ctx, renewed, rr.Owner, 2*Lease, TTL); err != nil {
			t.Fatalf("ExtendLease: %v", err)
		}
		h.Advance(800 * time.Millisecond) // past the TTL, within both leases
		for key, owner := range map[string]string{renewed: rr.Owner, taken: newOwner} {
			rec := load(t, h.Store, key)
			if rec == nil || rec.State != stores.StateInFlight || rec.Abandoned || rec.Owner != owner {
				t.Fatalf("record past its TTL under a live lease = %+v, want it in flight under %s", rec, owner)
			}
			if res := reserve(t, h.Store, Reservation(key, Long, Long)); res.Reserved {
				t.Fatalf("a duplicate reserved %s, whose owner still holds its lease", key)
			}
			if err := h.Store.Finalize(ctx, key, owner, sample); err != nil {
				t.Fatalf("Finalize under a live lease past the TTL: %v", err)
			}
		}
	})

	// A lifetime shorter than the lease (a short lifetime, a slow
	// commit, and on the memory store a lease as long as the execution)
	// must not let the record expire under its owner before the first
	// renewal: a duplicate would reserve the key as absent and execute it
	// again.
	t.Run("ReservedRecordOutlivesShortTTL", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		r := Reservation(key, 3*Lease, Lease/4)
		reserve(t, h.Store, r)
		h.Advance(Lease) // past the TTL, within the lease
		rec := load(t, h.Store, key)
		if rec == nil || rec.State != stores.StateInFlight || rec.Abandoned || rec.Owner != r.Owner {
			t.Fatalf("record past its TTL within its first lease = %+v, want it in flight under %s", rec, r.Owner)
		}
		if res := reserve(t, h.Store, Reservation(key, Long, Long)); res.Reserved {
			t.Fatal("a duplicate reserved the key while its owner held the lease it reserved with")
		}
		if err := h.Store.Finalize(ctx, key, r.Owner, sample); err != nil {
			t.Fatalf("Finalize within the lease, past the TTL: %v", err)
		}
	})

	// When the renewals stop (the owner's node died, or its renewals
	// failed while the catalog still ran the request) the record must
	// read as abandoned for its TTL past the lease's end, whatever the
	// lease was: a record that expired with its lease would let a retry
	// reserve the key as absent and execute it a second time, maybe beside
	// the first execution. Three leases end here, each past the TTL from
	// the reservation: one reserved longer than its TTL, one renewed, one
	// taken over.
	t.Run("LapsedLeaseReadsAbandonedForTTL", func(t *testing.T) {
		h := open(t)
		reserved, renewed, taken := NewKey(t), NewKey(t), NewKey(t)
		rs := Reservation(reserved, 3*Lease/2, TTL)
		rr, rt := Reservation(renewed, Lease, TTL), Reservation(taken, Lease, TTL)
		for _, r := range []stores.Reservation{rs, rr, rt} {
			reserve(t, h.Store, r)
		}
		h.Advance(700 * time.Millisecond)
		if err := h.Store.ExtendLease(ctx, renewed, rr.Owner, 2*Lease, TTL); err != nil {
			t.Fatalf("ExtendLease: %v", err)
		}
		h.Advance(800 * time.Millisecond) // taken's lease lapsed
		if ok, err := h.Store.TakeOver(ctx, taken, rt.Owner, uuid.NewString(), Lease, TTL); err != nil || !ok {
			t.Fatalf("TakeOver = %v, %v; want true", ok, err)
		}
		// 3.2 s: all three leases ended (1.5, 2.7 and 2.5 s) and the
		// first TTL from the reservation (2 s) too; lease end + TTL is
		// 3.5 s at the earliest.
		h.Advance(1700 * time.Millisecond)
		for _, key := range []string{reserved, renewed, taken} {
			rec := load(t, h.Store, key)
			if rec == nil || rec.State != stores.StateInFlight || !rec.Abandoned {
				t.Fatalf("record %s whose lease ended within its TTL = %+v, want it abandoned in flight", key, rec)
			}
			if res := reserve(t, h.Store, Reservation(key, Long, Long)); res.Reserved || !res.Existing.Abandoned {
				t.Fatalf("Reserve of %s, abandoned within its TTL = %+v, want the abandoned record", key, res)
			}
		}
	})

	t.Run("AbandonEndsLeaseAtOnce", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		reserve(t, h.Store, r)
		if err := h.Store.Abandon(ctx, key, "someone-else"); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("Abandon by stranger = %v, want ErrNotOwner", err)
		}
		if rec := load(t, h.Store, key); rec == nil || rec.Abandoned {
			t.Fatalf("record after a stranger's Abandon = %+v, want healthy in-flight", rec)
		}
		if err := h.Store.Abandon(ctx, key, r.Owner); err != nil {
			t.Fatalf("Abandon: %v", err)
		}
		// No clock movement: the record reads abandoned at once, although
		// its lease was Long.
		rec := load(t, h.Store, key)
		if rec == nil || !rec.Abandoned || rec.State != stores.StateInFlight {
			t.Fatalf("record after Abandon = %+v, want abandoned in-flight", rec)
		}
		if res := reserve(t, h.Store, Reservation(key, Long, Long)); res.Reserved || !res.Existing.Abandoned {
			t.Fatalf("Reserve of an abandoned key = %+v, want the abandoned record", res)
		}
		// Abandoning twice is harmless; the owner token still names the
		// record, so a takeover must present it.
		if err := h.Store.Abandon(ctx, key, r.Owner); err != nil {
			t.Fatalf("second Abandon: %v", err)
		}
		fresh := uuid.NewString()
		if ok, err := h.Store.TakeOver(ctx, key, r.Owner, fresh, Long, TTL); err != nil || !ok {
			t.Fatalf("TakeOver of an abandoned key = %v, %v; want true", ok, err)
		}
		if err := h.Store.Abandon(ctx, key, r.Owner); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("Abandon by the fenced owner = %v, want ErrNotOwner", err)
		}
		if err := h.Store.Finalize(ctx, key, fresh, sample); err != nil {
			t.Fatalf("Finalize by the new owner: %v", err)
		}
		if err := h.Store.Abandon(ctx, key, fresh); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("Abandon of a final record = %v, want ErrNotOwner", err)
		}
	})

	t.Run("AwaitWakesOnAbandon", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		r := Reservation(key, Long, Long)
		reserve(t, h.Store, r)
		got := make(chan *stores.Record, 1)
		go func() {
			rec, err := h.Store.Await(ctx, key)
			if err != nil {
				t.Errorf("Await: %v", err)
			}
			got <- rec
		}()
		time.Sleep(50 * time.Millisecond)
		if err := h.Store.Abandon(ctx, key, r.Owner); err != nil {
			t.Fatalf("Abandon: %v", err)
		}
		if rec := <-got; rec == nil || !rec.Abandoned {
			t.Fatalf("Await after Abandon = %+v, want the abandoned record", rec)
		}
	})

	t.Run("TakeOverFencesStaleOwner", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		stale := Reservation(key, Lease, Long)
		reserve(t, h.Store, stale)
		fresh := uuid.NewString()
		if ok, err := h.Store.TakeOver(ctx, key, stale.Owner, fresh, Long, TTL); err != nil || ok {
			t.Fatalf("TakeOver of a healthy lease = %v, %v; want false", ok, err)
		}
		h.Advance(Lease + 200*time.Millisecond)
		if ok, err := h.Store.TakeOver(ctx, key, "wrong-owner", fresh, Long, TTL); err != nil || ok {
			t.Fatalf("TakeOver naming the wrong old owner = %v, %v; want false", ok, err)
		}
		if ok, err := h.Store.TakeOver(ctx, key, stale.Owner, fresh, Long, TTL); err != nil || !ok {
			t.Fatalf("TakeOver = %v, %v; want true", ok, err)
		}
		if ok, _ := h.Store.TakeOver(ctx, key, stale.Owner, uuid.NewString(), Long, TTL); ok {
			t.Fatal("a second TakeOver from the same stale owner succeeded")
		}
		if err := h.Store.Finalize(ctx, key, stale.Owner, sample); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("stale owner Finalize = %v, want ErrNotOwner", err)
		}
		if err := h.Store.Release(ctx, key, stale.Owner); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("stale owner Release = %v, want ErrNotOwner", err)
		}
		if err := h.Store.ExtendLease(ctx, key, stale.Owner, Long, TTL); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("stale owner ExtendLease = %v, want ErrNotOwner", err)
		}
		rec := load(t, h.Store, key)
		if rec == nil || rec.Owner != fresh || rec.Abandoned {
			t.Fatalf("record after takeover = %+v, want healthy, owned by the new owner", rec)
		}
		if err := h.Store.Finalize(ctx, key, fresh, sample); err != nil {
			t.Fatalf("new owner Finalize: %v", err)
		}
	})

	t.Run("ExpiredBehavesAsAbsent", func(t *testing.T) {
		h := open(t)
		final, inflight := NewKey(t), NewKey(t)
		rf := Reservation(final, Lease, TTL)
		reserve(t, h.Store, rf)
		if err := h.Store.Finalize(ctx, final, rf.Owner, sample); err != nil {
			t.Fatal(err)
		}
		ri := Reservation(inflight, Lease, TTL)
		reserve(t, h.Store, ri)
		h.Advance(Lease + TTL + 200*time.Millisecond) // past the lease, then the TTL
		for _, key := range []string{final, inflight} {
			if rec := load(t, h.Store, key); rec != nil {
				t.Fatalf("expired record = %+v, want nil", rec)
			}
		}
		if err := h.Store.Finalize(ctx, inflight, ri.Owner, sample); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("Finalize of an expired record = %v, want ErrNotOwner", err)
		}
		r2 := Reservation(final, Long, Long)
		if res := reserve(t, h.Store, r2); !res.Reserved {
			t.Fatalf("Reserve over an expired record = %+v, want reserved", res)
		}
		if err := h.Store.Finalize(ctx, final, r2.Owner, sample); err != nil {
			t.Fatalf("Finalize after re-reserving an expired key: %v", err)
		}
	})

	t.Run("AwaitWakesOnFinalizeAndRelease", func(t *testing.T) {
		h := open(t)
		for _, finalize := range []bool{true, false} {
			key := NewKey(t)
			r := Reservation(key, Long, Long)
			reserve(t, h.Store, r)
			type result struct {
				rec *stores.Record
				err error
			}
			done := make(chan result, 1)
			go func() {
				actx, cancel := context.WithTimeout(ctx, 30*time.Second)
				defer cancel()
				rec, err := h.Store.Await(actx, key)
				done <- result{rec, err}
			}()
			// Await waiting before the write, as AwaitWakesOnAbandon's:
			// written at once, the record was final or gone before Await
			// read it, and a store whose Finalize and Release woke
			// nobody passed (the memory store with its wake-ups
			// removed, 35 runs in 35). For the stores that also poll
			// this checks the answer; their notify tests check how soon
			// it comes.
			time.Sleep(50 * time.Millisecond)
			var err error
			if finalize {
				err = h.Store.Finalize(ctx, key, r.Owner, sample)
			} else {
				err = h.Store.Release(ctx, key, r.Owner)
			}
			if err != nil {
				t.Fatal(err)
			}
			got := <-done
			switch {
			case got.err != nil:
				t.Fatalf("Await: %v", got.err)
			case finalize && (got.rec == nil || got.rec.State != stores.StateFinal):
				t.Fatalf("Await after Finalize = %+v, want final", got.rec)
			case !finalize && got.rec != nil:
				t.Fatalf("Await after Release = %+v, want nil", got.rec)
			}
		}
	})

	t.Run("AwaitEndsWithContext", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		reserve(t, h.Store, Reservation(key, Long, Long))
		actx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		if _, err := h.Store.Await(actx, key); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Await on a healthy in-flight record = %v, want DeadlineExceeded", err)
		}
	})

	// Stores on a database clock poll or wait for the lease to lapse: Await
	// must notice abandonment by itself, with no write to wake it, and an
	// expired in-flight record must be absent to every method.
	t.Run("AwaitSeesAbandonmentAndExpiry", func(t *testing.T) {
		h := open(t)
		if rec, err := h.Store.Await(ctx, NewKey(t)); err != nil || rec != nil {
			t.Fatalf("Await of an unknown key = %+v, %v; want nil, nil", rec, err)
		}
		key := NewKey(t)
		r := Reservation(key, Lease, TTL)
		reserve(t, h.Store, r)
		type result struct {
			rec *stores.Record
			err error
		}
		done := make(chan result, 1)
		go func() {
			actx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			rec, err := h.Store.Await(actx, key)
			done <- result{rec, err}
		}()
		h.Advance(Lease + 200*time.Millisecond)
		select {
		case got := <-done:
			if got.err != nil || got.rec == nil || !got.rec.Abandoned || got.rec.Owner != r.Owner {
				t.Fatalf("Await past the lease = %+v, %v; want the abandoned record", got.rec, got.err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Await did not return within 5s of the lease lapsing")
		}
		h.Advance(TTL) // the lease ended, then the TTL
		if err := h.Store.ExtendLease(ctx, key, r.Owner, Long, TTL); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("ExtendLease of an expired record = %v, want ErrNotOwner", err)
		}
		if ok, err := h.Store.TakeOver(ctx, key, r.Owner, uuid.NewString(), Long, TTL); err != nil || ok {
			t.Fatalf("TakeOver of an expired record = %v, %v; want false", ok, err)
		}
		if err := h.Store.Release(ctx, key, r.Owner); !errors.Is(err, stores.ErrNotOwner) {
			t.Fatalf("Release of an expired record = %v, want ErrNotOwner", err)
		}
		if rec, err := h.Store.Await(ctx, key); err != nil || rec != nil {
			t.Fatalf("Await of an expired record = %+v, %v; want nil, nil", rec, err)
		}
	})

	t.Run("ConcurrentReserveOneWinner", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		const n = 200
		var winners atomic.Int32
		var wg sync.WaitGroup
		errs := make(chan error, n)
		start := make(chan struct{})
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				res, err := h.Store.Reserve(ctx, Reservation(key, Long, Long))
				switch {
				case err != nil:
					errs <- err
				case res.Reserved:
					winners.Add(1)
				case res.Existing == nil:
					errs <- errors.New("neither reserved nor existing")
				}
			}()
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("concurrent Reserve: %v", err)
		}
		if got := winners.Load(); got != 1 {
			t.Fatalf("%d winners, want exactly 1", got)
		}
	})

	t.Run("ConcurrentReserveOverExpiredOneWinner", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		reserve(t, h.Store, Reservation(key, Lease, TTL))
		h.Advance(Lease + TTL + 200*time.Millisecond) // past the lease, then the TTL
		const n = 100
		var winners atomic.Int32
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				res, err := h.Store.Reserve(ctx, Reservation(key, Long, Long))
				switch {
				case err != nil:
					t.Errorf("Reserve: %v", err)
				case res.Reserved:
					winners.Add(1)
				case res.Existing == nil || res.Existing.State != stores.StateInFlight:
					t.Errorf("Reserve = %+v, want reserved or the new in-flight record", res)
				}
			}()
		}
		close(start)
		wg.Wait()
		if got := winners.Load(); got != 1 {
			t.Fatalf("%d winners over an expired record, want exactly 1", got)
		}
	})

	t.Run("ConcurrentTakeOverOneWinner", func(t *testing.T) {
		h := open(t)
		key := NewKey(t)
		stale := Reservation(key, Lease, Long)
		reserve(t, h.Store, stale)
		h.Advance(Lease + 200*time.Millisecond)
		const n = 50
		var winners atomic.Int32
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ok, err := h.Store.TakeOver(ctx, key, stale.Owner, uuid.NewString(), Long, TTL)
				if err != nil {
					t.Errorf("TakeOver: %v", err)
				}
				if ok {
					winners.Add(1)
				}
			}()
		}
		wg.Wait()
		if got := winners.Load(); got != 1 {
			t.Fatalf("%d takeover winners, want exactly 1", got)
		}
	})

	t.Run("PurgeInBatches", func(t *testing.T) {
		h := open(t)
		const expired, live, batch = 250, 10, 100
		var expiredKeys []string
		for i := 0; i < expired; i++ {
			k := NewKey(t)
			expiredKeys = append(expiredKeys, k)
			reserve(t, h.Store, Reservation(k, Lease, TTL))
		}
		var liveKeys []string
		h.Advance(Lease + TTL + 200*time.Millisecond) // past the lease, then the TTL
		for i := 0; i < live; i++ {
			k := NewKey(t)
			liveKeys = append(liveKeys, k)
			reserve(t, h.Store, Reservation(k, Long, Long))
		}
		if se, ok := h.Store.(stores.SelfExpiring); ok && se.SelfExpiring() {
			// The backend deleted the expired records itself: none is
			// left to purge or to load.
			if n, err := h.Store.PurgeExpired(ctx, batch); n != 0 || err != nil {
				t.Fatalf("PurgeExpired on a self-expiring store = %d, %v; want 0, nil", n, err)
			}
			for _, k := range expiredKeys {
				if rec := load(t, h.Store, k); rec != nil {
					t.Fatalf("expired record %s still loads: %+v", k, rec)
				}
			}
			for _, k := range liveKeys {
				if rec := load(t, h.Store, k); rec == nil {
					t.Fatalf("live record %s gone", k)
				}
			}
			return
		}
		total := 0
		for {
			n, err := h.Store.PurgeExpired(ctx, batch)
			if err != nil {
				t.Fatalf("PurgeExpired: %v", err)
			}
			if n > batch {
				t.Fatalf("PurgeExpired deleted %d > batch %d", n, batch)
			}
			total += n
			if n < batch {
				break
			}
		}
		if total != expired {
			t.Fatalf("purged %d, want %d", total, expired)
		}
		for _, k := range liveKeys {
			if rec := load(t, h.Store, k); rec == nil {
				t.Fatalf("live record %s purged", k)
			}
		}
	})
}

// FakeClock is a settable clock for stores that take one (the memory store),
// so leases and TTLs lapse without sleeping.
type FakeClock struct {
	mu  sync.Mutex
	now time.Time
}

// NewFakeClock returns a clock stopped at a fixed instant.
func NewFakeClock() *FakeClock { return &FakeClock{now: time.Unix(1_700_000_000, 0)} }

// Now returns the clock's time.
func (c *FakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward by d.
func (c *FakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}
