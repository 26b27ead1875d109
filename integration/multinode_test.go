package integration_test

// Durable shared stores, end to end: several real Caddy processes sharing one
// PostgreSQL or MariaDB/MySQL table, in front of one counting backend. What
// is checked is only what a client and the catalog can observe — statuses,
// bodies, headers, how often the backend executed — plus the "opened … store"
// log line, which is the only outside view of the connection pool.
//
// Every test runs once per database, in parallel subtests, each on its own
// fresh table that is dropped at the end.

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
)

// multiNodeBody is an updateTable request body; its content does not matter
// to the fake backend, only that every retry sends the same bytes.
const multiNodeBody = `{"requirements":[],"updates":[]}`

// multiNodePath is an updateTable path: a keyed, guarded mutation.
func multiNodePath(table string) string { return "/v1/namespaces/multinode/tables/" + table }

// forEachDB runs test once per database server, as parallel subtests.
func forEachDB(t *testing.T, test func(t *testing.T, db *sqlDB, dsn string)) {
	t.Parallel()
	for _, db := range multiNodeDBs {
		t.Run(db.Name, func(t *testing.T) {
			t.Parallel()
			test(t, db, db.dsn(t))
		})
	}
}

// multiNodeSite is a Caddyfile template guarding b with store and options.
// debug is on: some tests synchronise on the handler's decision log lines.
func multiNodeSite(b *caddyproc.Backend, store string, options ...string) string {
	return caddyproc.Caddyfile("debug",
		"iceberg_idempotency {\n"+store+"\n"+strings.Join(options, "\n")+"\n}\nreverse_proxy "+b.Addr())
}

func commit(t *testing.T, node *caddyproc.Instance, path, key string) response {
	t.Helper()
	return send(t, http.MethodPost, node.URL()+path, multiNodeBody, keyHeader, key)
}

// burst sends n copies of one keyed commit at once, to node i%len(nodes).
func burst(t *testing.T, nodes []*caddyproc.Instance, path, key string, n int) []response {
	t.Helper()
	out, err := burstRequests(nodes, path, key, n)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// burstRequests is burst for goroutines other than the test's.
func burstRequests(nodes []*caddyproc.Instance, path, key string, n int) ([]response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := make([]response, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			out[i], errs[i] = request(ctx, http.MethodPost, nodes[i%len(nodes)].URL()+path, multiNodeBody, keyHeader, key)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("request %d: %w", i, err)
		}
	}
	return out, nil
}

// countLogLines counts the lines of the nodes' logs holding every substring.
func countLogLines(nodes []*caddyproc.Instance, substrs ...string) int {
	n := 0
	for _, node := range nodes {
	lines:
		for _, line := range strings.Split(node.Logs(), "\n") {
			for _, s := range substrs {
				if !strings.Contains(line, s) {
					continue lines
				}
			}
			n++
		}
	}
	return n
}

func wantRetryAfter(t *testing.T, what string, r response, want string) {
	t.Helper()
	if got := r.Header.Get("Retry-After"); got != want {
		t.Errorf("%s: Retry-After %q, want %q", what, got, want)
	}
}

// TestMultiNodeConcurrentDuplicates: duplicates of one request spread over
// two nodes while the first is still at the catalog execute it once, and
// every client gets the same answer.
func TestMultiNodeConcurrentDuplicates(t *testing.T) {
	forEachDB(t, func(t *testing.T, db *sqlDB, dsn string) {
		b := caddyproc.NewBackend(t)
		store := db.storeBlock(dsn, db.newTable(t, dsn))
		// in_flight_wait well above how long the test holds the catalog
		// call, so no duplicate gives up with a 503.
		cfg := multiNodeSite(b, store, "in_flight_wait 30s")
		nodes := []*caddyproc.Instance{caddyproc.Start(t, cfg), caddyproc.Start(t, cfg)}

		path := multiNodePath("concurrent")
		gate := b.Stall(path)
		key := newKey(t)
		const n = 20
		var got []response
		var burstErr error
		done := make(chan struct{})
		go func() {
			defer close(done)
			got, burstErr = burstRequests(nodes, path, key, n)
		}()

		gate.WaitArrived(t, 1, 30*time.Second)
		// Hold the first execution until all 19 duplicates are waiting on
		// it (each logs "waiting for its owner" with the key), so the test
		// really covers overlapping requests on both nodes.
		deadline := time.Now().Add(30 * time.Second)
		for countLogLines(nodes, "waiting for its owner", key) < n-1 {
			if time.Now().After(deadline) {
				gate.Release()
				t.Fatalf("only %d of %d duplicates waited for the owner", countLogLines(nodes, "waiting for its owner", key), n-1)
			}
			time.Sleep(20 * time.Millisecond)
		}
		for i, node := range nodes {
			if countLogLines(nodes[i:i+1], "waiting for its owner", key) == 0 {
				t.Errorf("no duplicate waited on node %d (:%d)", i, node.Port)
			}
		}
		gate.Release()
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			t.Fatal("requests did not finish")
		}
		if burstErr != nil {
			t.Fatal(burstErr)
		}
		if t.Failed() {
			return
		}

		executed := 0
		for i, r := range got {
			wantStatus(t, fmt.Sprintf("request %d", i), r, http.StatusOK)
			if !bytes.Equal(r.Body, got[0].Body) {
				t.Errorf("request %d: body %q, request 0 got %q", i, r.Body, got[0].Body)
			}
			if !r.replayed() {
				executed++
			}
		}
		if executed != 1 {
			t.Errorf("%d answers were executions, want exactly 1 (the rest replays)", executed)
		}
		wantCount(t, b, path, 1)
	})
}

