// Command uuidv7 prints a new UUIDv7 in the lower-case hyphenated form, for
// an Idempotency-Key in a hand-made request:
//
//	curl -H "Idempotency-Key: $(go run ./cmd/uuidv7)" ...
//
// It exists so trying the module needs nothing beyond the repository (uuidgen
// and most shells make only version 4 UUIDs, which the module rejects).
package main

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/google/uuid"
)

func main() {
	if err := printKey(os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "uuidv7:", err)
		os.Exit(1)
	}
}

// printKey writes one new UUIDv7 and a newline to w.
func printKey(w io.Writer) error {
	u, err := uuid.NewV7()
	if err != nil {
		return fmt.Errorf("generating a UUIDv7: %w", err)
	}
	// String is lower case already; ToLower states the contract rather than
	// relying on the library's choice.
	_, err = fmt.Fprintln(w, strings.ToLower(u.String()))
	return err
}
