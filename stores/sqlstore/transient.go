package sqlstore

import (
	"context"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"syscall"
)

// A transient error is a store failure that says nothing about the record:
// the database was unreachable, the connection broke, the statement timed
// out, or the database picked it as a deadlock victim and rolled it back.
// Calling again, a little later, may succeed. The handler may therefore
// retry a Finalize or Release that failed transiently, where it must not
// retry after ErrNotOwner or ErrResponseTooLarge.
//
// One caveat for retries: when the connection broke after the statement
// was sent, the database may have committed it. A retried Finalize then
// returns stores.ErrNotOwner (the record is final already); Load tells
// whether it holds the response the caller tried to store.
//
// The stores mark their transient errors; IsTransient finds the mark
// anywhere in the chain. Callers outside this module can test for it
// without importing sqlstore:
//
//	var t interface{ Transient() bool }
//	if errors.As(err, &t) && t.Transient() { … }
type transientError struct{ err error }

func (e *transientError) Error() string   { return e.err.Error() }
func (e *transientError) Unwrap() error   { return e.err }
func (e *transientError) Transient() bool { return true }

// MarkTransient returns err marked as transient (nil stays nil).
func MarkTransient(err error) error {
	if err == nil || IsTransient(err) {
		return err
	}
	return &transientError{err: err}
}

// IsTransient reports whether err, or an error it wraps, is marked
// transient.
func IsTransient(err error) bool {
	var t interface{ Transient() bool }
	return errors.As(err, &t) && t.Transient()
}

// NetworkError reports whether err, as a driver returned it (before
// redaction, which hides the chain), is a failure to reach or keep talking
// to the server, or a timeout: the parts of transience both drivers share.
// A cancelled context is not one: the caller gave up.
func NetworkError(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, driver.ErrBadConn) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ETIMEDOUT) ||
		errors.Is(err, net.ErrClosed) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne)
}

// DialFailed reports whether err, as a driver returned it, is a failure
// to open a connection: the call never had one to send its statement on.
// database/sql retries a statement on a new connection only after
// driver.ErrBadConn, which a driver returns only when nothing was sent, so
// a dial error at the end of its retries proves that no attempt was sent.
func DialFailed(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// MarkNoConnection returns err marked as a call's failure to get a
// connection for its statement: the pool's wait, or a connect refused or
// hung. No statement of it ran, so how long it took says nothing of what
// the statement costs (the cleanup loop halves a batch only for a
// statement that ran past its timeout). nil stays nil.
func MarkNoConnection(err error) error {
	if err == nil || NoConnection(err) {
		return err
	}
	return &noConnectionError{err: err}
}

// NoConnection reports whether err, or an error it wraps, carries
// MarkNoConnection's mark, or is a store's that is not ready (its first
// contact with the database has not succeeded: no statement ran either).
func NoConnection(err error) bool {
	var n *noConnectionError
	return errors.As(err, &n) || errors.Is(err, ErrNotReady)
}

type noConnectionError struct{ err error }

func (e *noConnectionError) Error() string { return e.err.Error() }
func (e *noConnectionError) Unwrap() error { return e.err }
