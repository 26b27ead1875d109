package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// clockTicks is Linux's USER_HZ, the unit of /proc's CPU times: 100 on
// every architecture Go supports there.
const clockTicks = 100

// processCPU is the user and system CPU time pid has used so far.
func processCPU(tb testing.TB, pid int) time.Duration {
	cpu, _, err := readProcStat(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		tb.Fatalf("reading Caddy's CPU time: %v", err)
	}
	return cpu
}

// readProcStat reads a /proc/<pid>/stat file: the process's user and
// system CPU time, and its command name.
func readProcStat(path string) (time.Duration, string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, "", err
	}
	// The command name (field 2, in parentheses) may hold spaces; the
	// fields after its closing parenthesis start with field 3.
	open, end := strings.IndexByte(string(raw), '('), strings.LastIndexByte(string(raw), ')')
	if open < 0 || end < open || end+2 > len(raw) {
		return 0, "", fmt.Errorf("unexpected %s: %q", path, raw)
	}
	f := strings.Fields(string(raw[end+2:]))
	if len(f) < 13 {
		return 0, "", fmt.Errorf("unexpected %s: %q", path, raw)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64) // field 14
	stime, err2 := strconv.ParseInt(f[12], 10, 64) // field 15
	if err1 != nil || err2 != nil {
		return 0, "", fmt.Errorf("unexpected %s: %q", path, raw)
	}
	return time.Duration(utime+stime) * time.Second / clockTicks, string(raw[open+1 : end]), nil
}

// commandCPU is the CPU time used so far by the processes whose command
// name is one of names (a database server: PostgreSQL's processes, or
// MariaDB's or MySQL's one). A process that ended between two readings
// takes its time with it, so the difference undercounts by as much: the
// servers' backends here live as long as the pools' connections.
func commandCPU(names ...string) time.Duration {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var sum time.Duration
	for _, path := range stats {
		cpu, name, err := readProcStat(path)
		if err != nil {
			continue // ended meanwhile
		}
		for _, n := range names {
			if name == n {
				sum += cpu
			}
		}
	}
	return sum
}

// machineCPU is the time all CPUs have spent busy and idle (iowait
// included) so far, from /proc/stat.
func machineCPU() (busy, idle time.Duration) {
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, 0
	}
	for i, x := range f[1:] {
		if i >= 8 { // guest times are counted in user already
			break
		}
		v, _ := strconv.ParseInt(x, 10, 64)
		d := time.Duration(v) * time.Second / clockTicks
		if i == 3 || i == 4 { // idle, iowait
			idle += d
		} else {
			busy += d
		}
	}
	return busy, idle
}

// serverCommands are the command names of each database server's
// processes, by store name.
var serverCommands = map[string][]string{
	"postgres": {"postgres"},
	"mysql":    {"mariadbd", "mysqld"},
}
