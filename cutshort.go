package icebergidempotency

import (
	"bytes"
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
// object or array must close. A body that tells nothing (empty, not JSON,
// in another coding) is taken as whole, as before.
func answerCutShort(h http.Header, status int, body []byte) bool {
	if _, ok := h["Content-Length"]; ok || len(body) == 0 || status == http.StatusNoContent || status == http.StatusNotModified {
		return false
	}
	switch strings.ToLower(strings.TrimSpace(h.Get("Content-Encoding"))) {
	case "", "identity":
	case "gzip", "x-gzip", "deflate":
		rd, err := newDecoder(h.Get("Content-Encoding"), body)
		if err != nil {
			return true
		}
		defer rd.Close()
		_, err = io.Copy(io.Discard, rd)
		return err != nil
	default:
		return false
	}
	mt, _, err := mime.ParseMediaType(h.Get("Content-Type"))
	if err != nil || !(mt == "application/json" || strings.HasSuffix(mt, "+json")) {
		return false
	}
	return !jsonCloses(body)
}

// jsonCloses reports whether body, a JSON text whose top-level value is an
// object or an array, ends with that value closed: every bracket opened
// outside a string is closed again. It is not a validator: a body cut
// short leaves a bracket open, which is all it looks for, at about 1.7 ms
// per MiB. A body whose first value is not an object or an array is taken
// as closed: a cut there cannot be told, nor one after the first value
// closed.
func jsonCloses(body []byte) bool {
	body = bytes.TrimLeft(body, " \t\r\n")
	if len(body) == 0 || (body[0] != '{' && body[0] != '[') {
		return true
	}
	depth := 0
	inString, escaped := false, false
	for _, c := range body {
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
				return true
			}
		}
	}
	return false
}
