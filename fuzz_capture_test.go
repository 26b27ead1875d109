package icebergidempotency

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
)

// FuzzCaptureWriter drives a captureWriter with a random sequence of
// WriteHeader, Write and Flush calls under a random limit, as reverse_proxy
// might, and checks what the client ends up with: after deliver() the body is
// byte-identical to everything written, the status is the first final one
// (or the implicit 200), informational statuses went through in order, and
// nothing else reached the client before deliver() unless the response
// overflowed, in which case it streamed through untouched and deliver() adds
// nothing.
//
// The program is read byte by byte: op%3 == 0 WriteHeader(fuzzStatuses[arg]),
// 1 Write(the next op/3%64 bytes), 2 Flush through http.ResponseController.
// Writes after a status that allows no body (204, 304, 101) are left out.
func FuzzCaptureWriter(f *testing.F) {
	wh := func(code int) []byte { return []byte{0, byte(slices.Index(fuzzStatuses, code))} }
	write := func(p string) []byte { return append([]byte{byte(len(p)*3 + 1)}, p...) }
	flush := []byte{2}
	seq := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	f.Add(uint16(1024), seq(wh(201), write(`{"a":1}`)))                            // the common case
	f.Add(uint16(4), seq(write("abcdefg"), flush))                                 // overflow on the first write, then flush
	f.Add(uint16(0), []byte{})                                                     // nothing written: empty 200
	f.Add(uint16(0), write(""))                                                    // empty write under a zero limit
	f.Add(uint16(3), seq(wh(103), wh(201), flush, write("{}\nx"), flush, wh(500))) // interim, overflow, later status ignored
	f.Add(uint16(100), seq(wh(204), write("x"), wh(200)))                          // no body allowed
	f.Add(uint16(100), seq(wh(101), flush))                                        // 101 is final, not informational
	f.Add(uint16(8), seq(write("1234"), write("5678"), write("9")))                // exactly the limit, then one more byte
	f.Fuzz(func(t *testing.T, limit16 uint16, prog []byte) {
		limit := int64(limit16 % 512)
		client := newInterimRecorder()
		cw := newCaptureWriter(client, limit)

		var want bytes.Buffer
		wantStatus := 0 // the first final status; 0 until one is written
		var wantInterim []int
		for len(prog) > 0 {
			op := prog[0]
			prog = prog[1:]
			switch op % 3 {
			case 0:
				var arg byte
				if len(prog) > 0 {
					arg, prog = prog[0], prog[1:]
				}
				code := fuzzStatuses[int(arg)%len(fuzzStatuses)]
				cw.WriteHeader(code)
				if wantStatus == 0 {
					if isInterim(code) {
						wantInterim = append(wantInterim, code)
					} else {
						wantStatus = code
					}
				}
			case 1:
				chunk := prog[:min(int(op/3)%64, len(prog))]
				prog = prog[len(chunk):]
				if wantStatus != 0 && !bodyAllowed(wantStatus) {
					// No upstream can send a body with this status
					// (HTTP framing), so reverse_proxy never writes one.
					continue
				}
				n, err := cw.Write(chunk)
				if err != nil || n != len(chunk) {
					t.Fatalf("Write(%d bytes) = %d, %v", len(chunk), n, err)
				}
				if wantStatus == 0 {
					wantStatus = http.StatusOK
				}
				want.Write(chunk)
			case 2:
				if err := http.NewResponseController(cw).Flush(); err != nil {
					t.Fatalf("Flush: %v", err)
				}
			}
		}
		if wantStatus == 0 {
			wantStatus = http.StatusOK // net/http's answer when a handler writes nothing
		}

		overflow := int64(want.Len()) > limit
		if cw.overflowed != overflow {
			t.Fatalf("%d bytes under limit %d: overflowed = %v", want.Len(), limit, cw.overflowed)
		}
		if !slices.Equal(client.interim, wantInterim) {
			t.Fatalf("informational statuses sent %v, want %v", client.interim, wantInterim)
		}
		var streamed []byte
		if overflow {
			// Everything so far must already be with the client, as written.
			if client.final != wantStatus || !bytes.Equal(client.Body.Bytes(), want.Bytes()) {
				t.Fatalf("overflow: client has %d %q, want %d %q", client.final, client.Body.Bytes(), wantStatus, want.Bytes())
			}
			streamed = bytes.Clone(client.Body.Bytes())
		} else {
			if client.final != 0 || client.Body.Len() != 0 || client.Flushed {
				t.Fatalf("before deliver: client has status %d, %d bytes, flushed %v", client.final, client.Body.Len(), client.Flushed)
			}
			if got := cw.finalStatus(); got != wantStatus {
				t.Fatalf("finalStatus() = %d, want %d", got, wantStatus)
			}
		}

		cw.deliver()
		if client.final != wantStatus {
			t.Fatalf("client got status %d, want %d", client.final, wantStatus)
		}
		if !bytes.Equal(client.Body.Bytes(), want.Bytes()) {
			t.Fatalf("client got body %q, want %q", client.Body.Bytes(), want.Bytes())
		}
		if overflow && !bytes.Equal(client.Body.Bytes(), streamed) {
			t.Fatal("deliver() wrote after an overflow")
		}
	})
}

// fuzzStatuses are the statuses FuzzCaptureWriter picks from: informational
// ones (101 is final: the connection changes protocol), and final ones from
// every class.
var fuzzStatuses = []int{100, 101, 102, 103, 199, 200, 201, 204, 206, 301, 304, 400, 404, 409, 422, 499, 500, 503, 599}

// bodyAllowed reports whether a response with code may have a body (RFC 9110).
func bodyAllowed(code int) bool {
	return !(code >= 100 && code <= 199) && code != http.StatusNoContent && code != http.StatusNotModified
}

// isInterim reports whether net/http sends code as an informational response
// and keeps waiting for the final one.
func isInterim(code int) bool {
	return code >= 100 && code <= 199 && code != http.StatusSwitchingProtocols
}

// interimRecorder is an httptest.ResponseRecorder that treats informational
// statuses as net/http's server does (sent at once, not final) instead of
// taking the first WriteHeader as final whatever it is. It is a fake because
// no real server lets a test observe the order of interim and final writes
// per call; it records which final status was written, if any.
type interimRecorder struct {
	*httptest.ResponseRecorder
	interim []int
	final   int
}

func newInterimRecorder() *interimRecorder {
	return &interimRecorder{ResponseRecorder: httptest.NewRecorder()}
}

func (r *interimRecorder) WriteHeader(code int) {
	if r.final != 0 {
		return
	}
	if isInterim(code) {
		r.interim = append(r.interim, code)
		return
	}
	r.final = code
	r.ResponseRecorder.WriteHeader(code)
}

func (r *interimRecorder) Write(p []byte) (int, error) {
	if r.final == 0 {
		r.WriteHeader(http.StatusOK)
	}
	return r.ResponseRecorder.Write(p)
}

func (r *interimRecorder) Flush() {
	if r.final == 0 {
		r.WriteHeader(http.StatusOK)
	}
	r.ResponseRecorder.Flush()
}
