package integration_test

// Database plumbing for the multi-node tests: the servers (testdb), a fresh
// table per test, and where a proxy goes between the nodes and a server.
// The proxy that cuts a node off its database is the plugin's
// sqltest.Proxy.

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"

	"github.com/go-sql-driver/mysql"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/testdb"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

// sqlDB is one database server the multi-node tests run against, with what
// they need beyond testdb's: the store's log line and a way to put a proxy
// between the nodes and the server.
type sqlDB struct {
	*testdb.Server
	openedLog string                                 // what the store module logs when it opens a pool
	target    func(dsn string) (string, error)       // the server's host:port
	via       func(dsn, addr string) (string, error) // the DSN, pointed at addr instead
}

var (
	postgresDB   = &sqlDB{Server: testdb.Postgres, openedLog: "opened postgres store", target: pgTarget, via: pgVia}
	mysqlDB      = &sqlDB{Server: testdb.MySQL, openedLog: "opened mysql store", target: myTarget, via: myVia}
	multiNodeDBs = []*sqlDB{postgresDB, mysqlDB}
)

// dsn returns the server's DSN (see testdb.Server.DSN).
func (d *sqlDB) dsn(t testing.TB) string {
	t.Helper()
	return d.DSN(t)
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
	d.DropAtEnd(t, dsn, table)
	return table
}

// storeBlock is the Caddyfile `store` subdirective for dsn and table.
func (d *sqlDB) storeBlock(dsn, table string, options ...string) string {
	return "store " + d.Name + " {\n" +
		"dsn " + strconv.Quote(dsn) + "\n" +
		"table " + table + "\n" +
		strings.Join(options, "\n") + "\n}"
}

// --- PostgreSQL ---

func pgTarget(dsn string) (string, error) {
	host, err := testdb.PgOption(dsn, "host")
	if err != nil {
		return "", err
	}
	port, err := testdb.PgOption(dsn, "port")
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
	return testdb.PgSetOptions(dsn, map[string]string{"host": host, "port": port})
}

// --- MySQL/MariaDB ---

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

// proxied puts a TCP proxy the test controls between the nodes and the
// database server, and returns it with dsn pointed at it. It skips when
// dsn names no TCP server (a socket).
func (d *sqlDB) proxied(t *testing.T, dsn string) (*sqltest.Proxy, string) {
	t.Helper()
	target, err := d.target(dsn)
	if err != nil {
		t.Skip(err)
	}
	proxy := sqltest.NewProxy(t, target)
	viaProxy, err := d.via(dsn, proxy.Addr())
	if err != nil {
		t.Fatal(err)
	}
	return proxy, viaProxy
}
