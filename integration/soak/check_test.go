package soak

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// final4xx is a 4xx the module stores (the README's Finalize or release
// table): every 4xx but those it releases.
func final4xx(status int) bool {
	if status/100 != 4 {
		return false
	}
	switch status {
	case 401, 403, 408, 419, 421, 425, 429, 499:
		return false
	}
	return true
}

func isFinal(status int) bool { return status/100 == 2 || final4xx(status) }

func isUnknown(a attempt) bool {
	return a.errType == "CommitStateUnknownException" && (a.status == 500 || a.status == 502 || a.status == 504)
}

func label(a attempt) string {
	if a.status == 0 {
		return "no answer (" + a.err + ")"
	}
	if a.errType != "" {
		return strconv.Itoa(a.status) + " " + a.errType
	}
	return strconv.Itoa(a.status)
}

func (s *soak) eventsBetween(from, to time.Duration, kinds ...string) []event {
	s.evMu.Lock()
	defer s.evMu.Unlock()
	var out []event
	for _, e := range s.events {
		if e.end >= from && e.at <= to {
			for _, k := range kinds {
				if strings.Contains(e.kind, k) {
					out = append(out, e)
					break
				}
			}
		}
	}
	return out
}

func (s *soak) describe(r *keyRun, ex []execution) string {
	var b strings.Builder
	fmt.Fprintf(&b, "key #%d %s %s %s\n", r.idx, r.key, r.op, r.path)
	for i, e := range ex {
		fmt.Fprintf(&b, "    execution %d at %.2fs: %d (%s)\n", i+1, e.at.Seconds(), e.status, faultNames[e.fault])
	}
	for _, a := range r.attempts {
		fmt.Fprintf(&b, "    attempt %.2fs-%.2fs node %d: %s\n", a.at.Seconds(), a.end.Seconds(), a.node, label(a))
	}
	if len(r.attempts) > 0 {
		from := r.attempts[0].at - 5*time.Second
		to := r.attempts[len(r.attempts)-1].at + 5*time.Second
		for _, e := range s.eventsBetween(from, to, "") {
			fmt.Fprintf(&b, "    fault %s node %d from %.2fs to %.2fs\n", e.kind, e.node, e.at.Seconds(), e.end.Seconds())
		}
	}
	return b.String()
}

type counter map[string]int

func (c counter) String() string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return c[keys[i]] > c[keys[j]] || c[keys[i]] == c[keys[j]] && keys[i] < keys[j] })
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "    %6d  %s\n", c[k], k)
	}
	return b.String()
}