// TestMultiNodeReplayAcrossNodes: a response finalized on one node is replayed
// by the other, a stored error as much as a success.
func TestMultiNodeReplayAcrossNodes(t *testing.T) {
	forEachDB(t, func(t *testing.T, db *sqlDB, dsn string) {
		b := caddyproc.NewBackend(t)
		store := db.storeBlock(dsn, db.newTable(t, dsn))
		cfg := multiNodeSite(b, store)
		nodeA, nodeB := caddyproc.Start(t, cfg), caddyproc.Start(t, cfg)

		ok := multiNodePath("ok")
		key := newKey(t)
		orig := commit(t, nodeA, ok, key)
		wantStatus(t, "first request on A", orig, http.StatusOK)
		wantExecuted(t, "first request on A", orig)
		for _, node := range []*caddyproc.Instance{nodeB, nodeA, nodeB} {
			r := commit(t, node, ok, key)
			wantReplayOf(t, fmt.Sprintf("retry on :%d", node.Port), r, orig)
			for _, h := range replayHeaders {
				if r.Header.Get(h) != orig.Header.Get(h) {
					t.Errorf("retry on :%d: %s %q, original %q", node.Port, h, r.Header.Get(h), orig.Header.Get(h))
				}
			}
		}
		wantCount(t, b, ok, 1)

		// A 409 CommitFailedException is final: stored on A, replayed on B.
		conflict := multiNodePath("conflict")
		b.Script(conflict, caddyproc.Reply{
			Status: http.StatusConflict,
			Body:   []byte(`{"error":{"message":"Requirement failed: branch main has changed","type":"CommitFailedException","code":409}}`),
		})
		key = newKey(t)
		orig = commit(t, nodeA, conflict, key)
		wantStatus(t, "conflicting commit on A", orig, http.StatusConflict)
		wantReplayOf(t, "conflicting commit retried on B", commit(t, nodeB, conflict, key), orig)
		wantCount(t, b, conflict, 1)
	})
}

// TestMultiNodeCrash: the node owning a key dies (SIGKILL) while the catalog
// call is in flight. The other node keeps answering "in flight" while the
// dead owner's lease runs, then applies the abandoned policy: `unknown`
// never executes again; `reexecute` executes exactly once more. The dead
// node's catalog call finishing late changes nothing.
func TestMultiNodeCrash(t *testing.T) {
	forEachDB(t, func(t *testing.T, db *sqlDB, dsn string) {
		for _, policy := range []string{"unknown", "reexecute"} {
			t.Run("abandoned_"+policy, func(t *testing.T) {
				t.Parallel()
				// The 3s lease needs calls bounded by a quarter of it.
				testCrash(t, db.storeBlock(dsn, db.newTable(t, dsn), "statement_timeout 750ms"), policy)
			})
		}
	})
}

