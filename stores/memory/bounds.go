package memory

import "time"

// Stats is a point-in-time view of a Store's contents and bounds.
type Stats struct {
	Final    int   // final records held
	InFlight int   // in-flight records held, abandoned ones included
	Bytes    int64 // counted bytes of the final records
	Limits   Limits
}

// Stats reports what the store holds, expired records not yet purged
// included.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Stats{Final: len(s.final), InFlight: len(s.inflight), Bytes: s.bytes, Limits: s.limits}
}

// Limits reports the bounds in force.
func (s *Store) Limits() Limits {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.limits
}

// Resize changes the bounds in place, keeping the records: a config reload
// that changes max_entries or max_bytes must not start an empty store, whose
// keys would execute again on retry. Shrinking evicts least recently used
// final records (reported like any eviction) until the new bounds hold; it
// returns how many it evicted. Zero values take the defaults.
func (s *Store) Resize(l Limits) (int, error) {
	l, err := l.WithDefaults()
	if err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.limits = l
	// A count taken under the old bound no longer says whether the store
	// is full of records whose outcome is unknown.
	s.countedAt = time.Time{}
	return s.fit(s.now()), nil
}