func (s *soak) check() {
	t := s.t
	execs, _ := s.cat.snapshot()
	s.cat.mu.Lock()
	resetAt := make(map[string][]time.Duration, len(s.cat.resetAt))
	for k, v := range s.cat.resetAt {
		resetAt[k] = v
	}
	s.cat.mu.Unlock()
	hist := counter{}
	statuses := counter{}
	outcomes := counter{}
	allowed := counter{}
	unknowns := counter{}
	var violations, notes []string
	attempts, investigate := 0, 0
	lastKill := time.Duration(-1)
	for _, e := range s.eventsBetween(0, 1<<62, "kill -9 node") {
		lastKill = max(lastKill, e.end)
	}

	for _, r := range s.runs {
		ex := execs[r.key]
		hist[fmt.Sprintf("%d executions", len(ex))]++
		attempts += len(r.attempts)
		for _, a := range r.attempts {
			statuses[label(a)]++
		}
		// Second executions.
		for i := 1; i < len(ex); i++ {
			prev, cur := ex[i-1], ex[i]
			var abandoned string
			if s.reexecute {
				abandoned = s.abandonedAfter(r, prev, cur.at)
			}
			switch {
			case s.db == nil && len(s.eventsBetween(r.attempts[0].at, cur.at, "kill -9 node")) > 0:
				allowed["second execution: memory store, node killed in between (README: a restart forgets)"]++
			case prev.status/100 == 5 && prev.fault != faultResetAfter && prev.fault != faultStallAfter && !(r.op == "updateTable" && (prev.status == 500 || prev.status == 502 || prev.status == 504)):
				allowed["second execution: the catalog's own 5xx released it"]++
			case abandoned != "":
				allowed["second execution under abandoned reexecute: "+abandoned]++
			default:
				violations = append(violations, "executed again:\n"+s.describe(r, ex))
			}
		}
		// Every final answer is the answer of the key's execution.
		for _, a := range r.attempts {
			if !isFinal(a.status) {
				continue
			}
			switch {
			case len(ex) == 0:
				violations = append(violations, "final answer for a key the catalog never executed:\n"+s.describe(r, ex))
			case a.status == ex[0].status && bytes.Equal(a.body, ex[0].body):
			default:
				match := -1
				for i, e := range ex {
					if a.status == e.status && bytes.Equal(a.body, e.body) {
						match = i
					}
				}
				if match < 0 {
					violations = append(violations, fmt.Sprintf("answer %d is no execution's answer:\n%s", a.status, s.describe(r, ex)))
				} else {
					notes = append(notes, fmt.Sprintf("answer of execution %d (after an allowed re-execution): key #%d", match+1, r.idx))
				}
			}
		}
		// Unknown answers, and why.
		for _, a := range r.attempts {
			if !isUnknown(a) {
				continue
			}
			var why string
			var before []execution
			for _, e := range ex {
				if e.at <= a.end {
					before = append(before, e)
				}
			}
			from := r.attempts[0].at - time.Second
			switch {
			case len(before) > 0 && (before[0].fault == faultResetAfter || before[0].fault == faultStallAfter):
				why = "executed, catalog " + faultNames[before[0].fault]
			case len(before) > 0 && len(s.eventsBetween(from, a.end, "kill -9 node")) > 0:
				why = "executed, a node killed meanwhile"
			case len(before) > 0 && len(s.eventsBetween(from, a.end, "kill -9 database", "SIGSTOP database")) > 0:
				why = "executed, database fault meanwhile (answer not stored)"
			case len(before) > 0:
				why = "executed, no fault seen (investigate)"
			case len(resetAt[r.key]) > 0 && resetAt[r.key][0] <= a.end:
				why = "not executed: catalog reset the connection before executing (it may have read it)"
			case len(s.eventsBetween(from, a.end, "kill -9 node")) > 0:
				why = "not executed: a node killed holding the key"
			case len(s.eventsBetween(from, a.end, "kill -9 database", "SIGSTOP database")) > 0:
				why = "not executed: database fault (reservation's fate unknown)"
			default:
				why = "not executed, no fault seen (investigate)"
			}
			unknowns[why]++
			if strings.Contains(why, "investigate") && investigate < 5 {
				investigate++
				notes = append(notes, "unknown, "+why+":\n"+s.describe(r, ex))
			}
		}
		last := r.attempts[len(r.attempts)-1]
		switch {
		case isFinal(last.status):
			outcomes["final "+strconv.Itoa(last.status)]++
		case isUnknown(last):
			outcomes["unknown"]++
		default:
			outcomes["gave up after "+strconv.Itoa(len(r.attempts))+" attempts: "+label(last)]++
		}
	}

	// Replay sweep: every key that ended final is asked again on every
	// node; its answer must be the stored one, and nothing may execute.
	sweep := s.sweep(lastKill)
	after, _ := s.cat.snapshot()
	for _, r := range s.runs {
		if len(after[r.key]) == len(execs[r.key]) {
			continue
		}
		if why := s.sweptAgain(r, execs[r.key], after[r.key]); why != "" {
			allowed["replay sweep executed it again under abandoned reexecute: "+why]++
		} else {
			violations = append(violations, "the replay sweep executed it again:\n"+s.describe(r, after[r.key]))
		}
	}
	violations = append(violations, sweep.violations...)
	gaveUp := counter{}
	if s.db != nil {
		gaveUp = s.askGaveUp(execs)
		final, _ := s.cat.snapshot()
		for _, r := range s.runs {
			if len(execs[r.key]) == 0 && len(final[r.key]) > 1 {
				violations = append(violations, "a key that had given up executed twice when asked again:\n"+s.describe(r, final[r.key]))
			}
		}
	}
	if sweep.allowed > 0 {
		allowed["replayed as unknown: answered while the store failed, its node killed before the background Finalize landed (README, Finalize or release: if the store never took it)"] += sweep.allowed
	}

	evs := counter{}
	s.evMu.Lock()
	for _, e := range s.events {
		evs[e.kind]++
	}
	s.evMu.Unlock()
	cf := counter{}
	s.cat.mu.Lock()
	for f, n := range s.cat.faults {
		cf[faultNames[f]] += n
	}
	unkeyed := s.cat.unkeyed
	s.cat.mu.Unlock()

	var b strings.Builder
	policy := "unknown"
	if s.reexecute {
		policy = "reexecute"
	}
	fmt.Fprintf(&b, "soak store=%s abandoned=%s seed=%d duration=%.0fs nodes=%d\n", s.store, policy, s.seed, s.since().Seconds(), len(s.nodes))
	fmt.Fprintf(&b, "keys %d, attempts %d, unkeyed mutations at the catalog %d\n", len(s.runs), attempts, unkeyed)
	fmt.Fprintf(&b, "process faults fired:\n%s", evs)
	fmt.Fprintf(&b, "catalog faults drawn (per keyed arrival):\n%s", cf)
	fmt.Fprintf(&b, "executions per key:\n%s", hist)
	fmt.Fprintf(&b, "answers seen by clients:\n%s", statuses)
	fmt.Fprintf(&b, "how each key ended:\n%s", outcomes)
	fmt.Fprintf(&b, "unknown answers, by cause:\n%s", unknowns)
	fmt.Fprintf(&b, "allowed by the README:\n%s", allowed)
	fmt.Fprintf(&b, "replay sweep: %d keys asked again, %s\n", sweep.asked, sweep.summary)
	fmt.Fprintf(&b, "keys that gave up unexecuted, asked once more after the run:\n%s", gaveUp)
	for _, n := range s.gaveUpNotes {
		b.WriteString(n)
	}
	for i, n := range notes {
		if i == 20 {
			fmt.Fprintf(&b, "… %d more notes\n", len(notes)-20)
			break
		}
		fmt.Fprintf(&b, "note: %s\n", n)
	}
	fmt.Fprintf(&b, "Caddy log lines at warn and above, by message (every process):\n%s", s.logMessages())
	fmt.Fprintf(&b, "violations: %d\n", len(violations))
	for i, v := range violations {
		if i == 30 {
			fmt.Fprintf(&b, "… %d more\n", len(violations)-30)
			break
		}
		b.WriteString(v)
	}
	t.Log("\n" + b.String())
	if out := os.Getenv("ICEBERG_IDEMPOTENCY_SOAK_OUT"); out != "" {
		_ = os.WriteFile(out, []byte(b.String()), 0o644)
	}
	if len(violations) > 0 {
		t.Errorf("%d violations", len(violations))
	}
}

