//go:build !unix

package postgres

import "net"

// socketQuiet cannot peek here: pgxpool's own rule (ping after a second
// idle) is all there is.
func socketQuiet(net.Conn) bool { return true }
