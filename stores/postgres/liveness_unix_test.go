//go:build unix

package postgres

import (
	"net"
	"testing"
	"time"
)

// TestSocketQuiet checks the peek on a real loopback connection: quiet
// while nothing waits, not once the peer wrote or closed, and never held up
// by a reader blocked on the same socket (pgx leaves one behind a slow
// write; a peek that waited for the socket's read lock hung Acquire for
// good, and CI's race run of the conformance suite with it).
func TestSocketQuiet(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	peer := <-accepted
	if peer == nil {
		t.Fatal("accept failed")
	}
	defer peer.Close()

	within := func(what string, want bool) {
		t.Helper()
		got := make(chan bool, 1)
		go func() { got <- socketQuiet(c) }()
		select {
		case q := <-got:
			if q != want {
				t.Fatalf("%s: quiet = %v, want %v", what, q, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the peek did not return in 5s", what)
		}
	}
	within("idle", true)

	// A reader blocked on the socket, as pgx's background reader can be.
	read := make(chan []byte, 1)
	go func() {
		b := make([]byte, 16)
		n, _ := c.Read(b)
		read <- b[:n]
	}()
	time.Sleep(50 * time.Millisecond) // let it block (nothing can show it has)
	within("with a reader blocked on it", true)
	if _, err := peer.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if got := <-read; string(got) != "x" {
		t.Fatalf("the blocked reader got %q, want what the peer wrote: the peek took it", got)
	}

	if _, err := peer.Write([]byte("FATAL")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	within("with bytes waiting", false)
	b := make([]byte, 16)
	if n, _ := c.Read(b); string(b[:n]) != "FATAL" {
		t.Fatalf("read %q after the peek, want the bytes the peek left", b[:n])
	}
	peer.Close()
	time.Sleep(50 * time.Millisecond)
	within("closed by the peer", false)
}
