package mysql

import (
	"database/sql/driver"
	"fmt"
)

// A prepared statement's call (sql.Stmt.ExecContext) fails the same way,
// with the bare context error, whether its deadline passed while it waited
// for a pooled connection (every one busy at MaxConns, or a connect that
// hangs against a partitioned server) or while the statement ran on the
// server: database/sql does not say which. Only the first proves that
// nothing was written, and reporting it as possibly sent made the handler
// start a background undo per failed request, each waiting on the same
// stuck pool.
//
// handOff tells them apart at no cost on the wire: database/sql converts a
// call's arguments with the NamedValueChecker of the driver connection it
// got (driverArgsConnLocked), so only once it holds a connection with the
// statement prepared on it, and just before the driver sends the execute.
// A call whose first argument was never converted never reached that
// point. This keeps the call as it was: database/sql's per-connection
// prepared statements, its re-run on a bad pooled connection, one round
// trip.

// handOff stands in for a call's first argument and records its
// conversion. It is used by one call, in that call's goroutine: database/sql
// converts the arguments synchronously.
type handOff struct {
	arg    any
	handed bool
}

// Value implements driver.Valuer: the argument as database/sql would
// convert it itself. The driver's converter accepts what this returns.
func (h *handOff) Value() (driver.Value, error) {
	h.handed = true
	return driver.DefaultParameterConverter.ConvertValue(h.arg)
}

// withHandOff returns args with the first one standing in a handOff, and
// whether that was converted, i.e. the statement was handed to a
// connection. args itself is left as it is: callers re-run a statement
// with the same slice after a deadlock. A statement without arguments
// counts as handed, as before.
func withHandOff(args []any) ([]any, func() bool) {
	if len(args) == 0 {
		return args, func() bool { return true }
	}
	h := &handOff{arg: args[0]}
	out := make([]any, len(args))
	out[0] = h
	copy(out[1:], args[1:])
	return out, func() bool { return h.handed }
}

// unhandedError is the failure of a call before database/sql handed its
// statement to a connection: waiting for one, connecting, or preparing
// the statement on it. Nothing of it ran on the server; notSent
// recognises it.
type unhandedError struct{ err error }

func (e *unhandedError) Error() string {
	return fmt.Sprintf("no connection took the statement: %v", e.err)
}

func (e *unhandedError) Unwrap() error { return e.err }
