package memory

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"runtime"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func hexSum(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

func heapInUse() uint64 { return settledHeap().HeapAlloc }

// settledHeap is the heap's statistics once two collections have freed
// what nothing holds.
func settledHeap() runtime.MemStats {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m
}

// The byte count is an estimate of heap use; this keeps it honest for the
// records it matters most for, small commit answers, where the per-record
// overhead dominates: the count must not fall far below the heap the
// records really take, or max_bytes would let memory grow well past it.
func TestCountedBytesTrackHeap(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates")
	}
	const n = 20_000
	clock := storetest.NewFakeClock()
	s, err := New(Options{MaxEntries: n, MaxBytes: 1 << 30, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	keys := make([]string, n)
	owners := make([]string, n)
	for i := range n {
		keys[i] = storetest.NewKey(t)
		owners[i] = fmt.Sprintf("%032x", i)
	}
	body := make([]byte, 300)
	before := heapInUse()
	for i := range n {
		r := stores.Reservation{Key: keys[i], Owner: owners[i], Lease: time.Minute, TTL: time.Hour, Binding: stores.Binding{
			Operation: "updateTable", Path: fmt.Sprintf("/v1/namespaces/ns/tables/t%d", i),
			Principal: hexSum("p"), Fingerprint: hexSum(keys[i]),
		}}
		if _, err := s.Reserve(t.Context(), r); err != nil {
			t.Fatal(err)
		}
		hdr := http.Header{"Content-Type": {"application/json"}}
		if err := s.Finalize(t.Context(), keys[i], owners[i], stores.Response{Status: 200, Header: hdr, Body: body}); err != nil {
			t.Fatal(err)
		}
	}
	heap := float64(heapInUse()-before) / n
	counted := float64(s.Stats().Bytes) / n
	t.Logf("per small final record: %.0f bytes of heap, %.0f counted", heap, counted)
	if counted < 0.75*heap {
		t.Fatalf("counted %.0f bytes per record, heap %.0f: the estimate is too low", counted, heap)
	}
	runtime.KeepAlive(s)
}
