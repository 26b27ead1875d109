package integration_test

// Faults between Caddy and the catalog, one Caddy node on the memory store,
// with caddyproc.Backend as the catalog: these scenarios need a catalog that
// commits and then resets the connection, or commits slower than the
// proxy's execution_timeout, on cue, and one that counts every execution.
// (iceberg_faults_test.go drives the first fault with a real catalog and a
// real client.)

import (
	"fmt"
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
)

// promptly bounds how long a retry of an abandoned key may take: far below
// faultInFlightWait, which is what a retry that waited for the lapsed
// owner would take.
const (
	promptly          = 5 * time.Second
	faultInFlightWait = "20s"
)

const faultCommitBody = `{"requirements":[{"type":"assert-table-uuid","uuid":"9c12d441-03fe-4693-9a96-a0705ddf69c1"}],` +
	`"updates":[{"action":"set-properties","updates":{"owner":"faults"}}]}`

// warmUpstream sends an unkeyed read through Caddy so the connection Caddy
// keeps to the catalog is reused by the next request. A fault on a reused
// connection is the case where Go's HTTP transport may resend a request
// silently (it treats requests carrying an Idempotency-Key as replayable):
// the scenarios must show that does not happen.
func warmUpstream(t *testing.T, c *caddyproc.Instance) {
	t.Helper()
	wantStatus(t, "warm-up read", send(t, "GET", c.URL()+"/v1/config", ""), http.StatusOK)
}

// TestFaultResetAfterCommit: the catalog commits, then the connection to it
// is reset before any answer. Nobody knows whether the commit happened, so
// the key must never execute again under `abandoned unknown`: the first
// client gets 502, every retry at once 500 CommitStateUnknownException.
// Under `abandoned reexecute` the retry executes again, as configured.
func TestFaultResetAfterCommit(t *testing.T) {
	t.Parallel()
	for _, policy := range []string{"unknown", "reexecute"} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			c, b := startGuarded(t, "abandoned "+policy+"\nin_flight_wait "+faultInFlightWait)
			const path = "/v1/namespaces/faults/tables/reset"
			b.Script(path, caddyproc.Reply{Drop: true}, caddyproc.Reply{})
			warmUpstream(t, c)

			y := newTally()
			key := newKey(t)
			first := y.mustSend(t, "POST", c.URL()+path, faultCommitBody, key)
			wantStatus(t, "commit whose connection was reset", first, http.StatusBadGateway)
			checkErrorModel(t, "commit whose connection was reset", first)

			var note string
			switch policy {
			case "unknown":
				for i := 1; i <= 3; i++ {
					var r response
					took := timed(func() { r = y.mustSend(t, "POST", c.URL()+path, faultCommitBody, key) })
					what := fmt.Sprintf("retry %d", i)
					wantUnknown(t, what, r)
					if took > promptly {
						t.Errorf("%s took %v: the abandoned key was not answered at once", what, took)
					}
				}
				wantCount(t, b, path, 1)
				note = "first 502; every retry at once 500 CommitStateUnknownException"
			case "reexecute":
				r := y.mustSend(t, "POST", c.URL()+path, faultCommitBody, key)
				wantStatus(t, "retry", r, http.StatusOK)
				wantExecuted(t, "retry", r)
				replay := y.mustSend(t, "POST", c.URL()+path, faultCommitBody, key)
				wantReplayOf(t, "retry after the re-execution", replay, r)
				wantCount(t, b, path, 2)
				note = "`abandoned reexecute`: the retry executed again (the 1 duplicate is that policy's point), 200, then replayed"
			}
			row := y.record("reset after commit (memory, abandoned "+policy+")", b.Count(path), b.Count, note)
			if policy == "unknown" {
				wantNoDuplicates(t, row)
			}
		})
	}
}

