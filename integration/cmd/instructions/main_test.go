package main

import (
	"bytes"
	"net/http"
	"testing"
)

func TestDumpTotal(t *testing.T) {
	for _, c := range []struct {
		dump string
		want int64
	}{
		{"version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 649616276\n\nfn=(1) main\n", 649616276},
		{"events: Ir\ntotals: 42 7\n", 42},
	} {
		got, err := dumpTotal([]byte(c.dump))
		if err != nil || got != c.want {
			t.Errorf("dumpTotal(%q) = %d, %v; want %d", c.dump, got, err, c.want)
		}
	}
	if _, err := dumpTotal([]byte("events: Ir\n")); err == nil {
		t.Error("a dump without a summary line was accepted")
	}
}

// Each module case is set against the plain case of the same request: a
// replay against plain with a key, an unkeyed mutation against plain
// without one.
func TestWriteTable(t *testing.T) {
	cases := []*measured{
		{name: "plain keyed", method: http.MethodPost, keyed: true, perReq: 300000},
		{name: "plain", method: http.MethodPost, perReq: 299000},
		{name: "memory, fresh key", route: "memory", method: http.MethodPost, keyed: true, perReq: 381234.4},
		{name: "memory, no key", route: "memory", method: http.MethodPost, perReq: 298000},
		{name: "memory, replay", route: "memory", method: http.MethodPost, replay: "k", perReq: 150000},
	}
	var out bytes.Buffer
	writeTable(&out, cases, 10, 3)
	want := "| case (10 requests each, one at a time; median of 3 rounds) | instructions per request | vs plain | added per request |\n| --- | --- | --- | --- |\n" +
		"| plain keyed | 300,000 |  |  |\n" +
		"| plain | 299,000 |  |  |\n" +
		"| memory, fresh key | 381,234 | 1.27 | 81,234 |\n" +
		"| memory, no key | 298,000 | 1.00 | -1,000 |\n" +
		"| memory, replay | 150,000 | 0.50 | -150,000 |\n"
	if out.String() != want {
		t.Fatalf("got:\n%s\nwant:\n%s", out.String(), want)
	}
}
