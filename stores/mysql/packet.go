package mysql

import (
	"context"
	"errors"
	"fmt"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// A MySQL server refuses any packet larger than its max_allowed_packet, in
// both directions: the Finalize statement carrying a response, and the row
// a replay reads back. MariaDB's default (16 MiB) equals the handler's
// default max_response_size, so a response near that size would fail to
// store after the catalog executed it, and a stored row too large to read
// would fail every replay. Finalize therefore refuses, without sending, a
// row that might not fit, and returns stores.ErrResponseTooLarge: the
// handler delivers the response unstored and abandons the key.

// rowHeadroom is what a row needs beyond its body and headers: the path (a
// TEXT column, at most 64 KiB), the other columns, the statement and the
// protocol's framing. Statements are prepared, so values travel in binary,
// unescaped.
const rowHeadroom = 128 << 10

// TypicalMaxResponseSize is the handler's default max_response_size: a
// server whose packet limit cannot carry a response this large is worth a
// warning at the first contact.
const TypicalMaxResponseSize = 16 << 20

// errPacketTooLarge is ER_NET_PACKET_TOO_LARGE, the server's refusal.
const errPacketTooLarge = 1153

// readPacketLimit reads the server's max_allowed_packet (the session value,
// which a new connection takes from the global one) and sets the largest
// row Finalize sends. It is the first statement of the first contact, so
// it also checks that the server answers.
func (s *Store) readPacketLimit(ctx context.Context) error {
	qctx, cancel := s.opCtx(ctx)
	defer cancel()
	var limit int64
	if err := s.db.QueryRowContext(qctx, "SELECT @@max_allowed_packet").Scan(&limit); err != nil {
		return s.wrap("connect", err)
	}
	if s.clientPacketLimit > 0 && s.clientPacketLimit < limit {
		limit = s.clientPacketLimit // the driver's own cap (DSN maxAllowedPacket)
	}
	maxRow := limit - rowHeadroom
	if s.cfg.packetLimit > 0 { // tests
		maxRow = s.cfg.packetLimit - rowHeadroom
	}
	s.maxRow.Store(maxRow)
	if maxRow < TypicalMaxResponseSize {
		s.log.Warn("mysql max_allowed_packet is below the default max_response_size: larger responses are delivered but not stored, and their keys' outcome is unknown (a retry gets the abandoned policy's answer); raise max_allowed_packet on the server",
			zap.Int64("max_allowed_packet", limit), zap.Int64("largest_stored_response", max(maxRow, 0)),
			zap.Int("default_max_response_size", TypicalMaxResponseSize),
			zap.Int64("suggested_max_allowed_packet", TypicalMaxResponseSize+2*rowHeadroom))
	}
	return nil
}

// checkRowSize returns stores.ErrResponseTooLarge when the row Finalize
// would send might exceed the server's packet limit.
func (s *Store) checkRowSize(key, owner string, headers, body []byte) error {
	maxRow := s.maxRow.Load()
	if size := int64(len(body) + len(headers) + len(key) + len(owner)); size > maxRow {
		return fmt.Errorf("mysql finalize: response of %d bytes does not fit the server's max_allowed_packet (at most %d bytes per stored response): %w",
			size, max(maxRow, 0), stores.ErrResponseTooLarge)
	}
	return nil
}

// packetTooLarge reports whether the server or the driver refused a packet
// for its size: the backstop, should the limit have been lowered since the
// first contact.
func packetTooLarge(err error) bool {
	var me *mysql.MySQLError
	return errors.Is(err, mysql.ErrPktTooLarge) || (errors.As(err, &me) && me.Number == errPacketTooLarge)
}

// shrunkPacketLimit handles the other face of the server's refusal: it may
// drop the connection while a large packet is still being written, so the
// driver sees a reset rather than the error. After a broken connection
// under a large row, it reads the limit again (the global value, which the
// pool's next connections get) and reports whether the row no longer fits.
func (s *Store) shrunkPacketLimit(ctx context.Context, err error, key, owner string, headers, body []byte) bool {
	size := int64(len(body) + len(headers) + len(key) + len(owner))
	if !transient(err) || size < 1<<20 {
		return false
	}
	qctx, cancel := s.opCtx(ctx)
	defer cancel()
	var limit int64
	if s.db.QueryRowContext(qctx, "SELECT @@global.max_allowed_packet").Scan(&limit) != nil {
		return false
	}
	if s.cfg.packetLimit == 0 && limit-rowHeadroom < s.maxRow.Load() {
		s.maxRow.Store(limit - rowHeadroom)
		s.log.Warn("mysql max_allowed_packet was lowered", zap.Int64("max_allowed_packet", limit))
	}
	return size > s.maxRow.Load()
}
