// Package mysql is a stores.Store in MySQL or MariaDB (go-sql-driver/mysql),
// shared by every Caddy node that points at the same database. All lease
// and expiry decisions use the database clock (UTC_TIMESTAMP(6)), so the
// nodes' clocks may drift. Tested on MariaDB 10.11; MySQL 8 should work.
package mysql

import (
	"fmt"
	"math"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// DefaultMaxConns is the pool size when Config.MaxConns is 0.
const DefaultMaxConns = 10

// DefaultCombinedWrites is Config.CombinedWrites' value in the Caddy
// module when the Caddyfile does not set it.
const DefaultCombinedWrites = 1

// Config configures a Store.
type Config struct {
	// DSN is a go-sql-driver/mysql DSN: user:password@tcp(host:3306)/db.
	// The store sets parseTime, loc=UTC and clientFoundRows=false itself
	// (Reserve tells inserted, overwritten and untouched rows apart by the
	// number of changed rows).
	DSN string
	// Table is the records table; its schema version table is
	// <Table>_schema. Default iceberg_idempotency_records.
	Table string
	// MaxConns bounds the connection pool (0: DefaultMaxConns).
	MaxConns int
	// AutoMigrate applies missing schema versions at the first contact with
	// the database (under GET_LOCK, so nodes may start together). Without
	// it the first contact only checks the schema version, and operations
	// fail naming the file to apply until it is applied.
	AutoMigrate bool
	// StatementTimeout bounds each database call, connecting included.
	// Default sqlstore.DefaultStatementTimeout.
	StatementTimeout time.Duration
	// PollMin and PollMax bound Await's polling backoff, which doubles from
	// PollMin to PollMax. Defaults 10ms and 200ms.
	PollMin, PollMax time.Duration
	// RetryMin and RetryMax bound the backoff of Warm's attempts to reach
	// the database; RetryCooldown is how long operations fail fast after
	// a failed attempt. Defaults: see sqlstore.Lazy.
	RetryMin, RetryMax, RetryCooldown time.Duration

	// CombinedWrites is how many batches of Reserve's and Finalize's
	// statements may be in flight at once (see sqlstore.Combiner); the
	// statements of concurrent requests beyond that wait and go together,
	// as one transaction. 0 runs every statement on its own.
	CombinedWrites int

	// packetLimit replaces the server's max_allowed_packet in tests.
	packetLimit int64
}

// WithDefaults returns c with every unset option set to its default, or
// an error naming the first invalid option. Open applies it; the Caddy
// module calls it too, so that the pool it shares across reloads is keyed
// by the values in force. It is the one place where the store's options are
// defaulted and checked.
func (c Config) WithDefaults() (Config, error) {
	err := c.setDefaults()
	return c, err
}

func (c *Config) setDefaults() error {
	if c.DSN == "" {
		return fmt.Errorf("mysql: dsn is required")
	}
	if c.Table == "" {
		c.Table = sqlstore.DefaultTable
	}
	if err := sqlstore.ValidateTable(c.Table); err != nil {
		return fmt.Errorf("mysql: %w", err)
	}
	if err := stores.NegativeOption("mysql",
		stores.Bound{Name: "max_conns", Value: int64(c.MaxConns)},
		stores.Bound{Name: "combined_writes", Value: int64(c.CombinedWrites)},
		stores.Bound{Name: "statement_timeout", Value: int64(c.StatementTimeout), Duration: true},
		stores.Bound{Name: "poll_min", Value: int64(c.PollMin), Duration: true},
		stores.Bound{Name: "poll_max", Value: int64(c.PollMax), Duration: true},
	); err != nil {
		return err
	}
	// The Caddyfile bounds max_conns for both SQL stores (pgx counts a
	// pool in an int32), and a JSON config must not get what the
	// Caddyfile cannot. No MySQL/MariaDB pool needs more: a server's
	// max_connections is at most 100000.
	if c.MaxConns > math.MaxInt32 {
		return fmt.Errorf("mysql: max_conns %d is more than %d", c.MaxConns, math.MaxInt32)
	}
	if c.MaxConns == 0 {
		c.MaxConns = DefaultMaxConns
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = sqlstore.DefaultStatementTimeout
	}
	// As the Caddyfile refuses it for both SQL stores: a JSON config must
	// not get what the Caddyfile cannot.
	if c.StatementTimeout < time.Millisecond {
		return fmt.Errorf("mysql: statement_timeout must be at least 1ms, got %v", c.StatementTimeout)
	}
	// A DSN that does not parse is Open's to report, with the driver's
	// words.
	if mc, err := mysql.ParseDSN(c.DSN); err == nil {
		if _, err := dsnLockWaitSeconds(mc.Params); err != nil {
			return err
		}
	}
	if c.PollMin == 0 {
		c.PollMin = sqlstore.DefaultPollMin
	}
	if c.PollMax == 0 {
		c.PollMax = sqlstore.DefaultPollMax
	}
	if c.PollMax < c.PollMin {
		c.PollMax = c.PollMin
	}
	return nil
}
