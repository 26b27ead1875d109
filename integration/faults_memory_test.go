package integration_test

// Faults of load against the memory store, one Caddy node, with
// caddyproc.Backend as the catalog (it answers with any status or body size
// on cue and counts executions per path). The memory store is bounded by
// entries and bytes; a bound must never cost a key its guarantee while the
// key is in flight, and requests whose key is released must not push out
// what others stored.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
)

// TestFaultFloodOfReleasedKeys: a small store (max_entries 20) holds 10
// finalized keys and one in flight when 220 keyed requests arrive at once
// and the catalog answers them all 401 (released: stored nowhere). After
// the flood every finalized key still replays and the in-flight key's
// duplicate gets the owner's answer: nothing executed twice.
func TestFaultFloodOfReleasedKeys(t *testing.T) {
	t.Parallel()
	c, b := startGuarded(t, "store memory {\nmax_entries 20\n}\nin_flight_wait "+faultInFlightWait)
	y := newTally()
	const (
		kept  = 10
		flood = 220
	)
	keptPath := func(i int) string { return fmt.Sprintf("/v1/namespaces/kept%d/properties", i) }
	const body = `{"updates":{"owner":"faults"}}`

	keptKeys := make([]string, kept)
	keptAnswers := make([]response, kept)
	for i := range kept {
		keptKeys[i] = newKey(t)
		keptAnswers[i] = y.mustSend(t, "POST", c.URL()+keptPath(i), body, keptKeys[i])
		wantStatus(t, fmt.Sprintf("finalized key %d", i), keptAnswers[i], http.StatusOK)
	}

	const heldPath = "/v1/namespaces/held/properties"
	gate := b.Stall(heldPath)
	heldKey := newKey(t)
	// Until the build after 28dfe25 these goroutines called mustSend, whose t.Fatalf there left the test hanging on the channel.
	type sent struct {
		r   response
		err error
	}
	sendHeld := func(out chan<- sent) {
		r, err := y.send(context.Background(), "POST", c.URL()+heldPath, body, heldKey)
		out <- sent{r, err}
	}
	received := func(what string, ch <-chan sent) response {
		t.Helper()
		s := <-ch
		if s.err != nil {
			t.Fatalf("%s: POST %s (key %s): %v", what, heldPath, heldKey, s.err)
		}
		return s.r
	}
	held := make(chan sent, 1)
	go sendHeld(held)
	gate.WaitArrived(t, 1, 20*time.Second)

	const floodPath = "/v1/namespaces/flood/properties"
	b.Script(floodPath, caddyproc.Reply{Status: http.StatusUnauthorized,
		Body: []byte(`{"error":{"message":"not authorized","type":"NotAuthorizedException","code":401}}`)})
	var wg sync.WaitGroup
	var floodErrs atomic.Int64
	for range flood {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := y.send(context.Background(), "POST", c.URL()+floodPath, body, newKey(t))
			if err != nil || r.Status != http.StatusUnauthorized {
				floodErrs.Add(1)
			}
		}()
	}
	wg.Wait()
	if n := floodErrs.Load(); n != 0 {
		t.Errorf("%d of %d flood requests were not answered the catalog's 401", n, flood)
	}

	// The duplicate of the held key arrives while its owner is still in
	// flight; it must wait and get the owner's answer.
	dup := make(chan sent, 1)
	go sendHeld(dup)
	time.Sleep(200 * time.Millisecond) // let it reach the wait; either order must hold
	gate.Release()
	owner, duplicate := received("held key's owner", held), received("held key's duplicate", dup)
	wantStatus(t, "held key's owner", owner, http.StatusOK)
	wantExecuted(t, "held key's owner", owner)
	wantReplayOf(t, "held key's duplicate", duplicate, owner)
	wantCount(t, b, heldPath, 1)

	for i := range kept {
		r := y.mustSend(t, "POST", c.URL()+keptPath(i), body, keptKeys[i])
		wantReplayOf(t, fmt.Sprintf("finalized key %d after the flood", i), r, keptAnswers[i])
		wantCount(t, b, keptPath(i), 1)
	}
	wantCount(t, b, floodPath, flood)
	wantNoDuplicates(t, y.record("flood of 220 keyed 401s, max_entries 20 (memory)", b.Total(), b.Count,
		"10 finalized keys all replayed after the flood; the in-flight key's duplicate got its owner's 200 (replayed)"))
}

