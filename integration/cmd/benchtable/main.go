// Command benchtable turns `go test -bench` output into Markdown: one table
// per top-level benchmark, a row per sub-benchmark, a column per reported
// metric, each cell the median over the repeated runs (-count). Ratios are
// computed by the benchmarks within a round, so the median of a ratio is
// that of side-by-side measurements, not a ratio of medians.
//
//	go test -run '^$' -bench . -count 3 ./bench/ | go run ./cmd/benchtable
//
// Lines that are not benchmark results pass through to stderr, so a
// failure stays visible.
package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// hidden are metrics every benchmark reports that say nothing here: the
// load cases report req/s, and allocations are the benchmark client's own.
var hidden = map[string]bool{"ns/op": true, "B/op": true, "allocs/op": true}

// leading metrics come first, in this order; the rest follow as first seen.
var leading = []string{"req/s", "vs-plain", "vs-floor", "vs-bound", "vs-baseline", "p50-ms", "p99-ms"}

type table struct {
	name    string
	rows    []string
	metrics []string
	values  map[string]map[string][]float64 // row → metric → runs
}

var procsSuffix = regexp.MustCompile(`-\d+$`)

func main() {
	tables, header, err := parse(os.Stdin, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
	write(os.Stdout, tables, header)
}

func parse(r io.Reader, passthrough io.Writer) ([]*table, []string, error) {
	var (
		tables []*table
		byName = map[string]*table{}
		header []string
		pkg    string
	)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		for _, p := range []string{"goos:", "goarch:", "cpu:"} {
			if strings.HasPrefix(line, p) && !slices.Contains(header, line) {
				header = append(header, line)
			}
		}
		if p, ok := strings.CutPrefix(line, "pkg: "); ok {
			pkg = p
		}
		fields := strings.Fields(line)
		if len(fields) < 4 || !strings.HasPrefix(fields[0], "Benchmark") {
			fmt.Fprintln(passthrough, line)
			continue
		}
		if _, err := strconv.Atoi(fields[1]); err != nil {
			fmt.Fprintln(passthrough, line)
			continue
		}
		name := procsSuffix.ReplaceAllString(fields[0], "")
		top, row, _ := strings.Cut(name, "/")
		if row == "" {
			row = "-"
		}
		// Packages may have benchmarks of the same name (one per store).
		if pkg != "" {
			top = pkg[strings.LastIndex(pkg, "/")+1:] + ": " + top
		}
		t := byName[top]
		if t == nil {
			t = &table{name: top, values: map[string]map[string][]float64{}}
			byName[top] = t
			tables = append(tables, t)
		}
		if t.values[row] == nil {
			t.values[row] = map[string][]float64{}
			t.rows = append(t.rows, row)
		}
		for i := 2; i+1 < len(fields); i += 2 {
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				continue
			}
			unit := fields[i+1]
			if hidden[unit] {
				continue
			}
			if !slices.Contains(t.metrics, unit) {
				t.metrics = append(t.metrics, unit)
			}
			t.values[row][unit] = append(t.values[row][unit], v)
		}
	}
	return tables, header, sc.Err()
}

func write(w io.Writer, tables []*table, header []string) {
	if len(header) > 0 {
		fmt.Fprintf(w, "_%s_\n\n", strings.Join(header, " · "))
	}
	for _, t := range tables {
		metrics := order(t.metrics)
		fmt.Fprintf(w, "### %s\n\n| case | runs | %s |\n|---|---|%s\n", t.name, strings.Join(metrics, " | "), strings.Repeat("---|", len(metrics)))
		for _, row := range t.rows {
			runs := 0
			cells := make([]string, len(metrics))
			for i, m := range metrics {
				vs := t.values[row][m]
				runs = max(runs, len(vs))
				if len(vs) == 0 {
					continue
				}
				cells[i] = format(m, median(vs))
			}
			fmt.Fprintf(w, "| %s | %d | %s |\n", row, runs, strings.Join(cells, " | "))
		}
		fmt.Fprintln(w)
	}
}

func order(metrics []string) []string {
	var out []string
	for _, m := range leading {
		if slices.Contains(metrics, m) {
			out = append(out, m)
		}
	}
	for _, m := range metrics {
		if !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	return out
}

func median(vs []float64) float64 {
	s := slices.Clone(vs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func format(metric string, v float64) string {
	switch {
	case strings.HasPrefix(metric, "vs-") || strings.HasPrefix(metric, "x-"):
		return strconv.FormatFloat(v, 'f', 2, 64)
	case v >= 100 || v == float64(int64(v)):
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	default:
		return strconv.FormatFloat(v, 'f', 2, 64)
	}
}
