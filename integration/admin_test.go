package integration_test

// The admin API (admin.api.iceberg_idempotency) and the `caddy
// iceberg-idempotency` command, through a real Caddy process's admin
// endpoint, for each store.

import (
	"encoding/json"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
)

func TestAdminAPI(t *testing.T) {
	t.Parallel()
	t.Run("memory", func(t *testing.T) {
		t.Parallel()
		testAdminAPI(t, "memory", "")
	})
	for _, db := range multiNodeDBs {
		t.Run(db.Name, func(t *testing.T) {
			t.Parallel()
			dsn := db.dsn(t)
			testAdminAPI(t, db.Name, db.storeBlock(dsn, db.newTable(t, dsn)))
		})
	}
}

// adminRecord is what the admin API tells about a key in one store.
type adminRecord struct {
	Store     string `json:"store"`
	Backend   string `json:"backend"`
	State     string `json:"state"`
	Operation string `json:"operation"`
	Path      string `json:"path"`
	Status    int    `json:"status"`
	LeaseLeft string `json:"lease_left"`
	CreatedAt string `json:"created_at"`
	ExpiresAt string `json:"expires_at"`
}

// adminCall sends one request to the node's admin API.
func adminCall(t *testing.T, node *caddyproc.Instance, method, uri string) (int, []byte) {
	t.Helper()
	r := send(t, method, node.AdminURL()+uri, "")
	return r.Status, r.Body
}

// adminKey reads a key's records through the admin API.
func adminKey(t *testing.T, node *caddyproc.Instance, key string) []adminRecord {
	t.Helper()
	status, body := adminCall(t, node, http.MethodGet, "/iceberg_idempotency/keys/"+key)
	if status != http.StatusOK {
		t.Fatalf("GET key %s: %d %s", key, status, body)
	}
	var ans struct {
		Key     string        `json:"key"`
		Records []adminRecord `json:"records"`
	}
	if err := json.Unmarshal(body, &ans); err != nil || ans.Key != strings.ToLower(key) || len(ans.Records) != 1 {
		t.Fatalf("GET key %s: %s (%v)", key, body, err)
	}
	return ans.Records
}

// cli runs `caddy iceberg-idempotency args...` against the node.
func cli(t *testing.T, node *caddyproc.Instance, args ...string) (string, error) {
	t.Helper()
	args = append([]string{"iceberg-idempotency"}, args...)
	args = append(args, "--address", "127.0.0.1:"+strconv.Itoa(node.AdminPort))
	out, err := exec.Command(caddyproc.Binary(t), args...).CombinedOutput()
	return string(out), err
}

