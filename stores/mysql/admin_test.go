package mysql

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
