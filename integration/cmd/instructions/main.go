// Command instructions counts the CPU instructions a real Caddy executes
// per request, route by route, by running it under valgrind's callgrind:
// plain reverse_proxy and the iceberg_idempotency module on the memory store
// (and on PostgreSQL or MySQL when their DSNs are given), in front of one
// upstream that answers 2 KB of JSON. Instruction counts are the same from
// run to run, whatever else the machine does, where timings on a shared
// 2-core machine swing by ±25%: the way to see what a change to the request
// path costs end to end.
//
//	go build -o /tmp/caddy ./cmd/caddy   # in the repository root
//	go run ./cmd/instructions -caddy /tmp/caddy [-n 1000] [-postgres DSN] [-mysql DSN]
//
// Each figure counts everything the process executed while the case's
// requests were served one after another, timers and background work
// included, divided by the number of requests; the median of three rounds.
// The garbage collector is off (GOGC=off): when its cycles land is not the
// same from run to run, and one cycle more or less in a window moved a
// figure by up to 10%. What a request allocates, which is what the
// collector's work follows, is BenchmarkServeHTTP's allocs/op and B/op in
// the root package. Instructions are not time
// (cache misses and system calls are not weighted), and callgrind hides
// some CPU extensions (SHA-256 runs as AVX2 code under it, where the real
// CPU may use its SHA instructions), so compare cases of one run, not runs
// on different machines.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/testdb"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/workload"
)

func main() {
	caddyBin := flag.String("caddy", "", "Caddy binary with the module (go build ./cmd/caddy in the repository root)")
	n := flag.Int("n", 1000, "requests per case")
	pgDSN := flag.String("postgres", "", "PostgreSQL DSN: also measure the postgres store")
	myDSN := flag.String("mysql", "", "MySQL/MariaDB DSN: also measure the mysql store")
	keep := flag.String("keep", "", "directory to keep each case's callgrind dumps in, for callgrind_annotate")
	flag.Parse()
	if *caddyBin == "" || *n < 1 {
		fmt.Fprintln(os.Stderr, "usage: instructions -caddy BINARY [-n REQUESTS] [-postgres DSN] [-mysql DSN]")
		os.Exit(2)
	}
	if err := run(*caddyBin, *n, *pgDSN, *myDSN, *keep); err != nil {
		fmt.Fprintln(os.Stderr, "instructions:", err)
		os.Exit(1)
	}
}

// A case is one kind of request on one route.
type measured struct {
	name   string
	route  string // "" is plain reverse_proxy
	method string
	keyed  bool   // a fresh Idempotency-Key on every request
	replay string // a fixed key, executed once before the count
	perReq float64
}

