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