// Scenario 5's sizes: 300 answers of 4 MiB, 1.2 GiB in all, each under the
// default max_response_size (16 MiB) and so stored.
const (
	bigAnswers     = 300
	bigAnswerSize  = 4 << 20
	bigConcurrency = 6
	// defaultMaxBytes is the memory store's default byte bound.
	defaultMaxBytes = 256 << 20
	// heapOverhead is what Caddy's own heap and the answers in flight
	// (captured, then copied into the store) add to the store's bytes.
	heapOverhead = 64 << 20
	// rssOverhead is what the process adds to its heap: runtime, stacks,
	// binary, the answers in flight, memory freed but not yet returned.
	rssOverhead = 200 << 20
	// tightLimit is the GOMEMLIMIT of the second run: max_bytes plus
	// room for everything else.
	tightLimit = defaultMaxBytes + 192<<20
	// gomemlimitSlack is what RSS may exceed GOMEMLIMIT by (measured
	// here: 50-65 MiB).
	gomemlimitSlack = 128 << 20
)

// bigRun is what one pass of 1.2 GiB of answers did to the Caddy process.
type bigRun struct {
	before, peak, after, live int64
}

// TestFaultLargeResponsesMemoryBound: 1.2 GiB of stored answers pass
// through the default memory store (which held them all and reached ~3 GiB
// before it had a byte bound). What the store keeps must stay within
// max_bytes: Caddy's live heap after a GC is checked against it. Resident
// memory is a looser matter: with Go's default GOGC=100 the heap may grow to
// twice what is live before a collection, so by default RSS reaches about
// 2×(max_bytes + answers in flight); with GOMEMLIMIT set to max_bytes plus
// room, about that limit. Both are measured. Not parallel: it measures process memory and
// moves a lot of bytes.
func TestFaultLargeResponsesMemoryBound(t *testing.T) {
	t.Run("default GOGC", func(t *testing.T) {
		// GOMEMLIMIT unset: Caddy derives one from the machine's memory,
		// far above these figures, so only GOGC paces the collector.
		r := bigAnswersThrough(t, nil, "default memory store")
		// Live at the peak: the store's bytes plus the answers in flight;
		// GOGC=100 lets the heap reach twice that before collecting.
		if bound := int64(2*(defaultMaxBytes+heapOverhead) + rssOverhead); r.peak >= bound {
			t.Errorf("Caddy's peak RSS %s, want under %s (2 × (default max_bytes %s + %s), GOGC=100 headroom, + %s)",
				mib(r.peak), mib(bound), mib(defaultMaxBytes), mib(heapOverhead), mib(rssOverhead))
		}
	})
	t.Run("GOMEMLIMIT", func(t *testing.T) {
		env := []string{"GOMEMLIMIT=" + strconv.Itoa(tightLimit>>20) + "MiB"}
		r := bigAnswersThrough(t, env, "default memory store, "+env[0])
		// GOMEMLIMIT bounds the runtime's memory, not the whole RSS (the
		// binary's pages, memory the runtime has not returned yet).
		if bound := int64(tightLimit + gomemlimitSlack); r.peak >= bound {
			t.Errorf("Caddy's peak RSS %s with %s, want under %s (the limit + %s)",
				mib(r.peak), env[0], mib(bound), mib(gomemlimitSlack))
		}
	})
}

