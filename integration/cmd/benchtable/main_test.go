package main

import (
	"bytes"
	"strings"
	"testing"
)

// Rows keep their first-seen order, cells are medians over the runs, the
// GOMAXPROCS suffix is dropped, hidden metrics are left out, and lines that
// are not results pass through.
func TestTable(t *testing.T) {
	in := `goos: linux
pkg: example.com/m/bench
cpu: Test CPU
BenchmarkProxy/c=1/plain/post-2   100   5000 ns/op   200 req/s   1.0 p50-ms
BenchmarkProxy/c=1/memory/fresh_key-2   100   6000 ns/op   150 req/s   0.75 vs-plain   1.2 p50-ms
--- FAIL: BenchmarkOther
pkg: example.com/m/stores/postgres
BenchmarkGrowth-2   1   9 ns/op   3.5 x-load
pkg: example.com/m/stores/mysql
BenchmarkGrowth-2   1   9 ns/op   1.5 x-load
pkg: example.com/m/bench
BenchmarkProxy/c=1/plain/post-2   100   5000 ns/op   300 req/s   1.0 p50-ms
BenchmarkProxy/c=1/memory/fresh_key-2   100   6000 ns/op   170 req/s   0.55 vs-plain   1.4 p50-ms
BenchmarkProxy/c=1/plain/post-2   100   5000 ns/op   250 req/s   1.0 p50-ms
BenchmarkProxy/c=1/memory/fresh_key-2   100   6000 ns/op   160 req/s   0.65 vs-plain   1.3 p50-ms
`
	var pass bytes.Buffer
	tables, header, err := parse(strings.NewReader(in), &pass)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	write(&out, tables, header)
	want := "_goos: linux · cpu: Test CPU_\n\n" +
		"### bench: BenchmarkProxy\n\n" +
		"| case | runs | req/s | vs-plain | p50-ms |\n|---|---|---|---|---|\n" +
		"| c=1/plain/post | 3 | 250 |  | 1 |\n" +
		"| c=1/memory/fresh_key | 3 | 160 | 0.65 | 1.30 |\n\n" +
		"### postgres: BenchmarkGrowth\n\n| case | runs | x-load |\n|---|---|---|\n| - | 1 | 3.50 |\n\n" +
		"### mysql: BenchmarkGrowth\n\n| case | runs | x-load |\n|---|---|---|\n| - | 1 | 1.50 |\n\n"
	if out.String() != want {
		t.Fatalf("got:\n%s\nwant:\n%s", out.String(), want)
	}
	if !strings.Contains(pass.String(), "--- FAIL: BenchmarkOther") {
		t.Fatalf("a failure line did not pass through: %q", pass.String())
	}
}
