package mysql

import (
	"fmt"
	"strings"
)

// queries holds the statements, with the validated table name written in.
// Times are DATETIME(6) in UTC; durations arrive as microseconds and are
// added to UTC_TIMESTAMP(6), which is constant within a statement, so
// every comparison in one statement uses one database-clock instant.
type queries struct {
	reserveFresh, insertRows, reserve, load, owned, finalize, finalizeRows, release, extend, abandon, takeOver, purge, forget string
}

// recordCols selects a record the way sqlstore.Row scans it. `key` is a
// reserved word in MySQL, hence the backquotes.
const recordCols = "`key`" + `, operation, path, principal, fingerprint, state,
	COALESCE(owner, ''),
	COALESCE(state = 'in_flight' AND lease_until <= UTC_TIMESTAMP(6), FALSE),
	COALESCE(status, 0), headers, body, created_at, expires_at,
	COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until), 0),
	COALESCE(key_id, '')`

// ifExpired rewrites a column only when the existing row has expired.
func ifExpired(col string) string {
	return fmt.Sprintf("%[1]s = IF(expires_at <= UTC_TIMESTAMP(6), VALUES(%[1]s), %[1]s)", col)
}

// inTime is true as long as the statement runs no later than its
// argument, a moment on the database's clock (NULL: no bound); after it,
// the statement fails with "BIGINT UNSIGNED value is out of range" (1690,
// which lateRefusal recognises): the largest unsigned BIGINT plus the
// microseconds past the bound overflows, which the server refuses whatever
// the sql_mode. A refused statement writes nothing and ends a combined
// batch before its COMMIT, as any other. UTC_TIMESTAMP(6) is constant
// within a statement, read as it starts: when it arrives, or when a batch
// reaches it. A reservation (and a takeover) carries the end of the call
// that sends it (see sqlstore.SendDeadline). (A scalar subquery on a
// two-row derived table, refused for its second row, cost a combined
// batch a fifth of its throughput on MariaDB, once per row.)
const inTime = "COALESCE(18446744073709551615 + TIMESTAMPDIFF(MICROSECOND, ?, UTC_TIMESTAMP(6)), 1) > 0"

// reserveState is a reservation's state, bounded by inTime.
const reserveState = "IF(" + inTime + ", 'in_flight', NULL)"

// reserveCols and reserveValues insert a reservation; lease and TTL arrive
// as microseconds. The arguments: key, operation, path, principal,
// fingerprint, reserveState's bound (at reserveBoundArg), owner, lease,
// TTL.
const (
	reserveCols   = "(`key`, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at)"
	reserveRow    = `(?, ?, ?, ?, ?, ` + reserveState + `, ?,` + reserveTimes
	reserveValues = "VALUES " + reserveRow
	// mergedRow is reserveRow without the bound, for the rows of a
	// merged INSERT, which its batch bounds once (see batchQuery): in a
	// batch, sent as text, MariaDB parses and resolves each row's
	// expressions again, and one guard per row cost throughput.
	mergedRow       = `(?, ?, ?, ?, ?, 'in_flight', ?,` + reserveTimes
	reserveTimes    = "\n\tUTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6),\n\tUTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)"
	reserveBoundArg = 5
)

// Finalize's statement, alone or merged (batchQuery): what it sets on every
// row, the columns it sets from its arguments (in their order; the key and
// the owner follow), and the rows it may change.
const (
	finalizeSet  = "state = 'final', owner = NULL, lease_until = NULL"
	finalizeLive = "state = 'in_flight' AND expires_at > UTC_TIMESTAMP(6)"
)

var finalizeCols = [...]string{"status", "headers", "body", "key_id"}

// finalizeOwnerArg is the owner's position among Finalize's arguments,
// after the key's.
const finalizeOwnerArg = len(finalizeCols) + 1

