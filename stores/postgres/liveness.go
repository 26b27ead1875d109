package postgres

import (
	"context"
	"crypto/tls"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// pingAfterIdle is pgxpool's own rule, kept: a connection idle for longer
// is pinged before use, which also finds one a silent network lost.
const pingAfterIdle = time.Second

// shouldPing tells pgxpool, as it hands out a pooled connection, whether
// to ping it first. A connection used within the last second may be dead
// all the same: a server restart, a failover or pg_terminate_backend ends
// every session at once, leaving a FATAL message and an end of stream on
// each idle socket. pgxpool would send the next statement on it and fail
// after sending, which proves nothing about the record: each such
// connection cost one request a 503 and a background release. A peek at
// the socket (one non-blocking system call) finds what the server left
// there; the ping then reads it, fails, and pgxpool destroys the
// connection and hands out another. A server that never speaks between
// statements leaves nothing to find on a live one.
func shouldPing(_ context.Context, p pgxpool.ShouldPingParams) bool {
	if p.IdleDuration > pingAfterIdle {
		return true
	}
	pc := p.Conn.PgConn()
	if pc.IsClosed() {
		return true
	}
	return !quiet(pc.Conn())
}

// quiet reports whether c, a connection between statements, has nothing
// waiting to be read and has not been closed by its peer. It reports true
// when it cannot tell (a platform or a connection it cannot peek at), which
// leaves pgxpool's own rule in force.
func quiet(c net.Conn) bool {
	if tc, ok := c.(*tls.Conn); ok {
		// A TLS record waiting (a close_notify, a session ticket) counts
		// as something said: the ping reads it, and costs one round trip.
		c = tc.NetConn()
	}
	return socketQuiet(c)
}
