package catalog

import (
	"context"
	"sync"
)

// faults holds the test hooks of a Server. The idempotency proxy is judged by
// what reaches the catalog (how often a mutation really ran, whether a retry
// was answered without touching it), so the catalog counts and perturbs
// requests per operation id. All methods are safe for concurrent use.
type faults struct {
	mu         sync.Mutex
	executions map[string]int
	byKey      map[string]int // executions per Idempotency-Key
	requests   map[string]int
	failNext   map[string]int
	dropNext   map[string]int
	stalls     map[string][]*Stall
}

func newFaults() *faults {
	return &faults{
		executions: map[string]int{},
		byKey:      map[string]int{},
		requests:   map[string]int{},
		failNext:   map[string]int{},
		dropNext:   map[string]int{},
		stalls:     map[string][]*Stall{},
	}
}

// Stall holds one request of an operation before it touches the catalog, so a
// test can keep a request in flight while it sends others.
type Stall struct {
	op        string
	reached   chan struct{}
	released  chan struct{}
	reachOnce sync.Once
	relOnce   sync.Once
}

// Reached is closed once a request has arrived at the stall and is waiting.
func (st *Stall) Reached() <-chan struct{} { return st.reached }

// Release lets the stalled request (or the next one to arrive) go on. It may be
// called more than once and before any request arrived.
func (st *Stall) Release() { st.relOnce.Do(func() { close(st.released) }) }

// Op is the operation id the stall applies to.
func (st *Stall) Op() string { return st.op }

func (f *faults) addStall(op string) *Stall {
	st := &Stall{op: op, reached: make(chan struct{}), released: make(chan struct{})}
	f.mu.Lock()
	f.stalls[op] = append(f.stalls[op], st)
	f.mu.Unlock()

	return st
}

// takeStall pops the oldest pending stall of op, if any.
func (f *faults) takeStall(op string) *Stall {
	f.mu.Lock()
	defer f.mu.Unlock()
	q := f.stalls[op]
	if len(q) == 0 {
		return nil
	}
	f.stalls[op] = q[1:]

	return q[0]
}

// wait blocks until the stall is released, the request is cancelled or the
// server closes; it returns the context error when the request gave up.
func (st *Stall) wait(ctx context.Context, closed <-chan struct{}) error {
	st.reachOnce.Do(func() { close(st.reached) })
	select {
	case <-st.released:
		return nil
	case <-closed:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// arrive records a request of op and reports whether it must fail before
// commit.
func (f *faults) arrive(op string) (fail bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests[op]++
	if f.failNext[op] > 0 {
		f.failNext[op]--

		return true
	}

	return false
}

// executed counts a performed mutation of op, sent with Idempotency-Key key
// (empty: none), and reports whether its answer must be dropped instead of
// sent.
func (f *faults) executed(op, key string) (drop bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.executions[op]++
	if key != "" {
		f.byKey[key]++
	}
	if f.dropNext[op] > 0 {
		f.dropNext[op]--

		return true
	}

	return false
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}

	return n
}

// Executions reports how many times the catalog performed the mutation of op
// (an operationId such as "updateTable"). Reads, rejected requests and
// injected failures are not executions.
func (s *Server) Executions(op string) int {
	s.faults.mu.Lock()
	defer s.faults.mu.Unlock()

	return s.faults.executions[op]
}

// ExecutionsWithKey reports how many performed mutations arrived carrying
// Idempotency-Key key. The module takes the key off a body-less request (a
// DELETE) before it reaches the catalog: those are counted under no key.
func (s *Server) ExecutionsWithKey(key string) int {
	s.faults.mu.Lock()
	defer s.faults.mu.Unlock()

	return s.faults.byKey[key]
}

// TotalExecutions reports the executions of all operations together.
func (s *Server) TotalExecutions() int {
	s.faults.mu.Lock()
	defer s.faults.mu.Unlock()

	return sum(s.faults.executions)
}

// Requests reports how many requests of op reached the catalog, whatever
// their outcome; a proxy that answers a retry from its own store leaves it
// unchanged.
func (s *Server) Requests(op string) int {
	s.faults.mu.Lock()
	defer s.faults.mu.Unlock()

	return s.faults.requests[op]
}

// TotalRequests reports the requests of all operations together.
func (s *Server) TotalRequests() int {
	s.faults.mu.Lock()
	defer s.faults.mu.Unlock()

	return sum(s.faults.requests)
}

// FailNext makes the next request of op answer 503 ServiceUnavailable before
// anything is committed. Calls accumulate: two calls fail the next two.
func (s *Server) FailNext(op string) {
	s.faults.mu.Lock()
	s.faults.failNext[op]++
	s.faults.mu.Unlock()
}

// DropNextCommit makes the next successful execution of op commit and then
// close the connection with a TCP reset instead of answering: the mutation is
// in the catalog (and counted in Executions) but its caller never hears of
// it, as when the catalog's process or a middlebox dies right after the
// commit. Requests that fail (4xx, injected 503s) do not use it up. Calls
// accumulate.
func (s *Server) DropNextCommit(op string) {
	s.faults.mu.Lock()
	s.faults.dropNext[op]++
	s.faults.mu.Unlock()
}

// StallNext holds the next request of op before it is executed until the
// returned Stall is released, the request is cancelled or the server closes.
// Stalled requests hold no catalog lock, so other requests proceed.
func (s *Server) StallNext(op string) *Stall {
	return s.faults.addStall(op)
}

// ResetFaults clears counters, pending failures and pending stalls (releasing
// them), so one server can serve several test phases.
func (s *Server) ResetFaults() {
	s.faults.mu.Lock()
	stalls := s.faults.stalls
	s.faults.executions = map[string]int{}
	s.faults.byKey = map[string]int{}
	s.faults.requests = map[string]int{}
	s.faults.failNext = map[string]int{}
	s.faults.dropNext = map[string]int{}
	s.faults.stalls = map[string][]*Stall{}
	s.faults.mu.Unlock()
	for _, q := range stalls {
		for _, st := range q {
			st.Release()
		}
	}
}
