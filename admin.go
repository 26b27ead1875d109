package icebergidempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// adminBase is the admin API prefix of this module's endpoints.
const adminBase = "/iceberg_idempotency/"

// adminTimeout bounds one admin request's store calls, so an unreachable
// database answers with an error instead of hanging the operator.
const adminTimeout = 30 * time.Second

// AdminAPI is the admin endpoint module admin.api.iceberg_idempotency. It
// lets an operator look at, forget, and count the idempotency records of
// the stores the running config uses:
//
//	GET    /iceberg_idempotency/keys/<uuid>
//	DELETE /iceberg_idempotency/keys/<uuid>[?force=true]
//	GET    /iceberg_idempotency/stats
//
// It lives on Caddy's admin endpoint, so it has that endpoint's protection
// (its listener, origin checks, remote admin's access control) and no
// other. It never shows a response's body or header values, nor the
// principal or fingerprint a key is bound to: the admin endpoint is for
// operators, not for reading tenants' data.
type AdminAPI struct {
	logger *zap.Logger
}

var (
	_ caddy.AdminRouter = (*AdminAPI)(nil)
	_ caddy.Provisioner = (*AdminAPI)(nil)
)

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.iceberg_idempotency",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

// Provision sets up the logger. Caddy provisions admin routers with a
// context of no module, whose Logger is the unnamed default: the forget
// audit lines could not be told apart or routed like the module's other
// logs, so the logger is named after the module's ID.
func (a *AdminAPI) Provision(caddy.Context) error {
	a.logger = caddy.Log().Named(string(a.CaddyModule().ID))
	return nil
}

// Routes implements caddy.AdminRouter.
func (a *AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: adminBase, Handler: caddy.AdminHandlerFunc(a.serve)}}
}

func (a *AdminAPI) serve(w http.ResponseWriter, r *http.Request) error {
	rest := strings.TrimPrefix(r.URL.Path, adminBase)
	switch {
	case rest == "stats":
		if r.Method != http.MethodGet {
			return methodNotAllowed(r)
		}
		if err := onlyParams(r); err != nil {
			return err
		}
		return a.stats(w, r)
	case strings.HasPrefix(rest, "keys/"):
		key, err := adminKey(strings.TrimPrefix(rest, "keys/"))
		if err != nil {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("idempotency key %w", err)}
		}
		switch r.Method {
		case http.MethodGet:
			if err := onlyParams(r); err != nil {
				return err
			}
			return a.getKey(w, r, key)
		case http.MethodDelete:
			if err := onlyParams(r, "force"); err != nil {
				return err
			}
			return a.forgetKey(w, r, key)
		}
		return methodNotAllowed(r)
	}
	return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("resource not found: %s", r.URL.Path)}
}

// onlyParams refuses a query parameter other than allowed, or given twice:
// a misspelt force (forse=true) would otherwise be a silent "not forced".
func onlyParams(r *http.Request, allowed ...string) error {
	query, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("query: %w", err)}
	}
	for name, vals := range query {
		if !slices.Contains(allowed, name) {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("unknown query parameter %q", name)}
		}
		if len(vals) > 1 {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("query parameter %q given %d times", name, len(vals))}
		}
	}
	return nil
}

func methodNotAllowed(r *http.Request) error {
	return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method not allowed: %s", r.Method)}
}

// adminKey checks that s is a UUID in its 36-character hyphenated form and
// returns it in lower case, the form the handler stores keys in. Unlike
// the handler it accepts any UUID version: an operator may look up a key
// stored under an earlier key_versions setting.
func adminKey(s string) (string, error) {
	if len(s) != 36 {
		return "", fmt.Errorf("must be a UUID of 36 characters, got %d", len(s))
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if i == 8 || i == 13 || i == 18 || i == 23 {
			if c != '-' {
				return "", errors.New("must be hyphenated as 8-4-4-4-12 hex digits")
			}
			continue
		}
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return "", errors.New("must contain only hex digits and hyphens")
		}
	}
	return strings.ToLower(s), nil
}

