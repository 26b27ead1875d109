//go:build unix

package postgres

import (
	"errors"
	"net"
	"syscall"
)

// socketQuiet peeks at c's socket without blocking and without taking
// anything from it: EAGAIN means nothing is waiting and the peer has not
// closed; bytes waiting or an end of stream (0 bytes) or any other error
// mean the server spoke or left. A connection that is not a socket is
// taken as quiet.
func socketQuiet(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return true
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	var peekErr error
	var buf [1]byte
	// Control, not Read: Read takes the socket's read lock, which a
	// reader blocked on it holds until data comes. pgx leaves one so
	// after a write slow enough to start its background reader (a large
	// answer being stored), and in CI a peek waited behind it for good,
	// with nothing to come since the connection was never sent anything
	// again. Peeking takes nothing, so it cannot disturb such a reader.
	err = raw.Control(func(fd uintptr) {
		// The net package keeps its sockets non-blocking: the call
		// returns EAGAIN at once when nothing is waiting.
		_, _, peekErr = syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK)
	})
	if err != nil {
		return false
	}
	return errors.Is(peekErr, syscall.EAGAIN) || errors.Is(peekErr, syscall.EWOULDBLOCK)
}
