package icebergidempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/google/uuid"
	"go.uber.org/zap/zaptest"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
)

// loadOnly hides a store's optional admin interfaces: a store that only
// implements stores.Store.
type loadOnly struct{ stores.Store }

// adminFixture runs an app holding the given stores, as the running
// config's, and returns the admin API's handler.
func adminFixture(t *testing.T, held map[string]stores.Store) caddy.AdminHandler {
	t.Helper()
	app := &App{stores: make(map[string]stores.Store)}
	for k, s := range held {
		app.stores[k] = newPooledStore(s)
	}
	running.Store(app)
	t.Cleanup(func() { running.CompareAndSwap(app, nil) })
	a := &AdminAPI{logger: zaptest.NewLogger(t)}
	routes := a.Routes()
	if len(routes) != 1 || routes[0].Pattern != "/iceberg_idempotency/" {
		t.Fatalf("routes = %+v", routes)
	}
	return routes[0].Handler
}

// call runs one admin request and returns its status and body. An error
// the handler returns is answered the way Caddy's admin endpoint does.
func call(t *testing.T, h caddy.AdminHandler, method, target string) (int, []byte) {
	t.Helper()
	rec := httptest.NewRecorder()
	err := h.ServeHTTP(rec, httptest.NewRequest(method, target, nil))
	if err != nil {
		apiErr, ok := err.(caddy.APIError)
		if !ok {
			t.Fatalf("%s %s: error %v is not a caddy.APIError", method, target, err)
		}
		body, _ := json.Marshal(map[string]string{"error": apiErr.Err.Error()})
		return apiErr.HTTPStatus, body
	}
	if rec.Code == 0 {
		rec.Code = http.StatusOK
	}
	return rec.Code, rec.Body.Bytes()
}

