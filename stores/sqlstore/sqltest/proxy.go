package sqltest

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
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
	cp := func(dst, src net.Conn) {
		defer func() { done <- struct{}{} }()
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
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
	go cp(server, client)
	go cp(client, server)
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
