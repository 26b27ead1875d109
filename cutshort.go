package icebergidempotency

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"io"
	"mime"
	"net/http"
	"strings"
)

// answerCutShort reports whether a captured answer without a Content-Length
// is provably not the whole of what the catalog meant to send. Go's
// transport proves the end of an answer with a length, of a chunked one
// and of an HTTP/2 or HTTP/3 stream, and breaks the call off when it does
// not come (reverse_proxy then panics, and the key's outcome is unknown).
// An HTTP/1 answer with neither length nor chunks ends where the catalog
// closes its connection, and a connection that broke mid-answer looks the
// same: until the build after c861d98 such a cut answer was stored and
// replayed, with Idempotent-Replayed, to every retry as if whole. A client
// that cannot parse an answer to a commit may clean up after a commit that
// landed, so it is checked where the body itself tells: a gzip or deflate
// body must decode to its end (the codings' own checksums), and a JSON
// object or array, compressed or not, must close. Which framing an answer had does not reach
// this handler (the transport drops Transfer-Encoding), so every answer
// without a Content-Length is checked; a whole one passes. A body that
// tells nothing (empty, not JSON, in another coding, or decoding to more
// than maxCheckedDecode) is taken as whole, as before.
func answerCutShort(h http.Header, status int, body []byte) bool {
	if _, ok := h["Content-Length"]; ok || len(body) == 0 || status == http.StatusNoContent || status == http.StatusNotModified {
		return false
	}
	json := false
	if mt, _, err := mime.ParseMediaType(h.Get("Content-Type")); err == nil {
		json = mt == "application/json" || strings.HasSuffix(mt, "+json")
	}
	switch strings.ToLower(strings.TrimSpace(h.Get("Content-Encoding"))) {
	case "", "identity":
		return json && !jsonCloses(body)
	case "gzip", "x-gzip":
		return gzipCut(body, json)
	case "deflate":
		// zlib, as RFC 9110 says, or the raw deflate some servers send
		// under the name: a body whole in either is whole.
		if zr, err := zlib.NewReader(bytes.NewReader(body)); err == nil {
			if v := decodeChecked(zr, json); v != decodedCut {
				return v == decodedOpen
			}
		}
		v := decodeChecked(flate.NewReader(bytes.NewReader(body)), json)
		return v == decodedCut || v == decodedOpen
	default:
		return false
	}
}

// gzipCut reports whether body, under Content-Encoding gzip, is cut short:
// a member does not decode to its end, or what the members decode to is
// JSON that does not close. Every member counts, as decoders read them
// (until the build after d4fe47c only the first was checked, and a body
// cut inside its second was stored); bytes after the last whose header
// cannot be read (a newline some servers add, a stray 0x1f) are no cut, as
// Java's GZIPInputStream and Python's zlib ignore them too: a text cut
// there is still caught by its JSON.
func gzipCut(body []byte, json bool) bool {
	br := bytes.NewReader(body)
	zr, err := gzip.NewReader(br)
	if err != nil {
		return errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) // a header cut short
	}
	d := &checkedDecode{json: json}
	for {
		zr.Multistream(false)
		if v := d.decode(zr); v != decodedWhole {
			return v == decodedCut
		}
		rest := body[len(body)-br.Len():]
		if len(rest) == 0 || rest[0] != 0x1f || len(rest) > 1 && rest[1] != 0x8b {
			break
		}
		if zr.Reset(br) != nil {
			break
		}
	}
	return d.verdict() == decodedOpen
}

// maxCheckedDecode bounds the decoding answerCutShort does: a body that
// decodes to more is taken as whole, its end unchecked, so that a highly
// compressed answer cannot hold the request path for seconds.
const maxCheckedDecode = 64 << 20

// decoded is the verdict on a compressed body: whole, cut short in its
// coding, whole in its coding but a JSON text that does not close, or
// decoding to more than maxCheckedDecode (unchecked, taken as whole).
type decoded int

const (
	decodedWhole decoded = iota
	decodedCut
	decodedOpen
	decodedUnchecked
)

// decodeChecked decodes r to its end, following the JSON text it decodes
// to when json is set: the coding may be whole around a JSON text cut
// short, as when Caddy's encode, between this handler and reverse_proxy,
// compresses an answer the catalog broke off (until the build after
// d4fe47c such a body was stored and replayed as whole).
func decodeChecked(r io.Reader, json bool) decoded {
	d := &checkedDecode{json: json}
	if v := d.decode(r); v != decodedWhole {
		return v
	}
	return d.verdict()
}

// checkedDecode decodes one or more streams (gzip's members) as one text,
// within maxCheckedDecode in all.
type checkedDecode struct {
	json bool
	text jsonScanner
	n    int64
}

// decode decodes r to its end: decodedWhole, decodedCut or
// decodedUnchecked.
func (d *checkedDecode) decode(r io.Reader) decoded {
	var w io.Writer = io.Discard
	if d.json {
		w = &d.text
	}
	n, err := io.Copy(w, io.LimitReader(r, maxCheckedDecode-d.n+1))
	d.n += n
	switch {
	case d.n > maxCheckedDecode:
		return decodedUnchecked
	case err != nil:
		return decodedCut
	}
	return decodedWhole
}

// verdict is decodedOpen for a JSON text that did not close, else
// decodedWhole.
func (d *checkedDecode) verdict() decoded {
	if d.json && !d.text.closes() {
		return decodedOpen
	}
	return decodedWhole
}

// jsonCloses reports whether body, a JSON text whose top-level value is an
// object or an array, ends with that value closed (see jsonScanner).
func jsonCloses(body []byte) bool {
	var s jsonScanner
	_, _ = s.Write(body)
	return s.closes()
}

// jsonScanner follows a JSON text as it is written, far enough to tell
// whether its top-level object or array closes: every bracket opened
// outside a string is closed again. It is not a validator: a text cut
// short leaves a bracket open, which is all it looks for, at about 1.7 ms
// per MiB. A text whose first value is not an object or an array is taken
// as closed: a cut there cannot be told, nor one after the first value
// closed. A byte order mark before it is skipped as whitespace (until the
// build after d4fe47c a text that began with one was never checked).
type jsonScanner struct {
	started, done     bool
	inString, escaped bool
	depth             int
}

func (s *jsonScanner) Write(p []byte) (int, error) {
	n := len(p)
	if s.done {
		return n, nil
	}
	if !s.started {
		i := 0
		for i < len(p) && strings.IndexByte(" \t\r\n\xef\xbb\xbf", p[i]) >= 0 {
			i++
		}
		if p = p[i:]; len(p) == 0 {
			return n, nil
		}
		if p[0] != '{' && p[0] != '[' {
			s.done = true
			return n, nil
		}
		s.started = true
	}
	inString, escaped, depth := s.inString, s.escaped, s.depth // in registers
	for _, c := range p {
		switch {
		case inString:
			switch {
			case escaped:
				escaped = false
			case c == '\\':
				escaped = true
			case c == '"':
				inString = false
			}
		case c == '"':
			inString = true
		case c == '{' || c == '[':
			depth++
		case c == '}' || c == ']':
			depth--
			if depth == 0 {
				s.done = true
				return n, nil
			}
		}
	}
	s.inString, s.escaped, s.depth = inString, escaped, depth
	return n, nil
}

// closes reports whether the text written so far closed its top-level
// object or array, or tells nothing (empty, or no object or array).
func (s *jsonScanner) closes() bool { return s.done || !s.started }
