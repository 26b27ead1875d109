package postgres

import (
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestAdmin(t *testing.T) {
	storetest.RunAdmin(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, nil)
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

// With LISTEN/NOTIFY, Forget must notify: ForgetWakesAwait would otherwise
// wait for the slow fallback poll.
func TestAdminListenNotify(t *testing.T) {
	storetest.RunAdmin(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, func(c *Config) { c.ListenNotify = true })
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}
