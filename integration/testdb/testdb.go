// Package testdb is where the integration tests and benchmarks find their
// PostgreSQL and MariaDB/MySQL servers, create the test database if it is
// missing, and run admin statements. The conventions (environment
// variables, defaults, skip-or-fail) are the store packages' own, from
// sqltest.
//
// PostgreSQL is administered with psql (present wherever the server is, and
// used by .ci/run); MySQL with go-sql-driver/mysql.
package testdb

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

// Server is one database server the tests run against.
type Server struct {
	Name      string // the Caddyfile store module
	Server    string // human name, for messages
	Env, Def  string // DSN environment variable and its default
	StartHint string // command that starts a local server

	// Ensure checks the server is reachable and creates the DSN's
	// database if it is missing.
	Ensure func(ctx context.Context, dsn string) error
	// Exec runs one admin statement.
	Exec func(ctx context.Context, dsn, stmt string) error

	once     sync.Once
	setupErr error
}

var (
	Postgres = &Server{
		Name:      "postgres",
		Server:    "PostgreSQL",
		Env:       "ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN",
		Def:       "postgres://postgres@127.0.0.1:5432/iceberg_idempotency_test?sslmode=disable",
		StartHint: "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
		Ensure:    PgEnsure,
		Exec:      Psql,
	}
	MySQL = &Server{
		Name:      "mysql",
		Server:    "MySQL/MariaDB",
		Env:       "ICEBERG_IDEMPOTENCY_TEST_MYSQL_DSN",
		Def:       "root@tcp(127.0.0.1:3306)/iceberg_idempotency_test",
		StartHint: "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
		Ensure:    MySQLEnsure,
		Exec:      MySQLExec,
	}
)

// DSN returns the server's DSN, creating the test database on first use.
// An unreachable server skips the test with the command that starts it, and
// fails it under CI=true, where the server is part of the setup.
func (s *Server) DSN(t testing.TB) string {
	t.Helper()
	dsn := sqltest.DSN(s.Env, s.Def)
	s.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		s.setupErr = s.Ensure(ctx, dsn)
	})
	if s.setupErr != nil {
		sqltest.Unavailable(t, s.Server, s.Env, s.StartHint, s.setupErr)
	}
	return dsn
}

// DropAtEnd drops table and its schema-version table when the test ends.
// Call it before starting the Caddy nodes that use the table: cleanups run
// last-in first-out, so the table is dropped after the nodes have stopped.
func (s *Server) DropAtEnd(t testing.TB, dsn, table string) {
	t.Cleanup(func() {
		if err := s.Drop(dsn, table); err != nil {
			t.Errorf("dropping %s: %v", table, err)
		}
	})
}

// Drop drops table and its schema-version table.
func (s *Server) Drop(dsn, table string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	return s.Exec(ctx, dsn, "DROP TABLE IF EXISTS "+table+", "+table+"_schema")
}

// --- PostgreSQL, through psql ---

// Psql runs one statement with psql.
func Psql(ctx context.Context, dsn, stmt string) error {
	_, err := PsqlQuery(ctx, dsn, stmt)
	return err
}

// PsqlQuery runs one statement with psql and returns its unaligned,
// tuples-only output.
func PsqlQuery(ctx context.Context, dsn, stmt string) (string, error) {
	cmd := exec.CommandContext(ctx, "psql", "-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-c", stmt)
	cmd.Env = append(os.Environ(), "PGCONNECT_TIMEOUT=5")
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("psql: %v: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	return strings.TrimSpace(out.String()), nil
}

// PgEnsure checks the server answers and creates the DSN's database if it
// does not exist.
func PgEnsure(ctx context.Context, dsn string) error {
	if _, err := exec.LookPath("psql"); err != nil {
		return fmt.Errorf("these tests administer PostgreSQL with psql (postgresql-client): %w", err)
	}
	err := Psql(ctx, dsn, "SELECT 1")
	if err == nil || !strings.Contains(err.Error(), "does not exist") {
		return err
	}
	name, err := PgOption(dsn, "dbname")
	if err != nil || name == "" {
		return fmt.Errorf("test database missing and its name not found in the DSN: %v", err)
	}
	admin, err := PgSetOptions(dsn, map[string]string{"dbname": "postgres"})
	if err != nil {
		return err
	}
	err = Psql(ctx, admin, `CREATE DATABASE "`+strings.ReplaceAll(name, `"`, `""`)+`"`)
	if err != nil && strings.Contains(err.Error(), "already exists") { // created meanwhile
		err = nil
	}
	return err
}

var pgKV = regexp.MustCompile(`(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S*)`)

func isPgURL(dsn string) bool {
	return strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://")
}

// PgOption reads host, port or dbname from a URL or key=value DSN.
func PgOption(dsn, name string) (string, error) {
	if isPgURL(dsn) {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", errors.New("unparsable PostgreSQL DSN") // never echo it: it may hold a password
		}
		switch name {
		case "host":
			return u.Hostname(), nil
		case "port":
			return u.Port(), nil
		case "dbname":
			return strings.TrimPrefix(u.Path, "/"), nil
		}
		return u.Query().Get(name), nil
	}
	for _, m := range pgKV.FindAllStringSubmatch(dsn, -1) {
		if m[1] == name {
			return strings.Trim(m[2], "'"), nil
		}
	}
	return "", nil
}

// PgSetOptions returns dsn with host, port or dbname replaced.
func PgSetOptions(dsn string, set map[string]string) (string, error) {
	if isPgURL(dsn) {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", errors.New("unparsable PostgreSQL DSN")
		}
		host, port := u.Hostname(), u.Port()
		for k, v := range set {
			switch k {
			case "host":
				host = v
			case "port":
				port = v
			case "dbname":
				u.Path = "/" + v
			}
		}
		u.Host = host
		if port != "" {
			u.Host = net.JoinHostPort(host, port)
		}
		return u.String(), nil
	}
	out := dsn
	for k, v := range set {
		re := regexp.MustCompile(`(^|\s)` + k + `\s*=\s*('(?:[^'\\]|\\.)*'|\S*)`)
		if re.MatchString(out) {
			out = re.ReplaceAllLiteralString(out, " "+k+"="+v)
		} else {
			out += " " + k + "=" + v
		}
	}
	return strings.TrimSpace(out), nil
}

// --- MySQL/MariaDB, through go-sql-driver/mysql ---

// OpenMySQL opens dsn with a 5 s connect timeout. Its error never echoes
// the DSN, which may hold a password.
func OpenMySQL(dsn string) (*sql.DB, *mysql.Config, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, nil, errors.New("unparsable MySQL DSN")
	}
	cfg.Timeout = 5 * time.Second
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, nil, err
	}
	return sql.OpenDB(connector), cfg, nil
}

// MySQLEnsure checks the server answers and creates the DSN's database if
// it does not exist.
func MySQLEnsure(ctx context.Context, dsn string) error { return sqltest.EnsureMySQL(ctx, dsn) }

// MySQLExec runs one statement.
func MySQLExec(ctx context.Context, dsn, stmt string) error {
	db, _, err := OpenMySQL(dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	_, err = db.ExecContext(ctx, stmt)
	return err
}
