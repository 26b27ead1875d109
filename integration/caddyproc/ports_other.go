//go:build !unix

package caddyproc

import "sync"

// held is this process's reserved ports: off Unix there is no lock across
// processes, but one test binary's instances are still kept apart.
var held = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

func lockPort(port int) (unlock func(), err error) {
	held.Lock()
	defer held.Unlock()
	if held.ports[port] {
		return nil, errPortLocked
	}
	held.ports[port] = true
	return func() {
		held.Lock()
		defer held.Unlock()
		delete(held.ports, port)
	}, nil
}
