package redis

import (
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis/redistest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// TestLateReserveWritesNothing: a Reserve held up on its way to the server
// (a partition that drops packets, after which the kernel delivers what it
// had accepted, even from a socket its caller closed) must not create a
// record once its caller has given up. It did: the handler's undo of the
// lost Reserve had ended by then (ErrNotOwner after the settle window), so
// the record stayed in flight and then abandoned, and every retry of a key
// whose request never reached the catalog heard "unknown" for the record's
// TTL (36 minutes by default).
func TestLateReserveWritesNothing(t *testing.T) {
	const timeout = 300 * time.Millisecond
	late, s, direct := openLate(t, timeout)
	storetest.LateReserveWritesNothing(t, s, direct, func(string) <-chan struct{} {
		return late.holdNext([]byte(reserveScript.Hash()), timeout+ClockMargin+time.Second)
	}, 10*time.Second)
}

// openLate opens a store whose calls time out after timeout and reach the
// server through a lateProxy, and one on the same records that reaches it
// directly.
func openLate(t *testing.T, timeout time.Duration) (*lateProxy, *Store, *Store) {
	t.Helper()
	late := newLateProxy(t, redistest.Addr(t))
	s, cfg := openStore(t, func(c *Config) {
		c.Addrs = []string{late.addr}
		c.DialTimeout, c.ReadTimeout, c.WriteTimeout = timeout, timeout, timeout
	})
	direct, _ := openStore(t, func(c *Config) { c.KeyPrefix = cfg.KeyPrefix })
	return late, s, direct
}

// lateProxy forwards to a server, and can hold the next client write that
// contains a pattern for a while before delivering it, whether or not the
// client is still there: what a network that held the packets does.
type lateProxy struct {
	addr string

	mu      sync.Mutex
	pattern []byte
	hold    time.Duration
	done    chan struct{}
}

func newLateProxy(t *testing.T, target string) *lateProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &lateProxy{addr: ln.Addr().String()}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { p.pipe(c, target) })
		}
	})
	return p
}

// holdNext arms the proxy; the channel closes once the held write is
// delivered.
func (p *lateProxy) holdNext(pattern []byte, hold time.Duration) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pattern, p.hold, p.done = pattern, hold, make(chan struct{})
	return p.done
}

// take reports whether b is the write to hold, disarming the proxy.
func (p *lateProxy) take(b []byte) (time.Duration, chan struct{}, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pattern == nil || !bytes.Contains(b, p.pattern) {
		return 0, nil, false
	}
	p.pattern = nil
	return p.hold, p.done, true
}

func (p *lateProxy) pipe(c net.Conn, target string) {
	defer c.Close()
	s, err := net.Dial("tcp", target)
	if err != nil {
		return
	}
	defer s.Close()
	go func() {
		buf := make([]byte, 32<<10)
		for {
			n, err := s.Read(buf)
			if n > 0 {
				_, _ = c.Write(buf[:n])
			}
			if err != nil {
				return
			}
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if hold, done, ok := p.take(buf[:n]); ok {
				time.Sleep(hold)
				_, _ = s.Write(buf[:n])
				time.Sleep(100 * time.Millisecond) // the server reads it before the close
				close(done)
				return
			}
			if _, err := s.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// TestReserveAfterClockStep: a live Reserve is never refused as late. The
// server's clock stepped forward (or this node's back) since the offset
// was learned, by more than ClockMargin plus the call's timeout, made the
// server judge a Reserve on time as late: it wrote nothing and the handler
// answered 503 (an audit stepping a Redis's clock 10 s forward saw it on
// the first keyed request after each step). Now the Reserve is sent again
// with the offset its reply taught, and reserves.
func TestReserveAfterClockStep(t *testing.T) {
	s, _ := openStore(t, func(c *Config) {
		c.DialTimeout, c.ReadTimeout, c.WriteTimeout = time.Second, time.Second, time.Second
	})
	ctx := context.Background()
	if _, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)); err != nil {
		t.Fatal(err)
	}
	learned := s.clock.ahead.Load()
	// As if the server's clock had stepped 10 s forward since.
	s.clock.ahead.Add(-(10 * time.Second).Milliseconds())
	res, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long))
	if err != nil || !res.Reserved {
		t.Fatalf("Reserve on time after the server's clock stepped forward: %+v, %v; want it reserved", res, err)
	}
	if got := s.clock.ahead.Load(); got < learned-1000 {
		t.Fatalf("offset after the step: %d ms, want about %d (learned again)", got, learned)
	}
}

