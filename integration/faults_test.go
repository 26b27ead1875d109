package integration_test

// Shared pieces of the single-node fault suite (faults_*_test.go,
// iceberg_faults_test.go): a tally of what clients sent and were told, which
// becomes the scenario's row in the fault summary, and the checks every
// fault scenario makes.
//
// The guarantee under test: a key's request reaches the catalog at most
// once, unless nothing of it reached the catalog.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"
)

// tally counts the requests of one scenario as the clients saw them.
type tally struct {
	mu      sync.Mutex
	sent    int
	keys    map[string]bool
	at      map[string]map[string]bool // where → the keys sent there
	answers map[int]int
}

func newTally() *tally {
	return &tally{keys: map[string]bool{}, at: map[string]map[string]bool{}, answers: map[int]int{}}
}

// add records one request sent with key (empty: none) and its status, 0 for
// a transport error. where is what the scenario's backend counts executions
// by: the path on a caddyproc.Backend (which cannot count keys: the module
// takes the key off a body-less request), or the key itself on the catalog.
func (y *tally) add(where, key string, status int) {
	y.mu.Lock()
	defer y.mu.Unlock()
	y.sent++
	if key != "" {
		y.keys[key] = true
		if y.at[where] == nil {
			y.at[where] = map[string]bool{}
		}
		y.at[where][key] = true
	}
	y.answers[status]++
}

// send sends one keyed request and tallies its answer under its path; a
// transport error is returned, not fatal, since some faults produce them on
// purpose.
func (y *tally) send(ctx context.Context, method, rawURL, body, key string, headers ...string) (response, error) {
	r, err := request(ctx, method, rawURL, body, append([]string{keyHeader, key}, headers...)...)
	y.add(urlPath(rawURL), key, r.Status)
	return r, err
}

// urlPath is the escaped path of rawURL, as caddyproc.Backend counts it.
func urlPath(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return rawURL
	}
	return u.EscapedPath()
}

// mustSend is send that fails the test on a transport error.
func (y *tally) mustSend(t *testing.T, method, url, body, key string, headers ...string) response {
	t.Helper()
	r, err := y.send(context.Background(), method, url, body, key, headers...)
	if err != nil {
		t.Fatalf("%s %s (key %s): %v", method, url, key, err)
	}
	return r
}

// record adds the scenario's row to the fault summary. executions are
// counted at the catalog; executedAt(where) is the catalog's count for one
// where of add, and duplicates are its executions beyond one per key sent
// there, summed over every where.
func (y *tally) record(fault string, executions int, executedAt func(where string) int, note string) faultRow {
	y.mu.Lock()
	defer y.mu.Unlock()
	answers := make(map[int]int, len(y.answers))
	for c, n := range y.answers {
		answers[c] = n
	}
	// Until the build after 28dfe25 this was executions-len(keys): one key run twice and another never netted to 0.
	duplicates := 0
	for where, keys := range y.at {
		duplicates += max(0, executedAt(where)-len(keys))
	}
	row := faultRow{
		Fault:      fault,
		Sent:       y.sent,
		Keys:       len(y.keys),
		Executions: executions,
		Duplicates: duplicates,
		Answers:    answers,
		Note:       note,
	}
	recordFault(row)
	return row
}

// wantNoDuplicates fails the test when a key executed more than once.
func wantNoDuplicates(t *testing.T, row faultRow) {
	t.Helper()
	if row.Duplicates != 0 {
		t.Errorf("%s: %d duplicate executions (%d executions for %d keys), want 0",
			row.Fault, row.Duplicates, row.Executions, row.Keys)
	}
}

// wantUnknown checks the answer to a retry of an abandoned key: 500 with an
// Iceberg CommitStateUnknownException body, not a replay.
func wantUnknown(t *testing.T, what string, r response) {
	t.Helper()
	wantStatus(t, what, r, http.StatusInternalServerError)
	var doc struct {
		Error struct {
			Type string `json:"type"`
			Code int    `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(r.Body, &doc); err != nil || doc.Error.Type != "CommitStateUnknownException" || doc.Error.Code != 500 {
		t.Fatalf("%s: body %q, want an IcebergErrorResponse of type CommitStateUnknownException, code 500", what, r.Body)
	}
}

// checkErrorModel reports, without stopping the test, an answer that is not
// an IcebergErrorResponse with error.code equal to its status. The REST spec
// gives every mutation's 502 and 504 such a body (its examples say
// CommitStateUnknownException): a client reads the commit state from it.
func checkErrorModel(t *testing.T, what string, r response) {
	t.Helper()
	var doc struct {
		Error *struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	ct := r.Header.Get("Content-Type")
	if err := json.Unmarshal(r.Body, &doc); err != nil || doc.Error == nil || doc.Error.Type == "" ||
		doc.Error.Code != r.Status || !strings.HasPrefix(ct, "application/json") {
		t.Errorf("%s: %d with Content-Type %q and body %q, want an IcebergErrorResponse (application/json, error.code %d)",
			what, r.Status, ct, r.Body, r.Status)
	}
}

// timed runs f and returns how long it took.
func timed(f func()) time.Duration {
	start := time.Now()
	f()
	return time.Since(start)
}

// mib formats a byte count in MiB for notes.
func mib(n int64) string { return fmt.Sprintf("%.0f MiB", float64(n)/(1<<20)) }