func run(caddyBin string, n int, pgDSN, myDSN, keep string) error {
	for _, tool := range []string{"valgrind", "callgrind_control"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is needed (Debian package valgrind): %w", tool, err)
		}
	}
	up, err := startUpstream()
	if err != nil {
		return err
	}
	defer up.Close()

	dir, err := os.MkdirTemp("", "iceberg-idempotency-instructions-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	routes := [][2]string{{"memory", "memory"}}
	table := "instructions_" + randomHex(6)
	ctx := context.Background()
	if pgDSN != "" {
		routes = append(routes, [2]string{"postgres", fmt.Sprintf("postgres {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t}", pgDSN, table)})
		defer func() { _ = testdb.Psql(ctx, pgDSN, "DROP TABLE IF EXISTS "+table+", "+table+"_schema") }()
	}
	if myDSN != "" {
		routes = append(routes, [2]string{"mysql", fmt.Sprintf("mysql {\n\t\t\tdsn %q\n\t\t\ttable %s\n\t\t}", myDSN, table)})
		defer func() { _ = testdb.MySQLExec(ctx, myDSN, "DROP TABLE IF EXISTS "+table+", "+table+"_schema") }()
	}
	// A site per route, each on its own port: no request pays for
	// another route's matcher. The ports are picked together: Caddy binds
	// with SO_REUSEPORT, so two sites given one port would silently share it.
	names := append([]string{""}, routeNames(routes)...)
	free, err := caddyproc.FreePorts(len(names))
	if err != nil {
		return err
	}
	ports := map[string]int{}
	for i, name := range names {
		ports[name] = free[i]
	}
	cfg := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(cfg, []byte(caddyfile(ports, up.Addr().String(), routes)), 0o600); err != nil {
		return err
	}

	out := filepath.Join(dir, "callgrind.out")
	cmd := exec.Command("valgrind", "--tool=callgrind", "--callgrind-out-file="+out,
		caddyBin, "run", "--config", cfg, "--adapter", "caddyfile")
	// Go's asynchronous preemption signals trip callgrind. So does
	// RDTSCP, which valgrind 3.19 cannot run and Go's runtime uses to read
	// the clock wherever the CPU has it (AMD EPYC here: Caddy died of
	// SIGILL at once).
	cmd.Env = append(os.Environ(), "GODEBUG=asyncpreemptoff=1,cpu.rdtscp=off", "GOGC=off")
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		return err
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	// A request that fails most likely met a Caddy that died under
	// callgrind: stop it, so that its output is complete, and show its
	// start, where valgrind says what it could not run (the goroutine
	// dump that follows is of no help).
	withLogs := func(err error) error {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return fmt.Errorf("%w; the start of Caddy's output under callgrind:\n%s", err, head(logs.String(), 40))
	}
	urls := map[string]string{}
	for name, port := range ports {
		urls[name] = fmt.Sprintf("http://127.0.0.1:%d", port)
	}
	if err := waitReady(urls[""]); err != nil {
		return fmt.Errorf("%w; its output:\n%s", err, tail(logs.String(), 20))
	}

	cases := []*measured{
		{name: "plain reverse_proxy, POST with a fresh key", method: http.MethodPost, keyed: true},
		{name: "plain reverse_proxy, POST", method: http.MethodPost},
		{name: "plain reverse_proxy, GET", method: http.MethodGet},
		{name: "memory, fresh key", route: "memory", method: http.MethodPost, keyed: true},
		{name: "memory, mutation without key", route: "memory", method: http.MethodPost},
		{name: "memory, GET", route: "memory", method: http.MethodGet},
		{name: "memory, replay", route: "memory", method: http.MethodPost, replay: newKey()},
	}
	for _, r := range routes[1:] {
		cases = append(cases,
			&measured{name: r[0] + ", fresh key", route: r[0], method: http.MethodPost, keyed: true},
			&measured{name: r[0] + ", replay", route: r[0], method: http.MethodPost, replay: newKey()})
	}
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}, Timeout: time.Minute}
	// Warm every route up (the SQL stores' first contact and migration,
	// connections, code) before any count, so that no start-up work lands
	// in a case's window.
	for _, c := range cases {
		if c.replay != "" {
			if err := send(client, urls[c.route], c, c.replay); err != nil {
				return withLogs(err)
			}
		}
		for range 100 {
			if err := send(client, urls[c.route], c, c.key()); err != nil {
				return withLogs(err)
			}
		}
	}
	pid := strconv.Itoa(cmd.Process.Pid)
	perRound := make(map[*measured][]float64)
	if keep != "" {
		if err := os.MkdirAll(keep, 0o755); err != nil {
			return err
		}
	}
	for round := range rounds {
		for _, c := range cases {
			if err := callgrindControl("-z", pid); err != nil {
				return err
			}
			for range n {
				if err := send(client, urls[c.route], c, c.key()); err != nil {
					return withLogs(err)
				}
			}
			if err := callgrindControl("-d", pid); err != nil {
				return err
			}
			total, dump, err := newestDump(dir)
			if err != nil {
				return err
			}
			if keep != "" {
				kept := filepath.Join(keep, fmt.Sprintf("%s.round%d.callgrind", slug(c.name), round+1))
				if err := os.Rename(dump, kept); err != nil {
					return err
				}
			}
			perRound[c] = append(perRound[c], float64(total)/float64(n))
		}
	}
	for _, c := range cases {
		c.perReq = median(perRound[c])
	}
	writeTable(os.Stdout, cases, n, rounds)
	return nil
}

// rounds is how often every case is counted; the table shows the median,
// so that one round's background work (a garbage collection of the whole
// heap, a timer) does not decide a figure.
const rounds = 3

func median(vs []float64) float64 {
	s := append([]float64(nil), vs...)
	slices.Sort(s)
	return s[len(s)/2]
}

func (c *measured) key() string {
	switch {
	case c.replay != "":
		return c.replay
	case c.keyed:
		return newKey()
	}
	return ""
}

// caddyfile has a site per route, on the port ports gives its name: plain
// reverse_proxy on ports[""], and for each {name, store} the module on that
// store before reverse_proxy.
func caddyfile(ports map[string]int, upstream string, routes [][2]string) string {
	var b strings.Builder
	b.WriteString("{\n\tadmin off\n\tauto_https off\n\tpersist_config off\n\tlog default {\n\t\tlevel ERROR\n\t}\n}\n")
	fmt.Fprintf(&b, ":%d {\n\treverse_proxy %s\n}\n", ports[""], upstream)
	for _, r := range routes {
		fmt.Fprintf(&b, ":%d {\n\ticeberg_idempotency {\n\t\tstore %s\n\t}\n\treverse_proxy %s\n}\n", ports[r[0]], r[1], upstream)
	}
	return b.String()
}

