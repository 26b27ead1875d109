package icebergidempotency

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// maxRepairs bounds the background undos of lost replies (undoLostReply)
// that run at once for one handler. While the store is down every keyed
// request whose reply was lost adds one, and each is retried for the
// repair window: one goroutine apiece grew with the request rate times two
// minutes (1700 after a 3 s Redis cut under 16 clients), and all of them
// called the store at once when it came back. Past the bound an undo
// waits in the queue, a few hundred bytes, for a worker.
const maxRepairs = 64

// repairQueue runs a handler's undos with at most maxRepairs workers. The
// zero value is ready to use.
type repairQueue struct {
	mu      sync.Mutex
	queue   []*repairJob // by when each is due (push)
	workers int
}

type repairJob struct {
	undo           func(ctx context.Context, s stores.Store, key, owner string) error
	store          stores.Store
	key, owner     string
	failed         time.Time
	settle, repair time.Duration
	wait           time.Duration // before the next try
	due            time.Time
	leave          func()
}

// add queues j, due at once, and starts a worker if fewer than maxRepairs run.
func (q *repairQueue) add(j *repairJob) {
	q.mu.Lock()
	defer q.mu.Unlock()
	j.due = time.Now()
	q.push(j)
	if q.workers < maxRepairs {
		q.workers++
		go q.work()
	}
}

func (q *repairQueue) work() {
	for {
		q.mu.Lock()
		if len(q.queue) == 0 {
			q.workers--
			q.mu.Unlock()
			return
		}
		j := q.queue[0]
		q.queue[0] = nil
		q.queue = q.queue[1:]
		q.mu.Unlock()
		if d := time.Until(j.due); d > 0 {
			time.Sleep(d)
		}
		if j.try() {
			j.leave()
			continue
		}
		j.due = time.Now().Add(j.wait)
		j.wait = min(2*j.wait, undoRetryGap)
		q.mu.Lock()
		q.push(j)
		q.mu.Unlock()
	}
}

// push puts j in the queue by when it is due, after the jobs due as soon,
// so that a worker never sleeps on a job while one due sooner waits
// behind it. q.mu is held.
func (q *repairQueue) push(j *repairJob) {
	i, _ := slices.BinarySearchFunc(q.queue, j.due, func(k *repairJob, due time.Time) int {
		if k.due.After(due) {
			return 1
		}
		return -1
	})
	q.queue = slices.Insert(q.queue, i, j)
}

// try makes one undo try; it reports whether the job is over (see
// undoLostReply).
func (j *repairJob) try() bool {
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), storeOpTimeout)
	err := j.undo(ctx, j.store, j.key, j.owner)
	cancel()
	switch {
	case err == nil:
		return true
	// Nothing there settles it only for a try that began once the window
	// was over: its statement read the key at some moment after it began,
	// and a write that lands late lands within the window. Counted from
	// its reply, a try sent just before the end whose reply came back
	// after it ended the job, and a write landing in between held its key
	// unknown; so did one answered after the repair window, when the
	// settle window was as long (a lock wait of 2 minutes or more). The
	// next try begins after the window.
	case errors.Is(err, stores.ErrNotOwner):
		return began.Sub(j.failed) >= j.settle
	}
	return time.Since(j.failed) > max(j.repair, j.settle)
}
