package icebergidempotency

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/google/uuid"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
)

// runCmd runs one of the command functions with the command line args
// (flags and the key), as cobra would, and returns its exit code, error
// and output.
func runCmd(t *testing.T, f caddycmd.CommandFunc, args ...string) (int, error, string) {
	t.Helper()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	fs.String("address", "", "")
	fs.String("config", "", "")
	fs.String("adapter", "", "")
	fs.Bool("force", false, "")
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmdOut = &out
	t.Cleanup(func() { cmdOut = nil })
	code, err := f(caddycmd.Flags{FlagSet: fs})
	return code, err, out.String()
}

func TestAdminCommands(t *testing.T) {
	mem := newMemory(t)
	h := adminFixture(t, map[string]stores.Store{"memory": mem})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := h.ServeHTTP(w, r); err != nil {
			apiErr := err.(caddy.APIError)
			http.Error(w, `{"error":"`+apiErr.Err.Error()+`"}`, apiErr.HTTPStatus)
		}
	}))
	defer srv.Close()
	addr := "--address=" + strings.TrimPrefix(srv.URL, "http://")

	key := finalKey(t, mem, stores.Response{Status: 204})
	code, err, out := runCmd(t, cmdKey, addr, key)
	if code != caddy.ExitCodeSuccess || err != nil || !strings.Contains(out, `"state": "final"`) || !strings.Contains(out, `"status": 204`) {
		t.Fatalf("key = %d, %v, %q", code, err, out)
	}
	unknown := uuid.NewString()
	if code, err, _ = runCmd(t, cmdKey, addr, unknown); code == caddy.ExitCodeSuccess || err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("key of an unknown key = %d, %v; want failure naming 404", code, err)
	}

	inflight, _ := reserveKey(t, mem, time.Minute)
	// The admin API's message as text, naming the flag: until the build
	// after c2f848d, its JSON answer quoted whole, advising force=true.
	if code, err, _ = runCmd(t, cmdForget, addr, inflight); code == caddy.ExitCodeSuccess || err == nil ||
		!strings.HasPrefix(err.Error(), "admin API answered HTTP 409: idempotency key "+inflight) ||
		!strings.Contains(err.Error(), "--force") || strings.Contains(err.Error(), `"`) {
		t.Fatalf("forget in flight = %d, %v; want failure naming 409 and --force, without JSON", code, err)
	}
	code, err, out = runCmd(t, cmdForget, addr, "--force", inflight)
	if code != caddy.ExitCodeSuccess || err != nil || out != "forgot key "+inflight+" in 1 store(s)\n" {
		t.Fatalf("forget --force = %d, %v, %q", code, err, out)
	}
	if rec, _ := mem.Load(context.Background(), inflight); rec != nil {
		t.Fatal("record still there")
	}

	code, err, out = runCmd(t, cmdStats, addr)
	if code != caddy.ExitCodeSuccess || err != nil || !strings.Contains(out, `"final": 1`) {
		t.Fatalf("stats = %d, %v, %q", code, err, out)
	}
}

// countFails is a store whose Count fails, as a Redis store does when its
// server is down.
type countFails struct{ *memory.Store }

func (countFails) Count(context.Context) (stores.Counts, error) {
	return stores.Counts{}, errors.New("dial tcp 127.0.0.1:6379: connection refused")
}

// A store that could not count makes stats fail, and a mistyped
// subcommand is an error: scripts read the exit status. Before, both
// exited 0 (the second printing help).
func TestAdminCommandsFailOnPartialAnswers(t *testing.T) {
	mem := newMemory(t)
	h := adminFixture(t, map[string]stores.Store{"memory": mem, "redis/x": countFails{newMemory(t)}})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := h.ServeHTTP(w, r); err != nil {
			apiErr := err.(caddy.APIError)
			http.Error(w, `{"error":"`+apiErr.Err.Error()+`"}`, apiErr.HTTPStatus)
		}
	}))
	defer srv.Close()
	code, err, out := runCmd(t, cmdStats, "--address="+strings.TrimPrefix(srv.URL, "http://"))
	if code == caddy.ExitCodeSuccess || err == nil || !strings.Contains(err.Error(), "redis/x") || !strings.Contains(out, `"final"`) {
		t.Fatalf("stats with a store that could not count = %d, %v, %q; want the counts printed and a failure naming the store", code, err, out)
	}

	cmd, ok := caddycmd.Commands()["iceberg-idempotency"]
	if !ok {
		t.Fatal("the iceberg-idempotency command is not registered")
	}
	cobraCmd := &cobra.Command{Use: cmd.Name}
	cmd.CobraFunc(cobraCmd)
	root := &cobra.Command{Use: "caddy"} // as under caddy's root command
	root.AddCommand(cobraCmd)
	root.SetArgs([]string{cmd.Name, "forgte", uuid.NewString()})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	if err := root.Execute(); err == nil {
		t.Fatal("a mistyped subcommand succeeded")
	}
}

