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
type purgePacer struct {
	max   int // cleanup_batch: the most one statement deletes
	limit int // the next statement's limit
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
	return &purgePacer{max: max, limit: max}
}

// next takes how long the last statement (a full batch) took, sets the
// next statement's limit and returns the pause before it.
func (p *purgePacer) next(took time.Duration) time.Duration {
	switch {
	case took > purgeTarget:
		p.limit = max(1, p.limit/2)
	case took < purgeTarget/4:
		p.limit = min(p.max, p.limit*2)
	}
	return purgeRestFactor * took
}
