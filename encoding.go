package icebergidempotency

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// decodeBody reads a body the catalog compressed with gzip or deflate, up
// to limit bytes decompressed.
func decodeBody(encoding string, body []byte, limit int64) ([]byte, error) {
	rd, err := newDecoder(encoding, body)
	if err != nil {
		return nil, err
	}
	defer rd.Close()
	plain, err := io.ReadAll(io.LimitReader(rd, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(plain)) > limit {
		return nil, fmt.Errorf("decompressed body exceeds %d bytes", limit)
	}
	return plain, nil
}

// newDecoder reads body, compressed with gzip or deflate, decompressed.
func newDecoder(encoding string, body []byte) (io.ReadCloser, error) {
	switch strings.ToLower(strings.TrimSpace(encoding)) {
	case "gzip", "x-gzip":
		return gzip.NewReader(bytes.NewReader(body))
	case "deflate":
		return zlib.NewReader(bytes.NewReader(body))
	case "identity":
		return io.NopCloser(bytes.NewReader(body)), nil
	}
	return nil, fmt.Errorf("unsupported content encoding %q", encoding)
}

// acceptsEncoding reports whether the request's Accept-Encoding allows a
// body in coding (RFC 9110, section 12.5.3): named, or covered by "*",
// with a q-value above 0. A request without the header gets what plain
// reverse_proxy gives it, an uncompressed body (Go's transport asks the
// catalog for gzip itself and decodes it), so it accepts none.
func acceptsEncoding(h http.Header, coding string) bool {
	coding = strings.ToLower(strings.TrimSpace(coding))
	if coding == "x-gzip" {
		coding = "gzip"
	}
	named, wildcard := -1.0, -1.0
	for _, line := range h.Values("Accept-Encoding") {
		for item := range strings.SplitSeq(line, ",") {
			name, params, _ := strings.Cut(item, ";")
			name = strings.ToLower(strings.TrimSpace(name))
			if name == "x-gzip" {
				name = "gzip"
			}
			q := 1.0
			if k, v, ok := strings.Cut(strings.TrimSpace(params), "="); ok && strings.EqualFold(strings.TrimSpace(k), "q") {
				if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
					q = f
				}
			}
			switch name {
			case coding:
				named = q
			case "*":
				wildcard = q
			}
		}
	}
	if named >= 0 {
		return named > 0
	}
	return wildcard > 0
}

// narrowAcceptEncoding keeps, in r's Accept-Encoding for the upstream call,
// only the codings a replay can decode (gzip, deflate) and identity; restore
// puts the header back as it came. The catalog, or an encode handler after
// this one, compresses the response as the first request allows, and that
// body is stored: in zstd or br, a retry that does not take them could not
// be given a body it can read. A header left with nothing is dropped, and
// reverse_proxy's transport then asks for gzip itself and decodes it; so
// is one left with codings the client refuses only ("identity;q=0" of
// "identity;q=0, br"), which would ask the catalog for nothing it may
// send: a strict one answers 406, where plain reverse_proxy gets br.
func narrowAcceptEncoding(r *http.Request) (restore func()) {
	orig, ok := r.Header["Accept-Encoding"]
	if !ok {
		return func() {}
	}
	var kept []string
	changed := false
	for _, line := range orig {
		for item := range strings.SplitSeq(line, ",") {
			name, _, _ := strings.Cut(item, ";")
			switch strings.ToLower(strings.TrimSpace(name)) {
			case "gzip", "x-gzip", "deflate", "identity":
				kept = append(kept, strings.TrimSpace(item))
			case "":
			default:
				changed = true
			}
		}
	}
	if !changed {
		return func() {}
	}
	if len(kept) == 0 || refusesAll(kept) {
		delete(r.Header, "Accept-Encoding")
	} else {
		r.Header["Accept-Encoding"] = []string{strings.Join(kept, ", ")}
	}
	return func() { r.Header["Accept-Encoding"] = orig }
}

// refusesAll reports whether every Accept-Encoding item in items has a
// weight of 0 (RFC 9110, 12.4.2: "not acceptable").
func refusesAll(items []string) bool {
	for _, item := range items {
		_, params, _ := strings.Cut(item, ";")
		weight := "1"
		for p := range strings.SplitSeq(params, ";") {
			if k, v, ok := strings.Cut(strings.TrimSpace(p), "="); ok && strings.EqualFold(strings.TrimSpace(k), "q") {
				weight = strings.TrimSpace(v)
			}
		}
		if strings.Trim(weight, "0.") != "" {
			return false
		}
	}
	return true
}
