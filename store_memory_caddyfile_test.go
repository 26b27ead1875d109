package icebergidempotency

import (
	"encoding/json"
	"strings"
	"testing"
)

// The memory store's options adapt to its JSON fields; sizes take the same
// syntax as max_response_size.
func TestMemoryStoreCaddyfileBounds(t *testing.T) {
	for _, tc := range []struct {
		size string
		want int64
	}{{"64MiB", 64 << 20}, {"1GB", 1_000_000_000}, {"65536", 65536}} {
		out, err := adapt(t, ":8080 {\n\ticeberg_idempotency {\n\t\tstore memory {\n\t\t\tmax_bytes "+tc.size+"\n\t\t}\n\t}\n}\n")
		if err != nil {
			t.Fatalf("%s: %v", tc.size, err)
		}
		var cfg struct {
			Apps struct {
				HTTP struct {
					Servers map[string]struct {
						Routes []struct {
							Handle []struct {
								Store MemoryStore `json:"store"`
							} `json:"handle"`
						} `json:"routes"`
					} `json:"servers"`
				} `json:"http"`
			} `json:"apps"`
		}
		if err := json.Unmarshal(out, &cfg); err != nil {
			t.Fatal(err)
		}
		got := cfg.Apps.HTTP.Servers["srv0"].Routes[0].Handle[0].Store.MaxBytes
		if got != tc.want {
			t.Fatalf("max_bytes %s adapted to %d, want %d", tc.size, got, tc.want)
		}
	}
}

// A bad bound is refused at its line.
func TestMemoryStoreCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ line, want string }{
		{"max_bytes lots", `max_bytes must be a positive size of at most 1TiB, like 16MiB, got "lots"`},
		{"max_bytes 0", `max_bytes must be a positive size`},
		{"max_bytes 256", `max_bytes must be at least 64KiB: each record takes about 1KiB besides its answer, got 256 bytes (a unit left out?)`},
		{"max_bytes 63KiB", `max_bytes must be at least 64KiB`},
		{"max_bytes", `max_bytes needs a value`},
		{"max_bytes 1MiB 2MiB", `max_bytes takes a single value`},
		{"max_entries -5", `max_entries must be a positive integer up to 9007199254740992, got "-5"`},
		{"max_entries", `max_entries needs a value`},
		{"max_entrys 5", `unknown memory store option "max_entrys"`},
		{"when_full drop", `when_full must be evict or refuse, got "drop"`},
	} {
		_, err := adapt(t, ":8080 {\n\ticeberg_idempotency {\n\t\tstore memory {\n\t\t\t"+tc.line+"\n\t\t}\n\t}\n}\n")
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "Caddyfile:4") {
			t.Errorf("%q: error %v, want %q at Caddyfile:4", tc.line, err, tc.want)
		}
	}
}
