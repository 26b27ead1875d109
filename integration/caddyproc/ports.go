package caddyproc

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
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
// is chosen), not handed out again by this process, and locked against
// other test processes on the machine through a lock file.
//
// A port taken in the gap by some other program without SO_REUSEPORT still
// makes Caddy fail with "address already in use", which Start retries.

// maxPortProbes bounds the listeners opened to find n usable ports, for
// when reserved or locked ports keep coming back.
const maxPortProbes = 64

// reserved holds the ports this process has handed out and not released.
var reserved = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// listenLoopback opens the probing listeners; a variable so a test can make
// it offer a port it knows is reserved.
var listenLoopback = func() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }

// portLease is a set of reserved ports, held until release.
type portLease struct {
	ports []int
	locks []*os.File
	once  sync.Once
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
		if !reserveInProcess(port) {
			continue
		}
		lock, err := lockPort(port)
		if err != nil {
			releaseInProcess(port)
			if errors.Is(err, errPortLocked) {
				continue
			}
			lease.release()
			return nil, err
		}
		lease.ports = append(lease.ports, port)
		lease.locks = append(lease.locks, lock)
	}
	return lease, nil
}

// release frees the ports for later reservations. Call it only once the
// process they were given to has exited. Safe to call twice.
func (l *portLease) release() {
	l.once.Do(func() {
		for i, port := range l.ports {
			unlockPort(l.locks[i])
			releaseInProcess(port)
		}
	})
}

func reserveInProcess(port int) bool {
	reserved.Lock()
	defer reserved.Unlock()
	if reserved.ports[port] {
		return false
	}
	reserved.ports[port] = true
	return true
}

func releaseInProcess(port int) {
	reserved.Lock()
	defer reserved.Unlock()
	delete(reserved.ports, port)
}

// errPortLocked means another test process holds the port's lock.
var errPortLocked = errors.New("port reserved by another process")

// portLockPath is the lock file for port, shared by every process using
// this package on the machine. The files stay: removing one while another
// process opens it would let two processes lock different files.
func portLockPath(port int) (string, error) {
	dir := filepath.Join(os.TempDir(), "caddyproc-ports")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return "", fmt.Errorf("port lock directory: %w", err)
	}
	return filepath.Join(dir, strconv.Itoa(port)+".lock"), nil
}

// FreePorts returns n distinct loopback ports that were free when chosen,
// for programs that start Caddy themselves. They are not reserved: start
// the listeners soon.
func FreePorts(n int) ([]int, error) {
	var probes []net.Listener
	defer func() {
		for _, l := range probes {
			_ = l.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("probing for a free port: %w", err)
		}
		probes = append(probes, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
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
