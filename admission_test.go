package icebergidempotency

import "testing"

func TestParseKey(t *testing.T) {
	tests := []struct {
		name, in, want string
		ok             bool
	}{
		{"spec example, upper case", "017F22E2-79B0-7CC3-98C4-DC0C0C07398F", "017f22e2-79b0-7cc3-98c4-dc0c0c07398f", true},
		{"lower case v7", "019386a4-1b2c-7d3e-8f40-123456789abc", "019386a4-1b2c-7d3e-8f40-123456789abc", true},
		{"mixed case v7, variant b", "019386A4-1b2c-7D3e-bF40-123456789abc", "019386a4-1b2c-7d3e-bf40-123456789abc", true},
		{"variant 9", "019386a4-1b2c-7d3e-9f40-123456789abc", "019386a4-1b2c-7d3e-9f40-123456789abc", true},
		{"v4", "f47ac10b-58cc-4372-a567-0e02b2c3d479", "", false},
		{"v1", "6ba7b810-9dad-11d1-80b4-00c04fd430c8", "", false},
		{"v8", "019386a4-1b2c-8d3e-8f40-123456789abc", "", false},
		{"variant 0 (NCS)", "019386a4-1b2c-7d3e-0f40-123456789abc", "", false},
		{"variant c (Microsoft)", "019386a4-1b2c-7d3e-cf40-123456789abc", "", false},
		{"35 chars", "019386a4-1b2c-7d3e-8f40-123456789ab", "", false},
		{"37 chars", "019386a4-1b2c-7d3e-8f40-123456789abcd", "", false},
		{"braces", "{019386a4-1b2c-7d3e-8f40-123456789abc}", "", false},
		{"urn", "urn:uuid:019386a4-1b2c-7d3e-8f40-123456789abc", "", false},
		{"no hyphens, padded to 36", "019386a41b2c7d3e8f40123456789abc----", "", false},
		{"non-hex", "019386a4-1b2c-7d3e-8f40-123456789abg", "", false},
		{"empty", "", "", false},
		{"spaces", " 019386a4-1b2c-7d3e-8f40-123456789a ", "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseKey(tt.in)
			if tt.ok && (err != nil || got != tt.want) {
				t.Fatalf("parseKey(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
			}
			if !tt.ok && err == nil {
				t.Fatalf("parseKey(%q) = %q, want an error", tt.in, got)
			}
		})
	}
}
