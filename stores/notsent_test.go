package stores_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// The mark survives the wrapping a store's error goes through on its way
// to the handler, keeps the message, and sits beside the transient mark in
// either order.
func TestNotSentMark(t *testing.T) {
	base := errors.New("dial tcp 127.0.0.1:5432: connect: connection refused")
	if stores.NotSent(base) || stores.MarkNotSent(nil) != nil {
		t.Fatal("an unmarked error reads as not sent, or nil was marked")
	}
	for name, err := range map[string]error{
		"not sent, then transient": sqlstore.MarkTransient(stores.MarkNotSent(base)),
		"transient, then not sent": stores.MarkNotSent(sqlstore.MarkTransient(base)),
	} {
		wrapped := fmt.Errorf("reserve: %w", err)
		if !stores.NotSent(wrapped) || !sqlstore.IsTransient(wrapped) || !errors.Is(wrapped, base) {
			t.Errorf("%s: NotSent %v, transient %v, Is(base) %v; want all true", name,
				stores.NotSent(wrapped), sqlstore.IsTransient(wrapped), errors.Is(wrapped, base))
		}
		if err.Error() != base.Error() {
			t.Errorf("%s: message %q, want %q", name, err, base)
		}
	}
	if stores.NotSent(sqlstore.MarkTransient(base)) {
		t.Error("the transient mark alone reads as not sent")
	}
}
