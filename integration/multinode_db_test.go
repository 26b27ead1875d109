package integration_test

// Database plumbing for the multi-node tests: where the PostgreSQL and
// MariaDB/MySQL test servers are, and a fresh table per test. The proxy that
// cuts a node off its database is the plugin's sqltest.Proxy.
//
// PostgreSQL is administered with psql (present wherever the server is, and
// used by .ci/run) rather than pgx, which this module does not need
// otherwise; MySQL with go-sql-driver/mysql. The conventions (environment
// variables, defaults, skip-or-fail) are sqltest's.

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
)

// sqlDB is one database server the multi-node tests run against.
type sqlDB struct {
	name      string // subtest name and Caddyfile store module
	server    string // human name, for messages
	env, def  string // DSN environment variable and its default
	startHint string // command that starts a local server
	openedLog string // what the store module logs when it opens a pool

	ensure func(ctx context.Context, dsn string) error       // reachable; database created if missing
	exec   func(ctx context.Context, dsn, stmt string) error // one admin statement
	target func(dsn string) (string, error)                  // the server's host:port
	via    func(dsn, addr string) (string, error)            // the DSN, pointed at addr instead

	once     sync.Once
	setupErr error
}

var (
	postgresDB = &sqlDB{
		name:      "postgres",
		server:    "PostgreSQL",
		env:       "ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN",
		def:       "postgres://postgres@127.0.0.1:5432/iceberg_idempotency_test?sslmode=disable",
		startHint: "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
		openedLog: "opened postgres store",
		ensure:    pgEnsure,
		exec:      psql,
		target:    pgTarget,
		via:       pgVia,
	}
	mysqlDB = &sqlDB{
		name:      "mysql",
		server:    "MySQL/MariaDB",
		env:       "ICEBERG_IDEMPOTENCY_TEST_MYSQL_DSN",
		def:       "root@tcp(127.0.0.1:3306)/iceberg_idempotency_test",
		startHint: "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
		openedLog: "opened mysql store",
		ensure:    myEnsure,
		exec:      myExec,
		target:    myTarget,
		via:       myVia,
	}
	multiNodeDBs = []*sqlDB{postgresDB, mysqlDB}
)

// dsn returns the server's DSN, creating the test database on first use.
// An unreachable server skips the test with the command that starts it, and
// fails it under CI=true, where the server is part of the setup.
func (d *sqlDB) dsn(t testing.TB) string {
	t.Helper()
	dsn := d.def
	if v := os.Getenv(d.env); v != "" {
		dsn = v
	}
	d.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		d.setupErr = d.ensure(ctx, dsn)
	})
	if d.setupErr != nil {
		msg := d.server + " is not reachable (" + d.setupErr.Error() + "); set " + d.env + " or start it with: " + d.startHint
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return dsn
}

// newTable names a fresh records table, dropped (with its schema-version
// table) when the test ends. Call it before starting the Caddy nodes that
// use it: cleanups run last-in first-out, so the table is dropped after the
// nodes have stopped.
func (d *sqlDB) newTable(t testing.TB, dsn string) string {
	t.Helper()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	table := "multinode_" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := d.exec(ctx, dsn, "DROP TABLE IF EXISTS "+table+", "+table+"_schema"); err != nil {
			t.Errorf("dropping %s: %v", table, err)
		}
	})
	return table
}

// storeBlock is the Caddyfile `store` subdirective for dsn and table.
func (d *sqlDB) storeBlock(dsn, table string, options ...string) string {
	return "store " + d.name + " {\n" +
		"dsn " + strconv.Quote(dsn) + "\n" +
		"table " + table + "\n" +
		strings.Join(options, "\n") + "\n}"
}

// --- PostgreSQL, through psql ---

func psql(ctx context.Context, dsn, stmt string) error {
	cmd := exec.CommandContext(ctx, "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-c", stmt)
	cmd.Env = append(os.Environ(), "PGCONNECT_TIMEOUT=5")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("psql: %v: %s", err, bytes.TrimSpace(out))
	}
	return nil
}

func pgEnsure(ctx context.Context, dsn string) error {
	if _, err := exec.LookPath("psql"); err != nil {
		return fmt.Errorf("these tests administer PostgreSQL with psql (postgresql-client): %w", err)
	}
	err := psql(ctx, dsn, "SELECT 1")
	if err == nil || !strings.Contains(err.Error(), "does not exist") {
		return err
	}
	name, err := pgOption(dsn, "dbname")
	if err != nil || name == "" {
		return fmt.Errorf("test database missing and its name not found in the DSN: %v", err)
	}
	admin, err := pgSetOptions(dsn, map[string]string{"dbname": "postgres"})
	if err != nil {
		return err
	}
	err = psql(ctx, admin, `CREATE DATABASE "`+strings.ReplaceAll(name, `"`, `""`)+`"`)
	if err != nil && strings.Contains(err.Error(), "already exists") { // created meanwhile
		err = nil
	}
	return err
}

func pgTarget(dsn string) (string, error) {
	host, err := pgOption(dsn, "host")
	if err != nil {
		return "", err
	}
	port, err := pgOption(dsn, "port")
	if err != nil {
		return "", err
	}
	if host == "" || strings.HasPrefix(host, "/") {
		return "", fmt.Errorf("the PostgreSQL DSN must name a TCP host to be proxied, got %q", host)
	}
	if port == "" {
		port = "5432"
	}
	return net.JoinHostPort(host, port), nil
}

func pgVia(dsn, addr string) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", err
	}
	return pgSetOptions(dsn, map[string]string{"host": host, "port": port})
}

var pgKV = regexp.MustCompile(`(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S*)`)

func isPgURL(dsn string) bool {
	return strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://")
}

// pgOption reads host, port or dbname from a URL or key=value DSN.
func pgOption(dsn, name string) (string, error) {
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

// pgSetOptions returns dsn with host, port or dbname replaced.
func pgSetOptions(dsn string, set map[string]string) (string, error) {
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

func myOpen(dsn string) (*sql.DB, *mysql.Config, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, nil, errors.New("unparsable MySQL DSN") // never echo it: it may hold a password
	}
	cfg.Timeout = 5 * time.Second
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, nil, err
	}
	return sql.OpenDB(connector), cfg, nil
}

func myEnsure(ctx context.Context, dsn string) error {
	db, cfg, err := myOpen(dsn)
	if err != nil {
		return err
	}
	err = db.PingContext(ctx)
	db.Close()
	var me *mysql.MySQLError
	if !errors.As(err, &me) || me.Number != 1049 { // ER_BAD_DB_ERROR
		return err
	}
	name := cfg.DBName
	cfg.DBName = ""
	db, _, err = myOpen(cfg.FormatDSN())
	if err != nil {
		return err
	}
	defer db.Close()
	_, err = db.ExecContext(ctx, "CREATE DATABASE IF NOT EXISTS `"+strings.ReplaceAll(name, "`", "``")+"`")
	return err
}

func myExec(ctx context.Context, dsn, stmt string) error {
	db, _, err := myOpen(dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	_, err = db.ExecContext(ctx, stmt)
	return err
}

func myTarget(dsn string) (string, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return "", errors.New("unparsable MySQL DSN")
	}
	if cfg.Net != "tcp" {
		return "", fmt.Errorf("the MySQL DSN must use tcp to be proxied, got %q", cfg.Net)
	}
	return cfg.Addr, nil
}

func myVia(dsn, addr string) (string, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return "", errors.New("unparsable MySQL DSN")
	}
	cfg.Net, cfg.Addr = "tcp", addr
	return cfg.FormatDSN(), nil
}
