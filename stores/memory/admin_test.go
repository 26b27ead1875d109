package memory

import (
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestAdmin(t *testing.T) {
	storetest.RunAdmin(t, func(t *testing.T) storetest.Harness {
		clock := storetest.NewFakeClock()
		s, err := New(Options{MaxEntries: 1000, Now: clock.Now})
		if err != nil {
			t.Fatal(err)
		}
		return storetest.Harness{Store: s, Advance: clock.Advance}
	})
}
