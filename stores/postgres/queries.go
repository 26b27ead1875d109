package postgres

import "fmt"

// queries holds the statements, with the validated table name written in.
// Durations arrive as microseconds ($n::bigint) and are added to now(), the
// transaction (here: statement) start time on the database's clock.
type queries struct {
	reserve, deleteExpired, load, finalize, release, extend, abandon, takeOver, purge, forget string
	// mark sets watched on an in-flight row, for Await with ListenNotify.
	mark string
}

// recordCols selects a record the way sqlstore.Row scans it.
const recordCols = `key, operation, path, principal, fingerprint, state,
	coalesce(owner, '') AS owner,
	coalesce(state = 'in_flight' AND lease_until <= now(), false) AS abandoned,
	coalesce(status, 0) AS status, headers, body, created_at, expires_at,
	coalesce((extract(epoch FROM lease_until - now()) * 1000000)::bigint, 0) AS lease_left_us,
	coalesce(key_id, '') AS key_id`

// lateGuard is NULL while the statement runs no later than its parameter
// n, a moment on the database's clock (NULL: no bound), and fails the
// statement after it, with "more than one row returned by a subquery used
// as an expression" (21000, which lateRefusal recognises): a scalar
// subquery may return one row at most, and the two-row table is filtered
// down to none in time. A refused statement writes nothing and, in a
// combined batch, rolls the batch back like any other ERROR. now() is the
// start of the statement's transaction (of a combined batch: of the
// batch), which the server reads when the statement arrives.
func lateGuard(n int) string {
	return fmt.Sprintf("(SELECT NULL::text FROM (VALUES (1), (2)) AS two (n) WHERE now() > $%d::timestamptz)", n)
}

func newQueries(table, channel string) queries {
	q := queries{
		// The INSERT creates the row unless the key exists; DO NOTHING
		// leaves an existing row untouched and unlocked. A fresh key, the
		// common case, costs this one statement: the same INSERT a plain
		// loop over the table would run. Only when it reserved nothing does
		// Reserve load the row that blocked it, in a statement of its own
		// whose snapshot sees a row a concurrent reserver committed
		// meanwhile (ON CONFLICT waited for it). An expired row blocks the
		// INSERT without being live: then no live row comes back, and
		// Reserve deletes it (deleteExpired) and runs the INSERT again; so
		// it does when the row was released or purged in between.
		//
		// $9 is the end of the call that sends it, on this clock (see
		// sqlstore.SendDeadline): run after it, the INSERT fails (see
		// lateGuard) and writes nothing, existing key or not.
		reserve: fmt.Sprintf(`INSERT INTO %s (key, operation, path, principal, fingerprint, state, owner, lease_until, created_at, expires_at)
VALUES ($1, $2, $3, $4, $5, COALESCE(%s, 'in_flight'), $6,
	now() + $7::bigint * interval '1 microsecond', now(),
	now() + $8::bigint * interval '1 microsecond')
ON CONFLICT (key) DO NOTHING`, table, lateGuard(9)),

		deleteExpired: fmt.Sprintf(`DELETE FROM %s WHERE key = $1 AND expires_at <= now()`, table),

		load: fmt.Sprintf(`SELECT %[2]s FROM %[1]s WHERE key = $1 AND expires_at > now()`, table, recordCols),

		finalize: fmt.Sprintf(`UPDATE %s SET state = 'final', owner = NULL, lease_until = NULL,
	status = $3, headers = $4, body = $5, key_id = $6
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now()`, table),

		release: fmt.Sprintf(`DELETE FROM %s
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now()`, table),

		// A record outlives its lease by its TTL ($4 is lease plus TTL):
		// one whose owner still renews it does not expire under it, and
		// one whose renewals stop reads as abandoned for its TTL (see
		// stores.Reservation.RecordTTL). $5 is the end of its call, as for
		// reserve: a renewal run after it fails instead of reviving the
		// lease of a record its owner marked abandoned meanwhile. The
		// owner is written back unchanged, to evaluate the guard on the
		// row it renews.
		extend: fmt.Sprintf(`UPDATE %s SET owner = COALESCE(%s, owner), lease_until = now() + $3::bigint * interval '1 microsecond',
	expires_at = GREATEST(expires_at, now() + $4::bigint * interval '1 microsecond')
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now()`, table, lateGuard(5)),

		// The lease ends at the statement's now(): every later statement
		// sees it lapsed.
		abandon: fmt.Sprintf(`UPDATE %s SET lease_until = LEAST(lease_until, now())
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now()`, table),

		// Compare and swap on the owner and on the lapsed lease. Of
		// concurrent takeovers the first locks the row; the others then
		// re-check the WHERE on the row it wrote and match nothing. $6 is
		// the end of its call, as for reserve: a takeover run after it
		// fails instead of writing a lease nobody renews.
		takeOver: fmt.Sprintf(`UPDATE %s SET owner = COALESCE(%s, $3), lease_until = now() + $4::bigint * interval '1 microsecond',
	expires_at = GREATEST(expires_at, now() + $5::bigint * interval '1 microsecond')
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now() AND lease_until <= now()`, table, lateGuard(6)),

		// SKIP LOCKED: purgers on several nodes take disjoint batches, and
		// a row a reserver is overwriting right now is left alone (FOR
		// UPDATE re-checks expires_at on the row's newest version).
		purge: fmt.Sprintf(`DELETE FROM %[1]s WHERE key IN (
	SELECT key FROM %[1]s WHERE expires_at <= now()
	ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED
) AND expires_at <= now()`, table),

		// Forget (admin API) deletes an abandoned row (in flight, its lease
		// lapsed), or, forced, a row whatever its state or owner.
		forget: fmt.Sprintf(`DELETE FROM %s WHERE key = $1 AND ($2 OR (state = 'in_flight' AND lease_until <= now()))`, table),
	}
	// A waiter marks the row it waits for (see Store.Await); a fresh
	// row starts unwatched (the column's default) and TakeOver leaves
	// the mark, as the waiters still wait. NOT watched: of many waiters
	// of one key the first writes the row, the others wait for its
	// lock, re-check the WHERE on the row it wrote and match nothing.
	q.mark = fmt.Sprintf(`UPDATE %s SET watched = true
WHERE key = $1 AND state = 'in_flight' AND NOT watched AND expires_at > now()`, table)

	// The NOTIFY rides in the same statement (delivered at its commit),
	// so waking waiters costs no extra round trip, and is sent only
	// for a watched row: a transaction that queued a notification
	// takes a database-wide lock at commit, which serializes the
	// committing transactions, so it is paid only when someone waits.
	// The CASE evaluates pg_notify only on a watched row, and keeps one
	// result row per changed record, so RowsAffected still counts
	// them. In READ COMMITTED a statement that waited for the row lock
	// of a concurrent mark re-evaluates the newest row version, so
	// RETURNING watched sees any mark committed before it.
	notify := func(stmt string) string {
		return fmt.Sprintf("WITH changed AS (%s RETURNING key, watched)\nSELECT CASE WHEN watched THEN pg_notify('%s', key) END FROM changed", stmt, channel)
	}
	q.finalize = notify(q.finalize)
	q.release = notify(q.release)
	q.takeOver = notify(q.takeOver)
	q.abandon = notify(q.abandon)
	q.forget = notify(q.forget)
	return q
}
