package caddyproc

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
)

// Caddy binds its listeners with SO_REUSEPORT, so if two of its listeners
// are given the same port both binds succeed and the kernel splits the
// connections between them. A collision never shows as "address already in
// use": it shows as requests answered by the wrong listener (the admin
// API's "404 page not found" for a catalog route, as CI once saw when an
// instance's HTTP and admin ports came out equal). So a port the harness
// hands to Caddy stays reserved until that instance's test ends: distinct
// within one pick (the probing listeners are all held open until every port
// is chosen), and locked against every other pick, in this process or in
// another test process on the machine (lockPort).
//
// A port taken in the gap by some other program without SO_REUSEPORT still
// makes Caddy fail with "address already in use", which Start retries.

// maxPortProbes bounds the listeners opened to find n usable ports, for
// when reserved or locked ports keep coming back.
const maxPortProbes = 64

// listenLoopback opens the probing listeners; a variable so a test can make
// it offer a port it knows is reserved.
var listenLoopback = func() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }

// portLease is a set of reserved ports, held until release.
type portLease struct {
	ports   []int
	unlocks []func()
	once    sync.Once
}

// reservePorts picks n distinct free loopback ports that no other live
// reservation, in this process or another, holds.
func reservePorts(n int) (*portLease, error) {
	lease := &portLease{}
	var probes []net.Listener
	defer func() {
		for _, l := range probes {
			_ = l.Close()
		}
	}()
	for len(lease.ports) < n {
		if len(probes) >= maxPortProbes {
			lease.release()
			return nil, fmt.Errorf("no %d free loopback ports after %d probes", n, len(probes))
		}
		l, err := listenLoopback()
		if err != nil {
			lease.release()
			return nil, fmt.Errorf("probing for a free port: %w", err)
		}
		// Held open until the end, so the kernel cannot offer it twice.
		probes = append(probes, l)
		port := l.Addr().(*net.TCPAddr).Port
		unlock, err := lockPort(port)
		if errors.Is(err, errPortLocked) {
			continue
		}
		if err != nil {
			lease.release()
			return nil, err
		}
		lease.ports = append(lease.ports, port)
		lease.unlocks = append(lease.unlocks, unlock)
	}
	return lease, nil
}

// release frees the ports for later reservations. Call it only once the
// process they were given to has exited. Safe to call twice.
func (l *portLease) release() {
	l.once.Do(func() {
		for _, unlock := range l.unlocks {
			unlock()
		}
	})
}

// errPortLocked means another reservation holds the port.
var errPortLocked = errors.New("port reserved by another reservation")

// FreePorts returns n distinct loopback ports that were free, and held by
// no reservation, when chosen, for programs that start Caddy themselves.
// They are not kept reserved: start the listeners soon.
func FreePorts(n int) ([]int, error) {
	lease, err := reservePorts(n)
	if err != nil {
		return nil, err
	}
	lease.release()
	return lease.ports, nil
}

// ReservePort returns a loopback port that nothing listens on and that no
// Instance will be given until the test ends: an address to point a proxy
// at while its catalog is down, for NewBackendAt to bring up later.
func ReservePort(t testing.TB) int {
	t.Helper()
	lease, err := reservePorts(1)
	if err != nil {
		t.Fatalf("caddyproc: %v", err)
	}
	t.Cleanup(lease.release)
	return lease.ports[0]
}
