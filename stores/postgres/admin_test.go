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

// With LISTEN/NOTIFY, Forget must notify: with the fallback poll a minute
// apart, ForgetWakesAwait's 20 s wait would otherwise run out. (Until the
// build after 80fc55f the poll was 1 s, and the test passed with Forget's
// notify removed.)
func TestAdminListenNotify(t *testing.T) {
	storetest.RunAdmin(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, func(c *Config) { c.ListenNotify, c.NotifyFallback = true, time.Minute })
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}
