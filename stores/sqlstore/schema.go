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
	missing := missingFiles(have, ms)
	if len(missing) == 0 {
		if latest := schema.Latest(ms); have > latest {
			log.Warn("schema is newer than this build knows", zap.Int("version", have), zap.Int("known", latest))
		}
		return nil
	}
	return &SchemaError{Msg: fmt.Sprintf("%s: table %s is at schema version %d, this build needs %d: apply %s, or enable auto_migrate",
		dialect, table, have, schema.Latest(ms), toApply(applyHow, table, missing))}
}

// MigrationRefused is the verdict on an automatic migration the server
// refused for want of privilege (refusal, its error): the store's database
// user may read and write rows but not change the schema, as when a DBA
// owns it. Like CheckSchema's, it names the files to apply, from version
// have on, for someone who may.
func MigrationRefused(dialect, applyHow, table string, have int, ms []schema.Migration, refusal error) error {
	return &SchemaError{Msg: fmt.Sprintf("%s: table %s is at schema version %d, this build needs %d, and the store's database user may not change the schema (%v): apply %s as a user that may, such as the table's owner",
		dialect, table, have, schema.Latest(ms), refusal, toApply(applyHow, table, missingFiles(have, ms)))}
}

// MigrationFailed is the verdict on an automatic migration of a table at
// schema version have (above 0: it exists), behind the build's, that the
// database did not let finish for now (cause, its error): a lock it could
// not get in time behind a dump or a session left open on the table, or
// another node's migration holding the migration lock. The table stays
// behind, and is no outage: the older nodes sharing it guard their keys
// with it, and fail_open passing keyed requests beside them would execute
// a commit whose answer one of them holds. The next attempt migrates.
func MigrationFailed(dialect, applyHow, table string, have int, ms []schema.Migration, cause error) error {
	return &SchemaError{Msg: fmt.Sprintf("%s: table %s is at schema version %d, this build needs %d, and the migration did not finish (%v): tried again; or apply %s",
		dialect, table, have, schema.Latest(ms), cause, toApply(applyHow, table, missingFiles(have, ms)))}
}

// PrivilegeMissing is the verdict on a statement of the store's that the
// server refused its user for want of privilege (refusal, its error).
func PrivilegeMissing(dialect, table string, refusal error) error {
	return &AccessError{Msg: fmt.Sprintf("%s: the store's database user may not run the store's statements on table %s (%v): grant it SELECT, INSERT, UPDATE and DELETE on %s and %s_schema",
		dialect, table, refusal, table, table)}
}

// missingFiles lists the files of ms past version have, in order.
func missingFiles(have int, ms []schema.Migration) []string {
	var missing []string
	for _, m := range ms {
		if m.Version > have {
			missing = append(missing, m.File)
		}
	}
	return missing
}

// toApply says which files to apply, in order, and how.
func toApply(applyHow, table string, files []string) string {
	hint := ""
	if table != schema.Placeholder {
		hint = fmt.Sprintf(" with %s replaced by %s", schema.Placeholder, table)
	}
	return fmt.Sprintf("%s%s (%s)", strings.Join(files, ", then "), hint, applyHow)
}
