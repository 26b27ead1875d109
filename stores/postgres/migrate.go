package postgres

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// applyHow is how a DBA applies one of sql/postgres/'s files.
const applyHow = "psql --single-transaction -f FILE"

// insufficientPrivilege is the SQLSTATE of a statement the role may not
// run: a migration's DDL when the store's role does not own the table.
const insufficientPrivilege = "42501"

// tableBusy reports the server's verdict that a migration's statement could
// not have its table now: its lock_timeout ran out (55P03) behind a
// transaction holding the table, or it deadlocked (40P01). Only then is a
// table that exists and is behind the build's schema said to be behind
// (sqlstore.MigrationFailed); a lost connection, a shutting-down server or
// a full disk is an outage as any.
func tableBusy(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "55P03" || pe.Code == "40P01")
}

// migrateLockTimeout is how long a migration's DDL waits for its table
// lock (lock_timeout) before the attempt gives up.
const migrateLockTimeout = 200 * time.Millisecond

// migrate applies the missing versions of sql/postgres/ (auto) or checks that
// none is missing. It runs in one transaction holding a transaction-scoped
// advisory lock per table name, so nodes starting together apply each
// version once and the others wait, then see it applied; PostgreSQL's
// transactional DDL leaves no half-applied version behind.
func (s *Store) migrate(ctx context.Context, table string, auto bool) error {
	ms, err := schema.Migrations(schema.Postgres)
	if err != nil {
		return fmt.Errorf("postgres migrate: %w", err)
	}
	latest := schema.Latest(ms)
	if !auto {
		have, err := schemaVersion(ctx, s.pool, table)
		if err != nil {
			return s.wrap("check schema", err)
		}
		return sqlstore.CheckSchema("postgres", applyHow, table, have, ms, s.log)
	}

	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return s.wrap("migrate", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey(table)); err != nil {
		return s.wrap("migrate lock", err)
	}
	// Set after the advisory lock, which may wait for another node's
	// migration. An ALTER waiting for its table lock holds up every
	// statement on the table behind it, on every node: with a long
	// transaction on the table (a pg_dump), the attempt gives up at once
	// and a later one migrates, instead of stalling the writes for a whole
	// statement_timeout at every attempt.
	if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL lock_timeout = %d", migrateLockTimeout.Milliseconds())); err != nil {
		return s.wrap("migrate", err)
	}
	have, err := schemaVersion(ctx, tx, table)
	if err != nil {
		return s.wrap("migrate", err)
	}
	for _, m := range ms {
		if m.Version <= have {
			continue
		}
		for _, stmt := range m.Statements(table) {
			if _, err := tx.Exec(ctx, stmt); err != nil {
				if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) && pe.Code == insufficientPrivilege {
					return sqlstore.MigrationRefused("postgres", applyHow, table, have, ms, s.wrap("migrate "+m.File, err))
				}
				if have > 0 && tableBusy(err) {
					return sqlstore.MigrationFailed("postgres", applyHow, table, have, ms, s.wrap("migrate "+m.File, err))
				}
				return s.wrap("migrate "+m.File, err)
			}
		}
		s.log.Info("applied schema migration", zap.String("file", m.File), zap.Int("version", m.Version))
	}
	if err := tx.Commit(ctx); err != nil {
		return s.wrap("migrate commit", err)
	}
	if have > latest {
		s.log.Warn("schema is newer than this build knows", zap.Int("version", have), zap.Int("known", latest))
	}
	return nil
}

type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// schemaVersion returns the highest applied version, 0 when the version
// table or the records table is missing.
func schemaVersion(ctx context.Context, q querier, table string) (int, error) {
	var hasVersions, hasRecords bool
	// to_regclass resolves through search_path, as the store's statements do.
	err := q.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL",
		table+"_schema", table).Scan(&hasVersions, &hasRecords)
	if err != nil || !hasVersions || !hasRecords {
		return 0, err
	}
	var v int
	err = q.QueryRow(ctx, fmt.Sprintf("SELECT coalesce(max(version), 0) FROM %s_schema", table)).Scan(&v)
	return v, err
}

// lockKey maps a table name to an advisory lock key. Other applications'
// advisory locks could collide with it only by 64-bit chance.
func lockKey(table string) int64 {
	h := fnv.New64a()
	h.Write([]byte("caddy-iceberg-idempotency migrate " + table))
	return int64(h.Sum64())
}
