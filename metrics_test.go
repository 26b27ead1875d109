package icebergidempotency

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
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

// The series the example alerts watch exist before their first event: an
// increase() over a series born at 1 reads 0, and the first unreadable
// record or abandoned key after a start would not alert.
func TestAlertedSeriesExistFromTheStart(t *testing.T) {
	have := map[[3]string]bool{}
	for _, c := range []prometheus.Collector{decisions, executions} {
		for _, l := range gather(t, c) {
			have[[3]string{l["operation"], l["outcome"], l["result"]}] = true
		}
	}
	for _, op := range mutations {
		for _, outcome := range []string{outcomeAbandoned, outcomeUnreadable, outcomeStoreUnavailable, outcomeFailOpen} {
			if !have[[3]string{op.id, outcome, ""}] {
				t.Errorf("requests_total{operation=%q, outcome=%q} does not exist before its first event", op.id, outcome)
			}
		}
		for _, result := range []string{resultUnknown, resultRefused} {
			if !have[[3]string{op.id, "", result}] {
				t.Errorf("executions_total{operation=%q, result=%q} does not exist before its first event", op.id, result)
			}
		}
	}
}

// An answer the store refuses because the key is no longer the request's
// (here forgotten by force while the catalog ran) is counted: another
// execution may have run. Before, it was counted under no result.
func TestRefusedFinalizeIsCounted(t *testing.T) {
	mem := newMemoryStore(t)
	h := newTestHandler(t, mem)
	key := storetest.NewKey(t)
	forgetting := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		_, _ = io.ReadAll(r.Body)
		if ok, err := mem.Forget(r.Context(), key, true); err != nil || !ok {
			t.Errorf("forced Forget while executing = %v, %v", ok, err)
		}
		_, _ = io.WriteString(w, "{}")
		return nil
	}}
	before := value(t, executions, "operation", "updateTable", "result", resultRefused)
	if res := serve(t, h, forgetting, "POST", commitPath, key, commitBody); res.code() != http.StatusOK {
		t.Fatalf("commit = %d, want the catalog's 200 delivered", res.code())
	}
	if got := value(t, executions, "operation", "updateTable", "result", resultRefused) - before; got != 1 {
		t.Fatalf("executions_total{result=refused} rose by %v, want 1", got)
	}
}

// Every alert in examples/prometheus-alerts.yml names metrics the module
// exports and a Runbook section the README has.
func TestExampleAlertsNameWhatExists(t *testing.T) {
	alerts, err := os.ReadFile("examples/prometheus-alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	// The names registerMetrics registers, from their descriptions (a
	// family without a series yet is not gathered).
	names := map[string]bool{}
	descs := make(chan *prometheus.Desc, 100)
	for _, c := range collectors {
		c.Describe(descs)
	}
	close(descs)
	for d := range descs {
		name := regexp.MustCompile(`fqName: "([^"]+)"`).FindStringSubmatch(d.String())[1]
		names[name] = true
		names[name+"_bucket"] = true
	}
	for _, m := range regexp.MustCompile(`caddy_iceberg_idempotency_[a-z_]+`).FindAllString(string(alerts), -1) {
		if !names[m] {
			t.Errorf("an alert uses %s, which the module does not export", m)
		}
	}
	// The outcomes and results an alert watches have a series for every
	// mutation from the start: increase() over a series born at its first
	// event reads 0, and the first such event would not alert (until the
	// build after aa42a0c, unknown_full had none).
	reg := prometheus.NewRegistry()
	reg.MustRegister(decisions, executions)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			have[f.GetName()+"/"+labels["operation"]+"/"+labels["outcome"]+labels["result"]] = true
		}
	}
	for _, m := range regexp.MustCompile(`(caddy_iceberg_idempotency_(?:requests|executions)_total)\{(?:outcome|result)=~?"([^"]+)"\}`).FindAllStringSubmatch(string(alerts), -1) {
		for _, value := range strings.Split(m[2], "|") {
			for _, op := range mutations {
				if !have[m[1]+"/"+op.id+"/"+value] {
					t.Errorf("an alert watches %s{%s}, which has no series for %s before its first event", m[1], value, op.id)
				}
			}
		}
	}
	for _, m := range regexp.MustCompile(`runbook: "README: Runbook / ([^"]+)"`).FindAllStringSubmatch(string(alerts), -1) {
		if !regexp.MustCompile(`(?m)^### ` + regexp.QuoteMeta(m[1]) + `\b`).Match(readme) {
			t.Errorf("an alert's runbook names %q, which is no Runbook section of the README", m[1])
		}
	}
	for _, m := range regexp.MustCompile(`alert: (\w+)`).FindAllStringSubmatch(string(alerts), -1) {
		section := regexp.MustCompile(`(?m)^### (.+) \(.*` + "`" + m[1] + "`")
		for _, s := range section.FindAllSubmatch(readme, -1) {
			if !strings.Contains(string(alerts), `alert: `+m[1]+"\n") || !strings.Contains(string(alerts), `runbook: "README: Runbook / `+string(s[1])+`"`) {
				t.Errorf("alert %s has its own Runbook section %q, but its runbook annotation names another", m[1], s[1])
			}
		}
	}
}
