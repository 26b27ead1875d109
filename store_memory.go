package icebergidempotency

import (
	"fmt"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/memory"
)

// DefaultMaxEntries bounds the in-memory store when max_entries is not set.
const DefaultMaxEntries = 10000

// MemoryStore configures the embedded in-memory store: correct for a single
// Caddy node, lost on restart.
type MemoryStore struct {
	// Most records kept; the least recently used record is evicted beyond it
	// (logged as a warning, since an evicted key executes again on retry).
	// Handlers with the same max_entries share one store. Default: 10000.
	MaxEntries int `json:"max_entries,omitempty"`
}

var (
	_ StoreProvider         = (*MemoryStore)(nil)
	_ caddy.Provisioner     = (*MemoryStore)(nil)
	_ caddyfile.Unmarshaler = (*MemoryStore)(nil)
)

// CaddyModule returns the Caddy module information.
func (MemoryStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "iceberg_idempotency.stores.memory",
		New: func() caddy.Module { return new(MemoryStore) },
	}
}

// Provision sets defaults.
func (m *MemoryStore) Provision(caddy.Context) error {
	if m.MaxEntries == 0 {
		m.MaxEntries = DefaultMaxEntries
	}
	if m.MaxEntries < 0 {
		return fmt.Errorf("max_entries must be positive, got %d", m.MaxEntries)
	}
	return nil
}

// StoreKey implements StoreProvider.
func (m *MemoryStore) StoreKey() string { return "memory/" + strconv.Itoa(m.MaxEntries) }

// OpenStore implements StoreProvider.
func (m *MemoryStore) OpenStore(ctx caddy.Context) (stores.Store, error) {
	logger := ctx.Logger()
	return memory.New(memory.Options{
		MaxEntries: m.MaxEntries,
		OnEvict: func(key string, state stores.State) {
			logger.Warn("record evicted before expiry; raise max_entries",
				zap.String("key", key), zap.String("state", string(state)), zap.Int("max_entries", m.MaxEntries))
		},
	})
}

// UnmarshalCaddyfile parses
//
//	store memory [{
//	    max_entries <n>
//	}]
func (m *MemoryStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // store type name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "max_entries":
			if !d.NextArg() {
				return d.ArgErr()
			}
			n, err := strconv.Atoi(d.Val())
			if err != nil || n <= 0 {
				return d.Errf("max_entries must be a positive integer, got %q", d.Val())
			}
			m.MaxEntries = n
			if d.NextArg() {
				return d.ArgErr()
			}
		default:
			return d.Errf("unknown memory store option %q", d.Val())
		}
	}
	return nil
}
