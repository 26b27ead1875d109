package icebergidempotency

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
	"golang.org/x/net/http2"
)

// The errors unprocessed reads are Go's own, taken from its transport
// here rather than written out: a Go release that changes them fails this
// test (the handler would then take such requests for processed, the safe
// side, and leave their keys unknown).
func TestUnprocessedErrors(t *testing.T) {
	for _, c := range []struct {
		name   string
		err    func(t *testing.T) error
		unsent bool
	}{
		{"HTTP/2 GOAWAY below the stream", func(t *testing.T) error { return h2Refusal(t, refuseGoAway) }, true},
		{"HTTP/2 REFUSED_STREAM", func(t *testing.T) error { return h2Refusal(t, refuseStream) }, true},
		{"HTTP/2 PROTOCOL_ERROR", func(t *testing.T) error { return h2Refusal(t, resetProtocolError) }, false},
		{"HTTP/2 GOAWAY after the stream", func(t *testing.T) error { return h2Refusal(t, goAwayAfterStream) }, false},
		{"HTTP/1 nothing written", func(t *testing.T) error { return h1Failure(t, 0) }, true},
		{"HTTP/1 part written", func(t *testing.T) error { return h1Failure(t, 10) }, false},
		{"HTTP/1 reset after the request", func(t *testing.T) error { return h1Failure(t, -1) }, false},
		{"HTTP/3 REQUEST_REJECTED", func(t *testing.T) error { return h3Reset(t, http3.ErrCodeRequestRejected) }, true},
		{"HTTP/3 INTERNAL_ERROR", func(t *testing.T) error { return h3Reset(t, http3.ErrCodeInternalError) }, false},
		{"HTTP/3 REQUEST_CANCELLED", func(t *testing.T) error { return h3Reset(t, http3.ErrCodeRequestCanceled) }, false},
		// The client's own use of the code is no word from the catalog.
		{"HTTP/3 REQUEST_REJECTED, local", func(*testing.T) error {
			return &quic.StreamError{ErrorCode: quic.StreamErrorCode(http3.ErrCodeRequestRejected), Remote: false}
		}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.err(t)
			if err == nil {
				t.Fatal("the request succeeded")
			}
			t.Logf("%v", err)
			if got := unprocessed(err); got != c.unsent {
				t.Fatalf("unprocessed(%q) = %v, want %v", err, got, c.unsent)
			}
		})
	}
}

// opaqueBody hides its reader's type from http.NewRequest, which would
// otherwise give the request a GetBody, as the handler's body has none.
type opaqueBody struct{ io.Reader }

// h2Misbehaviour is what the test's HTTP/2 server does with the first
// request's stream.
type h2Misbehaviour int

const (
	refuseGoAway       h2Misbehaviour = iota // GOAWAY with last stream 0
	refuseStream                             // RST_STREAM REFUSED_STREAM
	resetProtocolError                       // RST_STREAM PROTOCOL_ERROR
	goAwayAfterStream                        // GOAWAY with the stream as the last, then the connection closed
)

// h2Refusal sends a POST over h2c to a server (x/net's framer, as no Go
// server misbehaves on purpose) that treats its stream as told, and
// returns the transport's error.
func h2Refusal(t *testing.T, how h2Misbehaviour) error {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	wg.Add(1)
	go func() {
		defer wg.Done()
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		serveH2Frames(conn, func(fr *http2.Framer, f http2.Frame) bool {
			h, ok := f.(*http2.MetaHeadersFrame)
			if !ok {
				return true
			}
			id := h.StreamID
			switch how {
			case refuseGoAway:
				_ = fr.WriteGoAway(0, http2.ErrCodeNo, nil)
			case refuseStream:
				_ = fr.WriteRSTStream(id, http2.ErrCodeRefusedStream)
			case resetProtocolError:
				_ = fr.WriteRSTStream(id, http2.ErrCodeProtocol)
			case goAwayAfterStream:
				_ = fr.WriteGoAway(id, http2.ErrCodeNo, nil)
			}
			if how == refuseGoAway || how == goAwayAfterStream {
				time.Sleep(50 * time.Millisecond) // the frame arrives before the close
				return false
			}
			return true
		})
	}()
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	defer tr.CloseIdleConnections()
	return postUnrewindable(t, tr, "http://"+ln.Addr().String()+commitPath, -1)
}

// postUnrewindable POSTs the commit over tr with a body it cannot rewind,
// as the handler's is, and returns the transport's error. contentLength
// is announced unless negative.
func postUnrewindable(t *testing.T, tr http.RoundTripper, url string, contentLength int64) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, opaqueBody{strings.NewReader(commitBody)})
	if err != nil {
		t.Fatal(err)
	}
	if contentLength >= 0 {
		req.ContentLength = contentLength
	}
	res, err := tr.RoundTrip(req)
	if err == nil {
		res.Body.Close()
	}
	return err
}

// scriptedConn is a connection whose writes fail after written bytes
// (all of them when written is -1, and then its reads fail instead). Its
// reads otherwise wait for the test's end, not for Close: a read failing
// as the transport closes the connection after the failed write would race
// the write's error to the caller (it failed 3 runs in 2,500 under load).
type scriptedConn struct {
	written int
	testEnd <-chan struct{}
}

func (c *scriptedConn) Write(p []byte) (int, error) {
	if c.written < 0 {
		return len(p), nil
	}
	return min(c.written, len(p)), syscall.EPIPE
}

func (c *scriptedConn) Read(p []byte) (int, error) {
	if c.written < 0 {
		return 0, syscall.ECONNRESET
	}
	<-c.testEnd
	return 0, net.ErrClosed
}

func (c *scriptedConn) Close() error { return nil }

func (c *scriptedConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *scriptedConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *scriptedConn) SetDeadline(time.Time) error      { return nil }
func (c *scriptedConn) SetReadDeadline(time.Time) error  { return nil }
func (c *scriptedConn) SetWriteDeadline(time.Time) error { return nil }

// h1Failure sends a POST over HTTP/1.1 on a connection that writes
// written bytes of it and then fails (-1: writes it all, then the read of
// the answer is reset), and returns the transport's error.
func h1Failure(t *testing.T, written int) error {
	t.Helper()
	testEnd := make(chan struct{})
	t.Cleanup(func() { close(testEnd) })
	tr := &http.Transport{DialContext: func(context.Context, string, string) (net.Conn, error) {
		return &scriptedConn{written: written, testEnd: testEnd}, nil
	}}
	defer tr.CloseIdleConnections()
	return postUnrewindable(t, tr, "http://catalog"+commitPath, int64(len(commitBody)))
}

// h3Reset sends a POST with a body it cannot rewind over quic-go's HTTP/3
// transport to a catalog that resets the stream with code, and returns the
// transport's error.
func h3Reset(t *testing.T, code http3.ErrCode) error {
	t.Helper()
	catalog := newH3CatalogResettingFirst(t, code, executeOK)
	tr := &http3.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}
	defer tr.Close()
	return postUnrewindable(t, tr, "https://"+catalog.addr+commitPath, -1)
}
