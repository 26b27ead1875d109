package postgres

import (
	"fmt"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

// TestLateReserveWritesNothing: statement_timeout counts from when the
// server receives a statement, so it does not bound a Reserve held up in
// the network; see sqltest.LateReserveWritesNothing. A real partition held
// one 22 s and the row landed in 3 of 3 runs; the proxy stands in for it.
func TestLateReserveWritesNothing(t *testing.T) {
	for _, combined := range []int{0, 1} {
		t.Run(fmt.Sprintf("combined_writes=%d", combined), func(t *testing.T) {
			const timeout = 500 * time.Millisecond
			proxy, dsn := proxiedDSN(t)
			s, cfg := openStore(t, func(c *Config) {
				c.DSN, c.StatementTimeout, c.CombinedWrites = dsn, timeout, combined
			})
			direct, _ := openStore(t, func(c *Config) { c.Table = cfg.Table })
			sqltest.LateReserveWritesNothing(t, s, direct, proxy, timeout)
		})
	}
}

// TestLateRenewalRevivesNothing: nor does statement_timeout bound a lease
// renewal held up in the network; see sqltest.LateRenewalRevivesNothing.
func TestLateRenewalRevivesNothing(t *testing.T) {
	const timeout = 500 * time.Millisecond
	proxy, dsn := proxiedDSN(t)
	s, cfg := openStore(t, func(c *Config) { c.DSN, c.StatementTimeout = dsn, timeout })
	direct, _ := openStore(t, func(c *Config) { c.Table = cfg.Table })
	sqltest.LateRenewalRevivesNothing(t, s, direct, proxy, timeout)
}

// stepBack makes s's reading of the server's clock an hour early.
func stepBack(s *Store) func() {
	return func() { s.clock.Learn(time.Now().Add(-time.Hour), time.Now()) }
}

func TestClockSteppedBack(t *testing.T) {
	s, _ := openStore(t, nil)
	sqltest.ClockSteppedBack(t, s, stepBack(s))
}

func TestLateBatchWritesNothing(t *testing.T) {
	s, cfg := openStore(t, func(c *Config) { c.CombinedWrites = 1 })
	sqltest.LateBatchWritesNothing(t, sqltest.CombineRig{
		Store: s,
		State: s.combined.State,
		Block: blockBatch(s, cfg.Table),
	}, stepBack(s), s.clock.Reads)
}