type sweepResult struct {
	asked      int
	allowed    int // final answers whose Finalize a crash cut off
	summary    string
	violations []string
}

// sweep asks every key that ended with a final answer or unknown, or that
// the catalog executed, again on every node. On the memory store only keys first executed after the last
// node kill are asked: a restart forgets the others by design.
func (s *soak) sweep(lastKill time.Duration) sweepResult {
	execs, _ := s.cat.snapshot()
	var todo []*keyRun
	for _, r := range s.runs {
		last := r.attempts[len(r.attempts)-1]
		// A key that gave up after the catalog executed it is asked too:
		// its retry must get that answer or "unknown", never run again.
		if !isFinal(last.status) && !isUnknown(last) && len(execs[r.key]) == 0 {
			continue
		}
		if ex := execs[r.key]; s.db == nil && (len(ex) == 0 || ex[0].at <= lastKill) {
			continue
		}
		todo = append(todo, r)
	}
	hc := &http.Client{Timeout: 20 * time.Second}
	var mu sync.Mutex
	res := sweepResult{asked: len(todo)}
	got := counter{}
	work := make(chan *keyRun)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for r := range work {
				last := r.attempts[len(r.attempts)-1]
				for node := range s.nodes {
					var a attempt
					deadline := time.Now().Add(150 * time.Second)
					for {
						a = s.send(hc, r, node)
						if a.status != 503 || time.Now().After(deadline) {
							break
						}
						time.Sleep(time.Second)
					}
					mu.Lock()
					got[label(a)]++
					ok := false
					switch ex := execs[r.key]; {
					case isFinal(last.status):
						ok = a.status == last.status && bytes.Equal(a.body, last.body)
					case isUnknown(last):
						ok = isUnknown(a) && a.status == 500
					default:
						ok = isUnknown(a) && a.status == 500 || a.status == ex[0].status && bytes.Equal(a.body, ex[0].body)
					}
					if !ok && s.reexecute {
						// The key may have been taken over and executed
						// again, this sweep included: its answer is then
						// one of its executions', or unknown when the
						// catalog reset or stalled the newest.
						ok = isFinal(a.status) && s.someExecutionsAnswer(r.key, a) || isUnknown(a) && s.newestExecutionLost(r.key)
					}
					if !ok && isFinal(last.status) && isUnknown(a) && s.finalizeCutOff(last) {
						res.allowed++
					} else if !ok {
						res.violations = append(res.violations, fmt.Sprintf("replay on node %d: %s, the client had %s:\n%s",
							node, label(a), label(last), s.describe(r, execs[r.key])))
					}
					mu.Unlock()
				}
			}
		})
	}
	for _, r := range todo {
		work <- r
	}
	close(work)
	wg.Wait()
	res.summary = "answers:\n" + got.String()
	return res
}

