// Package schema embeds the versioned DDL files of the SQL stores, so that
// the stores apply exactly the files a DBA can read and apply by hand.
//
// The directory is named sql/ for DBAs; the package is named schema so that
// importers do not shadow database/sql.
package schema

import (
	"embed"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
)

//go:embed postgres/*.sql mysql/*.sql
var files embed.FS

// Placeholder is the default table name. The files use it literally; it is
// replaced by the configured table name (which also renames the version
// table <table>_schema and the index <table>_expires_at_idx).
const Placeholder = "iceberg_idempotency_records"

// Dialects.
const (
	Postgres = "postgres"
	MySQL    = "mysql"
)

// Migration is one versioned DDL file.
type Migration struct {
	// Version is the number the file name starts with (0001 → 1).
	Version int
	// File is the path an operator finds the file at, e.g.
	// "sql/postgres/0001_records.sql".
	File string
	// SQL is the file's text, with the placeholder table name.
	SQL string
}

// Migrations returns dialect's migrations in version order.
func Migrations(dialect string) ([]Migration, error) {
	names, err := fs.Glob(files, dialect+"/*.sql")
	if err != nil {
		return nil, err
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("schema: no migrations for dialect %q", dialect)
	}
	var ms []Migration
	for _, name := range names {
		base := path.Base(name)
		num, _, ok := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("schema: migration file %s does not start with a version number", name)
		}
		b, err := files.ReadFile(name)
		if err != nil {
			return nil, err
		}
		ms = append(ms, Migration{Version: v, File: "sql/" + name, SQL: string(b)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].Version < ms[j].Version })
	for i := 1; i < len(ms); i++ {
		if ms[i].Version == ms[i-1].Version {
			return nil, fmt.Errorf("schema: two migrations with version %d", ms[i].Version)
		}
	}
	return ms, nil
}

// Latest returns the highest version in ms, 0 for none.
func Latest(ms []Migration) int {
	if len(ms) == 0 {
		return 0
	}
	return ms[len(ms)-1].Version
}

// Statements returns the migration's statements for table, which the caller
// has validated as a plain identifier. Full-line "--" comments are dropped
// and a statement ends with a line whose last character is ';' — the files
// are written that way, so no SQL tokenizer is needed.
func (m Migration) Statements(table string) []string {
	text := strings.ReplaceAll(m.SQL, Placeholder, table)
	var out []string
	var cur strings.Builder
	for _, line := range strings.Split(text, "\n") {
		trimmed := strings.TrimSpace(line)
		if trimmed == "" || strings.HasPrefix(trimmed, "--") {
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
		if strings.HasSuffix(trimmed, ";") {
			out = append(out, strings.TrimSpace(cur.String()))
			cur.Reset()
		}
	}
	if rest := strings.TrimSpace(cur.String()); rest != "" {
		out = append(out, rest)
	}
	return out
}