func newMemory(t *testing.T) *memory.Store {
	t.Helper()
	s, err := memory.New(memory.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func reserveKey(t *testing.T, s stores.Store, lease time.Duration) (key, owner string) {
	t.Helper()
	key, owner = uuid.Must(uuid.NewV7()).String(), uuid.NewString()
	res, err := s.Reserve(context.Background(), stores.Reservation{
		Key:     key,
		Binding: stores.Binding{Operation: "updateTable", Path: "/v1/namespaces/ns/tables/t", Principal: "secret-principal-hash", Fingerprint: "secret-fingerprint"},
		Owner:   owner, Lease: lease, TTL: time.Hour,
	})
	if err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	return key, owner
}

func finalKey(t *testing.T, s stores.Store, resp stores.Response) string {
	t.Helper()
	key, owner := reserveKey(t, s, time.Minute)
	if err := s.Finalize(context.Background(), key, owner, resp); err != nil {
		t.Fatal(err)
	}
	return key
}

type answer struct {
	Key     string           `json:"key"`
	Records []map[string]any `json:"records"`
	Errors  []map[string]any `json:"errors"`
	Forgot  *int             `json:"forgotten"`
}

func decode(t *testing.T, body []byte) answer {
	t.Helper()
	var a answer
	if err := json.Unmarshal(body, &a); err != nil {
		t.Fatalf("body %s: %v", body, err)
	}
	return a
}

func TestAdminGetKey(t *testing.T) {
	mem := newMemory(t)
	h := adminFixture(t, map[string]stores.Store{"memory": mem})

	key := finalKey(t, mem, stores.Response{Status: 201, Header: http.Header{"X-Secret-Header": {"hv"}}, Body: []byte(`{"vended":"credential"}`)})
	status, body := call(t, h, http.MethodGet, "/iceberg_idempotency/keys/"+strings.ToUpper(key))
	if status != http.StatusOK {
		t.Fatalf("GET final = %d %s", status, body)
	}
	for _, leak := range []string{"credential", "hv", "secret-principal-hash", "secret-fingerprint"} {
		if strings.Contains(string(body), leak) {
			t.Errorf("GET shows %q: %s", leak, body)
		}
	}
	a := decode(t, body)
	if a.Key != key || len(a.Records) != 1 {
		t.Fatalf("answer = %s", body)
	}
	r := a.Records[0]
	if r["state"] != "final" || r["status"] != float64(201) || r["operation"] != "updateTable" ||
		r["path"] != "/v1/namespaces/ns/tables/t" || r["store"] != "memory" || r["backend"] != "memory" {
		t.Errorf("record = %v", r)
	}
	if _, ok := r["lease_left"]; ok {
		t.Errorf("final record has a lease_left: %v", r)
	}
	if r["created_at"] == nil || r["expires_at"] == nil {
		t.Errorf("record lacks times: %v", r)
	}

	sealed := finalKey(t, mem, stores.Response{Body: []byte("ciphertext"), KeyID: "k1"})
	_, body = call(t, h, http.MethodGet, "/iceberg_idempotency/keys/"+sealed)
	r = decode(t, body).Records[0]
	if r["sealed"] != true || r["key_id"] != "k1" || r["status"] != nil {
		t.Errorf("sealed record = %v", r)
	}

	inflight, _ := reserveKey(t, mem, time.Minute)
	_, body = call(t, h, http.MethodGet, "/iceberg_idempotency/keys/"+inflight)
	r = decode(t, body).Records[0]
	left, err := time.ParseDuration(r["lease_left"].(string))
	if r["state"] != "in_flight" || err != nil || left <= 50*time.Second || left > time.Minute {
		t.Errorf("in-flight record = %v (%v)", r, err)
	}

	abandoned, owner := reserveKey(t, mem, time.Minute)
	if err := mem.Abandon(context.Background(), abandoned, owner); err != nil {
		t.Fatal(err)
	}
	_, body = call(t, h, http.MethodGet, "/iceberg_idempotency/keys/"+abandoned)
	if r = decode(t, body).Records[0]; r["state"] != "abandoned" || r["lease_left"] != nil {
		t.Errorf("abandoned record = %v", r)
	}

	if status, body = call(t, h, http.MethodGet, "/iceberg_idempotency/keys/"+uuid.NewString()); status != http.StatusNotFound {
		t.Errorf("GET unknown = %d %s, want 404", status, body)
	}
	for _, bad := range []string{"nope", strings.ReplaceAll(key, "-", "_"), key[:35] + "g"} {
		if status, body = call(t, h, http.MethodGet, "/iceberg_idempotency/keys/"+bad); status != http.StatusBadRequest {
			t.Errorf("GET %q = %d %s, want 400", bad, status, body)
		}
	}
	if status, _ = call(t, h, http.MethodPost, "/iceberg_idempotency/keys/"+key); status != http.StatusMethodNotAllowed {
		t.Errorf("POST = %d, want 405", status)
	}
	if status, _ = call(t, h, http.MethodGet, "/iceberg_idempotency/other"); status != http.StatusNotFound {
		t.Errorf("GET other = %d, want 404", status)
	}
}

// A node without a handler says so, rather than "no record": an operator
// who asked the wrong node or admin address would read that as the key
// being gone (until the build after a95b973 it said "no record in any
// store in use").
func TestAdminGetKeyWithoutRunningConfig(t *testing.T) {
	for name, setup := range map[string]func() caddy.AdminHandler{
		"no app": func() caddy.AdminHandler {
			running.Store(nil)
			return (&AdminAPI{logger: zaptest.NewLogger(t)}).Routes()[0].Handler
		},
		"app without stores": func() caddy.AdminHandler { return adminFixture(t, map[string]stores.Store{}) },
	} {
		t.Run(name, func(t *testing.T) {
			h := setup()
			for _, method := range []string{http.MethodGet, http.MethodDelete} {
				target := "/iceberg_idempotency/keys/" + uuid.NewString()
				if method == http.MethodDelete {
					target += "?force=true"
				}
				status, body := call(t, h, method, target)
				if status != http.StatusNotFound || !strings.Contains(string(body), "no store in use: the running config has no iceberg_idempotency handler") {
					t.Errorf("%s = %d %s, want 404 saying no store is in use", method, status, body)
				}
			}
			if status, body := call(t, h, http.MethodGet, "/iceberg_idempotency/stats"); status != http.StatusOK || !strings.Contains(string(body), `"stores":[]`) {
				t.Errorf("stats = %d %s", status, body)
			}
		})
	}
}

func TestAdminForget(t *testing.T) {
	mem := newMemory(t)
	h := adminFixture(t, map[string]stores.Store{"memory": mem})
	ctx := context.Background()

	// A final record's answer is what its retries replay: forgetting it
	// needs force.
	key := finalKey(t, mem, stores.Response{Status: 200})
	status, body := call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+key)
	if status != http.StatusConflict || !strings.Contains(string(body), "is final") {
		t.Fatalf("DELETE final = %d %s, want 409 saying it is final", status, body)
	}
	if rec, _ := mem.Load(ctx, key); rec == nil {
		t.Fatal("refused DELETE forgot the final record")
	}
	status, body = call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+key+"?force=true")
	if a := decode(t, body); status != http.StatusOK || a.Forgot == nil || *a.Forgot != 1 {
		t.Fatalf("forced DELETE final = %d %s", status, body)
	}
	if rec, _ := mem.Load(ctx, key); rec != nil {
		t.Fatalf("record still there: %+v", rec)
	}
	if status, _ = call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+key+"?force=true"); status != http.StatusNotFound {
		t.Errorf("second DELETE = %d, want 404", status)
	}

	inflight, owner := reserveKey(t, mem, time.Minute)
	if status, body = call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+inflight); status != http.StatusConflict {
		t.Fatalf("DELETE in flight = %d %s, want 409", status, body)
	}
	if rec, _ := mem.Load(ctx, inflight); rec == nil {
		t.Fatal("refused DELETE forgot the record")
	}
	if status, body = call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+inflight+"?force=true"); status != http.StatusOK {
		t.Fatalf("forced DELETE = %d %s", status, body)
	}
	if err := mem.Finalize(ctx, inflight, owner, stores.Response{Status: 200}); err != stores.ErrNotOwner {
		t.Errorf("Finalize by the forgotten owner = %v, want ErrNotOwner", err)
	}

	// An abandoned record needs no force: nobody is executing it.
	abandoned, owner := reserveKey(t, mem, time.Minute)
	if err := mem.Abandon(ctx, abandoned, owner); err != nil {
		t.Fatal(err)
	}
	if status, body = call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+abandoned); status != http.StatusOK {
		t.Fatalf("DELETE abandoned = %d %s", status, body)
	}
}

