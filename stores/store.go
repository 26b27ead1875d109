// Package stores defines the contract between the iceberg_idempotency handler
// and the places where idempotency records live (memory, PostgreSQL, MySQL).
//
// Every method must be safe when several Caddy nodes race on one key: the
// store, not the handler, decides who owns a key, and it decides with its own
// clock (the database's clock for SQL stores), never the caller's.
package stores

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// ErrNotOwner is returned by Finalize, Release and ExtendLease when the record
// is not in flight under the given owner token any more: it was finalized,
// released, expired, evicted, or taken over by another owner. The caller must
// not assume its result was stored.
var ErrNotOwner = errors.New("idempotency record is not owned by this token")

// ErrUnreadableRecord wraps the error of a call that found the key's record
// but could not read it: a state or a column this build does not know (a
// newer build's record, during a rolling upgrade or after a rollback), or a
// row altered by hand. The key is held: the request it records may have
// executed, so the caller neither passes the request through (fail_open)
// nor executes it.
var ErrUnreadableRecord = errors.New("idempotency record cannot be read by this build")

// ErrResponseTooLarge is returned by Finalize when the store cannot hold the
// response (for example, it exceeds the database server's packet limit). The
// record is left in flight under its owner, who treats the response like any
// response larger than max_response_size: delivered, not stored, outcome
// unknown (the record is abandoned).
var ErrResponseTooLarge = errors.New("response too large for the idempotency store")

// MarkNotSent marks err as the failure of a call that provably wrote
// nothing: it never reached the store's server (no connection could be
// had, the store's first contact with its database has not succeeded, or
// the driver guarantees it wrote nothing), or the server answered that it
// refused or rolled it back. Only such a failure proves that a write did
// not commit; any other (a reply lost, a timeout while the statement ran
// or waited for a lock) leaves it possible, and the handler then undoes
// the write in the background. The message is err's. nil stays nil.
func MarkNotSent(err error) error {
	if err == nil || NotSent(err) {
		return err
	}
	return &notSentError{err: err}
}

// NotSent reports whether err, or an error it wraps, carries MarkNotSent's
// mark.
func NotSent(err error) bool {
	var n *notSentError
	return errors.As(err, &n)
}

type notSentError struct{ err error }

func (e *notSentError) Error() string { return e.err.Error() }
func (e *notSentError) Unwrap() error { return e.err }

// State is the lifecycle state of a record.
type State string

const (
	// StateInFlight means an owner reserved the key and is executing it.
	StateInFlight State = "in_flight"
	// StateFinal means the final response is stored and replayable.
	StateFinal State = "final"
)

// Binding is what a key is bound to on first use. A later request with the
// same key must match it exactly, or it is rejected (422).
type Binding struct {
	// Operation is the Iceberg REST operationId, e.g. "updateTable".
	Operation string
	// Path is the request's escaped URL path.
	Path string
	// Principal is a fingerprint (hex SHA-256) of who sent the request.
	Principal string
	// Fingerprint is a hex SHA-256 over method, path, query and body.
	Fingerprint string
}

// Response is a captured final response.
type Response struct {
	Status int
	// Header holds only the allow-listed headers that are replayed.
	Header http.Header
	Body   []byte
	// KeyID names the secret a sealed response was encrypted under (the
	// handler's `secret` option). When it is set, Body is the ciphertext of
	// the status, headers and body, Status is 0 and Header is nil: the
	// store keeps the response opaque and returns it as it was given.
	// Empty for a response stored in clear.
	KeyID string
}

// MaxKeyIDLen bounds Response.KeyID: the width of the SQL stores' key_id
// column.
const MaxKeyIDLen = 64

// Check reports whether a store can keep r as the contract above describes.
// A sealed response (KeyID set) must carry no clear status or header, which
// a store would otherwise write next to the ciphertext, and its KeyID must
// be 1 to MaxKeyIDLen letters, digits, '-', '_' or '.', which every store
// holds unchanged (a SQL column in a lax mode would truncate a longer one).
// Stores call it in Finalize and refuse what fails it, so that a caller's
// mistake surfaces instead of being stored half in clear.
func (r Response) Check() error {
	if r.KeyID == "" {
		return nil
	}
	if len(r.KeyID) > MaxKeyIDLen {
		return fmt.Errorf("sealed response: key id of %d bytes, at most %d", len(r.KeyID), MaxKeyIDLen)
	}
	for i := 0; i < len(r.KeyID); i++ {
		c := r.KeyID[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return fmt.Errorf("sealed response: key id has byte %#02x at %d, want letters, digits, '-', '_' or '.'", c, i)
		}
	}
	if r.Status != 0 || len(r.Header) != 0 {
		return errors.New("sealed response carries a clear status or header")
	}
	return nil
}

