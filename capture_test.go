package icebergidempotency

import (
	"bytes"
	"net/http"
	"net/http/httptest"
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
