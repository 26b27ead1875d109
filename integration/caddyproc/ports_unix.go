//go:build unix

package caddyproc

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// lockPort takes the machine-wide lock on port and returns its unlock: an
// flock, which conflicts between any two opens of the file (in one process
// as across two) and which the kernel drops when the file is closed or the
// process dies, so a crashed test leaves nothing held.
func lockPort(port int) (unlock func(), err error) {
	path, err := portLockPath(port)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o666)
	if err != nil {
		return nil, fmt.Errorf("port lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, errPortLocked
		}
		return nil, fmt.Errorf("port lock %s: %w", path, err)
	}
	return func() { _ = f.Close() }, nil
}

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
