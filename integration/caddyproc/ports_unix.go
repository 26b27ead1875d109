//go:build unix

package caddyproc

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// lockPort takes the machine-wide lock on port: an flock, which the kernel
// drops when the file is closed or the process dies, so a crashed test
// leaves nothing held.
func lockPort(port int) (*os.File, error) {
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
	return f, nil
}

func unlockPort(f *os.File) { _ = f.Close() }