// storeInUse is one store of the running config.
type storeInUse struct {
	key     string // its StoreKey: no secrets (see StoreProvider)
	backend string
	store   stores.Store // unwrapped, for the optional interfaces
	leave   func()
}

// inUse lists the running config's stores in a stable order, each marked
// as in use (see pooledStore.enter) until release is called. None when no
// config with an iceberg_idempotency handler runs.
func inUse() (list []storeInUse, release func()) {
	app := running.Load()
	if app == nil {
		return nil, func() {}
	}
	app.mu.Lock()
	for key, s := range app.stores {
		u := storeInUse{key: key, backend: backendName(key), leave: func() {}}
		for {
			if p, ok := s.(*pooledStore); ok {
				u.leave = p.enter()
				s = p.Store
				continue
			}
			// A wrapper (for metrics, say) exposes the store under it.
			if w, ok := s.(interface{ Unwrap() stores.Store }); ok {
				s = w.Unwrap()
				continue
			}
			break
		}
		u.store = s
		list = append(list, u)
	}
	app.mu.Unlock()
	sort.Slice(list, func(i, j int) bool { return list[i].key < list[j].key })
	return list, func() {
		for _, u := range list {
			u.leave()
		}
	}
}

// backendName is the StoreKey's first segment: "memory", "postgres",
// "mysql", ...
func backendName(storeKey string) string {
	name, _, _ := strings.Cut(storeKey, "/")
	return name
}

