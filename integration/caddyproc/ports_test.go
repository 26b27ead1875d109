package caddyproc

import (
	"net"
	"strconv"
	"testing"
)

// offering makes the probing listeners come up on the given ports first
// (as the kernel may offer a port again once its probe is closed), then on
// free ones.
func offering(t *testing.T, ports ...int) {
	t.Helper()
	orig := listenLoopback
	t.Cleanup(func() { listenLoopback = orig })
	listenLoopback = func() (net.Listener, error) {
		if len(ports) == 0 {
			return orig()
		}
		p := ports[0]
		ports = ports[1:]
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			t.Fatalf("re-binding port %d to offer it again: %v", p, err)
		}
		return l, nil
	}
}

func TestReservePortsNeverHandsOutAHeldPort(t *testing.T) {
	first, err := reservePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	defer first.release()
	a, b := first.ports[0], first.ports[1]
	if a == b {
		t.Fatalf("one reservation holds port %d twice", a)
	}

	offering(t, a, b)
	second, err := reservePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	defer second.release()
	for _, p := range second.ports {
		if p == a || p == b {
			t.Fatalf("port %d handed out while an earlier reservation holds it: %v and %v", p, first.ports, second.ports)
		}
	}
	if second.ports[0] == second.ports[1] {
		t.Fatalf("one reservation holds port %d twice", second.ports[0])
	}

	// Once released, a port can be handed out again.
	first.release()
	offering(t, a)
	third, err := reservePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	defer third.release()
	if third.ports[0] != a {
		t.Errorf("released port %d not handed out again: got %d", a, third.ports[0])
	}
}

func TestReservePortsSkipsPortsLockedByAnotherProcess(t *testing.T) {
	probe, err := listenLoopback()
	if err != nil {
		t.Fatal(err)
	}
	port := probe.Addr().(*net.TCPAddr).Port
	_ = probe.Close()
	// A lock taken in this process conflicts as one taken by another
	// test binary would (see lockPort), so it stands in for one.
	unlock, err := lockPort(port)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()

	offering(t, port)
	lease, err := reservePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.release()
	if lease.ports[0] == port {
		t.Fatalf("port %d handed out while another process's lock holds it", port)
	}
}

func TestFreePortsAreDistinct(t *testing.T) {
	ports, err := FreePorts(8)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if seen[p] {
			t.Fatalf("port %d returned twice: %v", p, ports)
		}
		seen[p] = true
	}
}