func TestAdminForgetWithoutForgetter(t *testing.T) {
	mem := newMemory(t)
	h := adminFixture(t, map[string]stores.Store{"memory": loadOnly{mem}})
	key := finalKey(t, mem, stores.Response{Status: 200})
	status, body := call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+key+"?force=true")
	if status != http.StatusBadGateway || !strings.Contains(string(body), "cannot forget") {
		t.Fatalf("DELETE = %d %s, want 502 naming the store's lack", status, body)
	}
	if rec, _ := mem.Load(context.Background(), key); rec == nil {
		t.Fatal("record gone")
	}
}

func TestAdminStats(t *testing.T) {
	mem, other := newMemory(t), newMemory(t)
	h := adminFixture(t, map[string]stores.Store{"memory": mem, "plain/x": loadOnly{other}})
	finalKey(t, mem, stores.Response{Status: 200})
	finalKey(t, mem, stores.Response{Status: 204})
	reserveKey(t, mem, time.Minute)
	reserveKey(t, mem, time.Minute)
	k, o := reserveKey(t, mem, time.Minute)
	if err := mem.Abandon(context.Background(), k, o); err != nil {
		t.Fatal(err)
	}
	status, body := call(t, h, http.MethodGet, "/iceberg_idempotency/stats")
	if status != http.StatusOK {
		t.Fatalf("stats = %d %s", status, body)
	}
	var out struct {
		Stores []struct {
			Store, Backend string
			Counts         json.RawMessage
		}
	}
	if err := json.Unmarshal(body, &out); err != nil || len(out.Stores) != 2 {
		t.Fatalf("stats = %s (%v)", body, err)
	}
	if s := out.Stores[0]; s.Store != "memory" || string(s.Counts) != `{"in_flight":2,"abandoned":1,"final":2}` {
		t.Errorf("memory stats = %s %s", s.Store, s.Counts)
	}
	if s := out.Stores[1]; s.Store != "plain/x" || s.Backend != "plain" || string(s.Counts) != `"unavailable"` {
		t.Errorf("plain stats = %s %s %s", s.Store, s.Backend, s.Counts)
	}
	if status, _ = call(t, h, http.MethodDelete, "/iceberg_idempotency/stats"); status != http.StatusMethodNotAllowed {
		t.Errorf("DELETE stats = %d, want 405", status)
	}
}