// testCrash kills the owner of a key while the catalog call is in flight,
// on two nodes sharing store (a Caddyfile store block): the other node says
// "in flight" while the dead owner's lease runs, then applies policy —
// unknown: never execute again; reexecute: exactly once more.
func testCrash(t *testing.T, store, policy string) {
	// The owner renews its lease every lease/4, so at its death the lease
	// has between 3/4 and all of it left: with 3s, at least 2.25s. The two
	// retries right after the kill wait in_flight_wait (0.5s) each, well
	// inside that.
	const lease = 3 * time.Second
	b := caddyproc.NewBackend(t)
	nodeA := caddyproc.Start(t, multiNodeSite(b, store, "lease 3s", "in_flight_wait 500ms"))
	nodeB := caddyproc.Start(t, multiNodeSite(b, store, "lease 3s", "in_flight_wait 500ms", "abandoned "+policy))

	path := multiNodePath("crash")
	stalled := b.Stall(path)
	key := newKey(t)
	lost := make(chan error, 1)
	go func() {
		_, err := request(context.Background(), http.MethodPost, nodeA.URL()+path, multiNodeBody, keyHeader, key)
		lost <- err
	}()
	stalled.WaitArrived(t, 1, 30*time.Second)
	nodeA.Kill()
	killed := time.Now()
	select {
	case err := <-lost:
		if err == nil {
			t.Fatal("the request to the killed node got an answer")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the request to the killed node never ended")
	}

	for i := range 2 {
		what := fmt.Sprintf("retry %d on B while the dead owner's lease runs", i+1)
		r := commit(t, nodeB, path, key)
		if el := time.Since(killed); el >= lease*2/3 {
			t.Logf("warning: %s ended %v after the kill, when the lease may have lapsed", what, el)
		}
		wantIcebergError(t, what, r, http.StatusServiceUnavailable, "ServiceUnavailableException")
		wantRetryAfter(t, what, r, "1")
		wantCount(t, b, path, 1)
	}

	// Past the latest moment the lease can lapse (judged by the store's
	// clock, which is this machine's too), with a margin.
	time.Sleep(time.Until(killed.Add(lease + 500*time.Millisecond)))

	// after checks every later retry: all B can ever say about the key.
	var after func(what string)
	switch policy {
	case "unknown":
		after = func(what string) {
			for i, r := range burst(t, []*caddyproc.Instance{nodeB}, path, key, 6) {
				wantIcebergError(t, fmt.Sprintf("%s %d", what, i), r, http.StatusInternalServerError, "CommitStateUnknownException")
			}
			wantCount(t, b, path, 1)
		}
	case "reexecute":
		// From now on the backend answers at once, while the dead node's
		// call stays held by the first gate.
		b.Stall(path).Release()
		rs := burst(t, []*caddyproc.Instance{nodeB}, path, key, 6)
		var exec *response
		for i := range rs {
			wantStatus(t, fmt.Sprintf("retry %d after the lapse", i), rs[i], http.StatusOK)
			if !rs[i].replayed() {
				if exec != nil {
					t.Fatalf("two retries executed after the lapse:\n%s\n%s", exec, rs[i])
				}
				exec = &rs[i]
			}
		}
		if exec == nil {
			t.Fatal("no retry executed after the lapse")
		}
		if !bytes.Contains(exec.Body, []byte(`"execution":2`)) {
			t.Errorf("the re-execution's body is not the backend's second execution: %s", exec.Body)
		}
		for i := range rs {
			if rs[i].replayed() {
				wantReplayOf(t, fmt.Sprintf("retry %d after the lapse", i), rs[i], *exec)
			}
		}
		wantCount(t, b, path, 2)
		after = func(what string) {
			for i, r := range burst(t, []*caddyproc.Instance{nodeB}, path, key, 3) {
				wantReplayOf(t, fmt.Sprintf("%s %d", what, i), r, *exec)
			}
			wantCount(t, b, path, 2)
		}
	}
	after("retry after the lapse")

	// Let the dead node's catalog call finish. Nobody can store its answer;
	// B's outcome must not move.
	stalled.Release()
	deadline := time.Now().Add(10 * time.Second)
	for !hasBody(b.Sent(path), `"execution":1`) {
		if time.Now().After(deadline) {
			t.Fatal("the dead node's stalled call never finished at the backend")
		}
		time.Sleep(20 * time.Millisecond)
	}
	after("retry after the dead node's call finished")
}

func hasBody(bodies [][]byte, substr string) bool {
	for _, b := range bodies {
		if bytes.Contains(b, []byte(substr)) {
			return true
		}
	}
	return false
}

// TestMultiNodeReloadKeepsStore: an admin-API reload that changes a handler
// option reuses the open pool (the store is opened once) and the records; one
// that changes a store option opens a new pool, and the records, being in the
// database, survive that too.
func TestMultiNodeReloadKeepsStore(t *testing.T) {
	forEachDB(t, func(t *testing.T, db *sqlDB, dsn string) {
		b := caddyproc.NewBackend(t)
		table := db.newTable(t, dsn)
		store := db.storeBlock(dsn, table)
		node := caddyproc.Start(t, multiNodeSite(b, store, "in_flight_wait 5s"))
		nodes := []*caddyproc.Instance{node}

		path := multiNodePath("reload")
		key := newKey(t)
		orig := commit(t, node, path, key)
		wantStatus(t, "before the reload", orig, http.StatusOK)
		wantExecuted(t, "before the reload", orig)

		// opened waits until the request with key has been logged: logs are
		// written in order, so whatever the reload logged is in by then.
		opened := func(key string) int {
			t.Helper()
			waitLogs(t, node, key)
			return countLogLines(nodes, db.openedLog)
		}

		reload(t, node, multiNodeSite(b, store, "in_flight_wait 7s"))
		if cfg := node.Config(t); !bytes.Contains(cfg, []byte(`"in_flight_wait":7000000000`)) {
			t.Fatalf("the reload did not apply in_flight_wait 7s: %s", cfg)
		}
		wantReplayOf(t, "after the reload", commit(t, node, path, key), orig)
		key2 := newKey(t)
		wantExecuted(t, "new key after the reload", commit(t, node, path, key2))
		if n := opened(key2); n != 1 {
			t.Errorf("%q logged %d times across a reload that kept the store options, want 1", db.openedLog, n)
		}

		reload(t, node, multiNodeSite(b, db.storeBlock(dsn, table, "statement_timeout 4s"), "in_flight_wait 7s"))
		wantReplayOf(t, "after a reload with a new pool", commit(t, node, path, key), orig)
		key3 := newKey(t)
		wantExecuted(t, "new key after a reload with a new pool", commit(t, node, path, key3))
		if n := opened(key3); n != 2 {
			t.Errorf("%q logged %d times after a reload that changed statement_timeout, want 2", db.openedLog, n)
		}
		wantCount(t, b, path, 3)
	})
}

// TestMultiNodeDatabaseOutage: with its database unreachable — connections
// swallowed, then refused — a node fails closed (503 + Retry-After, an
// Iceberg error, the catalog not called), or passes through with fail_open;
// once the database is back the same node, not restarted, executes the
// client's retry and replays it after.
func TestMultiNodeDatabaseOutage(t *testing.T) {
	forEachDB(t, func(t *testing.T, db *sqlDB, dsn string) {
		proxy, viaProxy := db.proxied(t, dsn)
		b := caddyproc.NewBackend(t)
		table := db.newTable(t, dsn)
		// statement_timeout bounds every call to the dead database, so each
		// 503 comes after about a second.
		store := db.storeBlock(viaProxy, table, "statement_timeout 1s")
		closed := caddyproc.Start(t, multiNodeSite(b, store, "retry_after 2s"))
		open := caddyproc.Start(t, multiNodeSite(b, store, "fail_open"))

		before := multiNodePath("before")
		keyBefore := newKey(t)
		orig := commit(t, closed, before, keyBefore)
		wantStatus(t, "before the outage", orig, http.StatusOK)
		wantExecuted(t, "before the outage", orig)

		path := multiNodePath("outage")
		openPath := multiNodePath("fail_open")
		key := newKey(t) // a client retrying one commit through the outage
		openCalls := 0
		for _, mode := range []string{"blackhole", "refused"} {
			if mode == "blackhole" {
				proxy.Blackhole() // the open connections too: they hang
			} else {
				proxy.Stop()
			}
			// Twice: the first attempt may fail on a pooled connection the
			// outage cut (or froze), the second has to dial.
			for attempt := range 2 {
				what := fmt.Sprintf("%s: commit, attempt %d", mode, attempt+1)
				r := commit(t, closed, path, key)
				wantIcebergError(t, what, r, http.StatusServiceUnavailable, "ServiceUnavailableException")
				wantRetryAfter(t, what, r, "2")
				wantCount(t, b, path, 0)
			}

			r := commit(t, open, openPath, newKey(t))
			wantStatus(t, mode+": commit with fail_open", r, http.StatusOK)
			wantExecuted(t, mode+": commit with fail_open", r)
			openCalls++
			wantCount(t, b, openPath, openCalls)
		}

		proxy.Stop()
		proxy.Start()
		first := commit(t, closed, path, key)
		wantStatus(t, "retry once the database is back", first, http.StatusOK)
		wantExecuted(t, "retry once the database is back", first)
		wantReplayOf(t, "second retry once the database is back", commit(t, closed, path, key), first)
		wantCount(t, b, path, 1)
		wantReplayOf(t, "record from before the outage", commit(t, closed, before, keyBefore), orig)
		wantCount(t, b, before, 1)
	})
}
