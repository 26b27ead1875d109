package schema

import (
	"fmt"
	"strings"
	"testing"
)

func TestMigrations(t *testing.T) {
	for _, dialect := range []string{Postgres, MySQL} {
		ms, err := Migrations(dialect)
		if err != nil {
			t.Fatal(err)
		}
		if len(ms) == 0 || ms[0].Version != 1 || ms[0].File != "sql/"+dialect+"/0001_records.sql" {
			t.Fatalf("%s migrations = %+v", dialect, ms)
		}
		stmts := ms[0].Statements("my_table")
		if len(stmts) != 3 && len(stmts) != 4 {
			t.Fatalf("%s: %d statements: %q", dialect, len(stmts), stmts)
		}
		for _, s := range stmts {
			if strings.Contains(s, Placeholder) {
				t.Fatalf("%s: placeholder left in %q", dialect, s)
			}
			if !strings.HasSuffix(s, ";") {
				t.Fatalf("%s: statement not terminated: %q", dialect, s)
			}
		}
		joined := strings.Join(stmts, "\n")
		for _, want := range []string{"my_table_schema", "my_table_expires_at_idx", "CREATE TABLE IF NOT EXISTS my_table ("} {
			if !strings.Contains(joined, want) {
				t.Fatalf("%s: %q missing from %s", dialect, want, joined)
			}
		}
	}
	if _, err := Migrations("oracle"); err == nil {
		t.Fatal("unknown dialect accepted")
	}
}

// latest is each dialect's newest schema version: the dialects move on
// separately (0003 is PostgreSQL's only).
var latest = map[string]int{Postgres: 3, MySQL: 2}

func TestLatest(t *testing.T) {
	for dialect, want := range latest {
		ms, err := Migrations(dialect)
		if err != nil {
			t.Fatal(err)
		}
		if got := Latest(ms); got != want || len(ms) != want {
			t.Fatalf("%s: latest version %d of %d files, want %d of %d", dialect, got, len(ms), want, want)
		}
	}
}

// checkAddColumn checks migration version v of dialect, named file: it
// records version v last, adds column with an ALTER TABLE, and its
// statements split where the file says (no trailing comment hides a ';').
func checkAddColumn(t *testing.T, dialect string, v int, file, column string) {
	t.Helper()
	ms, err := Migrations(dialect)
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) < v || ms[v-1].Version != v || ms[v-1].File != "sql/"+dialect+"/"+file {
		t.Fatalf("%s migrations = %+v", dialect, ms)
	}
	stmts := ms[v-1].Statements("my_table")
	for _, s := range stmts {
		if strings.Contains(s, Placeholder) {
			t.Fatalf("%s: placeholder left in %q", dialect, s)
		}
		if !strings.HasSuffix(s, ";") || strings.Count(s, ";") != 1 {
			t.Fatalf("%s: not exactly one statement: %q", dialect, s)
		}
	}
	last := stmts[len(stmts)-1]
	if !strings.HasPrefix(last, "INSERT INTO my_table_schema") || !strings.Contains(last, fmt.Sprintf("(%d", v)) {
		t.Fatalf("%s: last statement %q does not record version %d", dialect, last, v)
	}
	joined := strings.Join(stmts, "\n")
	if !strings.Contains(joined, "ALTER TABLE my_table") || !strings.Contains(joined, column) {
		t.Fatalf("%s: no ALTER adding %s in %s", dialect, column, joined)
	}
}

// 0002 adds key_id after 0001, idempotently, and records version 2.
func TestKeyIDMigration(t *testing.T) {
	for _, dialect := range []string{Postgres, MySQL} {
		checkAddColumn(t, dialect, 2, "0002_key_id.sql", "key_id")
	}
}

// 0003 (PostgreSQL only) adds watched, NOT NULL with a constant default so
// that adding it rewrites nothing, and records version 3.
func TestWatchedMigration(t *testing.T) {
	checkAddColumn(t, Postgres, 3, "0003_watched.sql", "ADD COLUMN IF NOT EXISTS watched boolean NOT NULL DEFAULT false")
}
