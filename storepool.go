package icebergidempotency

import (
	"fmt"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// StoreProvider is implemented by the modules in the iceberg_idempotency.stores
// namespace: each opens one kind of store.
type StoreProvider interface {
	// StoreKey identifies the store the configuration opens. Handlers whose
	// providers return the same key share one store, across handlers and
	// across config reloads. It must not contain secrets in clear.
	StoreKey() string
	// OpenStore opens the store; called only when no handler holds it.
	OpenStore(ctx caddy.Context) (stores.Store, error)
}

// storePool shares stores across config reloads: a reload provisions the new
// handlers (taking a reference) before the old ones are cleaned up (dropping
// theirs), so records and connection pools survive an admin-API /load.
var storePool = caddy.NewUsagePool()

type pooledStore struct{ stores.Store }

func (p pooledStore) Destruct() error { return p.Close() }

func acquireStore(ctx caddy.Context, p StoreProvider) (stores.Store, error) {
	val, _, err := storePool.LoadOrNew(p.StoreKey(), func() (caddy.Destructor, error) {
		s, err := p.OpenStore(ctx)
		if err != nil {
			return nil, err
		}
		return pooledStore{s}, nil
	})
	if err != nil {
		return nil, fmt.Errorf("opening store: %w", err)
	}
	return val.(pooledStore).Store, nil
}
