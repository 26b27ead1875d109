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
// object or array must close. Which framing an answer had does not reach
// this handler (the transport drops Transfer-Encoding), so every answer
// without a Content-Length is checked; a whole one passes. A body that
// tells nothing (empty, not JSON, in another coding, or decoding to more
// than maxCheckedDecode) is taken as whole, as before.
func answerCutShort(h http.Header, status int, body []byte) bool {
	if _, ok := h["Content-Length"]; ok || len(body) == 0 || status == http.StatusNoContent || status == http.StatusNotModified {
		return false
	}
	switch strings.ToLower(strings.TrimSpace(h.Get("Content-Encoding"))) {
	case "", "identity":
	case "gzip", "x-gzip":
		zr, err := gzip.NewReader(bytes.NewReader(body))
		if err != nil {
			return errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) // a header cut short
		}
		// Its first member, as a decoder reads it; bytes after it
		// (a newline some servers add) are no cut.
		zr.Multistream(false)
		return !decodesToEnd(zr)
	case "deflate":
		// zlib, as RFC 9110 says, or the raw deflate some servers send
		// under the name: a body whole in either is whole.
		if zr, err := zlib.NewReader(bytes.NewReader(body)); err == nil && decodesToEnd(zr) {
			return false
		}
		return !decodesToEnd(flate.NewReader(bytes.NewReader(body)))
	default:
		return false
	}
	mt, _, err := mime.ParseMediaType(h.Get("Content-Type"))
	if err != nil || !(mt == "application/json" || strings.HasSuffix(mt, "+json")) {
		return false
	}
	return !jsonCloses(body)
}

// maxCheckedDecode bounds the decoding answerCutShort does: a body that
// decodes to more is taken as whole, its end unchecked, so that a highly
// compressed answer cannot hold the request path for seconds.
const maxCheckedDecode = 64 << 20

// decodesToEnd reports whether r decodes to its end without error, or to
// more than maxCheckedDecode bytes.
func decodesToEnd(r io.Reader) bool {
	n, err := io.Copy(io.Discard, io.LimitReader(r, maxCheckedDecode+1))
	return n > maxCheckedDecode || err == nil
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
