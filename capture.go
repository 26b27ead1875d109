package icebergidempotency

import (
	"bytes"
	"errors"
	"net/http"
	"strconv"
	"strings"
)

// captureWriter buffers a response so it can be stored before the client
// sees it: a retry that arrives right after the client got its answer must
// find the record final. Past limit bytes it gives up capturing and streams
// the rest straight through, so an oversize response is delivered untouched
// and is never stored truncated.
//
// The header map is the real writer's, like caddyhttp.ResponseRecorder's:
// headers set by earlier handlers stay visible and are sent as usual.
type captureWriter struct {
	w           http.ResponseWriter
	limit       int64
	status      int
	wroteHeader bool
	buf         bytes.Buffer
	overflowed  bool
	// clientGone is set when a write or flush of an overflowed answer to
	// the client failed: the client went away while it was streamed.
	clientGone bool
}

func newCaptureWriter(w http.ResponseWriter, limit int64) *captureWriter {
	return &captureWriter{w: w, limit: limit}
}

func (c *captureWriter) Header() http.Header { return c.w.Header() }

func (c *captureWriter) WriteHeader(status int) {
	if c.wroteHeader {
		return
	}
	// Informational responses (e.g. 103 Early Hints) are not final: pass
	// them on and keep waiting for the real status.
	if status >= 100 && status <= 199 && status != http.StatusSwitchingProtocols {
		c.w.WriteHeader(status)
		return
	}
	c.status = status
	c.wroteHeader = true
	// Up to maxPreallocated, one allocation of exactly the announced size
	// instead of a buffer grown by doubling: the memory store then keeps
	// the body as it is (see memory.Store.Finalize). A length above the
	// limit is left to overflow as it comes, and one above
	// maxPreallocated to grow as it comes (the memory store then copies
	// it to its size): the length is the catalog's word, not bytes
	// received, and a large max_response_size must not let one header
	// allocate it.
	if n, err := strconv.ParseInt(c.w.Header().Get("Content-Length"), 10, 64); err == nil && n > 0 && n <= c.limit {
		c.buf = *bytes.NewBuffer(make([]byte, 0, min(n, maxPreallocated)))
	}
}

// maxPreallocated is the most a captured answer's announced length
// reserves before its bytes arrive.
const maxPreallocated = 1 << 20

func (c *captureWriter) Write(p []byte) (int, error) {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
	}
	if c.overflowed {
		return c.passOn(p)
	}
	if int64(c.buf.Len()+len(p)) > c.limit {
		c.overflowed = true
		c.w.WriteHeader(c.status)
		if _, err := c.passOn(c.buf.Bytes()); err != nil {
			return 0, err
		}
		c.buf = bytes.Buffer{}
		return c.passOn(p)
	}
	return c.buf.Write(p)
}

// passOn writes p of an overflowed answer to the client.
func (c *captureWriter) passOn(p []byte) (int, error) {
	n, err := c.w.Write(p)
	if err != nil {
		c.clientGone = true
	}
	return n, err
}

// FlushError keeps reverse_proxy's periodic flushes from sending headers
// early while the response is still being captured; ResponseController
// finds it before it looks at Unwrap.
func (c *captureWriter) FlushError() error {
	if c.overflowed {
		err := http.NewResponseController(c.w).Flush()
		if err != nil && !errors.Is(err, http.ErrNotSupported) {
			c.clientGone = true
		}
		return err
	}
	return nil
}

// Unwrap lets http.ResponseController reach the real writer for everything
// else (deadlines).
func (c *captureWriter) Unwrap() http.ResponseWriter { return c.w }

// finalStatus is the status of the captured response; a handler that wrote
// nothing produced an empty 200, as net/http would send.
func (c *captureWriter) finalStatus() int {
	if !c.wroteHeader {
		return http.StatusOK
	}
	return c.status
}

// deliver sends the captured response to the client. A client that went away
// makes these writes fail; nothing more can be done for it then, and its
// retry will be answered from the store.
func (c *captureWriter) deliver() {
	if c.overflowed {
		return
	}
	h := c.w.Header()
	trailers := takeTrailers(h)
	c.w.WriteHeader(c.finalStatus())
	_, _ = c.w.Write(c.buf.Bytes())
	for name, vals := range trailers {
		h[name] = vals // net/http sends them after the body
	}
}

// takeTrailers removes from h, and returns, the values of the trailers h
// announces ("Trailer: X-Checksum"). reverse_proxy sets them into the
// header map after the body, which the capture writer held back: sent
// with the header now, they would reach the client as headers, where
// plain reverse_proxy sends them as trailers. nil, at no cost, when h
// announces none.
func takeTrailers(h http.Header) http.Header {
	var taken http.Header
	for _, line := range h["Trailer"] {
		for name := range strings.SplitSeq(line, ",") {
			name = http.CanonicalHeaderKey(strings.TrimSpace(name))
			if vals, ok := h[name]; ok {
				if taken == nil {
					taken = make(http.Header)
				}
				taken[name] = vals
				delete(h, name)
			}
		}
	}
	return taken
}

// dropEntityHeaders removes from h what describes the body of an answer
// about to be replaced by another: left, they would describe the new body
// (an encoding it does not have, the old length) to the client.
func dropEntityHeaders(h http.Header) {
	for _, name := range []string{"Content-Encoding", "Content-Length", "Content-Type", "Content-Range", "Etag", "Last-Modified", "Trailer"} {
		delete(h, name)
	}
}
