package icebergidempotency

import (
	"errors"
	"fmt"
	"strings"
)

// parseKey checks that s is a UUIDv7 in the 36-character hyphenated form the
// spec requires, with the RFC 9562 variant, and returns it in lower case.
// Any letter case is accepted: the spec's own example is upper case.
func parseKey(s string) (string, error) {
	if len(s) != 36 {
		return "", fmt.Errorf("must be 36 characters, got %d", len(s))
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if i == 8 || i == 13 || i == 18 || i == 23 {
			if c != '-' {
				return "", fmt.Errorf("must be hyphenated as 8-4-4-4-12 hex digits")
			}
			continue
		}
		if !isHex(c) {
			return "", fmt.Errorf("must contain only hex digits and hyphens")
		}
	}
	if s[14] != '7' {
		return "", fmt.Errorf("must be a version 7 UUID, got version %c", s[14])
	}
	switch s[19] {
	case '8', '9', 'a', 'b', 'A', 'B':
	default:
		return "", errors.New("must have the RFC 9562 variant (10xx)")
	}
	return strings.ToLower(s), nil
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}
