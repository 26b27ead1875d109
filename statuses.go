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

// checkFinalize refuses a finalize list that would let a retry execute a
// mutation again or replay an answer the spec forbids storing: every 2xx
// must be stored (a success not stored is released, and its retry commits
// a second time, or hears 409 and cleans up files the first commit still
// uses), and no 1xx (never final) or 5xx (the spec: "Do not finalize").
func (s statusSet) checkFinalize() error {
	if len(s.codes) == 0 && len(s.classes) == 0 {
		return fmt.Errorf("empty list: every success would be executed again on retry; give at least 2xx")
	}
	for code := 200; code <= 299; code++ {
		if !s.has(code) {
			return fmt.Errorf("leaves out %d: a success that is not stored is executed again on retry; give 2xx", code)
		}
	}
	for code := range s.codes {
		if code < 200 || code >= 500 {
			return fmt.Errorf("has %d: %s", code, notFinal(code))
		}
	}
	for class := range s.classes {
		if class == 1 || class == 5 {
			return fmt.Errorf("has %dxx: %s", class, notFinal(class*100))
		}
	}
	return nil
}

// checkRelease refuses a release list with a success in it: the catalog
// executed, and releasing the key would let a retry execute again.
func (s statusSet) checkRelease() error {
	if s.classes[2] {
		return fmt.Errorf("has 2xx: a released success is executed again on retry")
	}
	for code := range s.codes {
		if code/100 == 2 {
			return fmt.Errorf("has %d: a released success is executed again on retry", code)
		}
	}
	return nil
}

func notFinal(code int) string {
	if code < 200 {
		return "a 1xx response is never final, so it cannot be stored"
	}
	return "the Iceberg REST spec says 5xx answers are not finalized; they are released so a retry can execute"
}
