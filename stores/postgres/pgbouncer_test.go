//go:build unix

package postgres

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// The tests here put a real PgBouncer, configured as it ships (no
// ignore_startup_parameters), between the store and the test server.

// startPgBouncer starts a PgBouncer in mode (transaction, statement or
// session) in front of the test server, with poolSize server connections
// per database and user, and returns a DSN through it with params added.
// It skips (fails under CI=true) when pgbouncer is not installed.
func startPgBouncer(t *testing.T, mode string, poolSize int, params string) string {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		bin = "/usr/sbin/pgbouncer" // Debian's, outside root's PATH
		if _, statErr := os.Stat(bin); statErr != nil {
			sqltest.Missing(t, "pgbouncer is not installed (apt-get install pgbouncer): "+err.Error())
		}
	}
	cc, err := pgx.ParseConfig(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	port, err := sqltest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	// Not t.TempDir: its parent is root's alone, and PgBouncer may run
	// as postgres.
	dir, err := os.MkdirTemp("", "pgbouncer")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cred, err := sqltest.PostgresCredential()
	if err != nil {
		t.Fatalf("pgbouncer will not run as root, and there is no postgres user to run it as: %v", err)
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	server := fmt.Sprintf("host=%s port=%d user=%s", cc.Host, cc.Port, cc.User)
	if cc.Password != "" {
		server += " password=" + cc.Password
	}
	ini := fmt.Sprintf(`[databases]
* = %s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = %s
default_pool_size = %d
max_client_conn = 200
`, server, port, filepath.Join(dir, "users.txt"), mode, poolSize)
	for name, body := range map[string]string{"pgbouncer.ini": ini, "users.txt": fmt.Sprintf("%q \"\"\n", cc.User)} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var out bytes.Buffer
	cmd := exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("pgbouncer's log:\n%s", out.String())
		}
	})
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgbouncer did not listen on %s within 10s:\n%s", addr, out.String())
		}
	}
	dsn := fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", cc.User, addr, cc.Database)
	if params != "" {
		dsn += "&" + params
	}
	return dsn
}

// openThrough opens a store on table through dsn, its warnings observed,
// and makes the first contact.
func openThrough(t *testing.T, dsn, table string, mutate func(*Config)) (*Store, *observer.ObservedLogs) {
	t.Helper()
	cfg := Config{DSN: dsn, Table: table, MaxConns: 4}
	if mutate != nil {
		mutate(&cfg)
	}
	core, logs := observer.New(zap.InfoLevel)
	s := openAs(t, cfg, zap.New(core))
	if err := s.Ready(context.Background()); err != nil {
		t.Fatalf("first contact through pgbouncer: %v", err)
	}
	return s, logs
}

