package schema

import (
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

// 0002 adds key_id after 0001, idempotently, and records version 2; its
// statements split where the file says (no trailing comment hides a ';').
func TestKeyIDMigration(t *testing.T) {
	for _, dialect := range []string{Postgres, MySQL} {
		ms, err := Migrations(dialect)
		if err != nil {
			t.Fatal(err)
		}
		if len(ms) < 2 || ms[1].Version != 2 || ms[1].File != "sql/"+dialect+"/0002_key_id.sql" || Latest(ms) != 2 {
			t.Fatalf("%s migrations = %+v", dialect, ms)
		}
		stmts := ms[1].Statements("my_table")
		for _, s := range stmts {
			if strings.Contains(s, Placeholder) {
				t.Fatalf("%s: placeholder left in %q", dialect, s)
			}
			if !strings.HasSuffix(s, ";") || strings.Count(s, ";") != 1 {
				t.Fatalf("%s: not exactly one statement: %q", dialect, s)
			}
		}
		last := stmts[len(stmts)-1]
		if !strings.HasPrefix(last, "INSERT INTO my_table_schema") || !strings.Contains(last, "(2") {
			t.Fatalf("%s: last statement %q does not record version 2", dialect, last)
		}
		joined := strings.Join(stmts, "\n")
		if !strings.Contains(joined, "ALTER TABLE my_table") || !strings.Contains(joined, "key_id") {
			t.Fatalf("%s: no ALTER adding key_id in %s", dialect, joined)
		}
	}
}
