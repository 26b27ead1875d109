package mysql

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// migrateLockWait bounds how long a node waits for another node's
// migration: two statement timeouts (GET_LOCK counts whole seconds), so
// that the wait fits in one attempt of the first contact. A node that gives
// up tries again later, and finds the migration done.
func migrateLockWait(statementTimeout time.Duration) time.Duration {
	return max(time.Second, (2 * statementTimeout).Truncate(time.Second))
}

// applyHow is how a DBA applies one of sql/mysql/'s files.
const applyHow = "mysql DATABASE < FILE"

// privilegeRefused reports whether err is the server's refusal of a
// statement the user may not run (a migration's DDL when the store's user
// may only read and write rows): ER_DBACCESS_DENIED_ERROR,
// ER_TABLEACCESS_DENIED_ERROR, ER_COLUMNACCESS_DENIED_ERROR or
// ER_SPECIFIC_ACCESS_DENIED_ERROR.
func privilegeRefused(err error) bool {
	var me *mysql.MySQLError
	if !errors.As(err, &me) {
		return false
	}
	switch me.Number {
	case 1044, 1142, 1143, 1227:
		return true
	}
	return false
}

// tableBusy reports the server's verdict that a migration's statement could
// not have its table now: its lock_wait_timeout ran out (1205) behind a
// transaction holding the table, or it deadlocked (1213). Only then is a
// table that exists and is behind the build's schema said to be behind
// (sqlstore.MigrationFailed); a lost connection or a full disk is an
// outage as any.
func tableBusy(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == 1205 || me.Number == 1213)
}

// migrateLockTimeout is how long a migration's DDL waits for its metadata
// lock (lock_wait_timeout, in whole seconds) before the attempt gives up.
const migrateLockTimeout = time.Second

// migrate applies the missing versions of sql/mysql/ (auto) or checks that
// none is missing. Nodes starting together serialize on a named lock
// (GET_LOCK, held by one session, released when it ends even if the node
// dies). MySQL commits each DDL statement on its own, so the files are
// idempotent: a migration cut short is completed by the next attempt, and
// the version row is written last.
func (s *Store) migrate(ctx context.Context, table string, auto bool) error {
	ms, err := schema.Migrations(schema.MySQL)
	if err != nil {
		return fmt.Errorf("mysql migrate: %w", err)
	}
	if !auto {
		qctx, cancel := s.opCtx(ctx)
		defer cancel()
		have, err := schemaVersion(qctx, s.db, table)
		if err != nil {
			return s.wrap("check schema", err)
		}
		return sqlstore.CheckSchema("mysql", applyHow, table, have, ms, s.log)
	}

	conn, err := s.db.Conn(ctx)
	if err != nil {
		return s.wrap("migrate", err)
	}
	defer conn.Close()
	var dbName string
	if err := conn.QueryRowContext(ctx, "SELECT COALESCE(DATABASE(), '')").Scan(&dbName); err != nil {
		return s.wrap("migrate", err)
	}
	lock := lockName(dbName, table)
	var got sql.NullInt64
	wait := migrateLockWait(s.timeout)
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, ?)", lock, int(wait.Seconds())).Scan(&got); err != nil {
		return s.wrap("migrate lock", err)
	}
	if !got.Valid || got.Int64 != 1 {
		busy := fmt.Errorf("mysql migrate: another node held the migration lock for table %s longer than %v", table, wait)
		// That node is most likely migrating the table; a table that
		// exists and is behind is no outage, whoever holds the lock.
		if have, err := schemaVersion(ctx, conn, table); err == nil && have > 0 && have < schema.Latest(ms) {
			return sqlstore.MigrationFailed("mysql", applyHow, table, have, ms, busy)
		}
		return busy
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.timeout)
		defer cancel()
		var released sql.NullInt64
		if err := conn.QueryRowContext(rctx, "SELECT RELEASE_LOCK(?)", lock).Scan(&released); err != nil {
			s.log.Warn("mysql migrate: release lock", zap.Error(s.wrap("release lock", err)))
		}
	}()

	// An ALTER waiting for its metadata lock (behind a transaction that
	// read the table: a dump, a session left open) waits lock_wait_timeout,
	// a year by default: the attempt ran out its whole time, and the ALTER
	// kept waiting on the server after the node gave up, holding up MySQL
	// 8's writes on the table behind it. The session goes back to the pool
	// with the server's default again, or not at all.
	if _, err := conn.ExecContext(ctx, fmt.Sprintf("SET SESSION lock_wait_timeout = %d", int(migrateLockTimeout.Seconds()))); err != nil {
		return s.wrap("migrate", err)
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.timeout)
		defer cancel()
		if _, err := conn.ExecContext(rctx, "SET SESSION lock_wait_timeout = DEFAULT"); err != nil {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
	}()

	have, err := schemaVersion(ctx, conn, table)
	if err != nil {
		return s.wrap("migrate", err)
	}
	for _, m := range ms {
		if m.Version <= have {
			continue
		}
		for _, stmt := range m.Statements(table) {
			if _, err := conn.ExecContext(ctx, stmt); err != nil {
				if privilegeRefused(err) {
					return sqlstore.MigrationRefused("mysql", applyHow, table, have, ms, s.wrap("migrate "+m.File, err))
				}
				if have > 0 && tableBusy(err) {
					return sqlstore.MigrationFailed("mysql", applyHow, table, have, ms, s.wrap("migrate "+m.File, err))
				}
				return s.wrap("migrate "+m.File, err)
			}
		}
		s.log.Info("applied schema migration", zap.String("file", m.File), zap.Int("version", m.Version))
	}
	if latest := schema.Latest(ms); have > latest {
		s.log.Warn("schema is newer than this build knows", zap.Int("version", have), zap.Int("known", latest))
	}
	return nil
}

type querier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// schemaVersion returns the highest applied version, 0 when the version
// table or the records table is missing from the connection's database.
func schemaVersion(ctx context.Context, q querier, table string) (int, error) {
	var found int
	err := q.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name IN (?, ?)",
		table, table+"_schema").Scan(&found)
	if err != nil || found < 2 {
		return 0, err
	}
	var v int
	err = q.QueryRowContext(ctx, fmt.Sprintf("SELECT COALESCE(MAX(version), 0) FROM %s_schema", table)).Scan(&v)
	return v, err
}

// lockName is the GET_LOCK name for migrating table. Lock names are
// server-wide and at most 64 characters, hence the database and the hash.
func lockName(db, table string) string {
	sum := sha256.Sum256([]byte(db + "." + table))
	return "iceberg_idempotency_migrate_" + hex.EncodeToString(sum[:16])
}