// wrapped is a store wrapper, like the metrics' instrumentedStore, that
// exposes the store under it.
type wrapped struct{ inner stores.Store }

func (w wrapped) Unwrap() stores.Store { return w.inner }

func (w wrapped) Reserve(ctx context.Context, r stores.Reservation) (stores.ReserveResult, error) {
	return w.inner.Reserve(ctx, r)
}
func (w wrapped) Load(ctx context.Context, key string) (*stores.Record, error) {
	return w.inner.Load(ctx, key)
}
func (w wrapped) Await(ctx context.Context, key string) (*stores.Record, error) {
	return w.inner.Await(ctx, key)
}
func (w wrapped) Finalize(ctx context.Context, key, owner string, resp stores.Response) error {
	return w.inner.Finalize(ctx, key, owner, resp)
}
func (w wrapped) Release(ctx context.Context, key, owner string) error {
	return w.inner.Release(ctx, key, owner)
}
func (w wrapped) ExtendLease(ctx context.Context, key, owner string, lease, ttl time.Duration) error {
	return w.inner.ExtendLease(ctx, key, owner, lease, ttl)
}
func (w wrapped) Abandon(ctx context.Context, key, owner string) error {
	return w.inner.Abandon(ctx, key, owner)
}
func (w wrapped) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	return w.inner.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
}
func (w wrapped) PurgeExpired(ctx context.Context, limit int) (int, error) {
	return w.inner.PurgeExpired(ctx, limit)
}
func (w wrapped) Close() error { return w.inner.Close() }

// The app tracks the handler's store as the handler holds it: wrapped for
// metrics around the pool entry. The admin API reaches the store beneath.
func TestAdminUnwrapsStores(t *testing.T) {
	mem := newMemory(t)
	app := &App{stores: map[string]stores.Store{"memory": wrapped{newPooledStore(mem)}}}
	running.Store(app)
	t.Cleanup(func() { running.CompareAndSwap(app, nil) })
	h := (&AdminAPI{logger: zaptest.NewLogger(t)}).Routes()[0].Handler

	key := finalKey(t, mem, stores.Response{Status: 200})
	if status, body := call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+key+"?force=true"); status != http.StatusOK {
		t.Fatalf("DELETE through a wrapper = %d %s", status, body)
	}
	if status, body := call(t, h, http.MethodGet, "/iceberg_idempotency/stats"); !strings.Contains(string(body), `"counts":{"in_flight":0,"abandoned":0,"final":0}`) {
		t.Fatalf("stats through a wrapper = %d %s", status, body)
	}
}

// takenOverAfterLookup is a memory store whose Inspect, the admin API's
// lookup, reports the key's record as it was, abandoned, and then lets
// another request take the key over, as a node under abandoned reexecute
// can between the lookup and the delete. A stand-in: the real window is a
// few microseconds wide.
type takenOverAfterLookup struct {
	*memory.Store
	newOwner string
}

func (s takenOverAfterLookup) Inspect(ctx context.Context, key string) (*stores.Record, time.Duration, error) {
	rec, left, err := s.Store.Inspect(ctx, key)
	if err == nil && rec != nil && rec.Abandoned {
		if ok, err := s.TakeOver(ctx, key, rec.Owner, s.newOwner, time.Minute, time.Minute); err != nil || !ok {
			return nil, 0, fmt.Errorf("stand-in takeover = %v, %v", ok, err)
		}
	}
	return rec, left, err
}

