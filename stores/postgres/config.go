// Package postgres is a stores.Store in PostgreSQL (pgx), shared by every
// Caddy node that points at the same database. All lease and expiry
// decisions use the database clock (now()), so the nodes' clocks may drift.
package postgres

import (
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// DefaultMaxConns is the pool size when neither Config.MaxConns nor the
// DSN's pool_max_conns sets one. pgx's own default (the greater of 4 and
// the CPU count) starved 32 concurrent clients: on 2 cores, fresh keyed
// mutations went from about 2,900 req/s with 4 connections to about 4,500
// with 16; 32 gained nothing beyond the noise (scripts/bench.sh,
// ICEBERG_IDEMPOTENCY_BENCH_MAX_CONNS).
const DefaultMaxConns = 16

// DefaultCombinedWrites is Config.CombinedWrites' value in the Caddy
// module when the Caddyfile does not set it.
const DefaultCombinedWrites = 1

// Config configures a Store.
type Config struct {
	// DSN is a libpq/pgx connection string, URL or key=value form.
	DSN string
	// Table is the records table; its schema version table is
	// <Table>_schema. Default iceberg_idempotency_records.
	Table string
	// MaxConns bounds the connection pool (0: DefaultMaxConns, or the
	// DSN's pool_max_conns if it has one). ListenNotify uses one more
	// connection.
	MaxConns int
	// AutoMigrate applies missing schema versions at the first contact with
	// the database (under an advisory lock, so nodes may start together).
	// Without it the first contact only checks the schema version, and
	// operations fail naming the file to apply until it is applied.
	AutoMigrate bool
	// StatementTimeout bounds each database call, connecting included, and
	// is also set as the server-side statement_timeout. Default
	// sqlstore.DefaultStatementTimeout.
	StatementTimeout time.Duration
	// PollMin and PollMax bound Await's polling backoff, which doubles from
	// PollMin to PollMax. Defaults 10ms and 200ms.
	PollMin, PollMax time.Duration
	// ListenNotify makes Await mark the in-flight row it waits for, and
	// Finalize, Release, TakeOver, Abandon and Forget of a marked row send
	// a NOTIFY in the same statement; Await wakes on it through one
	// dedicated LISTEN connection per Store. Await then polls only every
	// NotifyFallback, in case a notification was lost.
	ListenNotify bool
	// CombinedWrites is how many batches of Reserve's and Finalize's
	// statements may be in flight at once (see combiner); the statements
	// of concurrent requests beyond that wait and go together, as one
	// transaction. 0 runs every statement on its own.
	CombinedWrites int
	// NotifyFallback is Await's polling interval with ListenNotify.
	// Default 1s.
	NotifyFallback time.Duration

	// RetryMin and RetryMax bound the backoff of Warm's attempts to reach
	// the database; RetryCooldown is how long operations fail fast after
	// a failed attempt. Defaults: see sqlstore.Lazy.
	RetryMin, RetryMax, RetryCooldown time.Duration

	// tracer is set by tests to count statements.
	tracer pgx.QueryTracer
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
		return fmt.Errorf("postgres: dsn is required")
	}
	if c.Table == "" {
		c.Table = sqlstore.DefaultTable
	}
	if err := sqlstore.ValidateTable(c.Table); err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	if err := stores.NegativeOption("postgres",
		stores.Bound{Name: "max_conns", Value: int64(c.MaxConns)},
		stores.Bound{Name: "combined_writes", Value: int64(c.CombinedWrites)},
		stores.Bound{Name: "statement_timeout", Value: int64(c.StatementTimeout), Duration: true},
		stores.Bound{Name: "poll_min", Value: int64(c.PollMin), Duration: true},
		stores.Bound{Name: "poll_max", Value: int64(c.PollMax), Duration: true},
		stores.Bound{Name: "notify_fallback", Value: int64(c.NotifyFallback), Duration: true},
	); err != nil {
		return err
	}
	if c.MaxConns > math.MaxInt32 { // pgx keeps it in an int32
		return fmt.Errorf("postgres: max_conns %d is more than %d", c.MaxConns, math.MaxInt32)
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = sqlstore.DefaultStatementTimeout
	}
	// The server counts it in whole milliseconds, and 0 there means no
	// limit at all.
	if c.StatementTimeout < time.Millisecond {
		return fmt.Errorf("postgres: statement_timeout must be at least 1ms, got %v", c.StatementTimeout)
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
	if c.NotifyFallback == 0 {
		c.NotifyFallback = time.Second
	}
	return nil
}
