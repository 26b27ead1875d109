package memory

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// wallStepped is t as time.Now returns it after the system clock was
// stepped forward by d (whole seconds): the wall clock moved, the
// monotonic reading did not. time.Time offers no way to build one, so this
// writes the seconds field of its wall word (bits 30 to 62 when the time
// carries a monotonic reading); the test checks the result is what it
// should be before relying on it.
func wallStepped(t time.Time, d time.Duration) time.Time {
	type layout struct {
		wall uint64
		ext  int64
		loc  *time.Location
	}
	(*layout)(unsafe.Pointer(&t)).wall += uint64(d/time.Second) << 30
	return t
}

// A system clock stepped forward (NTP after a drift, a VM resumed) leaves
// the final records' lifetimes as they were: their expiry is on the
// monotonic clock. Before, final records kept a wall-clock expiry, and a
// step of an hour expired every record with less than an hour left, whose
// retries then executed again.
func TestFinalRecordsOutliveAWallClockStep(t *testing.T) {
	now := time.Now()
	if stepped := wallStepped(now, time.Hour); stepped.Unix() != now.Unix()+3600 || stepped.Sub(now) != 0 {
		t.Skipf("cannot build a stepped time on this Go version: %v (wall) / %v (monotonic)", stepped.Unix()-now.Unix(), stepped.Sub(now))
	}
	var step atomic.Int64
	s, err := New(Options{Now: func() time.Time { return wallStepped(time.Now(), time.Duration(step.Load())) }})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := storetest.NewKey(t)
	r := storetest.Reservation(key, time.Minute, 35*time.Minute)
	if _, err := s.Reserve(ctx, r); err != nil {
		t.Fatal(err)
	}
	if err := s.Finalize(ctx, key, r.Owner, stores.Response{Status: 200, Body: []byte("{}")}); err != nil {
		t.Fatal(err)
	}
	step.Store(int64(time.Hour))
	if n, err := s.PurgeExpired(ctx, 100); n != 0 || err != nil {
		t.Fatalf("PurgeExpired after the step = %d, %v; want nothing expired", n, err)
	}
	if rec, err := s.Load(ctx, key); err != nil || rec == nil || rec.State != stores.StateFinal {
		t.Fatalf("Load after the clock stepped an hour = %+v, %v; want the final record, 36 minutes from expiring", rec, err)
	}
}