// keyRecord is what the admin API tells about one record. It leaves out,
// on purpose, the body, header values, principal, fingerprint and owner.
type keyRecord struct {
	Store     string    `json:"store"`
	Backend   string    `json:"backend"`
	State     string    `json:"state"`
	Operation string    `json:"operation"`
	Path      string    `json:"path"`
	Status    int       `json:"status,omitempty"`
	Sealed    bool      `json:"sealed,omitempty"`
	KeyID     string    `json:"key_id,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	ExpiresAt time.Time `json:"expires_at"`
	// LeaseLeft is set for a healthy in-flight record, by stores that tell
	// it (stores.Inspector).
	LeaseLeft string `json:"lease_left,omitempty"`
}

// storeError is a store that could not answer; its error names the
// operation and never holds a password (the stores redact their errors).
type storeError struct {
	Store   string `json:"store"`
	Backend string `json:"backend"`
	Error   string `json:"error"`
}

// keyAnswer is the body of GET and DELETE on a key.
type keyAnswer struct {
	Key     string       `json:"key"`
	Records []keyRecord  `json:"records"`
	Errors  []storeError `json:"errors,omitempty"`
	// Forgotten is set by DELETE: how many stores deleted the record.
	Forgotten *int `json:"forgotten,omitempty"`
}

// inspect reads key's record from one store without touching it (memory's
// recency order), with the lease left when the store tells it.
func inspect(ctx context.Context, u storeInUse, key string) (*keyRecord, error) {
	var (
		rec  *stores.Record
		left time.Duration
		err  error
	)
	if in, ok := u.store.(stores.Inspector); ok {
		rec, left, err = in.Inspect(ctx, key)
	} else {
		rec, err = u.store.Load(ctx, key)
	}
	if err != nil || rec == nil {
		return nil, err
	}
	out := &keyRecord{
		Store:     u.key,
		Backend:   u.backend,
		State:     string(rec.State),
		Operation: rec.Operation,
		Path:      rec.Path,
		CreatedAt: rec.CreatedAt,
		ExpiresAt: rec.ExpiresAt,
	}
	if rec.State == stores.StateInFlight && rec.Abandoned {
		out.State = "abandoned"
	}
	if out.State == string(stores.StateInFlight) && left > 0 {
		out.LeaseLeft = left.Round(time.Millisecond).String()
	}
	if resp := rec.Response; resp != nil {
		if resp.KeyID != "" {
			// The status is inside the ciphertext; opening it would need
			// the handler's secret, which this module does not hold.
			out.Sealed, out.KeyID = true, resp.KeyID
		} else {
			out.Status = resp.Status
		}
	}
	return out, nil
}

// lookup reads key from every store in use, all at once: one after the
// other, each store that did not answer added its own wait (three
// unreachable ones made a forced forget take 13 s). The answer lists them in
// list's order all the same.
func lookup(ctx context.Context, list []storeInUse, key string) keyAnswer {
	type result struct {
		rec *keyRecord
		err error
	}
	results := make([]result, len(list))
	var wg sync.WaitGroup
	for i, u := range list {
		wg.Go(func() {
			rec, err := inspect(ctx, u, key)
			results[i] = result{rec, err}
		})
	}
	wg.Wait()
	ans := keyAnswer{Key: key, Records: []keyRecord{}}
	for i, res := range results {
		u := list[i]
		if res.err != nil {
			ans.Errors = append(ans.Errors, storeError{Store: u.key, Backend: u.backend, Error: res.err.Error()})
			continue
		}
		if res.rec != nil {
			ans.Records = append(ans.Records, *res.rec)
		}
	}
	return ans
}

// notFound answers for a key no store holds: 404, or 503 when some store
// could not be asked, since the key may be there.
func notFound(ans keyAnswer) error {
	if len(ans.Errors) > 0 {
		msgs := make([]string, len(ans.Errors))
		for i, e := range ans.Errors {
			msgs[i] = e.Store + ": " + e.Error
		}
		return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable,
			Err: fmt.Errorf("idempotency key %s: not found in the stores that answered; failing: %s", ans.Key, strings.Join(msgs, "; "))}
	}
	return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("idempotency key %s: no record in any store in use", ans.Key)}
}

// noStoreInUse answers a key's lookup on a node whose running config has
// no iceberg_idempotency handler. "No record" would read as the key being
// gone, to an operator who asked the wrong node or admin address.
func noStoreInUse(key string) error {
	return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("idempotency key %s: %s", key, noStoreInUseText)}
}

// noStoreInUseText says that a node runs no handler, for the admin API's
// answers and the command's errors alike.
const noStoreInUseText = "no store in use: the running config has no iceberg_idempotency handler; ask the admin endpoint of a node that runs one"

func (a *AdminAPI) getKey(w http.ResponseWriter, r *http.Request, key string) error {
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	list, release := inUse()
	defer release()
	if len(list) == 0 {
		return noStoreInUse(key)
	}
	ans := lookup(ctx, list, key)
	if len(ans.Records) == 0 {
		return notFound(ans)
	}
	return writeJSON(w, ans)
}

// forgetKey deletes key's record from every store in use that holds it.
// Only an abandoned record goes unless forced: a healthy in-flight one's
// request is still executing, and a final one holds the answer its
// retries replay (maybe stored after the operator saw it abandoned);
// forgetting either lets a retry execute the commit a second time. The
// lookup gives the operator a clear 409; the stores judge the state and
// the lease again in the delete itself, so that a record abandoned when
// looked at and taken over (abandoned reexecute) or finalized since is
// kept all the same.
func (a *AdminAPI) forgetKey(w http.ResponseWriter, r *http.Request, key string) error {
	force := false
	if vals, given := r.URL.Query()["force"]; given {
		// The spellings the README names: strconv.ParseBool also took
		// t, T, TRUE, True (and their false ones) until the build after
		// 82a3712.
		switch vals[0] {
		case "true", "1":
			force = true
		case "false", "0":
		default:
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("force must be true or false, got %q", vals[0])}
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	list, release := inUse()
	defer release()
	if len(list) == 0 {
		return noStoreInUse(key)
	}
	ans := lookup(ctx, list, key)
	if len(ans.Records) == 0 {
		return notFound(ans)
	}
	if !force {
		for _, rec := range ans.Records {
			switch rec.State {
			case string(stores.StateInFlight):
				return caddy.APIError{HTTPStatus: http.StatusConflict,
					Err: fmt.Errorf("idempotency key %s is in flight in store %s with a live lease: its request is executing; add force=true (the CLI's --force) to forget it anyway", key, rec.Store)}
			case string(stores.StateFinal):
				return caddy.APIError{HTTPStatus: http.StatusConflict,
					Err: fmt.Errorf("idempotency key %s is final in store %s: its answer is stored and replayed to retries, and forgetting it lets a retry execute the request again; add force=true (the CLI's --force) to forget it anyway", key, rec.Store)}
			}
		}
	}
	held := make(map[string]keyRecord, len(ans.Records))
	for _, rec := range ans.Records {
		held[rec.Store] = rec
	}
	forgotten, kept, tried := 0, 0, false
	for _, u := range list {
		seen, ok := held[u.key]
		if !ok {
			continue
		}
		f, ok := u.store.(stores.Forgetter)
		if !ok {
			ans.Errors = append(ans.Errors, storeError{Store: u.key, Backend: u.backend, Error: "this store cannot forget records"})
			continue
		}
		if tried {
			// Two pools on one table (handlers whose pool options
			// differ) hold the same records: the delete through an
			// earlier one may have taken this record too (also when its
			// reply was lost, and it reported an error), and a retry may
			// have reserved the key since. Gone is gone; a record made
			// since the lookup is not the operator's to forget (forced,
			// its delete would take a live record, and a later retry
			// would execute the commit while that one runs), and
			// neither is a record that cannot be looked at again.
			now, err := inspect(ctx, u, key)
			if err != nil {
				ans.Errors = append(ans.Errors, storeError{Store: u.key, Backend: u.backend,
					Error: "not forgotten: looking the key up again after the delete in an earlier store failed (" + err.Error() + "); look it up again"})
				continue
			}
			if now == nil || !now.CreatedAt.Equal(seen.CreatedAt) {
				if now != nil {
					kept++
					ans.Errors = append(ans.Errors, storeError{Store: u.key, Backend: u.backend,
						Error: "not forgotten: the key was reserved again since it was looked up; look it up again"})
				}
				continue
			}
		}
		tried = true
		deleted, err := f.Forget(ctx, key, force)
		if err != nil {
			ans.Errors = append(ans.Errors, storeError{Store: u.key, Backend: u.backend, Error: err.Error()})
			continue
		}
		if !deleted && !force {
			kept++
			ans.Errors = append(ans.Errors, storeError{Store: u.key, Backend: u.backend,
				Error: "not forgotten: since it was looked up, the record was taken over or reserved again (in flight with a live lease now), its owner stored its answer (final now), or it went; look it up again"})
			continue
		}
		if deleted {
			forgotten++
			a.logger.Warn("idempotency record forgotten by the admin API",
				zap.String("key", key), zap.String("store", u.key), zap.Bool("force", force))
		}
	}
	ans.Forgotten = &forgotten
	if len(ans.Errors) > 0 && forgotten == 0 {
		status := http.StatusBadGateway
		if kept == len(ans.Errors) {
			status = http.StatusConflict
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		return json.NewEncoder(w).Encode(ans)
	}
	return writeJSON(w, ans)
}

// storeStats is one store's line in /stats. Counts is a stores.Counts, or
// the string "unavailable" for a store that cannot count.
type storeStats struct {
	Store   string `json:"store"`
	Backend string `json:"backend"`
	Counts  any    `json:"counts"`
	Error   string `json:"error,omitempty"`
}

// stats counts each store's live records by state. On the SQL stores it
// scans the whole table: an operator's occasional look, not a dashboard's
// poll (the metrics serve those).
func (a *AdminAPI) stats(w http.ResponseWriter, r *http.Request) error {
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	list, release := inUse()
	defer release()
	out := struct {
		Stores []storeStats `json:"stores"`
	}{Stores: make([]storeStats, len(list))}
	// All at once, as lookup does: a store that does not answer holds up
	// only its own line.
	var wg sync.WaitGroup
	for i, u := range list {
		wg.Go(func() {
			st := storeStats{Store: u.key, Backend: u.backend, Counts: "unavailable"}
			if c, ok := u.store.(stores.Counter); ok {
				counts, err := c.Count(ctx)
				if err != nil {
					st.Error = err.Error()
				} else {
					st.Counts = counts
				}
			}
			out.Stores[i] = st
		})
	}
	wg.Wait()
	return writeJSON(w, out)
}

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(v); err != nil {
		return caddy.APIError{HTTPStatus: http.StatusInternalServerError, Err: fmt.Errorf("encoding response: %w", err)}
	}
	return nil
}
