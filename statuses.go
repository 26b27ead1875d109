package icebergidempotency

import (
	"fmt"
	"strconv"
	"strings"
)

// statusSet matches response statuses given as exact codes ("409") or
// classes ("4xx").
type statusSet struct {
	codes   map[int]bool
	classes map[int]bool
}

func parseStatusSet(items []string) (statusSet, error) {
	s := statusSet{codes: map[int]bool{}, classes: map[int]bool{}}
	for _, it := range items {
		it = strings.ToLower(strings.TrimSpace(it))
		if len(it) == 3 && strings.HasSuffix(it, "xx") && it[0] >= '1' && it[0] <= '5' {
			s.classes[int(it[0]-'0')] = true
			continue
		}
		code, err := strconv.Atoi(it)
		if err != nil || code < 100 || code > 599 {
			return s, fmt.Errorf("invalid status %q: want a code like 409 or a class like 4xx", it)
		}
		s.codes[code] = true
	}
	return s, nil
}

func (s statusSet) has(code int) bool {
	return s.codes[code] || s.classes[code/100]
}
