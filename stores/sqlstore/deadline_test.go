package sqlstore

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Without a reading (the first contact, or after a refusal dropped it),
// concurrent callers share one read of the server's clock, and its failure
// is theirs: the handler calls Reserve and TakeOver without a deadline of
// their own, so callers that each read in turn behind a lock waited one
// statement timeout per caller ahead of them while the server did not
// answer (16 Reserves behind a blackholed PostgreSQL or MariaDB after a
// refusal, statement_timeout 500ms: the last returned after 8 s).
func TestServerClockCallersShareOneRead(t *testing.T) {
	var c ServerClock
	c.Learn(time.Now(), time.Now())
	c.Forget()
	const readTime = 200 * time.Millisecond
	refused := errors.New("no answer")
	var reads atomic.Int32
	read := func(ctx context.Context) (time.Time, time.Time, error) {
		reads.Add(1)
		time.Sleep(readTime)
		return time.Time{}, time.Time{}, stores.MarkNotSent(refused)
	}
	const n = 16
	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { errs[i] = c.Sync(context.Background(), read) })
	}
	wg.Wait()
	took := time.Since(start)
	for i, err := range errs {
		if !errors.Is(err, refused) || !stores.NotSent(err) {
			t.Errorf("caller %d: %v, want the read's error, not sent", i, err)
		}
	}
	if took > 3*readTime || reads.Load() > 2 {
		t.Errorf("%d callers without a reading took %v and %d reads of %v each", n, took, reads.Load(), readTime)
	}

	// The next caller reads again, and once that read succeeded the
	// others use it.
	ok := func(ctx context.Context) (time.Time, time.Time, error) {
		reads.Add(1)
		time.Sleep(readTime)
		return time.Now().Add(time.Hour), time.Now(), nil
	}
	reads.Store(0)
	for i := range n {
		wg.Go(func() { errs[i] = c.Sync(context.Background(), ok) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("caller %d: %v", i, err)
		}
	}
	if reads.Load() != 1 {
		t.Errorf("%d reads, want 1", reads.Load())
	}
	if got, _ := c.NotAfter(time.Now(), true).(time.Time); time.Until(got) < time.Hour {
		t.Errorf("the reading was not learned: bound %v", got)
	}
}

// A caller waiting for another's read gives up when its ctx ends, with
// nothing sent.
func TestServerClockWaiterHonoursCtx(t *testing.T) {
	var c ServerClock
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	defer time.AfterFunc(2*time.Second, unblock).Stop()
	reader := make(chan struct{})
	go func() {
		defer close(reader)
		_ = c.Sync(context.Background(), func(ctx context.Context) (time.Time, time.Time, error) {
			<-release
			return time.Now(), time.Now(), nil
		})
	}()
	time.Sleep(50 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := c.Sync(ctx, func(ctx context.Context) (time.Time, time.Time, error) {
		t.Error("a second read while one is under way")
		return time.Now(), time.Now(), nil
	})
	took := time.Since(start)
	unblock()
	<-reader
	if !errors.Is(err, context.DeadlineExceeded) || !stores.NotSent(err) || took > time.Second {
		t.Errorf("waiter: %v after %v, want its ctx's end, not sent", err, took)
	}
}