// TestBehindPgBouncerTransactionMode runs the conformance suite through
// PgBouncer in transaction mode, with the DSN setting the README asks for
// (default_query_exec_mode=exec). Until the build after 39977a6 every
// connection failed: PgBouncer refuses the statement_timeout startup
// parameter the store sends ("unsupported startup parameter"). The store
// now connects without it once refused, and warns that the sessions are
// unbounded unless the role bounds them.
func TestBehindPgBouncerTransactionMode(t *testing.T) {
	dsn := startPgBouncer(t, "transaction", 4, "default_query_exec_mode=exec")
	t.Run("warns of unbounded sessions", func(t *testing.T) {
		table := sqltest.TableName(t)
		dropOnCleanup(t, table)
		_, logs := openThrough(t, dsn, table, func(c *Config) { c.AutoMigrate = true })
		refused := logs.FilterMessageSnippet("connecting without it").Len()
		unbounded := logs.FilterMessageSnippet("do not bound the store's statements").All()
		if refused != 1 || len(unbounded) != 1 {
			t.Fatalf("warnings: %d of the refusal, %d of unbounded sessions; want 1 and 1: %v", refused, len(unbounded), logs.All())
		}
		if fix := unbounded[0].ContextMap()["fix"]; !strings.Contains(fmt.Sprint(fix), "ALTER ROLE") {
			t.Fatalf("the warning's fix: %v", fix)
		}
	})
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		table := sqltest.TableName(t)
		dropOnCleanup(t, table)
		s, _ := openThrough(t, dsn, table, func(c *Config) { c.AutoMigrate = true; c.CombinedWrites = 1 })
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

// TestBehindPgBouncerStatementMode: statement mode allows no transaction
// of more than one statement, so the schema is applied beforehand (here by
// a direct store) and the store runs with auto_migrate and combined_writes
// off, as the README says.
func TestBehindPgBouncerStatementMode(t *testing.T) {
	dsn := startPgBouncer(t, "statement", 4, "default_query_exec_mode=exec")
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		_, cfg := openStore(t, nil) // creates the table, drops it after
		s, _ := openThrough(t, dsn, cfg.Table, nil)
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

// TestBehindPgBouncerPreparedStatements: without
// default_query_exec_mode=exec, pgx prepares each statement under a name
// on the server session it happens to get; in transaction mode a second
// client connection then meets the first one's name on the same session.
// The error names the DSN setting that avoids it. PgBouncer's pool of one
// server connection makes the meeting certain.
func TestBehindPgBouncerPreparedStatements(t *testing.T) {
	dsn := startPgBouncer(t, "transaction", 1, "")
	table := sqltest.TableName(t)
	dropOnCleanup(t, table)
	s, err := Open(context.Background(), Config{DSN: dsn, Table: table, AutoMigrate: true, MaxConns: 4}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	var errs []error
	// Two client connections held at once run the same statements: the
	// second prepares what the first already did on the one server
	// session, whatever the order the pool hands them out in.
	if err := s.Ready(ctx); err != nil {
		errs = append(errs, err)
	}
	a, err := s.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Release()
	// The held connection prepares the store's reservation first: the
	// store's own connection then prepares it again on the one server
	// session.
	if _, err := a.Exec(ctx, s.q.reserve, storetest.NewKey(t), "op", "/p", "p", "f", "o", int64(1e6), int64(1e6), time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
	if _, err := s.Reserve(ctx, r); err != nil {
		errs = append(errs, err)
	}
	found := false
	for _, err := range errs {
		if strings.Contains(err.Error(), "prepared statement") {
			found = true
			if !strings.Contains(err.Error(), "default_query_exec_mode=exec") {
				t.Fatalf("the error does not name the DSN setting: %v", err)
			}
		}
	}
	if !found {
		t.Fatalf("no prepared-statement error met: the case was not shown (errors: %v)", errs)
	}
}

// TestBehindPgBouncerListenNotify: in transaction and statement mode the
// LISTEN runs on whichever server session PgBouncer lends for it, which
// then goes back to its pool, and PgBouncer drops the notifications that
// session gets later ("got packet 'A' from server when not linked"). With
// listen_notify left on, a waiting duplicate slept until its fallback poll
// (here a minute, 1 s by default) after every change. The store now finds
// out at its first contact, by notifying itself, warns and polls instead.
// In session mode the LISTEN keeps its session: no warning, and the
// waiter marks the record so that its change notifies.
func TestBehindPgBouncerListenNotify(t *testing.T) {
	for _, mode := range []string{"transaction", "statement", "session"} {
		t.Run(mode, func(t *testing.T) {
			dsn := startPgBouncer(t, mode, 4, "default_query_exec_mode=exec")
			owner, cfg := openStore(t, nil) // creates the table, drops it after
			waiter, logs := openThrough(t, dsn, cfg.Table, func(c *Config) {
				c.ListenNotify, c.NotifyFallback = true, time.Minute
			})
			unheard := logs.FilterMessageSnippet("set listen_notify off").Len()
			if want := map[bool]int{true: 0, false: 1}[mode == "session"]; unheard != want {
				t.Fatalf("%d warnings that notifications do not arrive, want %d: %v", unheard, want, logs.All())
			}
			awaitFinalize(t, owner, waiter, func(key string) {
				if mode == "session" {
					waitWatched(t, cfg.Table, key)
				} else {
					time.Sleep(100 * time.Millisecond) // the waiter has loaded the in-flight record
				}
			}, "the waiter slept through the Finalize")
		})
	}
}
