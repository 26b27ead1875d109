package caddyproc

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Pid is the process id of the running Caddy.
func (i *Instance) Pid() int {
	if i.cmd == nil || i.cmd.Process == nil {
		return 0
	}
	return i.cmd.Process.Pid
}

// RSS is the resident set size of the Caddy process in bytes, read from
// VmRSS in /proc/<pid>/status: what the process really holds in memory,
// which is what a memory bound must be judged by (the Go heap alone omits
// runtime overhead and memory not yet returned to the OS). Linux only; an
// error elsewhere or once the process is gone.
func (i *Instance) RSS() (int64, error) { return i.statusBytes("VmRSS") }

// PeakRSS is the highest resident set size the Caddy process has had so far
// (VmHWM), so a test sees the true peak however it samples RSS. Linux only.
func (i *Instance) PeakRSS() (int64, error) { return i.statusBytes("VmHWM") }

// statusBytes reads a "<field>: <n> kB" line of /proc/<pid>/status.
func (i *Instance) statusBytes(field string) (int64, error) {
	pid := i.Pid()
	if pid == 0 {
		return 0, errors.New("caddyproc: no process")
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("caddyproc: reading %s: %w", field, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), field+":")
		if !ok {
			continue
		}
		// The kernel writes e.g. "VmRSS:	  123456 kB".
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("caddyproc: parsing %s %q: %w", field, rest, err)
		}
		return kb << 10, nil
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("caddyproc: reading %s: %w", field, err)
	}
	return 0, fmt.Errorf("caddyproc: no %s for pid %d", field, pid)
}
