package integration_test

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
)

// faultRow is one line of the fault suite's summary: what a fault did to
// the requests clients sent through the module.
type faultRow struct {
	Fault      string // short name, e.g. "reset after commit (postgres)"
	Sent       int    // requests clients sent, retries included
	Keys       int    // distinct Idempotency-Keys
	Executions int    // catalog executions of those keys, counted at the catalog
	Duplicates int    // executions beyond one per key: must be 0
	Answers    map[int]int
	Note       string // what the clients were told, in words
}

var faultSummary struct {
	mu   sync.Mutex
	rows []faultRow
}

// recordFault adds a row to the summary that TestMain prints after the run.
func recordFault(r faultRow) {
	faultSummary.mu.Lock()
	defer faultSummary.mu.Unlock()
	faultSummary.rows = append(faultSummary.rows, r)
}

// faultSummaryFile is where TestMain also writes the summary, since go test
// shows a passing package's output only with -v; scripts/test.sh prints it.
func faultSummaryFile() string {
	if p := os.Getenv("ICEBERG_IDEMPOTENCY_FAULT_SUMMARY"); p != "" {
		return p
	}
	return filepath.Join(os.TempDir(), "iceberg-idempotency-fault-summary.md")
}

// writeFaultSummary prints the summary and writes it to faultSummaryFile.
func writeFaultSummary() {
	var buf bytes.Buffer
	printFaultSummary(&buf)
	if buf.Len() == 0 {
		return
	}
	_, _ = os.Stdout.Write(buf.Bytes())
	_ = os.WriteFile(faultSummaryFile(), buf.Bytes(), 0o644)
}

// printFaultSummary writes the summary as one Markdown table.
func printFaultSummary(w io.Writer) {
	faultSummary.mu.Lock()
	defer faultSummary.mu.Unlock()
	if len(faultSummary.rows) == 0 {
		return
	}
	fmt.Fprintln(w, "\nFault suite summary")
	fmt.Fprintln(w, "| fault | requests sent | keys | catalog executions | duplicates | answers | note |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|")
	for _, r := range faultSummary.rows {
		codes := make([]int, 0, len(r.Answers))
		for c := range r.Answers {
			codes = append(codes, c)
		}
		sort.Ints(codes)
		var parts []string
		for _, c := range codes {
			name := fmt.Sprint(c)
			if c == 0 {
				name = "transport error"
			}
			parts = append(parts, fmt.Sprintf("%s×%d", name, r.Answers[c]))
		}
		fmt.Fprintf(w, "| %s | %d | %d | %d | %d | %s | %s |\n",
			r.Fault, r.Sent, r.Keys, r.Executions, r.Duplicates, strings.Join(parts, ", "), r.Note)
	}
}