// An unforced DELETE of a record that was abandoned when looked up, and
// taken over before the delete, keeps the record: its commit is executing
// again. Before, the delete was unconditional, and a retry of the key
// executed the commit a third time.
func TestAdminForgetKeepsRecordTakenOverSinceLookup(t *testing.T) {
	mem := newMemory(t)
	s := takenOverAfterLookup{Store: mem, newOwner: uuid.NewString()}
	h := adminFixture(t, map[string]stores.Store{"memory": s})
	key, owner := reserveKey(t, mem, time.Minute)
	if err := mem.Abandon(context.Background(), key, owner); err != nil {
		t.Fatal(err)
	}
	status, body := call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+key)
	if status != http.StatusConflict || !strings.Contains(string(body), "look it up again") {
		t.Fatalf("DELETE of a record taken over since its lookup = %d %s, want 409 asking to look it up again", status, body)
	}
	if rec, _ := mem.Load(context.Background(), key); rec == nil || rec.Owner != s.newOwner || rec.Abandoned {
		t.Fatalf("record after the refused DELETE = %+v, want it in flight under the new owner", rec)
	}
}

// Query parameters are checked: a misspelt or unknown one, a force that is
// not one of true, false, 1 and 0, or one given twice is a 400 that names
// it, and nothing is forgotten; force=1 is as good as force=true.
func TestAdminQueryParameters(t *testing.T) {
	mem := newMemory(t)
	h := adminFixture(t, map[string]stores.Store{"memory": mem})
	inflight, _ := reserveKey(t, mem, time.Minute)
	path := "/iceberg_idempotency/keys/" + inflight
	for _, tt := range []struct{ method, query, want string }{
		{http.MethodDelete, "?forse=true", `unknown query parameter \"forse\"`},
		{http.MethodDelete, "?force=yes", `force must be true or false, got \"yes\"`},
		{http.MethodDelete, "?force=true&force=true", `query parameter \"force\" given 2 times`},
		{http.MethodGet, "?force=true", `unknown query parameter \"force\"`},
		{http.MethodDelete, "?force", `force must be true or false, got \"\"`},
		{http.MethodDelete, "?force=", `force must be true or false, got \"\"`},
		{http.MethodDelete, "?force=true;x", `invalid semicolon separator in query`},
		// strconv.ParseBool's other spellings, which the README does not
		// name, were taken until the build after 82a3712.
		{http.MethodDelete, "?force=T", `force must be true or false, got \"T\"`},
		{http.MethodDelete, "?force=True", `force must be true or false, got \"True\"`},
		{http.MethodDelete, "?force=TRUE", `force must be true or false, got \"TRUE\"`},
		{http.MethodDelete, "?force=f", `force must be true or false, got \"f\"`},
	} {
		status, body := call(t, h, tt.method, path+tt.query)
		if status != http.StatusBadRequest || !strings.Contains(string(body), tt.want) {
			t.Errorf("%s %s = %d %s, want 400 with %s", tt.method, tt.query, status, body, tt.want)
		}
	}
	if status, body := call(t, h, http.MethodGet, "/iceberg_idempotency/stats?x=1"); status != http.StatusBadRequest {
		t.Errorf("stats with an unknown parameter = %d %s, want 400", status, body)
	}
	if rec, _ := mem.Load(context.Background(), inflight); rec == nil {
		t.Fatal("a refused DELETE forgot the record")
	}
	if status, body := call(t, h, http.MethodDelete, path+"?force=1"); status != http.StatusOK {
		t.Fatalf("DELETE ?force=1 = %d %s, want 200", status, body)
	}
}

// Two handlers on one table whose pool options differ use two pools on the
// same records. The delete through the first pool takes the record; the
// second then finds none, which is no error. Before, it was reported as
// "not forgotten … add force=true", and the CLI's forget failed, for a key
// that was gone.
func TestForgetThroughTwoPoolsOnOneTable(t *testing.T) {
	s := newMemory(t) // one set of records, as one table is
	h := adminFixture(t, map[string]stores.Store{
		"postgres/iceberg_idempotency_records/aaaa": s,
		"postgres/iceberg_idempotency_records/bbbb": s,
	})
	key, owner := reserveKey(t, s, time.Minute)
	if err := s.Abandon(context.Background(), key, owner); err != nil {
		t.Fatal(err)
	}
	code, body := call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+key)
	if code != http.StatusOK || strings.Contains(string(body), `"errors"`) || !strings.Contains(string(body), `"forgotten":1`) {
		t.Fatalf("forget = %d %s; want 200, forgotten once, no errors", code, body)
	}
}

