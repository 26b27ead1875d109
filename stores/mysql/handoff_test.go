package mysql

import (
	"database/sql/driver"
	"testing"
)

// withHandOff must leave the caller's arguments as they are (a statement
// re-run after a deadlock passes the same slice again) and convert the
// first one as database/sql would, reporting the conversion.
func TestHandOff(t *testing.T) {
	args := []any{7, "key"}
	out, handed := withHandOff(args)
	if args[0] != 7 || handed() {
		t.Fatalf("before conversion: args %v, handed %v; want the arguments unchanged and not handed", args, handed())
	}
	v, err := out[0].(driver.Valuer).Value()
	if err != nil || v != int64(7) || out[1] != "key" || !handed() {
		t.Fatalf("converted: %v (%v), rest %v, handed %v; want int64(7), the rest as it was, handed", v, err, out[1:], handed())
	}
	if none, handed := withHandOff(nil); len(none) != 0 || !handed() {
		t.Fatal("a statement without arguments must count as handed")
	}
}
