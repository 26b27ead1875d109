package icebergidempotency

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// gather collects c through a registry of its own, as a scrape would.
// (prometheus/testutil would do, but pulls a module this one does not
// otherwise need.)
func gather(t *testing.T, c prometheus.Collector) []map[string]string {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var series []map[string]string
	for _, fam := range families {
		for _, m := range fam.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch {
			case m.GetHistogram() != nil:
				labels["__count"] = strconv.FormatUint(m.GetHistogram().GetSampleCount(), 10)
			case m.GetCounter() != nil:
				labels["__value"] = strconv.FormatFloat(m.GetCounter().GetValue(), 'g', -1, 64)
			case m.GetGauge() != nil:
				labels["__value"] = strconv.FormatFloat(m.GetGauge().GetValue(), 'g', -1, 64)
			}
			series = append(series, labels)
		}
	}
	return series
}

// storeCalls returns how many calls store_duration_seconds has recorded
// for a backend and operation.
func storeCalls(t *testing.T, backend, op string) uint64 {
	t.Helper()
	for _, labels := range gather(t, storeDuration) {
		if labels["store"] == backend && labels["operation"] == op {
			n, _ := strconv.ParseUint(labels["__count"], 10, 64)
			return n
		}
	}
	return 0
}

// value returns the value of c's series with the given label values (a
// counter or a gauge), 0 when it has none yet.
func value(t *testing.T, c prometheus.Collector, labelPairs ...string) float64 {
	t.Helper()
	for _, labels := range gather(t, c) {
		match := true
		for i := 0; i+1 < len(labelPairs); i += 2 {
			match = match && labels[labelPairs[i]] == labelPairs[i+1]
		}
		if match {
			v, _ := strconv.ParseFloat(labels["__value"], 64)
			return v
		}
	}
	return 0
}

// A handler provisioned as Caddy does registers the new collectors in the
// config's registry and times its store calls under the backend's name:
// an executed request reserves and finalizes, its retry reserves and
// replays, a request without a key touches no store.
func TestStoreDurationThroughProvision(t *testing.T) {
	ctx := runningCaddyContext(t) // Provision looks up the app
	h := new(Handler)
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Cleanup() })

	families, err := ctx.GetMetricsRegistry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	registered := map[string]bool{}
	for _, fam := range families {
		registered[fam.GetName()] = true
	}
	// Vectors without a series yet are not gathered; these two always are.
	for _, name := range []string{"caddy_iceberg_idempotency_executing", "caddy_iceberg_idempotency_lease_renewals_failed_total"} {
		if !registered[name] {
			t.Errorf("%s is not registered in the config's registry", name)
		}
	}

	reserves, finalizes := storeCalls(t, "memory", opReserve), storeCalls(t, "memory", opFinalize)
	up := answering(200, "{}")
	key := storetest.NewKey(t)
	serve(t, h, up, "POST", "/v1/namespaces", key, nsBody)
	if got := storeCalls(t, "memory", opReserve) - reserves; got != 1 {
		t.Fatalf("reserve timed %d times after one request, want 1", got)
	}
	if got := storeCalls(t, "memory", opFinalize) - finalizes; got != 1 {
		t.Fatalf("finalize timed %d times after one request, want 1", got)
	}
	if replay := serve(t, h, up, "POST", "/v1/namespaces", key, nsBody); replay.header.Get(ReplayedHeader) != "true" {
		t.Fatalf("retry not replayed: %d %s", replay.code(), replay.body)
	}
	serve(t, h, up, "POST", "/v1/namespaces", "", nsBody)
	if got := storeCalls(t, "memory", opReserve) - reserves; got != 2 {
		t.Fatalf("reserve timed %d times after a request, its retry and an unkeyed one; want 2", got)
	}
	if got := storeCalls(t, "memory", opFinalize) - finalizes; got != 1 {
		t.Fatalf("finalize timed %d times, want 1: a replay stores nothing", got)
	}
}

// The executing gauge counts requests whose upstream call runs, and drops
// back when it ends.
func TestExecutingGauge(t *testing.T) {
	h := newTestHandler(t, newMemoryStore(t))
	up, arrived, release := holdingUpstream()
	before := value(t, executing)
	done := make(chan result)
	for range 2 {
		key := storetest.NewKey(t)
		go func() { done <- serve(t, h, up, "POST", "/v1/namespaces", key, nsBody) }()
		<-arrived
	}
	if got := value(t, executing) - before; got != 2 {
		t.Fatalf("executing = %v more while two requests execute, want 2", got)
	}
	close(release)
	for range 2 {
		if res := <-done; res.code() != 200 {
			t.Fatalf("%d %s", res.code(), res.body)
		}
	}
	if got := value(t, executing) - before; got != 0 {
		t.Fatalf("executing = %v more after both finished, want 0", got)
	}
}

// renewalStore fails every ExtendLease with err.
type renewalStore struct {
	stores.Store
	err error
}

func (s renewalStore) ExtendLease(context.Context, string, string, time.Duration, time.Duration) error {
	return s.err
}

// Failed lease renewals are counted, whether the store failed or the key
// is no longer the request's; renewals that succeed are not.
func TestLeaseRenewalsFailedCounter(t *testing.T) {
	for _, tt := range []struct {
		name string
		err  error
		more bool
	}{
		{"renewed", nil, false},
		{"store down", errors.New("store down"), true},
		{"not owner", stores.ErrNotOwner, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newTestHandler(t, renewalStore{Store: newMemoryStore(t), err: tt.err})
			h.Lease = caddy.Duration(30 * time.Millisecond) // renewed every 10ms
			slow := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
				time.Sleep(100 * time.Millisecond)
				w.WriteHeader(200)
				_, _ = io.WriteString(w, "{}")
				return nil
			}}
			before := value(t, leaseRenewalsFailed)
			serve(t, h, slow, "POST", "/v1/namespaces", storetest.NewKey(t), nsBody)
			got := value(t, leaseRenewalsFailed) - before
			if tt.more != (got > 0) {
				t.Fatalf("lease_renewals_failed_total rose by %v; want a rise: %v", got, tt.more)
			}
		})
	}
}

// PurgeOnce counts what it deleted under the store's backend name, and
// times its purge statements.
func TestPurgedCounter(t *testing.T) {
	clock := storetest.NewFakeClock()
	s, err := memory.New(memory.Options{MaxEntries: 1000, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	for range 7 {
		if _, err := s.Reserve(t.Context(), storetest.Reservation(storetest.NewKey(t), time.Minute, time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	clock.Advance(2 * time.Minute)
	pooled := newPooledStore(s)
	pooled.backend = "memory"
	app := &App{CleanupBatch: 3}
	if err := app.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	app.track("memory/purged-counter-test", pooled)

	before := value(t, purged, "store", "memory")
	purges := storeCalls(t, "memory", opPurge)
	app.PurgeOnce(t.Context())
	if got := value(t, purged, "store", "memory") - before; got != 7 {
		t.Fatalf("purged_total{store=memory} rose by %v, want 7", got)
	}
	// Batches of 3: 3, 3, 1.
	if got := storeCalls(t, "memory", opPurge) - purges; got != 3 {
		t.Fatalf("purge timed %d times, want 3 batches", got)
	}
}
