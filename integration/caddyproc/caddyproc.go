// Package caddyproc runs real Caddy processes, built from this repository
// with the iceberg_idempotency module, for end-to-end tests.
//
// The binary is built once per test process (or taken from $CADDY_BINARY).
// Each Instance is a separate process on free loopback ports (reserved until
// its test ends, see ports.go), configured from a Caddyfile template, with
// its logs captured so tests can inspect them.
//
// A Caddyfile template is a text/template rendered with Vars. It should put
// {{.Global}} in its global options block, since that carries the options the
// harness relies on (admin address, no automatic HTTPS, no persisted config),
// and listen on {{.Port}}:
//
//	{
//		{{.Global}}
//		debug
//	}
//	:{{.Port}} {
//		iceberg_idempotency
//		reverse_proxy 127.0.0.1:8181
//	}
//
// Caddyfile composes such a template from a global-options snippet and a site
// body, which is all most tests need.
package caddyproc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"text/template"
	"time"
)

// BinaryEnv names the environment variable that points at a prebuilt Caddy
// binary, which then replaces the build.
const BinaryEnv = "CADDY_BINARY"

const (
	buildTimeout = 15 * time.Minute
	startTimeout = 30 * time.Second
	stopTimeout  = 10 * time.Second
	// startAttempts covers the window between picking a free port and Caddy
	// binding it, in which another process may take it.
	startAttempts = 3
)

var (
	buildOnce sync.Once
	buildDir  string
	buildPath string
	buildErr  error
)

// Binary returns the path of a Caddy binary with the iceberg_idempotency
// module: $CADDY_BINARY if set, else one built on first use and shared by
// every test of the process. Call Main from TestMain to remove the build
// directory at exit.
func Binary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() { buildPath, buildErr = build() })
	if buildErr != nil {
		t.Fatalf("caddyproc: %v", buildErr)
	}
	return buildPath
}

// Main runs the tests and then removes the binary the harness built:
//
//	func TestMain(m *testing.M) { os.Exit(caddyproc.Main(m)) }
func Main(m *testing.M) int {
	code := m.Run()
	if buildDir != "" {
		_ = os.RemoveAll(buildDir)
	}
	return code
}

func build() (string, error) {
	if p := os.Getenv(BinaryEnv); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("%s: %w", BinaryEnv, err)
		}
		return p, nil
	}
	root, err := repoRoot()
	if err != nil {
		return "", err
	}
	dir, err := os.MkdirTemp("", "caddyproc-")
	if err != nil {
		return "", err
	}
	buildDir = dir
	out := filepath.Join(dir, "caddy")
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	// Built inside the plugin's own module so the binary has exactly the
	// dependency versions the plugin ships with, not those the integration
	// module's other requirements would select.
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "./cmd/caddy")
	cmd.Dir = root
	if msg, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building caddy in %s: %v\n%s", root, err, msg)
	}
	return out, nil
}

// repoRoot is the plugin module's directory, found from this file's location
// so the tests do not depend on the working directory.
func repoRoot() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("cannot locate caddyproc source")
	}
	root := filepath.Join(filepath.Dir(file), "..", "..")
	if _, err := os.Stat(filepath.Join(root, "cmd", "caddy", "main.go")); err != nil {
		return "", fmt.Errorf("plugin module not found at %s: %w", root, err)
	}
	return root, nil
}

// Vars are the fields a Caddyfile template can use.
type Vars struct {
	Port      int    // HTTP listener
	AdminPort int    // admin API
	Global    string // global options the harness needs; put inside the global block
}

// Caddyfile returns a template with the harness's global options plus
// extraGlobal, and one site on {{.Port}} whose body is site.
func Caddyfile(extraGlobal, site string) string {
	return "{\n\t{{.Global}}\n" + indent(extraGlobal) + "}\n\n:{{.Port}} {\n" + indent(site) + "}\n"
}

func indent(s string) string {
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimSpace(s), "\n") {
		if line = strings.TrimSpace(line); line != "" {
			b.WriteString("\t" + line + "\n")
		}
	}
	return b.String()
}

// Options tune Start; the zero value is what most tests want.
type Options struct {
	// Port and AdminPort fix the ports (e.g. to restart on the same
	// address after Kill); 0 picks a free one.
	Port, AdminPort int
	// Env is added to the process environment.
	Env []string
	// Binary runs this Caddy binary instead of Binary's, e.g. one built
	// from an earlier commit to compare against.
	Binary string
}

