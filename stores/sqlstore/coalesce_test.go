package sqlstore

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Concurrent Awaits of one key share one wait and each gets the record;
// another key gets a wait of its own.
func TestAwaitGroupShares(t *testing.T) {
	var g AwaitGroup
	var runs atomic.Int32
	release := make(chan struct{})
	started := make(chan struct{}, 2)
	load := func(key string) LoadFunc {
		return func(ctx context.Context) (*stores.Record, time.Duration, error) {
			return &stores.Record{Key: key, State: stores.StateFinal, Response: &stores.Response{
				Status: 200, Header: http.Header{"Etag": {`"1"`}}, Body: []byte("{}"),
			}}, 0, nil
		}
	}
	// The wait loads once it is released: every Await joined before that
	// load began.
	await := func(ctx context.Context, load LoadFunc) (*stores.Record, error) {
		runs.Add(1)
		started <- struct{}{}
		<-release
		rec, _, err := load(ctx)
		return rec, err
	}
	const n = 50
	got := make([]*stores.Record, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rec, err := g.Do(t.Context(), "k1", load("k1"), await)
			if err != nil {
				t.Error(err)
			}
			got[i] = rec
		}()
	}
	<-started
	other, err := func() (*stores.Record, error) {
		done := make(chan struct{})
		var rec *stores.Record
		var err error
		go func() { rec, err = g.Do(t.Context(), "k2", load("k2"), await); close(done) }()
		<-started
		waitForWaiters(t, &g, "k1", n)
		close(release)
		<-done
		return rec, err
	}()
	wg.Wait()
	if err != nil || other == nil || other.Key != "k2" {
		t.Fatalf("k2: %+v, %v", other, err)
	}
	if r := runs.Load(); r != 2 {
		t.Fatalf("%d waits ran for two keys, want 2", r)
	}
	for i, rec := range got {
		if rec == nil || rec.Key != "k1" || rec.Response == nil || rec.Response.Status != 200 {
			t.Fatalf("Await %d got %+v", i, rec)
		}
	}
	// Each got its own copy: changing one changes no other.
	got[0].Response.Header.Set("Etag", "changed")
	got[0].State = stores.StateInFlight
	if got[1].Response.Header.Get("Etag") != `"1"` || got[1].State != stores.StateFinal {
		t.Fatalf("Awaits share a record: %+v", got[1])
	}
}

// An Await that leaves returns its own context's error and leaves the
// others waiting; once all have left the shared wait is cancelled, and the
// next Await starts a new one.
func TestAwaitGroupLeaving(t *testing.T) {
	var g AwaitGroup
	var runs atomic.Int32
	cancelled := make(chan struct{})
	noLoad := func(context.Context) (*stores.Record, time.Duration, error) { return nil, 0, nil }
	block := func(ctx context.Context, _ LoadFunc) (*stores.Record, error) {
		runs.Add(1)
		<-ctx.Done()
		close(cancelled)
		return nil, ctx.Err()
	}
	short, cancelShort := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancelShort()
	long, cancelLong := context.WithCancel(t.Context())
	longDone := make(chan error, 1)
	go func() { _, err := g.Do(long, "k", noLoad, block); longDone <- err }()
	waitForWaiters(t, &g, "k", 1)
	if _, err := g.Do(short, "k", noLoad, block); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("leaving Await got %v, want its own deadline", err)
	}
	select {
	case <-cancelled:
		t.Fatal("the shared wait was cancelled while an Await still waited")
	case <-time.After(20 * time.Millisecond):
	}
	cancelLong()
	if err := <-longDone; !errors.Is(err, context.Canceled) {
		t.Fatalf("last Await got %v, want context.Canceled", err)
	}
	<-cancelled // the shared wait ends once nobody waits
	rec, err := g.Do(t.Context(), "k", noLoad, func(ctx context.Context, load LoadFunc) (*stores.Record, error) {
		runs.Add(1)
		rec, _, err := load(ctx)
		return rec, err
	})
	if rec != nil || err != nil || runs.Load() != 2 {
		t.Fatalf("next Await: %+v, %v after %d waits; want a new wait", rec, err, runs.Load())
	}
}