func testAdminAPI(t *testing.T, backend, store string) {
	b := caddyproc.NewBackend(t)
	node := caddyproc.Start(t, multiNodeSite(b, store))

	// A final record: its state, binding and status; never its body.
	finalPath := multiNodePath("admin_final")
	finalKey := newKey(t)
	first := commit(t, node, finalPath, finalKey)
	wantStatus(t, "first commit", first, http.StatusOK)
	rec := adminKey(t, node, strings.ToUpper(finalKey))[0]
	if rec.State != "final" || rec.Status != http.StatusOK || rec.Operation != "updateTable" ||
		rec.Path != finalPath || rec.Backend != backend || !strings.HasPrefix(rec.Store, backend) ||
		rec.LeaseLeft != "" || rec.CreatedAt == "" || rec.ExpiresAt == "" {
		t.Errorf("final record = %+v", rec)
	}
	_, raw := adminCall(t, node, http.MethodGet, "/iceberg_idempotency/keys/"+finalKey)
	if strings.Contains(string(raw), string(first.Body)) || strings.Contains(string(raw), "principal") {
		t.Errorf("the admin API shows the body or the principal: %s", raw)
	}
	// A record shows these fields and no other: the check above finds the
	// body only as raw JSON, not base64 or quoted in a string (until the
	// build after 63b0b76 that was all).
	var shown struct {
		Records []map[string]json.RawMessage `json:"records"`
	}
	if err := json.Unmarshal(raw, &shown); err != nil || len(shown.Records) != 1 {
		t.Fatalf("GET key: %s (%v)", raw, err)
	}
	for field := range shown.Records[0] {
		switch field {
		case "store", "backend", "state", "operation", "path", "status", "sealed", "key_id", "created_at", "expires_at", "lease_left":
		default:
			t.Errorf("the admin API shows a record's %q, which is not one of the fields it may show: %s", field, raw)
		}
	}

	// The command prints the same.
	out, err := cli(t, node, "key", finalKey)
	if err != nil || !strings.Contains(out, `"state": "final"`) {
		t.Errorf("caddy iceberg-idempotency key: %v\n%s", err, out)
	}

	// An in-flight record, held by a stalled catalog: its lease is
	// renewed, so forgetting it needs force.
	flightPath := multiNodePath("admin_inflight")
	flightKey := newKey(t)
	gate := b.Stall(flightPath)
	defer gate.Release()
	owner := sendInBackground(node.URL()+flightPath, multiNodeBody, flightKey)
	gate.WaitArrived(t, 1, 30*time.Second)
	rec = adminKey(t, node, flightKey)[0]
	if left, err := time.ParseDuration(rec.LeaseLeft); rec.State != "in_flight" || err != nil || left <= 0 {
		t.Errorf("in-flight record = %+v", rec)
	}
	if status, body := adminCall(t, node, http.MethodDelete, "/iceberg_idempotency/keys/"+flightKey); status != http.StatusConflict {
		t.Fatalf("DELETE of a healthy in-flight record = %d %s, want 409", status, body)
	}
	if out, err := cli(t, node, "forget", flightKey); err == nil || !strings.Contains(out, "409") {
		t.Fatalf("caddy iceberg-idempotency forget (in flight) = %v, want a failure naming 409\n%s", err, out)
	}
	out, err = cli(t, node, "forget", "--force", flightKey)
	if err != nil || !strings.Contains(out, "forgot key "+flightKey+" in 1 store(s)") {
		t.Fatalf("caddy iceberg-idempotency forget --force: %v\n%s", err, out)
	}
	// Logged with its key, under the module's logger name so that it can
	// be routed and filtered like the module's other logs.
	waitLogs(t, node, `"logger":"admin.api.iceberg_idempotency","msg":"idempotency record forgotten by the admin API","key":"`+flightKey+`"`)
	if status, _ := adminCall(t, node, http.MethodGet, "/iceberg_idempotency/keys/"+flightKey); status != http.StatusNotFound {
		t.Errorf("GET of the forgotten key = %d, want 404", status)
	}
	gate.Release()
	select {
	case <-owner:
	case <-time.After(30 * time.Second):
		t.Fatal("the stalled request never ended")
	}
	// Forgotten, the key executes again.
	again := commit(t, node, flightPath, flightKey)
	wantStatus(t, "commit after forget --force", again, http.StatusOK)
	wantExecuted(t, "commit after forget --force", again)
	wantCount(t, b, flightPath, 2)

	// A final record needs force too (its answer is what retries replay);
	// then its key executes again.
	if status, body := adminCall(t, node, http.MethodDelete, "/iceberg_idempotency/keys/"+finalKey); status != http.StatusConflict {
		t.Fatalf("unforced DELETE of a final record = %d %s, want 409", status, body)
	}
	if status, body := adminCall(t, node, http.MethodDelete, "/iceberg_idempotency/keys/"+finalKey+"?force=true"); status != http.StatusOK {
		t.Fatalf("DELETE of a final record = %d %s", status, body)
	}
	again = commit(t, node, finalPath, finalKey)
	wantExecuted(t, "commit after forget", again)
	wantCount(t, b, finalPath, 2)

	// Stats: the two keys, each final once more.
	status, body := adminCall(t, node, http.MethodGet, "/iceberg_idempotency/stats")
	var stats struct {
		Stores []struct {
			Store   string         `json:"store"`
			Backend string         `json:"backend"`
			Counts  map[string]int `json:"counts"`
		} `json:"stores"`
	}
	if err := json.Unmarshal(body, &stats); status != http.StatusOK || err != nil || len(stats.Stores) != 1 {
		t.Fatalf("stats = %d %s (%v)", status, body, err)
	}
	if s := stats.Stores[0]; s.Backend != backend || s.Counts["final"] != 2 || s.Counts["in_flight"] != 0 || s.Counts["abandoned"] != 0 {
		t.Errorf("stats = %s", body)
	}
	if out, err := cli(t, node, "stats"); err != nil || !strings.Contains(out, `"final": 2`) {
		t.Errorf("caddy iceberg-idempotency stats: %v\n%s", err, out)
	}

	// Unknown and malformed keys.
	unknown := newKey(t)
	if status, body := adminCall(t, node, http.MethodGet, "/iceberg_idempotency/keys/"+unknown); status != http.StatusNotFound || !strings.Contains(string(body), `"error"`) {
		t.Errorf("GET of an unknown key = %d %s, want 404 with an error", status, body)
	}
	if status, _ := adminCall(t, node, http.MethodGet, "/iceberg_idempotency/keys/not-a-uuid"); status != http.StatusBadRequest {
		t.Errorf("GET of a malformed key = %d, want 400", status)
	}
	if out, err := cli(t, node, "key", unknown); err == nil {
		t.Errorf("caddy iceberg-idempotency key of an unknown key succeeded:\n%s", out)
	}
}