// Instance is one running Caddy process.
type Instance struct {
	Vars
	cmd    *exec.Cmd
	logs   *syncBuffer
	exited chan struct{}
	stop   sync.Once
	ports  *portLease // released when the test ends
}

// Start runs Caddy on the Caddyfile template and waits until its admin API
// and HTTP listener answer. The process is stopped when the test ends, and
// its logs are printed if the test failed.
func Start(t testing.TB, caddyfile string) *Instance {
	t.Helper()
	return StartWith(t, caddyfile, Options{})
}

// StartWith is Start with Options.
func StartWith(t testing.TB, caddyfile string, opts Options) *Instance {
	t.Helper()
	bin := opts.Binary
	if bin == "" {
		bin = Binary(t)
	}
	tmpl, err := template.New("Caddyfile").Option("missingkey=error").Parse(caddyfile)
	if err != nil {
		t.Fatalf("caddyproc: parsing Caddyfile template: %v", err)
	}
	dir := t.TempDir()
	var lastErr error
	for attempt := 0; attempt < startAttempts; attempt++ {
		inst, err := start(bin, tmpl, dir, opts)
		if err == nil {
			t.Cleanup(func() {
				inst.Stop()
				// Only now: a test may Kill the instance and start
				// another on the same ports (Options.Port).
				inst.ports.release()
				if t.Failed() {
					t.Logf("caddy logs (:%d):\n%s", inst.Port, tail(inst.Logs(), 64<<10))
				}
			})
			return inst
		}
		lastErr = err
		if !errors.Is(err, errAddrInUse) || (opts.Port != 0 && opts.AdminPort != 0) {
			break
		}
	}
	t.Fatalf("caddyproc: %v", lastErr)
	return nil
}

var errAddrInUse = errors.New("address already in use")

func start(bin string, tmpl *template.Template, dir string, opts Options) (*Instance, error) {
	// A fixed port is typically an earlier instance's, whose lease (held
	// until its test ends) keeps reservePorts from picking it again.
	lease, err := reservePorts(2)
	if err != nil {
		return nil, err
	}
	port, admin := opts.Port, opts.AdminPort
	if port == 0 {
		port = lease.ports[0]
	}
	if admin == 0 {
		admin = lease.ports[1]
	}
	inst, err := launch(bin, tmpl, dir, port, admin, opts)
	if err != nil {
		lease.release()
		return nil, err
	}
	inst.ports = lease
	return inst, nil
}

// launch runs Caddy on the given ports and waits until it is ready.
func launch(bin string, tmpl *template.Template, dir string, port, admin int, opts Options) (*Instance, error) {
	inst := &Instance{
		Vars: Vars{
			Port:      port,
			AdminPort: admin,
			Global: fmt.Sprintf("admin 127.0.0.1:%d\n\tauto_https off\n\tpersist_config off\n\tdefault_bind 127.0.0.1\n\tgrace_period 2s",
				admin),
		},
		logs:   &syncBuffer{},
		exited: make(chan struct{}),
	}
	cfg, err := inst.render(tmpl)
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(path, cfg, 0o600); err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "run", "--config", path, "--adapter", "caddyfile")
	cmd.Dir = dir
	// Caddy keeps state under $HOME/XDG dirs; isolate it per instance.
	cmd.Env = append(os.Environ(),
		"HOME="+dir, "XDG_CONFIG_HOME="+filepath.Join(dir, "config"), "XDG_DATA_HOME="+filepath.Join(dir, "data"))
	cmd.Env = append(cmd.Env, opts.Env...)
	cmd.Stdout = inst.logs
	cmd.Stderr = inst.logs
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting caddy: %w", err)
	}
	inst.cmd = cmd
	go func() {
		_ = cmd.Wait()
		close(inst.exited)
	}()
	if err := inst.waitReady(); err != nil {
		inst.Kill()
		logs := inst.Logs()
		if strings.Contains(logs, "address already in use") {
			return nil, fmt.Errorf("%w: %v\n%s", errAddrInUse, err, tail(logs, 8<<10))
		}
		return nil, fmt.Errorf("%v\nCaddyfile:\n%s\nlogs:\n%s", err, cfg, tail(logs, 16<<10))
	}
	return inst, nil
}

