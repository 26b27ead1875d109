package stores

import (
	"fmt"
	"time"
)

// Bound is a numeric option of a store's config, by its JSON name, for
// NegativeOption.
type Bound struct {
	Name     string
	Value    int64
	Duration bool // Value is a time.Duration, shown as the config writes one ("-5s")
}

// NegativeOption names the first of opts whose value is negative, so that
// a config error says which option to fix (a JSON config reaches a store
// without the Caddyfile parser's checks); nil when none is.
func NegativeOption(store string, opts ...Bound) error {
	for _, o := range opts {
		if o.Value >= 0 {
			continue
		}
		shown := fmt.Sprint(o.Value)
		if o.Duration {
			shown = time.Duration(o.Value).String()
		}
		return fmt.Errorf("%s: %s must not be negative, got %s", store, o.Name, shown)
	}
	return nil
}
