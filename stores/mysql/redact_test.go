package mysql

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

func TestOpenErrorsHideThePassword(t *testing.T) {
	mc, err := mysql.ParseDSN(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	const pw = "S3cret-Passw0rd"
	dsns := []string{
		// Unreachable host.
		fmt.Sprintf("%s:%s@tcp(127.0.0.1:1)/%s", mc.User, pw, mc.DBName),
		// Reachable server, wrong password.
		fmt.Sprintf("%s:%s@tcp(%s)/%s", mc.User, pw, mc.Addr, mc.DBName),
		// Unknown user.
		fmt.Sprintf("no_such_user_idem:%s@tcp(%s)/%s", pw, mc.Addr, mc.DBName),
		// Unparsable.
		fmt.Sprintf("%s:%s@tcp(%s)/%s?timeout=bogus", mc.User, pw, mc.Addr, mc.DBName),
	}
	for _, dsn := range dsns {
		core, logs := observer.New(zap.DebugLevel)
		start := time.Now()
		// A DSN that does not parse fails Open; an unreachable server or a
		// refused login fails the first contact (Open connects to nothing).
		s, err := Open(context.Background(), Config{DSN: dsn, StatementTimeout: 2 * time.Second}, zap.New(core))
		if err == nil {
			err = s.Ready(context.Background())
			s.Close()
		}
		if err == nil {
			t.Fatalf("Open(%s) succeeded", dsn)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("Open took %v", el)
		}
		if strings.Contains(err.Error(), pw) {
			t.Fatalf("password in error: %v", err)
		}
		for _, e := range logs.All() {
			if strings.Contains(fmt.Sprint(e.Message, e.ContextMap()), pw) {
				t.Fatalf("password in log: %v", e)
			}
		}
		t.Logf("%v", err)
	}
}

// A DSN written as a URL, or without tcp(...) around the address, is the
// common mistake: the driver's error ("default addr for network
// '127.0.0.1:3306' unknown") named neither, until the build after 797bdb9.
// The error now shows the form wanted, and still hides the password.
func TestOpenErrorShowsTheDSNForm(t *testing.T) {
	const pw = "S3cret-Passw0rd"
	for _, dsn := range []string{
		"root@127.0.0.1:3306/iceberg",
		"mysql://root:" + pw + "@127.0.0.1:3306/iceberg",
	} {
		_, err := Open(context.Background(), Config{DSN: dsn}, nil)
		if err == nil || !strings.Contains(err.Error(), "user:password@tcp(host:3306)/dbname") {
			t.Errorf("Open(%q) = %v, want the form wanted named", dsn, err)
		}
		if err != nil && strings.Contains(err.Error(), pw) {
			t.Errorf("password in error: %v", err)
		}
	}
}