// abandonedAfter says why, under abandoned reexecute, a retry may have
// taken key r over after its execution prev and executed it again at
// again: the README's abandoned cases ("Abandoned requests"). "" when
// nothing abandoned it, which is a violation. A fault counts from when
// the owner may have sent the request prev executed, up to
// execution_timeout before it: the catalog runs what it has read to its
// end, so an owner whose node was killed while its request was on its way
// or in a slow catalog (a Redis run had the kill 0.46 s before the
// execution) leaves its record to lapse just the same.
func (s *soak) abandonedAfter(r *keyRun, prev execution, again time.Duration) string {
	sent := prev.at - execTimeout
	switch {
	case prev.fault == faultResetAfter || prev.fault == faultStallAfter:
		return "the first's outcome unknown (catalog " + faultNames[prev.fault] + ")"
	case r.op == "updateTable" && (prev.status == 500 || prev.status == 502 || prev.status == 504):
		return "the catalog's 5xx to a commit (outcome unknown)"
	case len(s.eventsBetween(sent, again, "kill -9 node")) > 0:
		return "a node killed in between (its owner's lease lapsed)"
	case len(s.eventsBetween(sent, again, "kill -9 database", "SIGSTOP database")) > 0:
		return "a database fault in between (renewals or the Finalize failed)"
	}
	return ""
}

// sweptAgain says why, under abandoned reexecute, the replay sweep may
// have executed key r again (before: its executions during the run; all:
// after the sweep): its record was abandoned when the run ended, and each
// further execution in the sweep followed one whose outcome was lost. ""
// otherwise, which is a violation.
func (s *soak) sweptAgain(r *keyRun, before, all []execution) string {
	if !s.reexecute {
		return ""
	}
	last := r.attempts[len(r.attempts)-1]
	var why string
	switch {
	case isUnknown(last):
		why = "it ended unknown"
	case isFinal(last.status) && s.finalizeCutOff(last):
		why = "its Finalize died with its node"
	case !isFinal(last.status) && len(before) > 0:
		why = "its client gave up after it executed"
	default:
		return ""
	}
	for i := len(before) + 1; i < len(all); i++ {
		if s.abandonedAfter(r, all[i-1], all[i].at) == "" {
			return ""
		}
	}
	return why
}

// someExecutionsAnswer reports whether a is the answer of one of key's
// executions so far.
func (s *soak) someExecutionsAnswer(key string, a attempt) bool {
	s.cat.mu.Lock()
	defer s.cat.mu.Unlock()
	for _, e := range s.cat.execs[key] {
		if a.status == e.status && bytes.Equal(a.body, e.body) {
			return true
		}
	}
	return false
}

