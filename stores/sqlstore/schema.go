package sqlstore

import (
	"fmt"
	"strings"

	"go.uber.org/zap"

	schema "github.com/caddy-iceberg/caddy-iceberg-idempotency/sql"
)

// CheckSchema is a store's verdict on its table at schema version have,
// when it may not migrate it: nil when ms, the build's migrations, are all
// applied (with a warning when the table is newer than the build knows), or
// a *SchemaError that names the files to apply, in order, and how to apply
// one with the dialect's own client (applyHow).
func CheckSchema(dialect, applyHow, table string, have int, ms []schema.Migration, log *zap.Logger) error {
	var missing []string
	for _, m := range ms {
		if m.Version > have {
			missing = append(missing, m.File)
		}
	}
	if len(missing) == 0 {
		if latest := schema.Latest(ms); have > latest {
			log.Warn("schema is newer than this build knows", zap.Int("version", have), zap.Int("known", latest))
		}
		return nil
	}
	hint := ""
	if table != schema.Placeholder {
		hint = fmt.Sprintf(" with %s replaced by %s", schema.Placeholder, table)
	}
	return &SchemaError{Msg: fmt.Sprintf("%s: table %s is at schema version %d, this build needs %d: apply %s%s (%s), or enable auto_migrate",
		dialect, table, have, schema.Latest(ms), strings.Join(missing, ", then "), hint, applyHow)}
}
