package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/google/uuid"
)

// The printed key must be one the module accepts: 36 characters, version 7,
// RFC 9562 variant; lower case so it reads the same as the stored key.
func TestPrintKey(t *testing.T) {
	seen := map[string]bool{}
	for range 100 {
		var buf bytes.Buffer
		if err := printKey(&buf); err != nil {
			t.Fatal(err)
		}
		line, ok := strings.CutSuffix(buf.String(), "\n")
		if !ok || strings.Contains(line, "\n") {
			t.Fatalf("output %q is not one line", buf.String())
		}
		u, err := uuid.Parse(line)
		if err != nil {
			t.Fatalf("output %q: %v", line, err)
		}
		if len(line) != 36 || line != strings.ToLower(line) {
			t.Errorf("output %q: want 36 lower-case characters", line)
		}
		if u.Version() != 7 || u.Variant() != uuid.RFC4122 {
			t.Errorf("output %q: version %d variant %v, want 7 and RFC 4122/9562", line, u.Version(), u.Variant())
		}
		if seen[line] {
			t.Errorf("output %q repeated", line)
		}
		seen[line] = true
	}
}