// TestLateTakeOverWritesNothing: a TakeOver held up on its way to the
// server, as the Reserve above, must not take the record once its caller
// has given up. It did (only Reserve was bounded): the record went to an
// owner that never executes, with a lease nobody renews, while the request
// still executing under the old owner could no longer finalize it, and
// under `abandoned reexecute` the next retry executed the commit again.
func TestLateTakeOverWritesNothing(t *testing.T) {
	const timeout = 300 * time.Millisecond
	late, s, direct := openLate(t, timeout)
	ctx := context.Background()
	lapsed := func() stores.Reservation {
		r := storetest.Reservation(storetest.NewKey(t), 50*time.Millisecond, storetest.Long)
		if res, err := direct.Reserve(ctx, r); err != nil || !res.Reserved {
			t.Fatalf("Reserve: %+v, %v", res, err)
		}
		return r
	}
	// A pooled connection, the clock read and the script loaded: the held
	// write is the one that runs it, as on a busy node.
	warm := lapsed()
	time.Sleep(200 * time.Millisecond)
	if ok, err := s.TakeOver(ctx, warm.Key, warm.Owner, "warm", storetest.Long, storetest.Long); err != nil || !ok {
		t.Fatalf("TakeOver on time: %v, %v", ok, err)
	}

	r := lapsed()
	time.Sleep(200 * time.Millisecond)
	delivered := late.holdNext([]byte(takeOverScript.Hash()), timeout+ClockMargin+time.Second)
	if _, err := s.TakeOver(ctx, r.Key, r.Owner, "late", storetest.Long, storetest.Long); err == nil {
		t.Fatal("a TakeOver held up on its way succeeded")
	}
	select {
	case <-delivered:
	case <-time.After(10 * time.Second):
		t.Fatal("the held TakeOver was never delivered")
	}
	time.Sleep(200 * time.Millisecond) // for the server to run it
	rec, err := direct.Load(ctx, r.Key)
	if err != nil || rec == nil || rec.Owner != r.Owner {
		t.Fatalf("a TakeOver that reached the server after its caller gave up left %+v, %v; want the record still %q's", rec, err, r.Owner)
	}
}

// TestTakeOverAfterClockStep: a live TakeOver is never refused as late,
// as TestReserveAfterClockStep: sent again with the offset its reply
// taught, it takes the record.
func TestTakeOverAfterClockStep(t *testing.T) {
	afterClockStep(t, func(s *Store, r stores.Reservation) {
		if ok, err := s.TakeOver(context.Background(), r.Key, r.Owner, "new-owner", storetest.Long, storetest.Long); err != nil || !ok {
			t.Fatalf("TakeOver on time after the server's clock stepped forward: %v, %v; want it taken", ok, err)
		}
	})
}

// afterClockStep runs call on an abandoned record (its lease lapsed) of a
// store whose offset to the server's clock is off as if that clock had
// stepped 10 s forward since it was learned, and checks that the call's
// reply taught the offset again.
func afterClockStep(t *testing.T, call func(s *Store, r stores.Reservation)) {
	t.Helper()
	s, _ := openStore(t, func(c *Config) {
		c.DialTimeout, c.ReadTimeout, c.WriteTimeout = time.Second, time.Second, time.Second
	})
	r := storetest.Reservation(storetest.NewKey(t), 50*time.Millisecond, storetest.Long)
	if res, err := s.Reserve(context.Background(), r); err != nil || !res.Reserved {
		t.Fatalf("Reserve: %+v, %v", res, err)
	}
	time.Sleep(200 * time.Millisecond)
	learned := s.clock.ahead.Load()
	s.clock.ahead.Add(-(10 * time.Second).Milliseconds())
	call(s, r)
	if got := s.clock.ahead.Load(); got < learned-1000 {
		t.Fatalf("offset after the step: %d ms, want about %d (learned again)", got, learned)
	}
}

// TestLateRenewalRevivesNothing: a lease renewal held up on its way to
// the server, as the Reserve above, must renew nothing once its caller has
// given up. It did (only Reserve and TakeOver were bounded): landing after
// the owner had marked the record abandoned, it made the record read as
// in flight for a whole lease more.
func TestLateRenewalRevivesNothing(t *testing.T) {
	const timeout = 300 * time.Millisecond
	late, s, direct := openLate(t, timeout)
	storetest.LateRenewalRevivesNothing(t, s, direct, func(string) <-chan struct{} {
		return late.holdNext([]byte(extendScript.Hash()), timeout+ClockMargin+time.Second)
	}, 10*time.Second)
}

// TestExtendLeaseAfterClockStep: a live renewal is never refused as late,
// as TestReserveAfterClockStep: sent again with the offset its reply
// taught, it renews the lease.
func TestExtendLeaseAfterClockStep(t *testing.T) {
	afterClockStep(t, func(s *Store, r stores.Reservation) {
		ctx := context.Background()
		if err := s.ExtendLease(ctx, r.Key, r.Owner, storetest.Long, storetest.Long); err != nil {
			t.Fatalf("ExtendLease on time after the server's clock stepped forward: %v", err)
		}
		if rec, err := s.Load(ctx, r.Key); err != nil || rec == nil || rec.Abandoned {
			t.Fatalf("after the renewal: %+v, %v; want the lease live", rec, err)
		}
	})
}
