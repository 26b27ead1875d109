package stores

import (
	"context"
	"time"
)

// The interfaces in this file are optional: the admin API (admin.go in the
// root package) uses them when a store has them and says "unavailable"
// otherwise, so a new store need not implement them to serve requests.

// Forgetter is implemented by stores that can delete one record whatever
// its owner: an operator's way out of a stuck or wrong record.
type Forgetter interface {
	// Forget deletes key's record and reports whether it deleted one.
	// Unless force, only an abandoned record goes (in flight, its lease
	// lapsed, judged by the store's clock in the same statement as the
	// delete), and Forget reports false for any other: a record in flight
	// under a live lease is executing, maybe by one that took the key over
	// after the operator looked; a final one holds an answer, maybe stored
	// by an owner whose lease had lapsed when the operator looked at it.
	// Forgetting either would let a retry execute the commit a second time.
	// With force, any record goes, live or expired, in flight or final: an
	// owner that still runs gets ErrNotOwner from Finalize, as if its record
	// had expired, and a later request with the key executes afresh.
	Forget(ctx context.Context, key string, force bool) (bool, error)
}

// Counts is how many live (unexpired) records a store holds, by state.
type Counts struct {
	// InFlight counts in-flight records whose lease still holds.
	InFlight int `json:"in_flight"`
	// Abandoned counts in-flight records whose lease lapsed.
	Abandoned int `json:"abandoned"`
	// Final counts records holding a replayable response.
	Final int `json:"final"`
}

// Counter is implemented by stores that can count their records. It may
// be expensive (the SQL stores scan the table): it serves an operator's
// occasional look, not dashboards; use the metrics for those.
type Counter interface {
	Count(ctx context.Context) (Counts, error)
}

// Inspector is implemented by stores that can tell, beside a record, how
// long its lease has left (zero for a final or abandoned record).
type Inspector interface {
	Inspect(ctx context.Context, key string) (*Record, time.Duration, error)
}
