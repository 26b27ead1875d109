package memory

import "time"

// expiryIndex files the final records by the second (of the store's clock:
// see since) they expire in, so that a bound drops expired records before it
// evicts a live one, and a purge finds them without walking the recency
// order. Records of handlers with different lifetimes share one store, and a
// record read moves to the front of the recency order, so neither that order
// nor any other kept for free follows expiry. Filing and unfiling cost a
// lookup in a map of about one bucket per second of the longest lifetime,
// and two pointers; finding an expired record looks at each second once as
// the clock moves past it. A bound drops only records expired a second ago
// or more: the records of the current second would take a walk to tell
// apart.
type expiryIndex struct {
	buckets map[int64]*finalEntry // each second's records, linked by expPrev/expNext
	// oldest is no later than the second of the oldest record filed: the
	// search for expired records starts there.
	oldest int64
}

func newExpiryIndex() expiryIndex {
	return expiryIndex{buckets: make(map[int64]*finalEntry)}
}

// add files e under the second its record expires in.
func (x *expiryIndex) add(e *finalEntry) {
	sec := second(e.expiresAt)
	if len(x.buckets) == 0 || sec < x.oldest {
		x.oldest = sec
	}
	e.expSec = sec
	head := x.buckets[sec]
	e.expPrev, e.expNext = nil, head
	if head != nil {
		head.expPrev = e
	}
	x.buckets[sec] = e
}

// remove unfiles e.
func (x *expiryIndex) remove(e *finalEntry) {
	if e.expPrev != nil {
		e.expPrev.expNext = e.expNext
	} else if e.expNext != nil {
		x.buckets[e.expSec] = e.expNext
	} else {
		delete(x.buckets, e.expSec)
	}
	if e.expNext != nil {
		e.expNext.expPrev = e.expPrev
	}
	e.expPrev, e.expNext = nil, nil
}

// expired returns a filed record whose whole second has passed at now (it
// expired a second ago or more), or nil: one lookup per second the clock
// has moved past, whatever the number of records. Records expiring in the
// current second are left for the next call (or for inSecond).
func (x *expiryIndex) expired(now time.Time) *finalEntry {
	for last := second(since(now)); len(x.buckets) > 0 && x.oldest < last; x.oldest++ {
		if e := x.buckets[x.oldest]; e != nil {
			return e
		}
	}
	return nil
}

// inSecond returns the records filed under now's second that have expired
// at now.
func (x *expiryIndex) inSecond(now time.Time) []*finalEntry {
	var out []*finalEntry
	for e := x.buckets[second(since(now))]; e != nil; e = e.expNext {
		if e.expiredAt(now) {
			out = append(out, e)
		}
	}
	return out
}

// second is the second of the store's clock (see since) that ns falls in.
func second(ns int64) int64 {
	sec := ns / int64(time.Second)
	if ns%int64(time.Second) < 0 {
		sec-- // before the origin: a test's clock
	}
	return sec
}
