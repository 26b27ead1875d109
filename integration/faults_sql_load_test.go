package integration_test

// The load driver of the SQL fault scenarios: 32 clients, each sending
// keyed commits one after another to a set of Caddy nodes and retrying
// every commit the way a careful Iceberg client does (same key; on 503 after
// Retry-After; on a lost connection at once; on anything else it stops).
// Every attempt is kept, so a test can say precisely what a key was told and
// when, and check afterwards what the store kept.

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
)

const (
	// sqlFaultClients is how many clients send at once.
	sqlFaultClients = 32
	// sqlFaultMaxAttempts bounds one commit's retries: enough to ride out
	// a few seconds of 503s with Retry-After 1, which is all the scenarios
	// cause.
	sqlFaultMaxAttempts = 20
	// sqlFaultMaxCommit bounds one commit, retries included, so a key stuck
	// in flight ends the client's loop instead of the test's time budget.
	sqlFaultMaxCommit = 25 * time.Second
)

// sqlFaultAttempt is one request of a commit.
type sqlFaultAttempt struct {
	At     time.Duration // since the load started
	Took   time.Duration
	Node   int // index into the nodes
	Status int // 0: no answer (transport error)
	Type   string
	Err    string
}

func (a sqlFaultAttempt) String() string {
	s := fmt.Sprintf("@%v node %d: ", a.At.Round(time.Millisecond), a.Node)
	switch {
	case a.Status == 0:
		s += "no answer (" + a.Err + ")"
	case a.Type != "":
		s += strconv.Itoa(a.Status) + " " + a.Type
	default:
		s += strconv.Itoa(a.Status)
	}
	return s + fmt.Sprintf(" in %v", a.Took.Round(time.Millisecond))
}

// sqlFaultCommit is one logical request: one key, one catalog path, every
// attempt the client made, and the answer it ended with.
type sqlFaultCommit struct {
	Key, Path string
	Attempts  []sqlFaultAttempt
	Final     response // the last answer; Status 0 if none came
}

func (c *sqlFaultCommit) describe(b *caddyproc.Backend) string {
	var parts []string
	for _, a := range c.Attempts {
		parts = append(parts, a.String())
	}
	return fmt.Sprintf("key %s (%s), executed %d times at the catalog; attempts: %s",
		c.Key, c.Path, b.Count(c.Path), strings.Join(parts, "; "))
}

// sqlFaultLoad is what a load run sent and heard.
type sqlFaultLoad struct {
	Commits []*sqlFaultCommit
	Sent    int
	Answers map[int]int // status → count, 0 = transport error
}

// errorType pulls the Iceberg error type out of a response, "" if none.
func errorType(r response) string {
	if r.Status < 400 {
		return ""
	}
	const marker = `"type":"`
	i := strings.Index(string(r.Body), marker)
	if i < 0 {
		return ""
	}
	rest := string(r.Body[i+len(marker):])
	if j := strings.IndexByte(rest, '"'); j >= 0 {
		return rest[:j]
	}
	return ""
}