func newQueries(table string) queries {
	return queries{
		// Reserve tries this first: it inserts a fresh key (1 row) and
		// leaves any existing row as it is (0 rows: the no-op assignment
		// changes nothing, and without CLIENT_FOUND_ROWS the driver counts
		// only changed rows). An existing row that turns out to have
		// expired is then overwritten by reserve. Keys are UUIDv7, so
		// reuse after expiry is rare, and the hot path is this short
		// statement: in a combined batch, where every statement is sent
		// as text, the server parses and resolves it on every request,
		// and reserve's thirteen IF()s were a third of MariaDB's CPU per
		// fresh key.
		reserveFresh: fmt.Sprintf("INSERT INTO %s %s\n%s\nON DUPLICATE KEY UPDATE `key` = `key`", table, reserveCols, reserveValues),

		// MySQL has no RETURNING on an upsert, so Reserve is this INSERT
		// and, only when it did not reserve, a SELECT of the blocking row.
		// The INSERT creates the row, or overwrites it only when it has
		// expired (InnoDB locks the duplicate row first, so of concurrent
		// reservers of an expired key only one sees it expired). Without
		// CLIENT_FOUND_ROWS the driver reports 1 for an insert, 2 for an
		// overwrite and 0 for an untouched live row.
		//
		// MySQL evaluates ON DUPLICATE KEY UPDATE assignments left to
		// right, each seeing the columns already assigned, so expires_at,
		// the column every condition reads, must be assigned last.
		// (VALUES() is deprecated in MySQL 8.0.20+ but works there;
		// MariaDB lacks the row-alias replacement.)
		// A combined batch's fresh reservations, as one multi-row INSERT
		// (rows of reserveRow follow): see batchQuery.
		insertRows: fmt.Sprintf("INSERT INTO %s %s VALUES\n", table, reserveCols),

		reserve: fmt.Sprintf("INSERT INTO %s %s\n%s\n"+`ON DUPLICATE KEY UPDATE
	%s, %s, %s, %s,
	%s, %s, %s, %s,
	status = IF(expires_at <= UTC_TIMESTAMP(6), NULL, status),
	headers = IF(expires_at <= UTC_TIMESTAMP(6), NULL, headers),
	body = IF(expires_at <= UTC_TIMESTAMP(6), NULL, body),
	key_id = IF(expires_at <= UTC_TIMESTAMP(6), NULL, key_id),
	%s`, table, reserveCols, reserveValues,
			ifExpired("operation"), ifExpired("path"), ifExpired("principal"), ifExpired("fingerprint"),
			ifExpired("state"), ifExpired("owner"), ifExpired("lease_until"), ifExpired("created_at"),
			ifExpired("expires_at")),

		load: fmt.Sprintf("SELECT %s FROM %s WHERE `key` = ? AND expires_at > UTC_TIMESTAMP(6)", recordCols, table),

		// owned confirms ownership when ExtendLease changed no row: see there.
		owned: fmt.Sprintf("SELECT COUNT(*) FROM %s WHERE `key` = ? AND owner = ? AND state = 'in_flight' AND expires_at > UTC_TIMESTAMP(6)", table),

		finalize: fmt.Sprintf("UPDATE %s SET %s, %s = ?\nWHERE `key` = ? AND owner = ? AND %s",
			table, finalizeSet, strings.Join(finalizeCols[:], " = ?, "), finalizeLive),

		// A combined batch's finalizations, as one UPDATE: the CASEs
		// (one branch per key) and the key list follow, see batchQuery.
		finalizeRows: fmt.Sprintf("UPDATE %s SET %s", table, finalizeSet),

		release: fmt.Sprintf("DELETE FROM %s WHERE `key` = ? AND owner = ? AND state = 'in_flight' AND expires_at > UTC_TIMESTAMP(6)", table),

		// A record outlives its lease by its TTL (the second argument is
		// lease plus TTL): one whose owner still renews it does not expire
		// under it, and one whose renewals stop reads as abandoned for its
		// TTL (see stores.Reservation.RecordTTL). Bounded by the end of its
		// call as a reservation is (the first argument): a renewal run
		// after it fails instead of reviving the lease of a record its
		// owner marked abandoned meanwhile.
		extend: fmt.Sprintf("UPDATE %s SET lease_until = IF("+inTime+", UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, NULL),\n"+
			"expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)\n"+
			"WHERE `key` = ? AND owner = ? AND state = 'in_flight' AND expires_at > UTC_TIMESTAMP(6)", table),

		// The lease ends at the statement's clock; every later statement
		// sees it lapsed. A lease already lapsed is left as it is (0 rows
		// changed): Abandon then confirms ownership with owned.
		abandon: fmt.Sprintf("UPDATE %s SET lease_until = UTC_TIMESTAMP(6)\n"+
			"WHERE `key` = ? AND owner = ? AND state = 'in_flight' AND expires_at > UTC_TIMESTAMP(6) AND lease_until > UTC_TIMESTAMP(6)", table),

		// Compare and swap on the owner and the lapsed lease; the UPDATE
		// reads the newest committed row under its lock, so of concurrent
		// takeovers only the first matches. Bounded by the end of its call
		// as a reservation is (the first argument): a takeover run after
		// it fails instead of writing a lease nobody renews.
		takeOver: fmt.Sprintf("UPDATE %s SET owner = IF("+inTime+", ?, NULL), lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,\n"+
			"expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)\n"+
			"WHERE `key` = ? AND owner = ? AND state = 'in_flight' AND expires_at > UTC_TIMESTAMP(6) AND lease_until <= UTC_TIMESTAMP(6)", table),

		purge: fmt.Sprintf("DELETE FROM %s WHERE expires_at <= UTC_TIMESTAMP(6) ORDER BY expires_at LIMIT ?", table),

		// Forget (admin API) deletes an abandoned row (in flight, its lease
		// lapsed), or, forced, a row whatever its state or owner.
		forget: fmt.Sprintf("DELETE FROM %s WHERE `key` = ? AND (? OR (state = 'in_flight' AND lease_until <= UTC_TIMESTAMP(6)))", table),
	}
}
