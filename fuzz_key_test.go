package icebergidempotency

import (
	"strings"
	"testing"

	"github.com/google/uuid"
)

// FuzzParseKey: parseKey never panics; it accepts every UUID of an allowed
// version and the RFC 9562 variant in the 8-4-4-4-12 form; whatever it accepts is the canonical
// form (36 lower-case characters, 8-4-4-4-12 hex, an allowed version, RFC
// 9562 variant) of the input itself; letter case never changes the outcome,
// since the spec's own example key is upper case; and allowing more
// versions only ever accepts more keys, the same way. It runs with the
// default (version 7), with 4 and 7 (key_versions 4 7) and with any.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{
		"017F22E2-79B0-7CC3-98C4-DC0C0C07398F",     // the spec's example, upper case
		"017f22e2-79b0-7cc3-98c4-dc0c0c07398f",     // and lower case
		"019386A4-1b2c-7D3e-bF40-123456789abc",     // mixed case, variant b
		"f47ac10b-58cc-4372-a567-0e02b2c3d479",     // version 4
		"019386a4-1b2c-8d3e-8f40-123456789abc",     // version 8
		"6ba7b810-9dad-11d1-80b4-00c04fd430c8",     // version 1
		"019386a4-1b2c-0d3e-8f40-123456789abc",     // version 0: never allowed
		"019386a4-1b2c-fd3e-8f40-123456789abc",     // version 15: never allowed
		"019386a4-1b2c-7d3e-cf40-123456789abc",     // variant c
		"",                                         // empty
		"019386a4-1b2c-7d3e-8f40-123456789ab",      // 35 characters
		"019386a4-1b2c-7d3e-8f40-123456789abcd",    // 37 characters
		"{019386a4-1b2c-7d3e-8f40-123456789abc}",   // braces
		"019386a41b2c7d3e8f40123456789abc----",     // hyphens moved
		"019386a4-1b2c-7d3e-8f40-123456789abſ",     // non-ASCII letter whose upper case is ASCII
		"019386a4-1b2c-7d3e-8f40-12345678\xff\xfe", // invalid UTF-8
	} {
		f.Add(s)
	}
	anyVersion := newKeyVersionSet([]int{1, 2, 3, 4, 5, 6, 7, 8})
	sets := []keyVersionSet{keyVersionsSpec, newKeyVersionSet([]int{4, 7}), anyVersion}
	f.Fuzz(func(t *testing.T, s string) {
		var accepted []bool
		for _, allowed := range sets {
			got, err := parseKey(s, allowed)
			upper, upperErr := parseKey(strings.ToUpper(s), allowed)
			if (err == nil) != (upperErr == nil) || got != upper {
				t.Fatalf("%s: parseKey(%q) = %q, %v but parseKey(ToUpper) = %q, %v", allowed, s, got, err, upper, upperErr)
			}
			accepted = append(accepted, err == nil)
			// And it accepts every key it should: an RFC 9562 UUID in the
			// 8-4-4-4-12 form, of an allowed version, by google/uuid's
			// reading. Until the build after 28dfe25 only what it accepted
			// was checked, and one that refused everything passed.
			if u, perr := uuid.Parse(s); perr == nil && len(s) == 36 && u.Variant() == uuid.RFC4122 && allowed.has(int(u.Version())) && err != nil {
				t.Fatalf("%s: parseKey(%q) = %v, but it is a UUID of version %d and the RFC 9562 variant", allowed, s, err, u.Version())
			}
			if err != nil {
				if got != "" {
					t.Fatalf("%s: parseKey(%q) returned %q with error %v", allowed, s, got, err)
				}
				continue
			}
			checkCanonicalKey(t, s, got, allowed)
		}
		// Each set holds the one before it.
		for i := 1; i < len(accepted); i++ {
			if accepted[i-1] && !accepted[i] {
				t.Fatalf("parseKey(%q) accepted with %s but not with %s", s, sets[i-1], sets[i])
			}
		}
	})
}

// checkCanonicalKey fails t unless key is the canonical form of in.
func checkCanonicalKey(t *testing.T, in, key string, allowed keyVersionSet) {
	t.Helper()
	if len(key) != 36 || len(in) != 36 {
		t.Fatalf("parseKey(%q) = %q: want 36 characters in and out", in, key)
	}
	if !strings.EqualFold(in, key) {
		t.Fatalf("parseKey(%q) = %q: not the same key", in, key)
	}
	for i := range len(key) {
		c := key[i]
		switch {
		case i == 8 || i == 13 || i == 18 || i == 23:
			if c != '-' {
				t.Fatalf("parseKey(%q) = %q: byte %d is %q, want '-'", in, key, i, c)
			}
		case '0' <= c && c <= '9', 'a' <= c && c <= 'f':
		default:
			t.Fatalf("parseKey(%q) = %q: byte %d is %q, want a lower-case hex digit", in, key, i, c)
		}
	}
	// An independent reading of the same bytes must agree on version and
	// variant.
	u, err := uuid.Parse(key)
	if err != nil {
		t.Fatalf("parseKey(%q) = %q, which uuid.Parse rejects: %v", in, key, err)
	}
	if !allowed.has(int(u.Version())) || u.Variant() != uuid.RFC4122 {
		t.Fatalf("parseKey(%q) = %q: version %d, variant %v; want %s, RFC 4122/9562", in, key, u.Version(), u.Variant(), allowed)
	}
	if u.String() != key {
		t.Fatalf("parseKey(%q) = %q, uuid.Parse canonical form is %q", in, key, u.String())
	}
}
