package sqlstore

import (
	"bytes"
	"errors"
	"net/http"
	"reflect"
	"testing"
	"unicode/utf8"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// A row this build cannot read (a state a newer build wrote, headers that
// do not decode) is reported as unreadable, which the handler answers as
// outcome unknown, never passing the request through.
func TestUnreadableRows(t *testing.T) {
	for _, r := range []Row{
		{Key: "k", State: "done_v9"},
		{Key: "k", State: string(stores.StateFinal), Status: 200, Headers: []byte("not json")},
	} {
		if _, _, err := r.Record(); !errors.Is(err, stores.ErrUnreadableRecord) {
			t.Errorf("row in state %q: %v, want ErrUnreadableRecord", r.State, err)
		}
	}
	ok := Row{Key: "k", State: string(stores.StateFinal), Status: 200, Headers: []byte("{}")}
	if _, _, err := ok.Record(); err != nil {
		t.Errorf("a readable final row: %v", err)
	}
}

// Header values come back byte for byte, obs-text that is not UTF-8
// included, and headers that are all UTF-8 encode as rows have always held
// them, so that rows written before the raw member still read.
func TestHeaderRoundTrip(t *testing.T) {
	cases := []http.Header{
		{},
		{"Content-Type": {"application/json"}, "Etag": {`"abc"`}},
		{"Etag": {"W/\"caf\xe9\""}, "Content-Type": {"application/json"}},
		{"Etag": {"\xff\x80", "plain"}, "X-Quoted": {`a":raw":b`, "\x80"}},
		{"X-Quoted": {`":raw":`}},
		{"X-Empty": nil, "X-Blank": {""}, "Location": {"/v1/t\xc3\xa9"}},
	}
	for _, want := range cases {
		b, err := EncodeHeader(want)
		if err != nil {
			t.Fatalf("EncodeHeader(%q): %v", want, err)
		}
		if !utf8.Valid(b) {
			t.Errorf("EncodeHeader(%q) = %q: not UTF-8, which a text column refuses", want, b)
		}
		got, err := DecodeHeader(b)
		if err != nil {
			t.Fatalf("DecodeHeader(%q): %v", b, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("round trip of %q through %s = %q", want, b, got)
		}
	}
	old := []byte(`{"Content-Type":["application/json"],"Etag":["\"abc\""]}`)
	if b, _ := EncodeHeader(http.Header{"Content-Type": {"application/json"}, "Etag": {`"abc"`}}); !bytes.Equal(b, old) {
		t.Errorf("UTF-8 headers encode as %s, want the form rows have always held, %s", b, old)
	}
	for _, bad := range []string{`{":raw":{"Etag":["not base64!"]}}`, `{":raw":["x"]}`, `{"Etag":"x",":raw":{}}`} {
		if _, err := DecodeHeader([]byte(bad)); err == nil {
			t.Errorf("DecodeHeader(%s) = nil error, want one", bad)
		}
	}
}
