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
func TestLeaseShorterThanFourCallsIsRefused(t *testing.T) {
	for _, tt := range []struct {
		name, store string
		lease       time.Duration
		want        string // "" when accepted
	}{
		{"postgres default", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none"}`, 0, ""},
		{"postgres short lease", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none"}`, 10 * time.Second,
			"lease 10s is shorter than 4 times the store's call timeout 5s: a renewal that takes the whole timeout would let the lease lapse; raise lease to at least 20s, or lower statement_timeout (5s) to at most 2.5s"},
		// Three timeouts, accepted before: a renewal that succeeded a
		// timeout late, then a failed one and its retry, outlasted it.
		{"postgres three timeouts", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none", "statement_timeout": "1s"}`, 3 * time.Second,
			"lease 3s is shorter than 4 times the store's call timeout 1s"},
		{"postgres timeout lowered", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none", "statement_timeout": "1s"}`, 4 * time.Second, ""},
		{"mysql long timeout", `{"backend": "mysql", "dsn": "root@tcp(127.0.0.1:1)/none", "statement_timeout": "20s"}`, 0,
			"lease 30s is shorter than 4 times the store's call timeout 20s"},
		{"redis default", `{"backend": "redis", "addresses": ["127.0.0.1:1"]}`, 0, ""},
		{"redis one timeout", `{"backend": "redis", "addresses": ["127.0.0.1:1"], "read_timeout": "8s"}`, 20 * time.Second,
			"raise lease to at least 32s, or lower read_timeout (8s) to at most 5s"},
		// Only read_timeout set, but the defaults of the other two are too
		// long as well: lowering read_timeout alone would not do.
		{"redis defaults too", `{"backend": "redis", "addresses": ["127.0.0.1:1"], "read_timeout": "4s"}`, 10 * time.Second,
			"or lower dial_timeout (5s), read_timeout (4s) and write_timeout (5s) to at most 2.5s"},
		// JSON has no timeout option: the error names the three it has,
		// also when they are equal (the defaults here).
		{"redis json equal timeouts", `{"backend": "redis", "addresses": ["127.0.0.1:1"]}`, 10 * time.Second,
			"or lower dial_timeout (5s), read_timeout (5s) and write_timeout (5s) to at most 2.5s"},
		{"memory any lease", `{"backend": "memory"}`, 3 * time.Millisecond, ""},
		// Three times a timeout over 97 years wrapped negative, and the
		// check passed; raising the lease past ten years is no advice.
		{"postgres timeout past int64 thrice", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none", "statement_timeout": "1000000h"}`, 0,
			"lease 30s is shorter than 4 times the store's call timeout 1000000h0m0s: a renewal that takes the whole timeout would let the lease lapse; lower statement_timeout (1000000h0m0s) to at most 7.5s"},
		{"redis timeout past int64 thrice", `{"backend": "redis", "addresses": ["127.0.0.1:1"], "read_timeout": "1000000h"}`, 0,
			"lower read_timeout (1000000h0m0s) to at most 7.5s"},
		// JSON refuses what the Caddyfile does, for MySQL too.
		{"mysql statement_timeout below 1ms", `{"backend": "mysql", "dsn": "root@tcp(127.0.0.1:1)/none", "statement_timeout": "500us"}`, 0,
			"statement_timeout must be at least 1ms, got 500µs"},
		// A lease below the least allowed gets Validate's error, not advice
		// to lower the statement timeout to 0s.
		{"negative lease", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none"}`, -time.Second,
			"lease must be at least 3ms, got -1s"},
		{"lease below the least", `{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none"}`, time.Millisecond,
			"lease must be at least 3ms, got 1ms"},
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

// The Caddyfile checks the lease against the store's timeouts too, on the
// lease's line or, with the default lease, the store's.
func TestLeaseCheckedInTheCaddyfile(t *testing.T) {
	for _, tt := range []struct{ name, block, want, at string }{
		{"lease line", "iceberg_idempotency {\n\t\tlease 10s\n\t\tstore postgres {\n\t\t\tdsn x\n\t\t}\n\t}",
			"lease 10s is shorter than 4 times the store's call timeout 5s", "at Caddyfile:3"},
		{"store line", "iceberg_idempotency {\n\t\tstore mysql {\n\t\t\tdsn x\n\t\t\tstatement_timeout 15s\n\t\t}\n\t}",
			"lease 30s is shorter than 4 times the store's call timeout 15s: a renewal that takes the whole timeout would let the lease lapse; raise lease to at least 1m0s, or lower statement_timeout (15s) to at most 7.5s (30s is the default lease)", "at Caddyfile:3"},
		{"redis", "iceberg_idempotency {\n\t\tstore redis {\n\t\t\taddress a:1\n\t\t\ttimeout 20s\n\t\t}\n\t\tlease 40s\n\t}",
			"or lower timeout (20s) to at most 10s", "at Caddyfile:7"},
		{"redis default timeout", "iceberg_idempotency {\n\t\tstore redis {\n\t\t\taddress a:1\n\t\t}\n\t\tlease 10s\n\t}",
			"or lower timeout (5s) to at most 2.5s", "at Caddyfile:6"},
		// Given on their own, the three win over timeout: lowering timeout
		// would change nothing, so the error names them.
		{"redis three timeouts", "iceberg_idempotency {\n\t\tstore redis {\n\t\t\taddress a:1\n\t\t\tdial_timeout 20s\n\t\t\tread_timeout 20s\n\t\t\twrite_timeout 20s\n\t\t}\n\t\tlease 40s\n\t}",
			"or lower dial_timeout (20s), read_timeout (20s) and write_timeout (20s) to at most 10s", "at Caddyfile:9"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := adapt(t, ":8080 {\n\t"+tt.block+"\n\treverse_proxy 127.0.0.1:1\n}\n")
			if err == nil || !strings.Contains(err.Error(), tt.want) || !strings.HasSuffix(err.Error(), tt.at) {
				t.Fatalf("error = %v, want it to contain %q and end with %q", err, tt.want, tt.at)
			}
		})
	}
	if _, err := adapt(t, ":8080 {\n\ticeberg_idempotency {\n\t\tstore postgres {\n\t\t\tdsn x\n\t\t\tstatement_timeout 1s\n\t\t}\n\t\tlease 4s\n\t}\n\treverse_proxy 127.0.0.1:1\n}\n"); err != nil {
		t.Fatalf("a lease of 4 statement timeouts refused: %v", err)
	}
}