func (i *Instance) render(tmpl *template.Template) ([]byte, error) {
	var b bytes.Buffer
	if err := tmpl.Execute(&b, i.Vars); err != nil {
		return nil, fmt.Errorf("rendering Caddyfile template: %w", err)
	}
	return b.Bytes(), nil
}

// adminTransport opens a connection per admin request: every /load
// replaces Caddy's admin server, and a kept-alive connection to the old one
// can be reset under the next request (CI saw a POST /load fail so).
var adminTransport = &http.Transport{DisableKeepAlives: true}

func (i *Instance) waitReady() error {
	deadline := time.Now().Add(startTimeout)
	client := &http.Client{Timeout: time.Second, Transport: adminTransport}
	for {
		select {
		case <-i.exited:
			return errors.New("caddy exited during startup")
		default:
		}
		if i.adminReady(client) && dialable(i.Port) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("caddy not ready after %v", startTimeout)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

func (i *Instance) adminReady(client *http.Client) bool {
	resp, err := client.Get(i.AdminURL() + "/config/")
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func dialable(port int) bool {
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), time.Second)
	if err != nil {
		return false
	}
	_ = c.Close()
	return true
}

// URL is the base URL of the HTTP listener, without a trailing slash.
func (i *Instance) URL() string { return "http://127.0.0.1:" + strconv.Itoa(i.Port) }

// AdminURL is the base URL of the admin API.
func (i *Instance) AdminURL() string { return "http://127.0.0.1:" + strconv.Itoa(i.AdminPort) }

// Logs returns everything the process wrote to stdout and stderr so far.
func (i *Instance) Logs() string { return i.logs.String() }

// Load replaces the running configuration through the admin API (POST /load)
// with the Caddyfile template rendered for this instance's ports. The reload
// is forced even when the config is unchanged, so a test always exercises
// Caddy's provision-new/stop-old sequence.
func (i *Instance) Load(caddyfile string) error {
	tmpl, err := template.New("Caddyfile").Option("missingkey=error").Parse(caddyfile)
	if err != nil {
		return fmt.Errorf("parsing Caddyfile template: %w", err)
	}
	cfg, err := i.render(tmpl)
	if err != nil {
		return err
	}
	req, err := http.NewRequest(http.MethodPost, i.AdminURL()+"/load", bytes.NewReader(cfg))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	req.Header.Set("Cache-Control", "must-revalidate")
	resp, err := (&http.Client{Timeout: startTimeout, Transport: adminTransport}).Do(req)
	if err != nil {
		return fmt.Errorf("POST /load: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST /load: %s: %s", resp.Status, body)
	}
	return nil
}

// Reload is Load that fails the test on error.
func (i *Instance) Reload(t testing.TB, caddyfile string) {
	t.Helper()
	if err := i.Load(caddyfile); err != nil {
		t.Fatalf("caddyproc: %v", err)
	}
}

// Config returns the running configuration as JSON (GET /config/).
func (i *Instance) Config(t testing.TB) []byte {
	t.Helper()
	resp, err := (&http.Client{Timeout: 10 * time.Second, Transport: adminTransport}).Get(i.AdminURL() + "/config/")
	if err != nil {
		t.Fatalf("caddyproc: GET /config/: %v", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("caddyproc: GET /config/: %s %v", resp.Status, err)
	}
	return body
}

// Stop shuts Caddy down gracefully (SIGINT) and waits for it to exit,
// killing it if it takes longer than a few seconds. Safe to call twice.
func (i *Instance) Stop() {
	i.stop.Do(func() {
		if i.cmd.Process == nil {
			return
		}
		_ = i.cmd.Process.Signal(os.Interrupt)
		select {
		case <-i.exited:
		case <-time.After(stopTimeout):
			_ = i.cmd.Process.Kill()
			<-i.exited
		}
	})
}

// Kill ends Caddy with SIGKILL, as a crash would, and waits for it to be
// gone. Nothing is flushed or released.
func (i *Instance) Kill() {
	i.stop.Do(func() {
		if i.cmd.Process == nil {
			return
		}
		_ = i.cmd.Process.Kill() // SIGKILL on Unix
		<-i.exited
	})
}

// Exited reports whether the process has ended.
func (i *Instance) Exited() bool {
	select {
	case <-i.exited:
		return true
	default:
		return false
	}
}

// syncBuffer is written by the process's output copier and read by tests.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}