// runSQLFaultLoad runs sqlFaultClients clients against nodes until stop is
// closed; each then finishes the commit it is on. Client i sends attempt a
// of a commit to node (i+a) mod len(nodes), as a load balancer would spread
// retries. prefix makes the catalog paths unique to the scenario.
func runSQLFaultLoad(nodes []*caddyproc.Instance, prefix string, stop <-chan struct{}) *sqlFaultLoad {
	start := time.Now()
	var mu sync.Mutex
	load := &sqlFaultLoad{Answers: map[int]int{}}
	var wg sync.WaitGroup
	for c := range sqlFaultClients {
		wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				commit := &sqlFaultCommit{
					Key:  uuid.Must(uuid.NewV7()).String(),
					Path: "/v1/namespaces/faults/tables/" + prefix + "-" + strconv.Itoa(c) + "-" + strconv.Itoa(n),
				}
				sqlFaultSendCommit(nodes, c, start, commit)
				mu.Lock()
				load.Commits = append(load.Commits, commit)
				load.Sent += len(commit.Attempts)
				for _, a := range commit.Attempts {
					load.Answers[a.Status]++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return load
}

// sqlFaultSendCommit sends one commit until it gets an answer the client
// does not retry, or its attempts or time run out.
func sqlFaultSendCommit(nodes []*caddyproc.Instance, client int, start time.Time, c *sqlFaultCommit) {
	ctx, cancel := context.WithTimeout(context.Background(), sqlFaultMaxCommit)
	defer cancel()
	for a := range sqlFaultMaxAttempts {
		node := (client + a) % len(nodes)
		began := time.Now()
		r, err := request(ctx, http.MethodPost, nodes[node].URL()+c.Path, multiNodeBody, keyHeader, c.Key)
		att := sqlFaultAttempt{At: began.Sub(start), Took: time.Since(began), Node: node, Status: r.Status, Type: errorType(r)}
		if err != nil {
			att.Err = err.Error()
		}
		c.Attempts = append(c.Attempts, att)
		c.Final = r
		var wait time.Duration
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			wait = 50 * time.Millisecond // a lost connection: resend at once
		case r.Status == http.StatusServiceUnavailable:
			secs, perr := strconv.Atoi(r.Header.Get("Retry-After"))
			if perr != nil || secs <= 0 {
				secs = 1
			}
			wait = time.Duration(secs) * time.Second
		default:
			return
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return
		}
	}
}

// sqlFaultOutcome is what the catalog and the store made of a load.
type sqlFaultOutcome struct {
	Executions int // at the catalog, over every key of the load
	Duplicates int // executions beyond one per key
	Replayed   int // keys that got 200 and replayed it from every node
	Lost       int // keys that got 200 and did not replay it from some node
	// Unstored is how many of the Lost keys a node logged as "delivered
	// but not stored": their Finalize failed through every retry, so the
	// client had its 200 but a retry hears "unknown". The rest of Lost
	// were lost without that warning, which is worse.
	Unstored int
}

// checkSQLFaultLoad checks what the catalog and the store made of a load:
// no key executed twice, and every commit that got 200 replays, byte for
// byte, from every node. Each broken promise is reported with the key's
// story; the first few also with the nodes' log lines about the key.
func checkSQLFaultLoad(t *testing.T, b *caddyproc.Backend, nodes []*caddyproc.Instance, load *sqlFaultLoad) sqlFaultOutcome {
	t.Helper()
	var out sqlFaultOutcome
	for _, c := range load.Commits {
		n := b.Count(c.Path)
		out.Executions += n
		if n > 1 {
			out.Duplicates += n - 1
			t.Errorf("executed %d times: %s", n, c.describe(b))
		}
	}

	var mu sync.Mutex
	type lostKey struct{ key, msg string }
	var lost []lostKey
	work := make(chan *sqlFaultCommit)
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for c := range work {
				var wrong []string
				for i, node := range nodes {
					// A 503 is what a store too busy for the call's
					// time answers, and a client retries it: so does
					// the check (on a 2-CPU machine with both CPUs
					// otherwise busy, a node's Reserve timed out 4 s
					// after the restore, with 16 of these checks at once).
					var r response
					var err error
					for try := 0; try < 5; try++ {
						r, err = request(context.Background(), http.MethodPost, node.URL()+c.Path, multiNodeBody, keyHeader, c.Key)
						if err != nil || r.Status != http.StatusServiceUnavailable {
							break
						}
						time.Sleep(200 * time.Millisecond)
					}
					switch {
					case err != nil:
						wrong = append(wrong, fmt.Sprintf("node %d: %v", i, err))
					case r.Status != http.StatusOK || !r.replayed() || string(r.Body) != string(c.Final.Body):
						wrong = append(wrong, fmt.Sprintf("node %d: %d %s replayed=%v", i, r.Status, errorType(r), r.replayed()))
					}
				}
				var unstored bool
				if len(wrong) > 0 {
					logs := sqlFaultKeyLogs(nodes, c.Key)
					unstored = strings.Contains(logs, "finalize failed") && strings.Contains(logs, "not stored")
				}
				mu.Lock()
				switch {
				case len(wrong) == 0:
					out.Replayed++
				case unstored:
					out.Lost++
					out.Unstored++
					lost = append(lost, lostKey{c.Key, fmt.Sprintf("a key that got 200 does not replay (%s); its node logged that Finalize failed and the response was delivered but not stored: %s",
						strings.Join(wrong, ", "), c.describe(b))})
				default:
					out.Lost++
					lost = append(lost, lostKey{c.Key, fmt.Sprintf("a key that got 200 does not replay (%s), and no node logged a failed Finalize: %s",
						strings.Join(wrong, ", "), c.describe(b))})
				}
				mu.Unlock()
			}
		})
	}
	for _, c := range load.Commits {
		if c.Final.Status == http.StatusOK {
			work <- c
		}
	}
	close(work)
	wg.Wait()
	slices.SortFunc(lost, func(a, b lostKey) int { return strings.Compare(a.msg, b.msg) })
	for i, l := range lost {
		switch {
		case i < 3:
			t.Errorf("%s\nlogs:\n%s", l.msg, sqlFaultKeyLogs(nodes, l.key))
		case i < 10:
			t.Error(l.msg)
		default:
			t.Errorf("… and %d more keys that got 200 and do not replay", len(lost)-10)
			return out
		}
	}
	return out
}

// sqlFaultKeyLogs returns the nodes' log lines that mention key, for a
// failure message.
func sqlFaultKeyLogs(nodes []*caddyproc.Instance, key string) string {
	var out []string
	for i, node := range nodes {
		for _, line := range strings.Split(node.Logs(), "\n") {
			if strings.Contains(line, key) {
				out = append(out, fmt.Sprintf("node %d: %s", i, line))
			}
		}
	}
	return strings.Join(out, "\n")
}