// newestExecutionLost reports whether the catalog reset or stalled the
// answer of key's newest execution, or reset an arrival of key after it
// before executing (it may have read it).
func (s *soak) newestExecutionLost(key string) bool {
	s.cat.mu.Lock()
	defer s.cat.mu.Unlock()
	ex, resets := s.cat.execs[key], s.cat.resetAt[key]
	if len(ex) == 0 {
		return len(resets) > 0
	}
	newest := ex[len(ex)-1]
	return newest.fault == faultResetAfter || newest.fault == faultStallAfter ||
		len(resets) > 0 && resets[len(resets)-1] > newest.at
}

// finalizeCutOff reports whether a final answer may have been delivered
// without being stored: the database was down or frozen while it was
// answered, and the node that answered it was killed before the database
// came back, so the background Finalize retries died with it.
func (s *soak) finalizeCutOff(a attempt) bool {
	for _, kill := range s.eventsBetween(a.at, a.end+130*time.Second, "kill -9 node") {
		if kill.node != a.node || kill.at < a.at {
			continue
		}
		if len(s.eventsBetween(a.at, kill.at, "kill -9 database", "SIGSTOP database")) > 0 {
			return true
		}
	}
	return false
}

// askGaveUp sends once more, after the run, every key whose client gave up
// (503s, no answer) before the catalog ever executed it: nothing of it ran,
// so its retry should execute (once), unless its reservation's fate was
// unknown to the store (a Reserve whose reply was lost and whose release did
// not land before the lease lapsed: the README's "unknown" case).
func (s *soak) askGaveUp(execs map[string][]execution) counter {
	got := counter{}
	var mu sync.Mutex
	hc := &http.Client{Timeout: 20 * time.Second}
	work := make(chan *keyRun)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for r := range work {
				var a attempt
				asked := time.Since(s.cat.start)
				deadline := time.Now().Add(150 * time.Second)
				for {
					a = s.send(hc, r, 0)
					if a.status != 503 || time.Now().After(deadline) {
						break
					}
					time.Sleep(time.Second)
				}
				heard := false
				for _, b := range r.attempts {
					heard = heard || isUnknown(b)
				}
				what := label(a)
				s.cat.mu.Lock()
				resets := len(s.cat.resetAt[r.key])
				var faultAfter catalogFault
				for _, e := range s.cat.execs[r.key] {
					if e.at >= asked && (e.fault == faultResetAfter || e.fault == faultStallAfter) {
						faultAfter = e.fault
					}
				}
				s.cat.mu.Unlock()
				if isUnknown(a) && a.status != 500 && faultAfter != faultNone {
					// This ask executed the key, and the catalog then reset
					// or stalled it (a fault drawn for it): unknown is its
					// answer, not something the run left behind.
					what += ", this ask executed it, then the catalog drew: " + faultNames[faultAfter]
				} else if isUnknown(a) && a.status != 500 && resets > 0 {
					// This attempt went to the catalog, which reset it
					// before executing (a fault drawn for it).
					what += ", this attempt reset by the catalog before executing"
				} else if isUnknown(a) && !heard {
					what += ", never heard before"
					mu.Lock()
					s.gaveUpNotes = append(s.gaveUpNotes, "unknown on asking again, never heard before:\n"+s.describe(r, nil))
					mu.Unlock()
				} else if isUnknown(a) {
					what += ", as heard before"
				}
				mu.Lock()
				got[what]++
				mu.Unlock()
			}
		})
	}
	for _, r := range s.runs {
		last := r.attempts[len(r.attempts)-1]
		if !isFinal(last.status) && !isUnknown(last) && len(execs[r.key]) == 0 {
			work <- r
		}
	}
	close(work)
	wg.Wait()
	return got
}

// logMessages counts the nodes' log lines at warn level and above by level
// and message (no field values: they hold keys, never bodies).
func (s *soak) logMessages() counter {
	c := counter{}
	for _, inst := range s.allNodes {
		for _, line := range strings.Split(inst.Logs(), "\n") {
			var l struct {
				Level string `json:"level"`
				Msg   string `json:"msg"`
			}
			if json.Unmarshal([]byte(line), &l) != nil {
				if strings.Contains(line, "panic") || strings.Contains(line, "fatal error") {
					c["raw: "+line[:min(len(line), 160)]]++
				}
				continue
			}
			switch l.Level {
			case "warn", "error", "panic", "fatal", "dpanic":
				c[l.Level+": "+l.Msg]++
			}
		}
	}
	return c
}