// reservedAgain deletes through Forget and, as a retry arriving right
// then would, reserves the key anew: a stand-in for the race between two
// pools' deletes, which no real store shows on cue.
type reservedAgain struct {
	*memory.Store
	t *testing.T
}

func (s reservedAgain) Forget(ctx context.Context, key string, force bool) (bool, error) {
	deleted, err := s.Store.Forget(ctx, key, force)
	if err == nil && deleted {
		res, err := s.Store.Reserve(ctx, stores.Reservation{Key: key, Owner: "the retry", Lease: time.Minute, TTL: time.Hour,
			Binding: stores.Binding{Operation: "updateTable", Path: "/v1/namespaces/ns/tables/t", Principal: "p", Fingerprint: "f"}})
		if err != nil || !res.Reserved {
			s.t.Errorf("the retry's reservation: %+v, %v", res, err)
		}
	}
	return deleted, err
}

// A forced forget through two pools on one table deletes the record it
// looked up once: a retry that reserved the key between the two deletes
// keeps its live record. Before, the second forced delete took it too,
// and a later retry could execute the commit while the first retry ran.
func TestForcedForgetKeepsARecordReservedSince(t *testing.T) {
	s := newMemory(t)
	key, _ := reserveKey(t, s, time.Minute)
	h := adminFixture(t, map[string]stores.Store{
		"postgres/iceberg_idempotency_records/aaaa": reservedAgain{Store: s, t: t},
		"postgres/iceberg_idempotency_records/bbbb": reservedAgain{Store: s, t: t},
	})
	time.Sleep(time.Millisecond) // the retry's record is created at another instant
	code, body := call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+key+"?force=true")
	if code != http.StatusOK || !strings.Contains(string(body), `"forgotten":1`) {
		t.Fatalf("forced forget = %d %s; want 200, forgotten once", code, body)
	}
	rec, err := s.Load(context.Background(), key)
	if err != nil || rec == nil || rec.State != stores.StateInFlight || rec.Owner != "the retry" {
		t.Fatalf("after the forget the key holds %+v (%v); want the retry's live reservation", rec, err)
	}
}

// reservedAgainReplyLost is reservedAgain whose delete's reply is lost: it
// deleted, but reports an error.
type reservedAgainReplyLost struct{ reservedAgain }

func (s reservedAgainReplyLost) Forget(ctx context.Context, key string, force bool) (bool, error) {
	if _, err := s.reservedAgain.Forget(ctx, key, force); err != nil {
		return false, err
	}
	return false, errors.New("the reply was lost")
}

// inspectFailsAfterLookup answers the admin API's first look at a key and
// fails every later one, as a pool whose connection broke meanwhile.
type inspectFailsAfterLookup struct {
	*memory.Store
	looks *atomic.Int32
}

func (s inspectFailsAfterLookup) Inspect(ctx context.Context, key string) (*stores.Record, time.Duration, error) {
	if s.looks.Add(1) > 1 {
		return nil, 0, errors.New("statement timeout")
	}
	return s.Store.Inspect(ctx, key)
}

// A forced forget through two pools on one table leaves the retry's
// reservation alone when it cannot tell it from the record it looked up:
// the earlier pool's delete reported an error although it deleted (its
// reply was lost), or looking the key up again through the later pool
// failed. Before, the later pool's forced delete took the retry's live
// record, and the second case answered 200 with no error.
func TestForcedForgetKeepsARecordItCannotTellFromTheOneLookedUp(t *testing.T) {
	for _, c := range []struct {
		name          string
		first, second func(*memory.Store) stores.Store
	}{
		{"earlier delete's reply lost",
			func(s *memory.Store) stores.Store { return reservedAgainReplyLost{reservedAgain{Store: s, t: t}} },
			func(s *memory.Store) stores.Store { return s }},
		{"second look failed",
			func(s *memory.Store) stores.Store { return reservedAgain{Store: s, t: t} },
			func(s *memory.Store) stores.Store { return inspectFailsAfterLookup{Store: s, looks: new(atomic.Int32)} }},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newMemory(t)
			key, _ := reserveKey(t, s, time.Minute)
			h := adminFixture(t, map[string]stores.Store{
				"postgres/iceberg_idempotency_records/aaaa": c.first(s),
				"postgres/iceberg_idempotency_records/bbbb": c.second(s),
			})
			time.Sleep(time.Millisecond) // the retry's record is created at another instant
			code, body := call(t, h, http.MethodDelete, "/iceberg_idempotency/keys/"+key+"?force=true")
			if !strings.Contains(string(body), `"errors"`) {
				t.Fatalf("forced forget = %d %s; want an error saying what was not forgotten", code, body)
			}
			rec, err := s.Load(context.Background(), key)
			if err != nil || rec == nil || rec.State != stores.StateInFlight || rec.Owner != "the retry" {
				t.Fatalf("after the forget (%d %s) the key holds %+v (%v); want the retry's live reservation", code, body, rec, err)
			}
		})
	}
}

