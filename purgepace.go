package icebergidempotency

import "time"

// purgePacer sizes and spaces the statements of one store's purge run, so
// that a backlog (a first start, a long outage, a lifetime shortened)
// drains without taking the database from the requests.
//
// Why both: what a purge statement costs the requests is how long it keeps
// the database busy, which its row count alone does not say: a store
// holding 16 MB answers makes every row thousands of times heavier than one
// holding 2 KB answers. So the statement's limit follows its duration, and
// the pause after it follows the duration too.
//
// A statement that fails with a transient error (it timed out, and deleted
// nothing) is retried with half its limit, which becomes the most the
// limit grows back to until a run ends without a failure: without that, a
// limit over the statement timeout was tried again first at every run, and
// the table only grew.
type purgePacer struct {
	max     int // cleanup_batch: the most one statement deletes
	ceiling int // the most the limit grows to: max, or half a failed limit
	limit   int // the next statement's limit
}

const (
	// purgeTarget is how long one purge statement should take: a limit
	// whose statement took longer is halved for the next, one whose
	// statement took under a quarter of it doubled (up to cleanup_batch).
	purgeTarget = 50 * time.Millisecond
	// purgeRestFactor is the pause after a full batch, in multiples of
	// the time the batch took: at 2, a backlog keeps one database
	// connection busy a third of the time at most.
	purgeRestFactor = 2
)

func newPurgePacer(max int) *purgePacer {
	return &purgePacer{max: max, ceiling: max, limit: max}
}

// failed takes how long a statement that failed with a transient error (a
// timeout) took, halves the limit and returns the pause before the retry.
func (p *purgePacer) failed(took time.Duration) time.Duration {
	p.limit = max(1, p.limit/2)
	p.ceiling = p.limit
	return purgeRestFactor * took
}

// ended is told that a run ended, and whether a statement of it failed: a
// run without failures lets the limit grow twice as far in the next.
func (p *purgePacer) ended(failures int) {
	if failures == 0 {
		p.ceiling = min(p.max, p.ceiling*2)
	}
}

// next takes how long the last statement (a full batch) took, sets the
// next statement's limit and returns the pause before it.
func (p *purgePacer) next(took time.Duration) time.Duration {
	switch {
	case took > purgeTarget:
		p.limit = max(1, p.limit/2)
	case took < purgeTarget/4:
		p.limit = min(p.ceiling, p.limit*2)
	}
	return purgeRestFactor * took
}
