package icebergidempotency

import (
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// A reload that lowers lifetime keeps the next records for the old
// lifetime + grace for as long as clients that read the old lifetime from
// /v1/config may retry within it. Before, a new record got the new, shorter
// life at once, and a retry within the lifetime the client was told
// executed the commit again.
func TestReloadLoweringLifetimeKeepsTheOldRetention(t *testing.T) {
	resetRetention(t)
	old := &Handler{Lifetime: caddy.Duration(time.Hour)}
	if err := old.Provision(runningCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	zero := caddy.Duration(0)
	lowered := &Handler{Lifetime: caddy.Duration(time.Second), Grace: &zero, ExecutionTimeout: caddy.Duration(time.Second)}
	if err := lowered.Provision(runningCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lowered.Cleanup() })
	if err := old.Cleanup(); err != nil { // the old config goes
		t.Fatal(err)
	}
	catalog := newCountingCatalog(t, answerOK)
	proxy := newReverseProxy(t, catalog.addr())
	key := storetest.NewKey(t)
	if r := serve(t, lowered, proxy, "POST", commitPath, key, commitBody); r.code() != http.StatusOK {
		t.Fatalf("answer = %d %q", r.code(), r.body)
	}
	rec, err := lowered.store.Load(t.Context(), key)
	if err != nil || rec == nil {
		t.Fatalf("record = %+v, %v", rec, err)
	}
	if life := rec.ExpiresAt.Sub(rec.CreatedAt); life < time.Hour+DefaultGrace {
		t.Fatalf("a record made after the reload lives %v, want at least the old lifetime + grace (%v)", life, time.Hour+DefaultGrace)
	}
}

// A released hold keeps the floor for its own length, then lets it go.
func TestRetentionFloorOutlivesItsConfigByItsLength(t *testing.T) {
	resetRetention(t)
	long, releaseLong := holdRetention("test/place", 200*time.Millisecond)
	_, releaseShort := holdRetention("test/place", 10*time.Millisecond)
	defer releaseShort()
	if got := long.get(); got != 200*time.Millisecond {
		t.Fatalf("floor %v with both held, want the longer", got)
	}
	releaseLong()
	if got := long.get(); got != 200*time.Millisecond {
		t.Fatalf("floor %v right after the longer was released, want it kept", got)
	}
	time.Sleep(250 * time.Millisecond)
	if got := long.get(); got != 10*time.Millisecond {
		t.Fatalf("floor %v once the released hold's length passed, want the one still held", got)
	}
	if other, release := holdRetention("test/other", time.Millisecond); other.get() != time.Millisecond {
		t.Fatal("another place shares the floor")
	} else {
		release()
	}
}

// resetRetention gives the test floors of its own: every provisioned
// handler of the package's tests holds one, for as long again once
// cleaned up.
func resetRetention(t *testing.T) {
	retentionFloors.Lock()
	saved := retentionFloors.m
	retentionFloors.m = map[string]*retentionFloor{}
	retentionFloors.Unlock()
	t.Cleanup(func() {
		retentionFloors.Lock()
		retentionFloors.m = saved
		retentionFloors.Unlock()
	})
}
