package memory

import (
	"fmt"
	"net/http"
	"reflect"
	"runtime"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A final record reads back as it was finalized, whatever its header: none
// (a sealed response), an empty one, several names and values.
func TestFinalRecordReadsBackAsStored(t *testing.T) {
	for name, resp := range map[string]stores.Response{
		"no header":    {Body: []byte("sealed"), KeyID: "k1"},
		"empty header": {Status: 204, Header: http.Header{}},
		"header": {Status: 201, Body: []byte(`{"a":1}`), Header: http.Header{
			"Content-Type":     {"application/json"},
			"Etag":             {`W/"1"`},
			"Cache-Control":    {"no-store", "private"},
			"X-Empty-Value":    {""},
			"X-No-Value":       nil,
			"X-Unicode-Ünïcø∂": {"välue"},
		}},
	} {
		t.Run(name, func(t *testing.T) {
			clock := storetest.NewFakeClock()
			s, err := New(Options{Now: clock.Now})
			if err != nil {
				t.Fatal(err)
			}
			key := storetest.NewKey(t)
			r := stores.Reservation{Key: key, Owner: "owner", Lease: time.Minute, TTL: time.Hour, Binding: stores.Binding{
				Operation: "updateTable", Path: "/v1/namespaces/ns/tables/t", Principal: hexSum("p"), Fingerprint: hexSum("f"),
			}}
			if _, err := s.Reserve(t.Context(), r); err != nil {
				t.Fatal(err)
			}
			want := resp
			want.Header = resp.Header.Clone()
			if err := s.Finalize(t.Context(), key, "owner", resp); err != nil {
				t.Fatal(err)
			}
			clock.Advance(time.Minute)
			rec, err := s.Load(t.Context(), key)
			if err != nil || rec == nil {
				t.Fatalf("Load = %v, %v", rec, err)
			}
			if rec.Key != key || rec.Binding != r.Binding || rec.State != stores.StateFinal || rec.Owner != "" || rec.Abandoned {
				t.Fatalf("record = %+v, want the reservation's key and binding, final", rec)
			}
			if !rec.ExpiresAt.Equal(clock.Now().Add(time.Hour)) || !rec.CreatedAt.Equal(clock.Now().Add(-time.Minute)) {
				t.Fatalf("created %v expires %v, want the lease and an hour after the reservation", rec.CreatedAt, rec.ExpiresAt)
			}
			if !reflect.DeepEqual(*rec.Response, want) {
				t.Fatalf("response = %#v, want %#v", *rec.Response, want)
			}
			// A caller may change what it was given; the next reader
			// still gets the record as stored.
			if rec.Response.Header != nil {
				rec.Response.Header.Set("Content-Type", "text/plain")
				rec.Response.Header["Cache-Control"] = append(rec.Response.Header["Cache-Control"], "changed")
			}
			again, _ := s.Load(t.Context(), key)
			if !reflect.DeepEqual(*again.Response, want) {
				t.Fatalf("after a caller changed its copy: response = %#v, want %#v", *again.Response, want)
			}
		})
	}
}

// A record whose lifetime runs past 2262, where Unix nanoseconds end, is
// kept, not read as expired the moment it is stored (found by a review:
// the module puts no upper bound on lifetime).
func TestFinalRecordOfACenturiesLongLifetimeIsKept(t *testing.T) {
	s, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	key := storetest.NewKey(t)
	r := stores.Reservation{Key: key, Owner: "owner", Lease: time.Minute, TTL: 250 * 365 * 24 * time.Hour}
	if _, err := s.Reserve(t.Context(), r); err != nil {
		t.Fatal(err)
	}
	if err := s.Finalize(t.Context(), key, "owner", stores.Response{Status: 200, Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Load(t.Context(), key)
	if err != nil || rec == nil || rec.State != stores.StateFinal {
		t.Fatalf("Load right after Finalize = %+v, %v; want the final record", rec, err)
	}
	if n, _ := s.PurgeExpired(t.Context(), 10); n != 0 {
		t.Fatalf("PurgeExpired dropped %d records, want none", n)
	}
}

// A final record costs the garbage collector a few objects, not one per
// string and header value: a full store holds hundreds of thousands of
// them, and every collection cycle marks each object again. With the
// record kept as a stores.Record and its header map, a record with a
// two-value header was eleven objects.
func TestFinalRecordIsFewObjects(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates")
	}
	const n = 20_000
	s, err := New(Options{MaxEntries: n, MaxBytes: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = storetest.NewKey(t)
	}
	before := heapObjects()
	for i, key := range keys {
		// Everything the record is made of is allocated afresh, as a
		// request's binding and its answer are.
		r := stores.Reservation{Key: key, Owner: fmt.Sprintf("owner-%d", i), Lease: time.Minute, TTL: time.Hour, Binding: stores.Binding{
			Operation: "updateTable", Path: fmt.Sprintf("/v1/namespaces/ns/tables/t%d", i),
			Principal: hexSum(fmt.Sprint("p", i)), Fingerprint: hexSum(key),
		}}
		if _, err := s.Reserve(t.Context(), r); err != nil {
			t.Fatal(err)
		}
		hdr := http.Header{"Content-Type": {"application/json"}, "Etag": {fmt.Sprintf(`"%d"`, i)}}
		body := []byte(fmt.Sprintf(`{"metadata-location":"s3://b/t%d/metadata/1.json"}`, i))
		if err := s.Finalize(t.Context(), key, r.Owner, stores.Response{Status: 200, Header: hdr, Body: body}); err != nil {
			t.Fatal(err)
		}
	}
	perRecord := float64(heapObjects()-before) / n
	t.Logf("%.2f heap objects per final record", perRecord)
	// The entry, its packed text and its body, plus the key map's share.
	if perRecord > 3.5 {
		t.Fatalf("%.2f heap objects per final record, want at most 3.5", perRecord)
	}
	runtime.KeepAlive(s)
}

func heapObjects() uint64 { return settledHeap().HeapObjects }
