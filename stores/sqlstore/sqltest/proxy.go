package sqltest

import (
	"bytes"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy forwards a local TCP port to a database server. Stop cuts every
// connection and refuses new ones, as a dead server would; Blackhole makes
// every connection hang, open ones included, as a partition would; Start
// serves again on the same port.
type Proxy struct {
	t      testing.TB
	target string
	addr   string
	frozen atomic.Bool // open connections swallow what they read

	mu    sync.Mutex
	ln    net.Listener
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
	late  *lateWrite // under mu: see HoldNext
}

// lateWrite is a client write to hold back: see HoldNext.
type lateWrite struct {
	pattern   []byte
	hold      time.Duration
	delivered chan struct{}
}

// HoldNext holds the next write of a client that contains pattern for
// hold, then delivers it to the server whether or not the client is still
// there, as the kernel does with what it had accepted from a socket when a
// partition that dropped the packets heals. (A partition's test needs a
// network namespace; the proxy stands in for it.) The channel closes once
// the write was delivered, and the server had 100 ms to read it before the
// client's side can end the connection.
func (p *Proxy) HoldNext(pattern []byte, hold time.Duration) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.late = &lateWrite{pattern: pattern, hold: hold, delivered: make(chan struct{})}
	return p.late.delivered
}

// held returns the armed lateWrite if b is the write it waits for, and
// disarms it.
func (p *Proxy) held(b []byte) *lateWrite {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.late == nil || !bytes.Contains(b, p.late.pattern) {
		return nil
	}
	l := p.late
	p.late = nil
	return l
}

// NewProxy starts a proxy to target (host:port); it is stopped at cleanup.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	p := &Proxy{t: t, target: target, conns: map[net.Conn]struct{}{}}
	ln, err := listenOwnPort()
	if err != nil {
		t.Fatal(err)
	}
	p.addr = ln.Addr().String()
	p.serve(ln)
	t.Cleanup(p.Stop)
	return p
}

// listenOwnPort listens on a loopback port below the kernel's ephemeral
// range, which it never hands out by itself: not to a listener on port 0
// (every other test's), nor as the local port of an outgoing connection.
// Start binds the port again after Stop, and a port from the ephemeral
// range could be taken in between: CI once saw "address already in use".
// Ports are drawn at random and not reused within the process; another
// test process drawing the same one while this proxy is stopped is the
// remaining, unlikely, collision.
func listenOwnPort() (net.Listener, error) {
	low := ephemeralLow()
	const first = 10000
	for range 100 {
		if low <= first {
			break
		}
		port := first + rand.IntN(low-first)
		usedPortsMu.Lock()
		used := usedPorts[port]
		usedPorts[port] = true
		usedPortsMu.Unlock()
		if used {
			continue
		}
		if ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port))); err == nil {
			return ln, nil
		}
	}
	return net.Listen("tcp", "127.0.0.1:0")
}

var (
	usedPortsMu sync.Mutex
	usedPorts   = map[int]bool{}
)

// ephemeralLow is the first port of the kernel's ephemeral range (Linux's
// default when it cannot be read).
func ephemeralLow() int {
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				return n
			}
		}
	}
	return 32768
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.addr }

// Start serves again after Stop.
func (p *Proxy) Start() {
	p.t.Helper()
	p.frozen.Store(false) // Stop closed every frozen connection
	p.listen()
}

// listen serves on the proxy's address again.
func (p *Proxy) listen() {
	p.t.Helper()
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		p.t.Fatal(err)
	}
	p.serve(ln)
}

// serve accepts on ln until it closes. While the proxy is frozen, a new
// connection is held and never answered.
func (p *Proxy) serve(ln net.Listener) {
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if p.frozen.Load() {
				if !p.track(c) {
					c.Close()
				}
				continue
			}
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				p.pipe(c)
			}()
		}
	}()
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) pipe(client net.Conn) {
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		client.Close()
		return
	}
	if !p.track(client) || !p.track(server) {
		client.Close()
		server.Close()
		return
	}
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn, up bool) {
		defer func() { done <- struct{}{} }()
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 && up {
				if l := p.held(buf[:n]); l != nil {
					time.Sleep(l.hold)
					_, _ = dst.Write(buf[:n])
					time.Sleep(100 * time.Millisecond)
					close(l.delivered)
					continue
				}
			}
			if n > 0 && !p.frozen.Load() {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return // either side went; nothing to report
			}
		}
	}
	go cp(server, client, true)
	go cp(client, server, false)
	<-done
	client.Close()
	server.Close()
	<-done
	p.mu.Lock()
	delete(p.conns, client)
	delete(p.conns, server)
	p.mu.Unlock()
}

// Blackhole freezes the open connections (they read and drop everything)
// and accepts new ones that never get an answer, as a server behind a
// dropped route would. Stop ends it. The listener stays: closing it and
// listening again could lose the port in between.
func (p *Proxy) Blackhole() {
	p.t.Helper()
	p.frozen.Store(true)
	p.mu.Lock()
	stopped := p.ln == nil
	p.mu.Unlock()
	if stopped {
		p.listen()
	}
}

// Stop closes the listener and every proxied connection.
func (p *Proxy) Stop() {
	p.mu.Lock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
	p.mu.Unlock()
	p.wg.Wait()
}

// FreePort returns a loopback port nothing listens on, drawn as a Proxy's
// is, for a server a test starts itself.
func FreePort() (int, error) {
	ln, err := listenOwnPort()
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
