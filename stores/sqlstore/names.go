package sqlstore

import (
	"fmt"
	"regexp"
	"time"
)

// DefaultStatementTimeout bounds each database call when no
// statement_timeout is configured.
const DefaultStatementTimeout = 5 * time.Second

// DefaultTable is the table name used when none is configured.
const DefaultTable = "iceberg_idempotency_records"

// MaxTableLen bounds table names so that the derived names (<table>_schema,
// <table>_expires_at_idx, the NOTIFY channel) stay within PostgreSQL's 63-
// and MySQL's 64-byte identifier limits.
const MaxTableLen = 48

// Table names are lowercase so that PostgreSQL's case folding of unquoted
// identifiers and MySQL's case-sensitive file names on Linux agree, and the
// name can be written into SQL unquoted.
var tableRE = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// ValidateTable reports whether name is safe to write into SQL as a table
// name. The stores never interpolate a name that did not pass it.
func ValidateTable(name string) error {
	if len(name) > MaxTableLen || !tableRE.MatchString(name) {
		return fmt.Errorf("invalid table name %q: want lowercase letters, digits and underscores, not starting with a digit, at most %d characters", name, MaxTableLen)
	}
	return nil
}

// MaxKeyLen is the width of the key column: a canonical UUID.
const MaxKeyLen = 36

// CheckKey rejects keys the key column cannot hold unchanged. A database in
// a lax SQL mode would otherwise truncate a long key, silently merging two
// different keys.
func CheckKey(key string) error {
	if key == "" || len(key) > MaxKeyLen {
		return fmt.Errorf("idempotency key must be 1 to %d bytes, got %d", MaxKeyLen, len(key))
	}
	return nil
}