// TestFaultDropResetWithHeaderRules: a keyed DELETE (dropTable) that the
// catalog executes before its connection, a reused keep-alive one, is
// reset, through a reverse_proxy with a header_up rule. Go's HTTP
// transport resends by itself a body-less request that carries
// Idempotency-Key; the rule makes reverse_proxy rebuild the request's
// header map under canonical names, so the key must be off the request,
// not renamed, for the call. The drop ran once: 502, then 500
// CommitStateUnknownException.
func TestFaultDropResetWithHeaderRules(t *testing.T) {
	t.Parallel()
	b := caddyproc.NewBackend(t)
	c := caddyproc.Start(t, caddyproc.Caddyfile("", "iceberg_idempotency {\nin_flight_wait "+faultInFlightWait+
		"\n}\nreverse_proxy "+b.Addr()+" {\nheader_up X-Forwarded-Prefix /catalog\n}"))
	const path = "/v1/namespaces/faults/tables/dropped"
	b.Script(path, caddyproc.Reply{Drop: true}, caddyproc.Reply{Status: http.StatusNotFound})
	warmUpstream(t, c)

	y := newTally()
	key := newKey(t)
	first := y.mustSend(t, "DELETE", c.URL()+path, "", key)
	wantStatus(t, "drop whose connection was reset", first, http.StatusBadGateway)
	checkErrorModel(t, "drop whose connection was reset", first)
	wantUnknown(t, "retry", y.mustSend(t, "DELETE", c.URL()+path, "", key))
	wantCount(t, b, path, 1)
	wantNoDuplicates(t, y.record("drop reset after executing, reverse_proxy with header_up (memory)", b.Count(path), b.Count,
		"first 502; the retry 500 CommitStateUnknownException; the transport resent nothing"))
}

// TestFaultExecutionTimeout: the catalog is still committing when
// execution_timeout fires. The first client gets 504; the commit may still
// land, so a retry gets 500 CommitStateUnknownException at once, well
// before the lease (30s) would have lapsed, and the catalog ran it once.
func TestFaultExecutionTimeout(t *testing.T) {
	t.Parallel()
	c, b := startGuarded(t, "execution_timeout 1s\nin_flight_wait "+faultInFlightWait)
	const path = "/v1/namespaces/faults/tables/slow"
	b.Script(path, caddyproc.Reply{Delay: 2500 * time.Millisecond}, caddyproc.Reply{})

	y := newTally()
	key := newKey(t)
	first := y.mustSend(t, "POST", c.URL()+path, faultCommitBody, key)
	wantStatus(t, "commit past execution_timeout", first, http.StatusGatewayTimeout)
	checkErrorModel(t, "commit past execution_timeout", first)
	for i := 1; i <= 2; i++ {
		var r response
		took := timed(func() { r = y.mustSend(t, "POST", c.URL()+path, faultCommitBody, key) })
		what := fmt.Sprintf("retry %d", i)
		wantUnknown(t, what, r)
		if took > promptly {
			t.Errorf("%s took %v: the abandoned key was not answered at once", what, took)
		}
	}
	wantCount(t, b, path, 1)
	wantNoDuplicates(t, y.record("execution_timeout during a commit (memory)", b.Count(path), b.Count,
		"first 504; retries at once 500 CommitStateUnknownException"))
}

// TestFaultDialFailure: the catalog is down, so nothing of the request
// reached it; the key is released and, once the catalog is up on the same
// address, the retry executes once and later retries replay it.
func TestFaultDialFailure(t *testing.T) {
	t.Parallel()
	// Reserved, so no Caddy of this run (this test's or a parallel one's)
	// is handed the catalog's port while the catalog is down.
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(caddyproc.ReservePort(t)))
	c := caddyproc.Start(t, caddyproc.Caddyfile("", "iceberg_idempotency\nreverse_proxy "+addr))

	const path = "/v1/namespaces/faults/tables/down"
	y := newTally()
	key := newKey(t)
	first := y.mustSend(t, "POST", c.URL()+path, faultCommitBody, key)
	if first.Status != http.StatusBadGateway && first.Status != http.StatusServiceUnavailable {
		t.Fatalf("commit to a catalog that is down: %s, want 502 or 503", first)
	}

	b := caddyproc.NewBackendAt(t, addr)
	r := y.mustSend(t, "POST", c.URL()+path, faultCommitBody, key)
	wantStatus(t, "retry with the catalog up", r, http.StatusOK)
	wantExecuted(t, "retry with the catalog up", r)
	replay := y.mustSend(t, "POST", c.URL()+path, faultCommitBody, key)
	wantReplayOf(t, "retry after success", replay, r)
	wantCount(t, b, path, 1)
	wantNoDuplicates(t, y.record("dial failure, then catalog up (memory)", b.Count(path), b.Count,
		fmt.Sprintf("first %d (nothing sent); retry executed once, 200; next retry replayed", first.Status)))
}