// bigAnswersThrough sends 300 keyed commits whose answers are 4 MiB through
// a Caddy on the default memory store, started with env, and records the
// row. It checks that each key executed once, that the newest answers
// replay, and that the live heap stays within max_bytes plus overhead; the
// caller judges RSS.
func bigAnswersThrough(t *testing.T, env []string, fault string) bigRun {
	b := caddyproc.NewBackend(t)
	c := caddyproc.StartWith(t, site(b, "", ""), caddyproc.Options{Env: env})
	if _, err := c.RSS(); err != nil {
		t.Skipf("cannot read the Caddy process's RSS here: %v", err)
	}
	const path = "/v1/namespaces/big/tables/t"
	// One body for every execution: the backend keeps what it sent, and 300
	// distinct 4 MiB bodies would put 1.2 GiB in the test process.
	big := append(append([]byte(`{"pad":"`), bytes.Repeat([]byte("x"), bigAnswerSize-len(`{"pad":""}`))...), `"}`...)
	b.Script(path, caddyproc.Reply{Body: big})

	// A client that streams bodies away instead of holding them.
	hc := &http.Client{Timeout: 60 * time.Second,
		Transport: &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: bigConcurrency}}
	t.Cleanup(hc.CloseIdleConnections)
	y := newTally()
	post := func(key string) (status int, replayed bool, err error) {
		req, err := http.NewRequest("POST", c.URL()+path, bytes.NewReader([]byte(faultCommitBody)))
		if err != nil {
			return 0, false, err
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(keyHeader, key)
		resp, err := hc.Do(req)
		if err != nil {
			y.add(path, key, 0)
			return 0, false, err
		}
		defer resp.Body.Close()
		n, err := io.Copy(io.Discard, resp.Body)
		y.add(path, key, resp.StatusCode)
		if err == nil && n != int64(len(big)) {
			err = fmt.Errorf("body of %d bytes, want %d", n, len(big))
		}
		return resp.StatusCode, resp.Header.Get(replayedHeader) == "true", err
	}

	var r bigRun
	r.before, _ = c.RSS()
	keys := make([]string, bigAnswers)
	for i := range keys {
		keys[i] = newKey(t)
	}
	next := make(chan string)
	var wg sync.WaitGroup
	var failures atomic.Int64
	start := time.Now()
	for range bigConcurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for key := range next {
				if status, _, err := post(key); err != nil || status != http.StatusOK {
					if failures.Add(1) == 1 {
						t.Errorf("big commit: status %d, %v", status, err)
					}
				}
			}
		}()
	}
	for _, k := range keys {
		next <- k
	}
	close(next)
	wg.Wait()
	took := time.Since(start)
	r.after, _ = c.RSS()
	// VmHWM is the kernel's record of the highest RSS: no sampling needed.
	var err error
	if r.peak, err = c.PeakRSS(); err != nil {
		t.Fatal(err)
	}
	r.live = liveHeap(t, c)

	// The newest answers are the ones a byte-bounded store keeps: they
	// replay. (Older ones may have been evicted to respect the bound.)
	for _, k := range keys[bigAnswers-5:] {
		status, replayed, err := post(k)
		if err != nil || status != http.StatusOK || !replayed {
			t.Errorf("retry of a recent big commit: status %d replayed %v, %v; want a 200 replay", status, replayed, err)
		}
	}
	executions := b.Count(path)
	t.Logf("%d answers of %d MiB in %v; Caddy RSS before %s, peak %s, after %s; live heap after a GC %s",
		bigAnswers, bigAnswerSize>>20, took.Round(time.Millisecond), mib(r.before), mib(r.peak), mib(r.after), mib(r.live))
	row := y.record("1.2 GiB of 4 MiB answers, "+fault, executions, b.Count,
		fmt.Sprintf("all 200, the newest 5 replayed; Caddy RSS before %s, peak %s; live heap after the run %s (max_bytes %s)",
			mib(r.before), mib(r.peak), mib(r.live), mib(defaultMaxBytes)))
	wantNoDuplicates(t, row)
	if executions != bigAnswers {
		t.Errorf("catalog executed %d commits, want %d (one per key)", executions, bigAnswers)
	}
	if bound := int64(defaultMaxBytes + heapOverhead); r.live == 0 || r.live >= bound {
		t.Errorf("Caddy's live heap after the run %s, want under %s (default max_bytes %s + %s)",
			mib(r.live), mib(bound), mib(defaultMaxBytes), mib(heapOverhead))
	}
	return r
}

var heapAllocLine = regexp.MustCompile(`(?m)^# HeapAlloc = (\d+)$`)

