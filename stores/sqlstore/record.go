package sqlstore

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"time"
	"unicode/utf8"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Row is a record as both dialects select it: NULL-able columns are already
// COALESCEd in SQL, abandonment and the remaining lease are computed by the
// database from its own clock.
type Row struct {
	Key, Operation, Path, Principal, Fingerprint string
	State, Owner                                 string
	Abandoned                                    bool
	Status                                       int
	Headers                                      []byte // JSON, NULL while in flight
	Body                                         []byte
	CreatedAt, ExpiresAt                         time.Time
	LeaseLeftMicros                              int64
	// KeyID is the sealing secret's id ('' for a clear-text response,
	// stored as NULL).
	KeyID string
}

// Record converts the row.
func (r *Row) Record() (*stores.Record, time.Duration, error) {
	rec := &stores.Record{
		Key: r.Key,
		Binding: stores.Binding{
			Operation:   r.Operation,
			Path:        r.Path,
			Principal:   r.Principal,
			Fingerprint: r.Fingerprint,
		},
		State:     stores.State(r.State),
		Owner:     r.Owner,
		Abandoned: r.Abandoned,
		CreatedAt: r.CreatedAt,
		ExpiresAt: r.ExpiresAt,
	}
	switch rec.State {
	case stores.StateInFlight:
	case stores.StateFinal:
		if r.KeyID != "" {
			// Sealed: the body is opaque; status and headers are inside it.
			rec.Response = &stores.Response{Body: r.Body, KeyID: r.KeyID}
			break
		}
		h, err := DecodeHeader(r.Headers)
		if err != nil {
			return nil, 0, fmt.Errorf("%w: record %s: %w", stores.ErrUnreadableRecord, r.Key, err)
		}
		rec.Response = &stores.Response{Status: r.Status, Header: h, Body: r.Body}
	default:
		return nil, 0, fmt.Errorf("%w: record %s has unknown state %q", stores.ErrUnreadableRecord, r.Key, r.State)
	}
	return rec, time.Duration(max(r.LeaseLeftMicros, 0)) * time.Microsecond, nil
}

// Final holds the column values Finalize writes for a response. A sealed
// response writes NULL status and headers (they are inside the ciphertext)
// and its key_id; a clear one writes key_id NULL.
type Final struct {
	Status  any    // int, or nil for NULL
	Headers []byte // JSON, nil for NULL
	Body    []byte // never nil: an empty body, not an unknown one
	KeyID   any    // string, or nil for NULL
}

// EncodeFinal returns the columns for resp, after resp.Check.
func EncodeFinal(resp stores.Response) (Final, error) {
	if err := resp.Check(); err != nil {
		return Final{}, err
	}
	f := Final{Body: resp.Body}
	if f.Body == nil {
		f.Body = []byte{}
	}
	if resp.KeyID != "" {
		f.KeyID = resp.KeyID
		return f, nil
	}
	h, err := EncodeHeader(resp.Header)
	if err != nil {
		return Final{}, err
	}
	f.Status, f.Headers = resp.Status, h
	return f, nil
}

// HeadersArg is f.Headers as a text parameter: a string, or nil for NULL.
func (f Final) HeadersArg() any {
	if f.Headers == nil {
		return nil
	}
	return string(f.Headers)
}

// EncodeHeader encodes replayed headers as a JSON object of string arrays.
//
// JSON strings are UTF-8, and the columns are text, yet a header value may
// carry obs-text (bytes 0x80–0xFF, an ETag's for one) that is not UTF-8.
// json.Marshal would put U+FFFD in its place and a replay would differ from
// the answer. So a header with such a value is kept, base64 per value, in
// the member rawHeaders, which no header name can be; headers that are all
// UTF-8 encode exactly as they always have, so existing rows still read.
func EncodeHeader(h http.Header) ([]byte, error) {
	if h == nil {
		h = http.Header{}
	}
	if headerIsUTF8(h) {
		return json.Marshal(h)
	}
	out := make(map[string]any, len(h)+1)
	raw := make(map[string][]string)
	for name, vals := range h {
		if valuesAreUTF8(vals) {
			out[name] = vals
			continue
		}
		enc := make([]string, len(vals))
		for i, v := range vals {
			enc[i] = base64.StdEncoding.EncodeToString([]byte(v))
		}
		raw[name] = enc
	}
	out[rawHeaders] = raw
	return json.Marshal(out)
}

// rawHeaders names the member holding base64 header values. A header name
// is a token, and ':' is not a token character, so no header collides.
const rawHeaders = ":raw"

func headerIsUTF8(h http.Header) bool {
	for _, vals := range h {
		if !valuesAreUTF8(vals) {
			return false
		}
	}
	return true
}

func valuesAreUTF8(vals []string) bool {
	for _, v := range vals {
		if !utf8.ValidString(v) {
			return false
		}
	}
	return true
}

// DecodeHeader is EncodeHeader's inverse; empty input is an empty header.
func DecodeHeader(b []byte) (http.Header, error) {
	h := http.Header{}
	if len(b) == 0 {
		return h, nil
	}
	// The member's name, quoted and followed by its colon, cannot occur
	// inside a JSON string (the quotes would be escaped), so rows without
	// it take the one-pass decode they always took.
	if !bytes.Contains(b, []byte(`"`+rawHeaders+`":`)) {
		if err := json.Unmarshal(b, &h); err != nil {
			return nil, fmt.Errorf("decode stored headers: %w", err)
		}
		if h == nil {
			h = http.Header{}
		}
		return h, nil
	}
	var members map[string]json.RawMessage
	if err := json.Unmarshal(b, &members); err != nil {
		return nil, fmt.Errorf("decode stored headers: %w", err)
	}
	for name, m := range members {
		if name != rawHeaders {
			var vals []string
			if err := json.Unmarshal(m, &vals); err != nil {
				return nil, fmt.Errorf("decode stored headers: %s: %w", name, err)
			}
			h[name] = vals
			continue
		}
		var raw map[string][]string
		if err := json.Unmarshal(m, &raw); err != nil {
			return nil, fmt.Errorf("decode stored headers: %s: %w", rawHeaders, err)
		}
		for rname, enc := range raw {
			vals := make([]string, len(enc))
			for i, e := range enc {
				v, err := base64.StdEncoding.DecodeString(e)
				if err != nil {
					return nil, fmt.Errorf("decode stored headers: %s: %w", rname, err)
				}
				vals[i] = string(v)
			}
			h[rname] = vals
		}
	}
	return h, nil
}

// Micros converts a duration for SQL interval arithmetic. Durations, never
// timestamps, cross to the database, so only its clock matters.
func Micros(d time.Duration) int64 { return d.Microseconds() }
