package sqlstore

import (
	"errors"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// A row this build cannot read (a state a newer build wrote, headers that
// do not decode) is reported as unreadable, which the handler answers as
// outcome unknown, never passing the request through.
func TestUnreadableRows(t *testing.T) {
	for _, r := range []Row{
		{Key: "k", State: "done_v9"},
		{Key: "k", State: string(stores.StateFinal), Status: 200, Headers: []byte("not json")},
	} {
		if _, _, err := r.Record(); !errors.Is(err, stores.ErrUnreadableRecord) {
			t.Errorf("row in state %q: %v, want ErrUnreadableRecord", r.State, err)
		}
	}
	ok := Row{Key: "k", State: string(stores.StateFinal), Status: 200, Headers: []byte("{}")}
	if _, _, err := ok.Record(); err != nil {
		t.Errorf("a readable final row: %v", err)
	}
}
