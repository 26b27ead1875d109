package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
)

// A connection pooler in front of PostgreSQL (PgBouncer, say) changes three
// things the store relies on; see the README's "Behind a connection pooler".
//
// PgBouncer refuses a startup parameter it does not know, statement_timeout
// among them, failing every connection: once it has (startupTimeoutRefused),
// the store connects without it (beforeConnect), and checks what bound the
// sessions it gets actually have (checkServerTimeout). In transaction or statement mode a session's
// prepared statements are not the client's: pgx's default statement cache
// fails on them, and the error says what to put in the DSN
// (preparedStatementHint).

// startupTimeoutParam is the runtime parameter the store sends at startup
// so that the server bounds each statement.
const startupTimeoutParam = "statement_timeout"

// beforeConnect drops the statement_timeout startup parameter once a
// pooler has refused it. pgxpool hands it a copy of the connection's
// config for each new connection.
func (s *Store) beforeConnect(_ context.Context, cc *pgx.ConnConfig) error {
	if s.noStartupTimeout.Load() {
		delete(cc.RuntimeParams, startupTimeoutParam)
	}
	return nil
}

// startupTimeoutRefused reports whether err is a refusal of the
// statement_timeout startup parameter (PgBouncer: "unsupported startup
// parameter: statement_timeout", SQLSTATE 08P01).
func startupTimeoutRefused(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "08P01" &&
		strings.Contains(pe.Message, "startup parameter") && strings.Contains(pe.Message, startupTimeoutParam)
}

// checkServerTimeout reads the statement_timeout the store's sessions have
// and warns when it does not bound them within the store's own: a pooler
// dropped the startup parameter (PgBouncer's ignore_startup_parameters), or
// refused it and the store connected without it. Then a statement whose
// caller gave up may still commit long afterwards, and the role should
// carry the bound instead.
func (s *Store) checkServerTimeout(ctx context.Context) error {
	ctx, cancel := s.opCtx(ctx)
	defer cancel()
	var ms int64
	// pg_settings gives it in milliseconds whatever its text form.
	if err := s.pool.QueryRow(ctx, "SELECT setting::bigint FROM pg_settings WHERE name = 'statement_timeout'").Scan(&ms); err != nil {
		return s.wrap("check statement_timeout", err)
	}
	want := s.cfg.StatementTimeout.Milliseconds()
	if ms > 0 && ms <= want {
		return nil
	}
	have := "0 (no bound)"
	if ms > 0 {
		have = (time.Duration(ms) * time.Millisecond).String()
	}
	user := s.pool.Config().ConnConfig.User
	s.log.Warn("postgres sessions do not bound the store's statements: a statement whose caller gave up may commit long afterwards; a connection pooler dropped or refused the statement_timeout startup parameter? Set it for the store's role",
		zap.String("statement_timeout", have),
		zap.String("want", s.cfg.StatementTimeout.String()),
		zap.Bool("startup_parameter_refused", s.noStartupTimeout.Load()),
		zap.String("fix", fmt.Sprintf("ALTER ROLE %s SET statement_timeout = '%dms'", pgx.Identifier{user}.Sanitize(), want)))
	return nil
}

// preparedStatementHint names the DSN setting that a prepared-statement
// error behind a pooler in transaction or statement mode calls for
// (SQLSTATE 42P05 duplicate_prepared_statement, 26000
// invalid_sql_statement_name), or "".
func preparedStatementHint(err error) string {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || (pe.Code != "42P05" && pe.Code != "26000") || !strings.Contains(pe.Message, "prepared statement") {
		return ""
	}
	return "; behind a connection pooler in transaction or statement mode (PgBouncer), add default_query_exec_mode=exec to the DSN"
}