// An Await that joins while the shared wait's last load is under way does
// not get what that load read before the Await began: the record may have
// changed since (another node took the abandoned reservation over, say). It
// loads again. Found by the store model (TestModel, Redis): an Await that
// began after a takeover returned the record abandoned under the old owner.
// The loads are scripted here, since no store can hold a load at that point.
func TestAwaitGroupLateJoinerLoadsAgain(t *testing.T) {
	var g AwaitGroup
	var loads atomic.Int32
	loading := make(chan struct{})
	finish := make(chan struct{})
	load := func(context.Context) (*stores.Record, time.Duration, error) {
		if loads.Add(1) == 1 {
			close(loading)
			<-finish // the first load read the key as it was: abandoned under "old"
			return &stores.Record{Key: "k", State: stores.StateInFlight, Owner: "old", Abandoned: true}, 0, nil
		}
		return &stores.Record{Key: "k", State: stores.StateInFlight, Owner: "new", Abandoned: true}, 0, nil
	}
	await := func(ctx context.Context, load LoadFunc) (*stores.Record, error) {
		rec, _, err := load(ctx)
		return rec, err
	}
	type result struct {
		rec *stores.Record
		err error
	}
	first, late := make(chan result, 1), make(chan result, 1)
	go func() {
		rec, err := g.Do(t.Context(), "k", load, await)
		first <- result{rec, err}
	}()
	<-loading
	go func() {
		rec, err := g.Do(t.Context(), "k", load, await)
		late <- result{rec, err}
	}()
	waitForWaiters(t, &g, "k", 2)
	close(finish)
	if r := <-first; r.err != nil || r.rec == nil || r.rec.Owner != "old" {
		t.Fatalf("the Await whose load it was got %+v, %v; want the record under old", r.rec, r.err)
	}
	if r := <-late; r.err != nil || r.rec == nil || r.rec.Owner != "new" {
		t.Fatalf("the Await that joined during the load got %+v, %v; want a fresh load (under new)", r.rec, r.err)
	}
	if n := loads.Load(); n != 2 {
		t.Fatalf("%d loads, want 2", n)
	}
}

// The Awaits that joined during a shared wait's last load go round again
// together, served by the next shared wait's first load; not one at a time,
// a load each (as an earlier version did: 51 loads for 50 such Awaits). The
// next load waits until all of them have joined it, as they would while a
// real load is under way.
func TestAwaitGroupStaleJoinersShareOneReload(t *testing.T) {
	var g AwaitGroup
	const n = 50
	var loads, returned atomic.Int32
	loading := make(chan struct{})
	finish := make(chan struct{})
	final := &stores.Record{Key: "k", State: stores.StateFinal}
	load := func(context.Context) (*stores.Record, time.Duration, error) {
		if loads.Add(1) == 1 {
			close(loading)
			<-finish
			return final, 0, nil
		}
		for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Microsecond) {
			if g.Waiting("k") >= n-int(returned.Load()) {
				break
			}
		}
		return final, 0, nil
	}
	await := func(ctx context.Context, load LoadFunc) (*stores.Record, error) {
		rec, _, err := load(ctx)
		return rec, err
	}
	firstDone := make(chan struct{})
	go func() { _, _ = g.Do(t.Context(), "k", load, await); close(firstDone) }()
	<-loading
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer returned.Add(1)
			if _, err := g.Do(t.Context(), "k", load, await); err != nil {
				t.Error(err)
			}
		}()
	}
	waitForWaiters(t, &g, "k", n+1)
	close(finish)
	wg.Wait()
	<-firstDone
	if got := loads.Load(); got != 2 {
		t.Errorf("%d loads for %d Awaits that joined during the first: want 2 (the first, and one reload they share)", got, n)
	}
}

// An Await that starts the shared wait itself never takes that wait's first
// load for a stale one, however soon the wait's goroutine runs (an earlier
// version read its count after starting the goroutine: a few Awaits in
// 100,000 on a busy machine loaded twice).
func TestAwaitGroupLoneAwaitLoadsOnce(t *testing.T) {
	var g AwaitGroup
	var loads atomic.Int64
	load := func(context.Context) (*stores.Record, time.Duration, error) {
		loads.Add(1)
		return &stores.Record{Key: "k", State: stores.StateFinal}, 0, nil
	}
	await := func(ctx context.Context, load LoadFunc) (*stores.Record, error) {
		rec, _, err := load(ctx)
		return rec, err
	}
	const n = 20000
	for i := range n {
		if _, err := g.Do(t.Context(), "k", load, await); err != nil {
			t.Fatal(err)
		}
		if got := loads.Load(); got != int64(i+1) {
			t.Fatalf("Await %d: %d loads in all, want %d (one each)", i+1, got, i+1)
		}
	}
}

// waitForWaiters waits until n Awaits have joined key's shared wait.
func waitForWaiters(t *testing.T, g *AwaitGroup, key string, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if g.Waiting(key) >= n {
			return
		}
	}
	t.Fatalf("%d Awaits of %s did not join within 10s", n, key)
}
