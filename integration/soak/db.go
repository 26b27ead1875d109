package soak

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
)

// privateDB is a database server this soak starts itself, on its own port
// and data directory, so that it can crash it (SIGKILL to its whole process
// group) and freeze it (SIGSTOP) without touching a server anybody else uses.
type privateDB struct {
	kind string // postgres, mysql, redis
	dir  string
	port int

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	logf *os.File
}

const pgBin = "/usr/lib/postgresql/15/bin"

func newPrivateDB(kind, dir string, port int) (*privateDB, error) {
	d := &privateDB{kind: kind, dir: dir, port: port}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	lf, err := os.Create(filepath.Join(dir, "server.log"))
	if err != nil {
		return nil, err
	}
	d.logf = lf
	if err := d.init(); err != nil {
		return nil, err
	}
	if err := d.start(); err != nil {
		return nil, err
	}
	return d, nil
}

func (d *privateDB) dataDir() string { return filepath.Join(d.dir, "data") }

func (d *privateDB) init() error {
	switch d.kind {
	case "postgres":
		cred, err := sqltest.PostgresCredential()
		if err != nil {
			return err
		}
		if err := os.MkdirAll(d.dataDir(), 0o700); err != nil {
			return err
		}
		if cred != nil {
			if err := os.Chown(d.dir, int(cred.Uid), int(cred.Gid)); err != nil {
				return err
			}
			if err := os.Chown(d.dataDir(), int(cred.Uid), int(cred.Gid)); err != nil {
				return err
			}
		}
		cmd := exec.Command(pgBin+"/initdb", "-D", d.dataDir(), "-U", "postgres", "--auth=trust", "--no-sync")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("initdb: %v\n%s", err, out)
		}
	case "mysql":
		cmd := exec.Command("mariadb-install-db", "--no-defaults", "--datadir="+d.dataDir(), "--user=root",
			"--auth-root-authentication-method=normal", "--skip-test-db")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("mariadb-install-db: %v\n%s", err, out)
		}
	case "redis":
		if err := os.MkdirAll(d.dataDir(), 0o755); err != nil {
			return err
		}
	default:
		return fmt.Errorf("no private server for %q", d.kind)
	}
	return nil
}

func (d *privateDB) command() (*exec.Cmd, error) {
	p := strconv.Itoa(d.port)
	switch d.kind {
	case "postgres":
		cred, err := sqltest.PostgresCredential()
		if err != nil {
			return nil, err
		}
		cmd := exec.Command(pgBin+"/postgres", "-D", d.dataDir(), "-p", p, "-k", d.dir,
			"-c", "listen_addresses=127.0.0.1", "-c", "max_connections=200", "-c", "fsync=on",
			"-c", "synchronous_commit=on")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: cred}
		return cmd, nil
	case "mysql":
		cmd := exec.Command("/usr/sbin/mariadbd", "--no-defaults", "--datadir="+d.dataDir(), "--port="+p,
			"--socket="+filepath.Join(d.dir, "mysqld.sock"), "--bind-address=127.0.0.1", "--user=root",
			"--skip-grant-tables", "--innodb-flush-log-at-trx-commit=1", "--max-connections=300",
			"--pid-file="+filepath.Join(d.dir, "mysqld.pid"))
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		return cmd, nil
	case "redis":
		// appendfsync always: the README's condition for a crash to lose
		// nothing Redis acknowledged.
		cmd := exec.Command("redis-server", "--port", p, "--bind", "127.0.0.1", "--save", "",
			"--appendonly", "yes", "--appendfsync", "always", "--dir", d.dataDir())
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		return cmd, nil
	}
	return nil, errors.New("unknown kind")
}

func (d *privateDB) start() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	cmd, err := d.command()
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = d.logf, d.logf
	if err := cmd.Start(); err != nil {
		return err
	}
	d.cmd = cmd
	done := make(chan struct{})
	d.done = done
	go func() { _ = cmd.Wait(); close(done) }()
	deadline := time.Now().Add(90 * time.Second)
	for {
		if d.ready() {
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("%s exited during startup (see %s)", d.kind, d.logf.Name())
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after 90s", d.kind)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (d *privateDB) ready() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	switch d.kind {
	case "postgres":
		c, err := pgx.Connect(ctx, d.adminDSN())
		if err != nil {
			return false
		}
		defer c.Close(ctx)
		return c.Ping(ctx) == nil
	case "mysql":
		db, err := sql.Open("mysql", fmt.Sprintf("root@tcp(127.0.0.1:%d)/", d.port))
		if err != nil {
			return false
		}
		defer db.Close()
		if _, err := db.ExecContext(ctx, "CREATE DATABASE IF NOT EXISTS soak"); err != nil {
			return false
		}
		return true
	case "redis":
		c, err := net.DialTimeout("tcp", d.addr(), time.Second)
		if err != nil {
			return false
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.Write([]byte("PING\r\n")); err != nil {
			return false
		}
		buf := make([]byte, 64)
		n, _ := c.Read(buf)
		return n >= 5 && string(buf[:5]) == "+PONG"
	}
	return false
}

func (d *privateDB) addr() string { return "127.0.0.1:" + strconv.Itoa(d.port) }

func (d *privateDB) adminDSN() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", d.port)
}

// storeBlock is the Caddyfile store block for this server; variant changes
// the pool size, so that a reload opens a new pool on the same records.
func (d *privateDB) storeBlock(variant int) string {
	conns := 8 + 4*variant
	switch d.kind {
	case "postgres":
		return fmt.Sprintf("store postgres {\ndsn %q\ntable soak\nstatement_timeout 2s\nmax_conns %d\n}", d.adminDSN(), conns)
	case "mysql":
		cfg := mysql.NewConfig()
		cfg.User, cfg.Net, cfg.Addr, cfg.DBName = "root", "tcp", d.addr(), "soak"
		return fmt.Sprintf("store mysql {\ndsn %q\ntable soak\nstatement_timeout 2s\nmax_conns %d\n}", cfg.FormatDSN(), conns)
	case "redis":
		return fmt.Sprintf("store redis {\naddress %s\nkey_prefix soak:\ntimeout 2s\npool_size %d\n}", d.addr(), conns)
	}
	return ""
}

// crash kills the server's whole process group with SIGKILL and waits until
// every process of it is gone.
func (d *privateDB) crash() {
	d.mu.Lock()
	pid, done := d.cmd.Process.Pid, d.done
	d.mu.Unlock()
	_ = syscall.Kill(-pid, syscall.SIGCONT)
	_ = syscall.Kill(-pid, syscall.SIGKILL)
	<-done
	for i := 0; i < 200; i++ {
		if err := syscall.Kill(-pid, 0); errors.Is(err, syscall.ESRCH) {
			return
		}
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		time.Sleep(50 * time.Millisecond)
	}
}

// freeze stops (SIGSTOP) or resumes (SIGCONT) every process of the server.
func (d *privateDB) freeze(stop bool) {
	d.mu.Lock()
	pid := d.cmd.Process.Pid
	d.mu.Unlock()
	sig := syscall.SIGCONT
	if stop {
		sig = syscall.SIGSTOP
	}
	_ = syscall.Kill(-pid, sig)
}

func (d *privateDB) close() {
	d.crash()
	_ = d.logf.Close()
}