// The commands check that the answer is the admin API's: a site's address
// given as --address answered 200 with the catalog's JSON, and forget
// printed "forgot key  in 0 store(s)" and exited 0 (until the build after
// a95b973), key and stats printed the catalog's answer as the key's.
func TestAdminCommandsRefuseAnotherServersAnswer(t *testing.T) {
	key := uuid.NewString()
	for _, answer := range []string{`{"defaults":{},"overrides":{}}`, "<!DOCTYPE html><html><body>Catalog</body></html>"} {
		addr := adminAnswering(t, answer)
		for name, run := range map[string]func() (int, error, string){
			"key":    func() (int, error, string) { return runCmd(t, cmdKey, addr, key) },
			"forget": func() (int, error, string) { return runCmd(t, cmdForget, addr, "--force", key) },
			"stats":  func() (int, error, string) { return runCmd(t, cmdStats, addr) },
		} {
			code, err, out := run()
			if code == caddy.ExitCodeSuccess || err == nil || !strings.Contains(err.Error(), "is --address Caddy's admin endpoint") || out != "" {
				t.Errorf("%s against a site answering %.20q = %d, %v, %q; want a failure asking whether --address is the admin endpoint, nothing printed", name, answer, code, err, out)
			}
		}
	}
}

// adminAnswering serves one fixed JSON answer, as the admin API would.
func adminAnswering(t *testing.T, body string) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	return "--address=" + strings.TrimPrefix(srv.URL, "http://")
}

// A forced forget whose record went before its delete (another forget,
// or the purge) answers forgotten 0 without errors: the key is gone, as
// asked, and the command says why nothing was forgotten.
func TestAdminForgetCommandWhenTheRecordWentMeanwhile(t *testing.T) {
	key := uuid.NewString()
	addr := adminAnswering(t, `{"key":"`+key+`","records":[{"store":"redis/x","backend":"redis","state":"final"}],"forgotten":0}`)
	code, err, out := runCmd(t, cmdForget, addr, "--force", strings.ToUpper(key))
	if code != caddy.ExitCodeSuccess || err != nil || !strings.Contains(out, "no store held it any more") {
		t.Fatalf("forget = %d, %v, %q; want success saying the record had gone", code, err, out)
	}
	addr = adminAnswering(t, `{"key":"`+uuid.NewString()+`","records":[],"forgotten":1}`)
	if code, err, _ := runCmd(t, cmdForget, addr, key); code == caddy.ExitCodeSuccess || err == nil || !strings.Contains(err.Error(), "answered about key") {
		t.Fatalf("forget answered about another key = %d, %v; want failure", code, err)
	}
}

// stats on a node without a handler fails, and names every store that
// could not count, not only the first.
func TestAdminStatsCommandNamesEveryFailure(t *testing.T) {
	code, err, _ := runCmd(t, cmdStats, adminAnswering(t, `{"stores":[]}`))
	if code == caddy.ExitCodeSuccess || err == nil || !strings.Contains(err.Error(), "no store in use") {
		t.Fatalf("stats without stores = %d, %v; want failure saying no store is in use", code, err)
	}
	code, err, _ = runCmd(t, cmdStats, adminAnswering(t, `{"stores":[`+
		`{"store":"postgres/a","backend":"postgres","counts":"unavailable","error":"dial tcp: refused"},`+
		`{"store":"redis/b","backend":"redis","counts":"unavailable","error":"i/o timeout"}]}`))
	if code == caddy.ExitCodeSuccess || err == nil || !strings.Contains(err.Error(), "postgres/a: dial tcp: refused") || !strings.Contains(err.Error(), "redis/b: i/o timeout") {
		t.Fatalf("stats with two failing stores = %d, %v; want failure naming both", code, err)
	}
}
