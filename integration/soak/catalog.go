package soak

import (
	"bytes"
	"context"
	"encoding/binary"
	"hash/fnv"
	"net/http"
	"net/http/httptest"
	"sync"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/catalog"
)

// catalogFault is what the catalog does to one keyed request.
type catalogFault int

const (
	faultNone        catalogFault = iota
	faultRefuse                   // 503 before executing: nothing ran, the key is released
	faultSlow                     // executes after a pause under execution_timeout
	faultResetAfter               // executes, then resets the connection instead of answering
	faultStallAfter               // executes, then answers only after execution_timeout
	faultResetBefore              // resets the connection before executing
)

var faultNames = map[catalogFault]string{
	faultNone: "none", faultRefuse: "503 before executing", faultSlow: "slow",
	faultResetAfter: "reset after executing", faultStallAfter: "stall past execution_timeout after executing",
	faultResetBefore: "reset before executing",
}

// execution is one run of a key's request in the catalog: the answer the
// catalog produced (whether or not it was delivered).
type execution struct {
	at     time.Duration // since the soak started
	status int
	body   []byte
	fault  catalogFault
}

// countingCatalog wraps the real test catalog: it counts, per
// Idempotency-Key, every request the catalog executed and keeps its answer,
// and draws for every keyed arrival a fault from the seed, the key's index
// and the arrival's number, so a run's catalog faults do not depend on
// timing.
type countingCatalog struct {
	cat     *catalog.Server
	seed    uint64
	start   time.Time
	execTO  time.Duration
	index   func(key string) (int, bool)
	mu      sync.Mutex
	arrived map[string]int
	resetAt map[string][]time.Duration // arrivals reset before executing
	execs   map[string][]execution
	faults  map[catalogFault]int
	unkeyed int
}

func (c *countingCatalog) draw(key string, arrival int) catalogFault {
	idx, ok := c.index(key)
	if !ok {
		return faultNone
	}
	h := fnv.New64a()
	var b [24]byte
	binary.LittleEndian.PutUint64(b[0:], c.seed)
	binary.LittleEndian.PutUint64(b[8:], uint64(idx))
	binary.LittleEndian.PutUint64(b[16:], uint64(arrival))
	_, _ = h.Write(b[:])
	switch v := h.Sum64() % 1000; {
	case v < 40:
		return faultRefuse
	case v < 70:
		return faultResetAfter
	case v < 90:
		return faultStallAfter
	case v < 110:
		return faultResetBefore
	case v < 200:
		return faultSlow
	}
	return faultNone
}

func (c *countingCatalog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	if key == "" || r.Method == http.MethodGet {
		if r.Method != http.MethodGet {
			c.mu.Lock()
			c.unkeyed++
			c.mu.Unlock()
		}
		c.cat.ServeHTTP(w, r)
		return
	}
	c.mu.Lock()
	c.arrived[key]++
	f := c.draw(key, c.arrived[key])
	c.faults[f]++
	c.mu.Unlock()

	switch f {
	case faultRefuse:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(`{"error":{"message":"soak: refused before executing","type":"ServiceUnavailableException","code":503}}`))
		return
	case faultResetBefore:
		c.mu.Lock()
		c.resetAt[key] = append(c.resetAt[key], time.Since(c.start))
		c.mu.Unlock()
		catalog.DropConnection(w)
		return
	case faultSlow:
		time.Sleep(c.execTO / 4) // not cut short: the request was read
	}
	// A catalog runs a commit it has begun to its end, whether or not its
	// caller is still there (a Caddy node killed meanwhile).
	rec := httptest.NewRecorder()
	c.cat.ServeHTTP(rec, r.WithContext(context.WithoutCancel(r.Context())))
	c.mu.Lock()
	c.execs[key] = append(c.execs[key], execution{
		at: time.Since(c.start), status: rec.Code, body: bytes.Clone(rec.Body.Bytes()), fault: f,
	})
	c.mu.Unlock()
	switch f {
	case faultResetAfter:
		catalog.DropConnection(w)
		return
	case faultStallAfter:
		select {
		case <-time.After(c.execTO + time.Second):
		case <-r.Context().Done():
			return
		}
	}
	for k, v := range rec.Header() {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.Code)
	_, _ = w.Write(rec.Body.Bytes())
}

func (c *countingCatalog) snapshot() (map[string][]execution, map[string]int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := make(map[string][]execution, len(c.execs))
	for k, v := range c.execs {
		e[k] = append([]execution(nil), v...)
	}
	a := make(map[string]int, len(c.arrived))
	for k, v := range c.arrived {
		a[k] = v
	}
	return e, a
}

// setup creates the namespace and tables the commits go to, straight through
// the catalog's handler.
func setupCatalog(ctx context.Context, cat *catalog.Server, tables int) error {
	do := func(path, body string) error {
		req := httptest.NewRequestWithContext(ctx, http.MethodPost, path, bytes.NewReader([]byte(body)))
		req.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		cat.ServeHTTP(rec, req)
		if rec.Code/100 != 2 {
			return &setupError{path: path, status: rec.Code, body: rec.Body.String()}
		}
		return nil
	}
	if err := do("/v1/namespaces", `{"namespace":["soak"]}`); err != nil {
		return err
	}
	for i := range tables {
		body := `{"name":"t` + itoa(i) + `","schema":{"type":"struct","schema-id":0,"fields":[{"id":1,"name":"id","type":"int","required":true}]}}`
		if err := do("/v1/namespaces/soak/tables", body); err != nil {
			return err
		}
	}
	return nil
}

type setupError struct {
	path   string
	status int
	body   string
}

func (e *setupError) Error() string {
	return "setup " + e.path + ": " + itoa(e.status) + " " + e.body
}