// liveHeap is the Caddy process's heap after a forced GC, from the admin
// API's pprof endpoint: what the process really keeps, as opposed to RSS,
// which also holds the garbage collector's headroom. 0 when unavailable.
func liveHeap(t *testing.T, c *caddyproc.Instance) int64 {
	t.Helper()
	resp, err := http.Get(c.AdminURL() + "/debug/pprof/heap?gc=1&debug=1")
	if err != nil {
		t.Logf("live heap: %v", err)
		return 0
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	m := heapAllocLine.FindSubmatch(body)
	if m == nil {
		t.Logf("live heap: no HeapAlloc in the heap profile (%s)", resp.Status)
		return 0
	}
	n, _ := strconv.ParseInt(string(m[1]), 10, 64)
	return n
}

// TestFaultFailedReloadKeepsRecords: a reload that asks the shared memory
// store for smaller bounds, and then fails (another handler of the new
// config cannot be provisioned, or another app cannot start), leaves the
// running config in force with every record it stored. Before, the store
// was shrunk while the new config's handler was provisioned (20 of 30
// finalized keys were evicted and their retries executed again, although
// the reload was refused), and then when the new config's app started,
// even if a later app refused to (and the admin API lost the running
// config's stores).
func TestFaultFailedReloadKeepsRecords(t *testing.T) {
	t.Parallel()
	c, b := startGuarded(t, "store memory {\nmax_entries 100\n}")
	y := newTally()
	const n = 30
	path := func(i int) string { return fmt.Sprintf("/v1/namespaces/reload%d/properties", i) }
	const body = `{"updates":{"owner":"reload"}}`
	keys := make([]string, n)
	answers := make([]response, n)
	for i := range n {
		keys[i] = newKey(t)
		answers[i] = y.mustSend(t, "POST", c.URL()+path(i), body, keys[i])
		wantStatus(t, fmt.Sprintf("key %d", i), answers[i], http.StatusOK)
	}

	failing := caddyproc.Caddyfile("", "iceberg_idempotency {\nstore memory {\nmax_entries 10\n}\n}\n"+
		"handle /unprovisionable* {\nreverse_proxy https://127.0.0.1:9 {\ntransport http {\n"+
		"tls_client_auth /nonexistent/cert.pem /nonexistent/key.pem\n}\n}\n}\n"+
		"reverse_proxy "+b.Addr())
	if err := c.Load(failing); err == nil {
		t.Fatal("a config whose client certificate does not exist loaded")
	}
	client.CloseIdleConnections()

	// Refused later, at start: the new config's second site listens on a
	// port another process holds, so the http app fails to start. Caddy
	// starts a config's apps in map order and stops those already started
	// when one fails; iceberg_idempotency starts first about every other
	// time, which the repetitions cover.
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	failingAtStart := caddyproc.Caddyfile("", "iceberg_idempotency {\nstore memory {\nmax_entries 10\n}\n}\nreverse_proxy "+b.Addr()) +
		"\nhttp://" + taken.Addr().String() + " {\nrespond 200\n}\n"
	for i := range 8 {
		if err := c.Load(failingAtStart); err == nil {
			t.Fatalf("reload %d: a config listening on a port in use loaded", i+1)
		}
		// The admin API still answers for the running config's store.
		if recs := adminKey(t, c, keys[0]); len(recs) != 1 || recs[0].State != "final" {
			t.Fatalf("after start-refused reload %d the admin API sees %+v for a final key", i+1, recs)
		}
	}
	client.CloseIdleConnections()

	for i := range n {
		r := y.mustSend(t, "POST", c.URL()+path(i), body, keys[i])
		wantReplayOf(t, fmt.Sprintf("key %d after the failed reloads", i), r, answers[i])
		if got := b.Count(path(i)); got != 1 {
			t.Fatalf("key %d: the catalog executed it %d times", i, got)
		}
	}
	wantNoDuplicates(t, y.record("reloads to max_entries 10 refused at provision (memory, 30 final keys under max_entries 100), then 8 at start", b.Total(), b.Count,
		"the running config kept all 30 records: every retry replayed"))
}
