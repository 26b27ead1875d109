package postgres

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// sideListener LISTENs on a store's channel on a connection of its own, as
// another node's listener would.
type sideListener struct {
	t       *testing.T
	channel string
	conn    *pgx.Conn // LISTENs
	send    *pgx.Conn // sends the sentinels
}

func listenTo(t *testing.T, cfg Config) *sideListener {
	t.Helper()
	l := &sideListener{t: t, channel: cfg.Table + "_changed", conn: admin(t), send: admin(t)}
	if _, err := l.conn.Exec(context.Background(), "LISTEN "+l.channel); err != nil {
		t.Fatal(err)
	}
	return l
}

// next returns the next notification's payload.
func (l *sideListener) next() string {
	l.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := l.conn.WaitForNotification(ctx)
	if err != nil {
		l.t.Fatalf("no notification on %s: %v", l.channel, err)
	}
	return n.Payload
}

// drain returns the payloads of the notifications committed so far. It
// sends a sentinel notification and reads up to it: notifications of
// different transactions arrive in commit order, so everything committed
// before the sentinel arrives before it, without waiting for a silence.
func (l *sideListener) drain() []string {
	l.t.Helper()
	sentinel := "sentinel-" + uuid.NewString()
	if _, err := l.send.Exec(context.Background(), "SELECT pg_notify($1, $2)", l.channel, sentinel); err != nil {
		l.t.Fatal(err)
	}
	var got []string
	for {
		p := l.next()
		if p == sentinel {
			return got
		}
		got = append(got, p)
	}
}

// watched reads key's watched column.
func watched(t *testing.T, table, key string) bool {
	t.Helper()
	var w bool
	if err := admin(t).QueryRow(context.Background(), "SELECT watched FROM "+table+" WHERE key = $1", key).Scan(&w); err != nil {
		t.Fatalf("watched of %s: %v", key, err)
	}
	return w
}

