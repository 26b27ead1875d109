package redis

import (
	"bufio"
	"context"
	"io"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis/redistest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A script is marked not sent (stores.NotSent) only when it provably never
// reached the server, since the handler then skips undoing it. Refused,
// the client has no connection to send on; blackholed, the connection it
// holds takes the command and no answer comes back, so the script may have
// run.
func TestNotSentOnlyWhenProvablyUnsent(t *testing.T) {
	proxy := sqltest.NewProxy(t, redistest.Addr(t))
	s, _ := openStore(t, func(c *Config) {
		c.Addrs = []string{proxy.Addr()}
		c.DialTimeout, c.ReadTimeout, c.WriteTimeout = outageTimeout, outageTimeout, outageTimeout
	})
	ctx := context.Background()
	reserve := func() error {
		_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
		return err
	}
	if err := reserve(); err != nil {
		t.Fatal(err)
	}
	proxy.Stop()
	if err := reserve(); err == nil || !stores.NotSent(err) {
		t.Fatalf("Reserve with connections refused: err = %v, NotSent = %v; want a not-sent error", err, stores.NotSent(err))
	}
	proxy.Start()
	if err := reserve(); err != nil {
		t.Fatalf("Reserve after the server came back: %v", err)
	}
	proxy.Blackhole()
	defer proxy.Stop()
	if err := reserve(); err == nil || stores.NotSent(err) {
		t.Fatalf("Reserve on a blackholed connection: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
	}
}

// A call that waited for a pooled connection and got none never sent its
// script. Before, the pool's own wait (read timeout + 1 s) outlasted the
// call's deadline, so the call ended as "context deadline exceeded", which
// proves nothing, and the handler undid it with releases sent to a pool
// that had no connection to spare.
func TestPoolWaitIsNotSent(t *testing.T) {
	proxy := sqltest.NewProxy(t, redistest.Addr(t))
	s, _ := openStore(t, func(c *Config) {
		c.Addrs = []string{proxy.Addr()}
		c.PoolSize = 1
		c.DialTimeout, c.ReadTimeout, c.WriteTimeout = outageTimeout, outageTimeout, outageTimeout
	})
	ctx := context.Background()
	if _, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)); err != nil {
		t.Fatal(err)
	}
	// The check of the store's commands, which that first call started
	// in the background, is over: the pool's one connection is free.
	for !s.accessChecked() {
		time.Sleep(time.Millisecond)
	}
	// The pool's one connection takes a script and answers nothing.
	proxy.Blackhole()
	defer proxy.Stop()
	held := make(chan error, 1)
	go func() {
		_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
		held <- err
	}()
	for s.client.PoolStats().IdleConns != 0 {
		time.Sleep(time.Millisecond)
	}
	_, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
	if err == nil || !stores.NotSent(err) {
		t.Fatalf("Reserve that found no free connection: err = %v, NotSent = %v; want a not-sent error", err, stores.NotSent(err))
	}
	if err := <-held; err == nil || stores.NotSent(err) {
		t.Fatalf("Reserve on the blackholed connection: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
	}
}

// A cluster client resends a command after a network error, whatever
// MaxRetries says, so even its dial error does not prove that no attempt
// ran: it is never marked not sent.
func TestClusterErrorsNeverNotSent(t *testing.T) {
	a, b := sqltest.NewProxy(t, redistest.Addr(t)), sqltest.NewProxy(t, redistest.Addr(t))
	a.Stop()
	b.Stop()
	s, err := Open(Config{Addrs: []string{a.Addr(), b.Addr()}, KeyPrefix: redistest.Prefix(t),
		DialTimeout: outageTimeout, ReadTimeout: outageTimeout, WriteTimeout: outageTimeout}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_, err = s.Reserve(context.Background(), storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
	if err == nil || stores.NotSent(err) {
		t.Fatalf("cluster Reserve with every node refusing: err = %v, NotSent = %v; want an error not marked not sent", err, stores.NotSent(err))
	}
}

// A reply that refuses the script instead of running it proves it did not
// run: the handler has nothing to undo, where before every keyed request
// while Redis loaded its data set after a restart left a release retried
// every 2 s for 2 minutes. So do OOM, MISCONF and NOREPLICAS, which Redis
// answers only before a script's first write (see refusedUnrun and
// TestRefusedWritesAreNotSent, on a real server). A script that ran and
// failed proves nothing. A stand-in server answers every command with the
// reply: a real Redis cannot be held loading or busy on demand.
func TestServerRefusalsAreNotSent(t *testing.T) {
	for _, c := range []struct {
		reply    string
		notSent  bool
		password string
	}{
		{"LOADING Redis is loading the dataset in memory", true, ""},
		// A connection that could not log in runs nothing. Before, these
		// started a background release for every keyed request, each
		// refused the same way and resent every 2 s for 2 minutes.
		{"NOAUTH Authentication required.", true, ""},
		{"WRONGPASS invalid username-password pair or user is disabled.", true, "not-the-password"},
		{"READONLY You can't write against a read only replica.", true, ""},
		{"MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", true, ""},
		{"BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", true, ""},
		{"OOM command not allowed when used memory > 'maxmemory'.", true, ""},
		{"MISCONF Errors writing to the AOF file: No space left on device", true, ""},
		{"NOREPLICAS Not enough good replicas to write.", true, ""},
		{"ERR user_script:1: Script attempted to access nonexistent global variable 'x'", false, ""},
		{"BUSYKEY Target key name already exists.", false, ""},
	} {
		name, _, _ := strings.Cut(c.reply, " ")
		t.Run(name, func(t *testing.T) {
			s, err := Open(Config{Addrs: []string{replyingServer(t, c.reply)}, KeyPrefix: redistest.Prefix(t), Password: c.password}, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			_, err = s.Reserve(context.Background(), storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
			if err == nil || stores.NotSent(err) != c.notSent {
				t.Fatalf("Reserve answered %q: err = %v, NotSent = %v; want %v", c.reply, err, stores.NotSent(err), c.notSent)
			}
		})
	}
}

// replyingServer speaks just enough RESP to answer every command with the
// error reply.
func replyingServer(t *testing.T, reply string) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				rd := bufio.NewReader(c)
				for {
					// *<n>\r\n, then n times $<len>\r\n<bytes>\r\n
					line, err := rd.ReadString('\n')
					if err != nil || len(line) < 2 {
						return
					}
					n, _ := strconv.Atoi(strings.TrimSpace(line[1:]))
					for range n {
						l, err := rd.ReadString('\n')
						if err != nil || len(l) < 2 {
							return
						}
						size, _ := strconv.Atoi(strings.TrimSpace(l[1:]))
						if _, err := io.CopyN(io.Discard, rd, int64(size)+2); err != nil {
							return
						}
					}
					if _, err := io.WriteString(c, "-"+reply+"\r\n"); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}
