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
	await := func(key string) func(context.Context) (*stores.Record, error) {
		return func(ctx context.Context) (*stores.Record, error) {
			runs.Add(1)
			started <- struct{}{}
			<-release
			return &stores.Record{Key: key, State: stores.StateFinal, Response: &stores.Response{
				Status: 200, Header: http.Header{"Etag": {`"1"`}}, Body: []byte("{}"),
			}}, nil
		}
	}
	const n = 50
	got := make([]*stores.Record, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rec, err := g.Do(t.Context(), "k1", await("k1"))
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
		go func() { rec, err = g.Do(t.Context(), "k2", await("k2")); close(done) }()
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
	block := func(ctx context.Context) (*stores.Record, error) {
		runs.Add(1)
		<-ctx.Done()
		close(cancelled)
		return nil, ctx.Err()
	}
	short, cancelShort := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancelShort()
	long, cancelLong := context.WithCancel(t.Context())
	longDone := make(chan error, 1)
	go func() { _, err := g.Do(long, "k", block); longDone <- err }()
	waitForWaiters(t, &g, "k", 1)
	if _, err := g.Do(short, "k", block); !errors.Is(err, context.DeadlineExceeded) {
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
	rec, err := g.Do(t.Context(), "k", func(context.Context) (*stores.Record, error) {
		runs.Add(1)
		return nil, nil
	})
	if rec != nil || err != nil || runs.Load() != 2 {
		t.Fatalf("next Await: %+v, %v after %d waits; want a new wait", rec, err, runs.Load())
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