// waitWatched waits until key's row is marked.
func waitWatched(t *testing.T, table, key string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !watched(t, table, key) {
		if time.Now().After(deadline) {
			t.Fatalf("%s not marked watched", key)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

var finalResp = stores.Response{Status: 200, Body: []byte("{}")}

// A Finalize nobody awaits sends no notification (and its row stays
// unwatched); the Finalize of an awaited record, marked by the Await,
// does, and wakes the Await.
func TestNotifyOnlyWhenAwaited(t *testing.T) {
	s, cfg := openStore(t, func(c *Config) { c.ListenNotify = true })
	ctx := context.Background()
	l := listenTo(t, cfg)

	lone := storetest.NewKey(t)
	r := storetest.Reservation(lone, storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	if err := s.Finalize(ctx, lone, r.Owner, finalResp); err != nil {
		t.Fatal(err)
	}
	if got := l.drain(); len(got) != 0 {
		t.Fatalf("Finalize of a record nobody awaits notified %q", got)
	}
	if watched(t, cfg.Table, lone) {
		t.Fatal("a record nobody awaits is watched")
	}

	awaited := storetest.NewKey(t)
	r = storetest.Reservation(awaited, storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	got := awaitAsync(t, ctx, s, awaited)
	waitWatched(t, cfg.Table, awaited)
	if err := s.Finalize(ctx, awaited, r.Owner, finalResp); err != nil {
		t.Fatal(err)
	}
	if p := l.next(); p != awaited {
		t.Fatalf("notification %q, want %q", p, awaited)
	}
	if rec := <-got; rec == nil || rec.State != stores.StateFinal {
		t.Fatalf("Await = %+v, want the final record", rec)
	}
	if n := s.marks.Load(); n != 1 {
		t.Fatalf("%d marks, want 1", n)
	}
}

// Without listen_notify nothing is marked: no change would notify anyway.
func TestNoMarkWithoutListenNotify(t *testing.T) {
	s, cfg := openStore(t, func(c *Config) { c.PollMin, c.PollMax = 5*time.Millisecond, 10*time.Millisecond })
	ctx := context.Background()
	key := storetest.NewKey(t)
	r := storetest.Reservation(key, storetest.Long, storetest.Long)
	if _, err := s.Reserve(ctx, r); err != nil {
		t.Fatal(err)
	}
	got := awaitAsync(t, ctx, s, key)
	time.Sleep(50 * time.Millisecond)
	if watched(t, cfg.Table, key) {
		t.Fatal("marked without listen_notify")
	}
	if err := s.Finalize(ctx, key, r.Owner, finalResp); err != nil {
		t.Fatal(err)
	}
	if rec := <-got; rec == nil || rec.State != stores.StateFinal || s.marks.Load() != 0 {
		t.Fatalf("Await = %+v after %d marks", rec, s.marks.Load())
	}
}

// Every change that ends a wait notifies a watched record, and only a
// watched one; TakeOver keeps the mark (the waiters still wait). So does a
// node with listen_notify off: the waiter may be on a node that listens.
func TestNotifyWatchedChanges(t *testing.T) {
	for _, listens := range []bool{true, false} {
		t.Run(fmt.Sprintf("listen_notify=%v", listens), func(t *testing.T) { testNotifyWatchedChanges(t, listens) })
	}
}

func testNotifyWatchedChanges(t *testing.T, listens bool) {
	s, cfg := openStore(t, func(c *Config) { c.ListenNotify = listens })
	ctx := context.Background()
	l := listenTo(t, cfg)
	const shortLease = 100 * time.Millisecond
	ops := []struct {
		name string
		do   func(key, owner string) error
	}{
		{"Finalize", func(key, owner string) error { return s.Finalize(ctx, key, owner, finalResp) }},
		{"Release", func(key, owner string) error { return s.Release(ctx, key, owner) }},
		{"Abandon", func(key, owner string) error { return s.Abandon(ctx, key, owner) }},
		{"TakeOver", func(key, owner string) error {
			time.Sleep(shortLease + 50*time.Millisecond) // the lease lapses
			if ok, err := s.TakeOver(ctx, key, owner, uuid.NewString(), storetest.Long, storetest.TTL); err != nil || !ok {
				t.Fatalf("TakeOver = %v, %v", ok, err)
			}
			return nil
		}},
		{"Forget", func(key, _ string) error {
			if ok, err := s.Forget(ctx, key, true); err != nil || !ok {
				t.Fatalf("Forget = %v, %v", ok, err)
			}
			return nil
		}},
	}
	for _, op := range ops {
		for _, watch := range []bool{false, true} {
			key := storetest.NewKey(t)
			r := storetest.Reservation(key, shortLease, storetest.Long)
			if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
				t.Fatalf("Reserve = %+v, %v", res, err)
			}
			if watch {
				before := s.marks.Load()
				if err := s.mark(ctx, key); err != nil || s.marks.Load() != before+1 {
					t.Fatalf("mark = %v, %d rows marked", err, s.marks.Load()-before)
				}
				if err := s.mark(ctx, key); err != nil || s.marks.Load() != before+1 {
					t.Fatalf("second mark = %v, wrote the row again", err)
				}
			}
			if err := op.do(key, r.Owner); err != nil {
				t.Fatalf("%s: %v", op.name, err)
			}
			var want []string
			if watch {
				want = []string{key}
			}
			if got := l.drain(); !slices.Equal(got, want) {
				t.Fatalf("%s of a record watched=%v notified %q, want %q", op.name, watch, got, want)
			}
			if op.name == "TakeOver" && watched(t, cfg.Table, key) != watch {
				t.Fatalf("TakeOver changed watched from %v", watch)
			}
		}
	}

	// A key released while watched and reserved again is a new,
	// unwatched reservation.
	key := storetest.NewKey(t)
	r := storetest.Reservation(key, storetest.Long, storetest.Long)
	if _, err := s.Reserve(ctx, r); err != nil {
		t.Fatal(err)
	}
	if err := s.mark(ctx, key); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, key, r.Owner); err != nil {
		t.Fatal(err)
	}
	if res, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long)); err != nil || !res.Reserved {
		t.Fatalf("Reserve again = %+v, %v", res, err)
	}
	if watched(t, cfg.Table, key) {
		t.Fatal("a new reservation starts watched")
	}
	if got := l.drain(); !slices.Equal(got, []string{key}) {
		t.Fatalf("notified %q, want the release only", got)
	}
}

// Many waiters of one in-flight key, its owner finalizing at a random
// moment: every waiter returns the final record, and at most one mark
// writes the row (exactly one when the finalize comes after a mark).
func TestAwaitManyWaitersOneMark(t *testing.T) {
	s, cfg := openStore(t, func(c *Config) { c.ListenNotify = true })
	ctx := context.Background()
	const waiters, rounds = 50, 6
	for round := range rounds {
		key := storetest.NewKey(t)
		r := storetest.Reservation(key, storetest.Long, storetest.Long)
		if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
			t.Fatalf("Reserve = %+v, %v", res, err)
		}
		before := s.marks.Load()
		var wg sync.WaitGroup
		recs := make(chan *stores.Record, waiters)
		for range waiters {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rec, err := s.Await(ctx, key)
				if err != nil {
					t.Errorf("Await: %v", err)
				}
				recs <- rec
			}()
		}
		if round == 0 {
			waitWatched(t, cfg.Table, key)
		}
		time.Sleep(time.Duration(rand.IntN(50)) * time.Millisecond)
		if err := s.Finalize(ctx, key, r.Owner, finalResp); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		close(recs)
		for rec := range recs {
			if rec == nil || rec.State != stores.StateFinal || rec.Response == nil || rec.Response.Status != 200 {
				t.Fatalf("round %d: Await = %+v, want the final record", round, rec)
			}
		}
		marks := s.marks.Load() - before
		w := watched(t, cfg.Table, key)
		t.Logf("round %d: %d marks, watched %v", round, marks, w)
		if marks > 1 || w != (marks == 1) || (round == 0 && marks != 1) {
			t.Fatalf("round %d: %d marks wrote the row, watched %v; want at most one (one in round 0), watched if one", round, marks, w)
		}
	}
}

