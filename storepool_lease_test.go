package icebergidempotency

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// A lease that one renewal taking its whole call timeout could let lapse
// is refused at provisioning, naming the option to change; the defaults
// (30s lease, 5s statement and Redis timeouts) pass. Nothing is dialled:
// the stores open lazily, so no server is needed.
func TestLeaseShorterThanThreeCallsIsRefused(t *testing.T) {
	for _, tt := range []struct {
		name, store string
		lease       time.Duration
		want        string // "" when accepted
	}{
		{"postgres default", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none"}`, 0, ""},
		{"postgres short lease", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none"}`, 10 * time.Second,
			"lease 10s is shorter than 3 times the store's call timeout (statement_timeout 5s): a renewal that takes the whole timeout would let the lease lapse; raise lease to at least 15s or lower statement_timeout"},
		{"postgres timeout lowered", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none", "statement_timeout": "1s"}`, 3 * time.Second, ""},
		{"mysql long timeout", `{"backend": "mysql", "dsn": "root@tcp(127.0.0.1:1)/none", "statement_timeout": "20s"}`, 0,
			"lease 30s is shorter than 3 times the store's call timeout (statement_timeout 20s)"},
		{"redis default", `{"backend": "redis", "addresses": ["127.0.0.1:1"]}`, 0, ""},
		{"redis short lease", `{"backend": "redis", "addresses": ["127.0.0.1:1"], "read_timeout": "8s"}`, 20 * time.Second,
			"(read_timeout 8s): a renewal that takes the whole timeout would let the lease lapse; raise lease to at least 24s or lower read_timeout"},
		{"redis all timeouts", `{"backend": "redis", "addresses": ["127.0.0.1:1"], "dial_timeout": "2s", "read_timeout": "2s", "write_timeout": "2s"}`, 5 * time.Second,
			"(timeout 2s)"},
		{"memory any lease", `{"backend": "memory"}`, 3 * time.Millisecond, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := &Handler{StoreRaw: json.RawMessage(tt.store), Lease: caddy.Duration(tt.lease)}
			err := h.Provision(runningCaddyContext(t))
			defer func() { _ = h.Cleanup() }()
			if tt.want == "" && err != nil {
				t.Fatalf("Provision = %v, want accepted", err)
			}
			if tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
				t.Fatalf("Provision = %v, want an error containing %q", err, tt.want)
			}
		})
	}
}
