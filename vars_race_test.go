package icebergidempotency

import (
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// The catalog call ends (execution_timeout) while Go's transport still
// dials the catalog in a goroutine of its own, which reads the request's
// Caddy variables (reverse_proxy's dialer looks up its proxy variable).
// The handler wrote the same map once the call was over (the guard's mark
// taken back, a hidden key's), a data race the race detector reports here
// (the test suite runs with -race), and which, unreported, is a fatal
// "concurrent map read and map write" of the whole process. The handler's
// per-call state now travels in the call's context. The catalog is a
// listener that never completes a TLS handshake: no real one stalls on cue.
func TestNoVarsWrittenWhileTheTransportStillDials(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, conn) // held open, never a handshake
			mu.Unlock()
		}
	}()
	slowHandshake := withTLS(reverseproxy.TLSConfig{InsecureSkipVerify: true, HandshakeTimeout: caddy.Duration(5 * time.Second)})
	h := newTestHandler(t, newMemoryStore(t))
	h.ExecutionTimeout = caddy.Duration(200 * time.Millisecond)
	proxy := newReverseProxy(t, ln.Addr().String(), slowHandshake)
	for range 3 {
		res := serve(t, h, proxy, http.MethodPost, commitPath, storetest.NewKey(t), commitBody)
		if res.code() < 500 {
			t.Fatalf("a call the execution timeout ended mid-handshake = %d %s, want a 5xx", res.code(), res.body)
		}
		res = serve(t, h, proxy, http.MethodDelete, commitPath, storetest.NewKey(t), "") // a hidden key
		if res.code() < 500 {
			t.Fatalf("a body-less call the execution timeout ended mid-handshake = %d %s, want a 5xx", res.code(), res.body)
		}
	}
	time.Sleep(100 * time.Millisecond) // the dials go on
}
