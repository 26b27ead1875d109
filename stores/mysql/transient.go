package mysql

import (
	"database/sql/driver"
	"errors"

	"github.com/go-sql-driver/mysql"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// transient reports whether a driver error is worth another call: see
// sqlstore.IsTransient.
func transient(err error) bool {
	if sqlstore.NetworkError(err) || errors.Is(err, mysql.ErrInvalidConn) {
		return true
	}
	var me *mysql.MySQLError
	if !errors.As(err, &me) {
		return false
	}
	switch me.Number {
	case 1040, // ER_CON_COUNT_ERROR: too many connections
		1053, // ER_SERVER_SHUTDOWN
		1205, // ER_LOCK_WAIT_TIMEOUT
		1213, // ER_LOCK_DEADLOCK
		1927, // ER_CONNECTION_KILLED (MariaDB)
		1969, // ER_STATEMENT_TIMEOUT (MariaDB max_statement_time)
		3024: // ER_QUERY_TIMEOUT (MySQL max_execution_time)
		return true
	}
	return false
}

// notSent reports whether a driver error proves that the statement did not
// commit: it never reached the server (it got no connection in time, see
// unhandedError; no connection could be opened for it; or the driver said
// ErrBadConn, which database/sql's contract allows
// only when nothing was sent; go-sql-driver answers ErrInvalidConn once it
// has written), or the server refused it (see refused).
func notSent(err error) bool {
	var unhanded *unhandedError
	if errors.As(err, &unhanded) || sqlstore.DialFailed(err) || errors.Is(err, driver.ErrBadConn) {
		return true
	}
	var me *mysql.MySQLError
	return errors.As(err, &me) && refused(me)
}

// refused reports whether a server's error reply proves that the statement
// it answers committed nothing: an error rolls an autocommit statement back
// (InnoDB's statements are atomic), and a combined batch stops at it before
// its COMMIT (see runBatch). A session killed (KILL, KILL QUERY), a
// statement past MariaDB's max_statement_time (the same kill, by a timer)
// or the server shutting down prove nothing: the server checks for a kill
// after the statement ran and answers the kill's error in place of its OK,
// so the error may come when the commit is already through.
func refused(me *mysql.MySQLError) bool {
	switch me.Number {
	case 1053, // ER_SERVER_SHUTDOWN
		1317, // ER_QUERY_INTERRUPTED
		1927, // ER_CONNECTION_KILLED (MariaDB)
		1969: // ER_STATEMENT_TIMEOUT (MariaDB max_statement_time)
		return false
	}
	return true
}
