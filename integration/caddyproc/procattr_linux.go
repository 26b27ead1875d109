package caddyproc

import "syscall"

// sysProcAttr has the kernel kill Caddy when the test process dies without
// running its cleanups (a -timeout panic, a SIGKILL), so no orphan keeps
// holding ports.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