// awaitAsync runs s.Await(ctx, key) in the background; the channel gets its
// record (nil after an error, which fails the test).
func awaitAsync(t *testing.T, ctx context.Context, s *Store, key string) <-chan *stores.Record {
	got := make(chan *stores.Record, 1)
	go func() {
		rec, err := s.Await(ctx, key)
		if err != nil {
			t.Errorf("Await: %v", err)
		}
		got <- rec
	}()
	return got
}

// awaitFinalize reserves a new key on owner and has waiter Await it; once
// waiting(key) returns (the waiter is waiting), it finalizes the key on
// owner and fails the test unless the Await returns the final record
// within 20 s. slept names what a waiter that slept through it shows.
func awaitFinalize(t *testing.T, owner, waiter *Store, waiting func(key string), slept string) {
	t.Helper()
	ctx := context.Background()
	key := storetest.NewKey(t)
	r := storetest.Reservation(key, storetest.Long, storetest.Long)
	if res, err := owner.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	got := awaitAsync(t, wctx, waiter, key)
	waiting(key)
	if err := owner.Finalize(ctx, key, r.Owner, finalResp); err != nil {
		t.Fatal(err)
	}
	if rec := <-got; rec == nil || rec.State != stores.StateFinal {
		t.Fatalf("Await = %+v: %s", rec, slept)
	}
}

// A waiter on a node with listen_notify on wakes at the NOTIFY of a change
// made on a node with it off (a rolling change of the option), not at its
// fallback poll, here a minute.
func TestMixedListenNotifyWakes(t *testing.T) {
	waiter, cfg := openStore(t, func(c *Config) { c.ListenNotify, c.NotifyFallback = true, time.Minute })
	c := cfg
	c.ListenNotify = false
	owner, err := Open(context.Background(), c, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { owner.Close() })
	awaitFinalize(t, owner, waiter, func(key string) { waitWatched(t, cfg.Table, key) },
		"the waiter slept through the Finalize of a node with listen_notify off")
}

// TestListenerOutlivesIdleSessionTimeout: a role's or database's
// idle_session_timeout (PostgreSQL 14+) ends any session idle that long,
// and the LISTEN connection is idle whenever no change comes. Until the
// build after 958c034 the server ended it every idle_session_timeout: a
// "connection lost" warning each time, and a waiter then woke only at the
// reconnect. The listener now turns the timeout off for its own session;
// the pool's sessions keep it, and the pool replaces the ones it ends.
func TestListenerOutlivesIdleSessionTimeout(t *testing.T) {
	var version int
	if err := admin(t).QueryRow(context.Background(), "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if version < 140000 {
		t.Skipf("PostgreSQL %d has no idle_session_timeout", version)
	}
	core, logs := observer.New(zap.InfoLevel)
	cfg := Config{Table: sqltest.TableName(t), AutoMigrate: true, MaxConns: 4, ListenNotify: true, NotifyFallback: time.Minute}
	cfg.DSN = withParams(t, testDSN(t), map[string]string{"idle_session_timeout": "300"})
	dropOnCleanup(t, cfg.Table)
	s, err := Open(context.Background(), cfg, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	ctx := context.Background()
	if err := s.Ready(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // five timeouts' worth of quiet
	if lost := logs.FilterMessageSnippet("postgres listen: connection lost").Len(); lost != 0 {
		t.Fatalf("the LISTEN connection was lost %d times in 1.5 s of quiet", lost)
	}
	awaitFinalize(t, s, s, func(key string) {
		waitWatched(t, cfg.Table, key)
		time.Sleep(600 * time.Millisecond) // quiet again, past the timeout
	}, "the waiter slept through the Finalize")
}