func routeNames(routes [][2]string) []string {
	var names []string
	for _, r := range routes {
		names = append(names, r[0])
	}
	return names
}

func send(client *http.Client, base string, c *measured, key string) error {
	path := workload.CommitPath
	if c.method == http.MethodGet {
		path = workload.ReadPath
	}
	req, err := workload.NewRequest(c.method, base+path, key)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: status %d", c.name, resp.StatusCode)
	}
	return nil
}

func startUpstream() (net.Listener, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	go func() {
		_ = http.Serve(ln, http.HandlerFunc(workload.Answer))
	}()
	return ln, nil
}

// waitReady waits for Caddy, slow to start under callgrind, to answer.
func waitReady(base string) error {
	deadline := time.Now().Add(3 * time.Minute)
	client := &http.Client{Timeout: 10 * time.Second}
	for time.Now().Before(deadline) {
		if resp, err := client.Get(base + workload.ReadPath); err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(time.Second)
	}
	return errors.New("caddy under callgrind did not answer within 3 minutes")
}

func callgrindControl(args ...string) error {
	out, err := exec.Command("callgrind_control", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("callgrind_control %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

var dumpName = regexp.MustCompile(`^callgrind\.out\.(\d+)$`)

// newestDump reads the instruction total of the newest numbered dump in
// dir, and gives its path.
func newestDump(dir string) (int64, string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, "", err
	}
	newest, name := -1, ""
	for _, e := range entries {
		if m := dumpName.FindStringSubmatch(e.Name()); m != nil {
			if i, _ := strconv.Atoi(m[1]); i > newest {
				newest, name = i, e.Name()
			}
		}
	}
	if name == "" {
		return 0, "", errors.New("callgrind wrote no dump")
	}
	path := filepath.Join(dir, name)
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, "", err
	}
	total, err := dumpTotal(raw)
	return total, path, err
}

// slug is a case's name as a file name: "memory, fresh key" is
// "memory-fresh-key".
func slug(name string) string {
	return strings.Trim(nonWord.ReplaceAllString(strings.ToLower(name), "-"), "-")
}

var nonWord = regexp.MustCompile(`[^a-z0-9]+`)

// dumpTotal is the event total of a callgrind dump: its "summary:" line
// (or "totals:", which some versions write instead).
func dumpTotal(raw []byte) (int64, error) {
	for _, line := range strings.Split(string(raw), "\n") {
		for _, p := range []string{"summary:", "totals:"} {
			if v, ok := strings.CutPrefix(line, p); ok {
				return strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			}
		}
	}
	return 0, errors.New("callgrind dump without a summary line")
}

// writeTable prints the cases in Markdown, each module case against the
// plain reverse_proxy case of the same request.
func writeTable(w io.Writer, cases []*measured, n, rounds int) {
	plain := map[string]float64{}
	for _, c := range cases {
		if c.route == "" {
			plain[c.method+strconv.FormatBool(c.keyed)] = c.perReq
		}
	}
	fmt.Fprintf(w, "| case (%d requests each, one at a time; median of %d rounds) | instructions per request | vs plain | added per request |\n| --- | --- | --- | --- |\n", n, rounds)
	for _, c := range cases {
		ref := plain[c.method+strconv.FormatBool(c.keyed || c.replay != "")]
		if c.route == "" || ref == 0 {
			fmt.Fprintf(w, "| %s | %s |  |  |\n", c.name, thousands(c.perReq))
			continue
		}
		fmt.Fprintf(w, "| %s | %s | %.2f | %s |\n", c.name, thousands(c.perReq), c.perReq/ref, thousands(c.perReq-ref))
	}
}

// thousands formats v rounded, with thousands separators.
func thousands(v float64) string {
	s := strconv.FormatInt(int64(v+0.5*sign(v)), 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	if neg {
		return "-" + s
	}
	return s
}

func sign(v float64) float64 {
	if v < 0 {
		return -1
	}
	return 1
}

func newKey() string { return uuid.Must(uuid.NewV7()).String() }

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%x", b)
}

func head(s string, lines int) string {
	parts := strings.SplitN(s, "\n", lines+1)
	return strings.Join(parts[:min(len(parts), lines)], "\n")
}

func tail(s string, lines int) string {
	parts := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n")
}