// Record is one idempotency key's stored state, as read by the store.
type Record struct {
	Key string
	Binding
	State State
	// Owner is the opaque token of the reservation that owns an in-flight
	// record. It is empty for final records.
	Owner string
	// Abandoned reports that the record is in flight but its lease lapsed
	// (judged by the store's clock): its owner stopped heartbeating, most
	// likely because its node died.
	Abandoned bool
	// Response is set for final records.
	Response *Response
	// CreatedAt and ExpiresAt are in the store's clock; informational.
	CreatedAt time.Time
	ExpiresAt time.Time
}

// Reservation asks a store to reserve a key.
type Reservation struct {
	Key string
	Binding
	// Owner is a fresh, unguessable token identifying this reservation.
	Owner string
	// Lease is how long the reservation holds without a heartbeat.
	Lease time.Duration
	// TTL is how long the record lives (lifetime plus grace) past the end
	// of its lease: see RecordTTL.
	TTL time.Duration
}

// RecordTTL is how long a reserved record lives from now: its lease, then
// its TTL. Every renewal (ExtendLease, TakeOver) keeps the record alive for
// the TTL past the new lease's end in the same way. An in-flight record
// must outlive its lease by the TTL, not merely last as long: when the
// owner's renewals fail or its node dies, the record has to read as
// abandoned ("outcome unknown") to the client's retries; one that expired
// with the lease would let a retry reserve the key as absent and execute
// it a second time, perhaps while the first execution still runs.
func (r Reservation) RecordTTL() time.Duration { return r.Lease + r.TTL }

// ReserveResult is the outcome of Reserve: either the caller now owns the key
// (Reserved), or Existing holds the live record somebody else created.
type ReserveResult struct {
	Reserved bool
	Existing *Record
}

// Store keeps idempotency records. Expired records behave exactly as absent
// ones in every method.
//
// The handler calls a store under a context that the client's departure
// does not cancel, often without a deadline: a store bounds each call
// itself (the SQL stores by their statement timeout, on the server too),
// so that a call whose caller gave up cannot commit long afterwards.
type Store interface {
	// Reserve creates an in-flight record owned by r.Owner, unless a live
	// record for r.Key exists, in which case it returns that record. It is
	// atomic: of any number of concurrent callers, at most one is Reserved.
	Reserve(ctx context.Context, r Reservation) (ReserveResult, error)

	// Load returns the live record for key, or nil when there is none.
	Load(ctx context.Context, key string) (*Record, error)

	// Await blocks until the record for key is no longer a healthy in-flight
	// record: it is final, gone (nil), or abandoned. It returns the record in
	// that state, or ctx's error once ctx ends.
	Await(ctx context.Context, key string) (*Record, error)

	// Finalize stores the final response, only if key is in flight under
	// owner (compare and swap); otherwise ErrNotOwner. The store may keep
	// resp's header map and body as they are: the caller must not change
	// them afterwards.
	Finalize(ctx context.Context, key, owner string, resp Response) error

	// Release deletes the in-flight record, only if it is owned by owner;
	// otherwise ErrNotOwner. A later request with the key executes afresh.
	Release(ctx context.Context, key, owner string) error

	// ExtendLease renews the lease of an in-flight record owned by owner,
	// and moves the record's expiry to ttl past the lease's end if it came
	// sooner (see Reservation.RecordTTL): a record does not expire while
	// its owner still renews it, nor for ttl after the renewals stop. A
	// renewal that reaches the store after its call ended renews nothing,
	// and says it was not sent (NotSent): landing after its owner marked
	// the record abandoned, it would make the record read as in flight
	// for a whole lease more.
	ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error

	// Abandon ends the lease of an in-flight record owned by owner now, so
	// that the record reads as Abandoned at once: the owner cannot tell
	// whether the catalog executed the request (the connection broke after
	// it was sent, or the execution timed out), and a retry must get the
	// abandoned policy's answer instead of waiting for a lease nobody
	// renews. Otherwise ErrNotOwner.
	Abandon(ctx context.Context, key, owner string) error

	// TakeOver transfers an abandoned in-flight record from oldOwner to
	// newOwner with a fresh lease (compare and swap on the owner token and on
	// the lapsed lease), the expiry moved as by ExtendLease. It reports
	// whether the takeover happened; false means another node took it over
	// first or the old owner came back.
	TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error)

	// PurgeExpired deletes at most limit expired records and reports how
	// many it deleted. Callers repeat it until it returns less than limit.
	PurgeExpired(ctx context.Context, limit int) (int, error)

	// Close releases the store's resources.
	Close() error
}

// SelfExpiring is implemented by stores whose backend deletes expired
// records itself (Redis key TTLs), so that PurgeExpired never has work.
// The app checks it to leave such stores out of its purge rounds, and
// says so once instead of logging a no-op purge every interval.
type SelfExpiring interface {
	SelfExpiring() bool
}
