package icebergidempotency

import (
	"strconv"
	"strings"
	"time"
)

// isoDuration formats d as an ISO-8601 duration, the form the spec uses for
// idempotency-key-lifetime: 30m → PT30M, 2h → PT2H, 90m → PT1H30M. Hours are
// not folded into days: "PT24H" is what clients expect to read.
func isoDuration(d time.Duration) string {
	if d <= 0 {
		return "PT0S"
	}
	var b strings.Builder
	b.WriteString("PT")
	if h := d / time.Hour; h > 0 {
		b.WriteString(strconv.FormatInt(int64(h), 10) + "H")
		d -= h * time.Hour
	}
	if m := d / time.Minute; m > 0 {
		b.WriteString(strconv.FormatInt(int64(m), 10) + "M")
		d -= m * time.Minute
	}
	if d > 0 {
		b.WriteString(strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + "S")
	}
	return b.String()
}
