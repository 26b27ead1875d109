package postgres

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

func TestOpenErrorsHideThePassword(t *testing.T) {
	cc, err := pgx.ParseConfig(testDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	const pw = "S3cret-Passw0rd"
	dsns := []string{
		// Unreachable host.
		fmt.Sprintf("postgres://%s:%s@127.0.0.1:1/db?sslmode=disable", cc.User, pw),
		fmt.Sprintf("host=127.0.0.1 port=1 user=%s password=%s dbname=db sslmode=disable", cc.User, pw),
		// Reachable server, wrong database (trust auth accepts any password).
		fmt.Sprintf("postgres://%s:%s@%s:%d/no_such_db_for_idempotency?sslmode=disable", cc.User, pw, cc.Host, cc.Port),
		// Unparsable.
		fmt.Sprintf("postgres://%s:%s@%s:%d/db?sslmode=bogus", cc.User, pw, cc.Host, cc.Port),
	}
	for _, dsn := range dsns {
		core, logs := observer.New(zap.DebugLevel)
		start := time.Now()
		// A DSN that does not parse fails Open; an unreachable server
		// fails the first contact (Open itself connects to nothing).
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
