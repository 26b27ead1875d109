package icebergidempotency

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"testing"
)

// Flushes during capture must not send headers: the response may still be
// replaced by nothing (release) or must be stored first.
func TestCaptureWriterHoldsUntilDeliver(t *testing.T) {
	rec := httptest.NewRecorder()
	cw := newCaptureWriter(rec, 1024)
	cw.Header().Set("Content-Type", "application/json")
	cw.WriteHeader(http.StatusCreated)
	_, _ = cw.Write([]byte(`{"a":1}`))
	if err := http.NewResponseController(cw).Flush(); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	if rec.Flushed || rec.Body.Len() != 0 {
		t.Fatalf("flushed=%v body=%q before deliver", rec.Flushed, rec.Body.String())
	}
	if cw.finalStatus() != http.StatusCreated || cw.buf.String() != `{"a":1}` {
		t.Fatalf("captured %d %q", cw.finalStatus(), cw.buf.String())
	}
	cw.deliver()
	if rec.Code != http.StatusCreated || rec.Body.String() != `{"a":1}` {
		t.Fatalf("delivered %d %q", rec.Code, rec.Body.String())
	}
}

// Past the limit the whole response still reaches the client, intact and in
// order, and the capture says it overflowed so nothing truncated is stored.
func TestCaptureWriterOverflowStreamsEverything(t *testing.T) {
	rec := httptest.NewRecorder()
	cw := newCaptureWriter(rec, 10)
	cw.WriteHeader(http.StatusOK)
	want := bytes.Repeat([]byte("0123456789abcdef"), 4)
	for i := 0; i < len(want); i += 6 {
		end := min(i+6, len(want))
		if _, err := cw.Write(want[i:end]); err != nil {
			t.Fatal(err)
		}
	}
	cw.deliver() // no-op after overflow
	if !cw.overflowed {
		t.Fatal("not marked overflowed")
	}
	if !bytes.Equal(rec.Body.Bytes(), want) {
		t.Fatalf("client got %q, want %q", rec.Body.Bytes(), want)
	}
}

func TestCaptureWriterDefaultsTo200(t *testing.T) {
	rec := httptest.NewRecorder()
	cw := newCaptureWriter(rec, 10)
	if cw.finalStatus() != http.StatusOK {
		t.Fatalf("status %d", cw.finalStatus())
	}
	cw.WriteHeader(http.StatusEarlyHints) // informational: passed on, not final
	cw.WriteHeader(http.StatusNoContent)
	if cw.finalStatus() != http.StatusNoContent {
		t.Fatalf("status %d, want 204", cw.finalStatus())
	}
}

// An announced length is not bytes received: a catalog (or anything on the
// way) announcing 256 MiB under a large max_response_size and sending ten
// bytes must not make the capture allocate the 256 MiB. With a length of
// 200 GB this killed Caddy (out of memory in WriteHeader).
func TestCaptureWriterDoesNotAllocateTheAnnouncedLength(t *testing.T) {
	rec := httptest.NewRecorder()
	cw := newCaptureWriter(rec, 1<<40)
	cw.Header().Set("Content-Length", strconv.Itoa(256<<20))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	cw.WriteHeader(http.StatusOK)
	_, _ = cw.Write([]byte("0123456789"))
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 8<<20 {
		t.Fatalf("allocated %d bytes for an answer announcing 256 MiB and sending 10", grew)
	}
	if cw.buf.String() != "0123456789" {
		t.Fatalf("captured %q", cw.buf.String())
	}
}
