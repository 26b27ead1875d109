// Package sqltest helps the SQL stores' tests find their database server,
// name throw-away tables, and cut the network to the server.
package sqltest

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
	"time"
)

// DSN returns the DSN in env, or def when env is unset.
func DSN(env, def string) string {
	if v := os.Getenv(env); v != "" {
		return v
	}
	return def
}

// Unavailable ends a test whose database server cannot be reached: it fails
// under CI=true, where the server is part of the test setup, and skips
// elsewhere, saying how to start the server.
func Unavailable(t testing.TB, server, env, start string, err error) {
	t.Helper()
	Missing(t, server+" is not reachable ("+err.Error()+"); set "+env+" or start it with: "+start)
}

// Missing ends a test that cannot run here, msg saying why: a server or a
// tool it needs is missing, or a server refuses what the test needs of it
// (a managed server without CONFIG or ACL). It fails under CI=true, whose
// setup provides all of it, so that CI never passes without the test's
// checks, and skips elsewhere.
func Missing(t testing.TB, msg string) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// TableName returns a fresh table name for one test.
func TableName(t testing.TB) string {
	t.Helper()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return "idem_test_" + hex.EncodeToString(b[:])
}

// WaitNoneLeft polls count until it reports none, for up to 10 s: the
// connections a test ended take a moment to leave the server's list. what
// names them in the failure.
func WaitNoneLeft(t testing.TB, what string, count func() (int, error)) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		n, err := count()
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d %s still there after 10s", n, what)
		}
	}
}
