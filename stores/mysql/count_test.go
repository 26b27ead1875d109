package mysql

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// counts reads the server's per-session counters of prepared statement
// executions and preparations. The store's pool has one connection, so the
// session is the store's own; SHOW STATUS itself is neither.
func counts(t *testing.T, s *Store) [2]int64 {
	t.Helper()
	rows, err := s.db.Query("SHOW SESSION STATUS WHERE Variable_name IN ('Com_stmt_execute', 'Com_stmt_prepare')")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var c [2]int64
	for rows.Next() {
		var name string
		var v int64
		if err := rows.Scan(&name, &v); err != nil {
			t.Fatal(err)
		}
		switch name {
		case "Com_stmt_execute":
			c[0] = v
		case "Com_stmt_prepare":
			c[1] = v
		}
	}
	return c
}

func TestStatementCounts(t *testing.T) {
	s, _ := openStore(t, func(c *Config) { c.MaxConns = 1 })
	ctx := context.Background()
	delta := func(before [2]int64) [2]int64 {
		after := counts(t, s)
		return [2]int64{after[0] - before[0], after[1] - before[1]}
	}
	for _, phase := range []string{"first", "second"} {
		key := storetest.NewKey(t)
		r := storetest.Reservation(key, storetest.Long, storetest.Long)
		before := counts(t, s)
		if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
			t.Fatalf("Reserve = %+v, %v", res, err)
		}
		reserve := delta(before)
		before = counts(t, s)
		if err := s.Finalize(ctx, key, r.Owner, stores.Response{Status: 200, Body: []byte("{}")}); err != nil {
			t.Fatal(err)
		}
		finalize := delta(before)
		before = counts(t, s)
		if res, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long)); err != nil || res.Existing == nil {
			t.Fatalf("replay = %+v, %v", res, err)
		}
		replay := delta(before)
		t.Logf("%s mutation: reserve %d stmt (+%d prepare), finalize %d (+%d), replay %d (+%d)",
			phase, reserve[0], reserve[1], finalize[0], finalize[1], replay[0], replay[1])
		if reserve != [2]int64{1, 0} || finalize != [2]int64{1, 0} || replay != [2]int64{2, 0} {
			t.Fatalf("reserve %v finalize %v replay %v; want 1, 1 and 2 statements, no prepares", reserve, finalize, replay)
		}
	}
	// A key whose row expired: the fresh-key INSERT leaves the row, the
	// SELECT finds it expired, and the upsert overwrites it.
	key := storetest.NewKey(t)
	if _, err := s.Reserve(ctx, storetest.Reservation(key, 10*time.Millisecond, 10*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	before := counts(t, s)
	if res, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long)); err != nil || !res.Reserved {
		t.Fatalf("Reserve of an expired key = %+v, %v", res, err)
	}
	if expired := delta(before); expired != [2]int64{3, 0} {
		t.Fatalf("Reserve of an expired key ran %v; want 3 statements, no prepares", expired)
	}
}
