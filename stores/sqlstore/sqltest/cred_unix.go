//go:build unix

package sqltest

import (
	"os"
	"os/user"
	"strconv"
	"syscall"
)

// PostgresCredential is what a test runs PostgreSQL's own programs with
// (postgres, initdb, pgbouncer), which refuse to run as root: user
// postgres when this process is root, nil (this process's user) otherwise.
func PostgresCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, err
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}