// meetingStore is a memory store whose Inspect and Count return only once
// every store of its meeting has been asked (or the admin call's deadline
// passes): a stand-in for stores that are slow to answer, which the admin
// API must ask at once rather than one after the other.
type meetingStore struct {
	*memory.Store
	m *meeting
}

type meeting struct {
	all   chan struct{}
	size  int32
	count atomic.Int32
}

func newMeeting(size int32) *meeting {
	return &meeting{all: make(chan struct{}), size: size}
}

// attend waits until size calls have arrived.
func (m *meeting) attend(ctx context.Context) error {
	if m.count.Add(1) == m.size {
		close(m.all)
	}
	select {
	case <-m.all:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("asked alone: %w", ctx.Err())
	}
}

func (s meetingStore) Inspect(ctx context.Context, key string) (*stores.Record, time.Duration, error) {
	if err := s.m.attend(ctx); err != nil {
		return nil, 0, err
	}
	return s.Store.Inspect(ctx, key)
}

func (s meetingStore) Count(ctx context.Context) (stores.Counts, error) {
	if err := s.m.attend(ctx); err != nil {
		return stores.Counts{}, err
	}
	return s.Store.Count(ctx)
}

// The admin API asks its stores at once, and answers in their order: one
// after the other, each store that did not answer added its wait to the
// next's (three unreachable stores made a forced forget take 13 s, until
// the build after b35c62e).
func TestAdminAsksStoresAtOnce(t *testing.T) {
	held := map[string]stores.Store{}
	var mems []*memory.Store
	lookups := newMeeting(3)
	for _, name := range []string{"memory/a", "memory/b", "memory/c"} {
		mem := newMemory(t)
		mems = append(mems, mem)
		held[name] = meetingStore{Store: mem, m: lookups}
	}
	key := finalKey(t, mems[1], stores.Response{Status: 200})
	h := adminFixture(t, held)
	status, body := call(t, h, http.MethodGet, "/iceberg_idempotency/keys/"+key)
	if status != http.StatusOK {
		t.Fatalf("GET = %d %s, want 200", status, body)
	}
	if ans := decode(t, body); len(ans.Records) != 1 || ans.Records[0]["store"] != "memory/b" || len(ans.Errors) != 0 {
		t.Fatalf("GET = %s, want the record of memory/b alone", body)
	}

	counts := newMeeting(3)
	for name, s := range held {
		held[name] = meetingStore{Store: s.(meetingStore).Store, m: counts}
	}
	h = adminFixture(t, held)
	status, body = call(t, h, http.MethodGet, "/iceberg_idempotency/stats")
	var out struct {
		Stores []struct {
			Store, Error string
			Counts       json.RawMessage
		}
	}
	if err := json.Unmarshal(body, &out); status != http.StatusOK || err != nil || len(out.Stores) != 3 {
		t.Fatalf("stats = %d %s (%v)", status, body, err)
	}
	for i, want := range []string{"memory/a", "memory/b", "memory/c"} {
		if s := out.Stores[i]; s.Store != want || s.Error != "" || string(s.Counts) == `"unavailable"` {
			t.Errorf("stats line %d = %s %s %s, want %s counted", i, s.Store, s.Counts, s.Error, want)
		}
	}
}
