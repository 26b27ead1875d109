package icebergidempotency

import (
	"testing"
	"time"
)

func TestISODuration(t *testing.T) {
	for d, want := range map[time.Duration]string{
		30 * time.Minute:                  "PT30M",
		2 * time.Hour:                     "PT2H",
		90 * time.Minute:                  "PT1H30M",
		24 * time.Hour:                    "PT24H",
		45 * time.Second:                  "PT45S",
		time.Hour + 1500*time.Millisecond: "PT1H1.5S",
		0:                                 "PT0S",
	} {
		if got := isoDuration(d); got != want {
			t.Errorf("isoDuration(%v) = %q, want %q", d, got, want)
		}
	}
}

func TestSetTopLevelField(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"append keeps bytes",
			`{"defaults": {"a": "1"},  "overrides":{} ,"endpoints":["GET /v1/{prefix}/namespaces"]}`,
			`{"defaults": {"a": "1"},  "overrides":{} ,"endpoints":["GET /v1/{prefix}/namespaces"],"idempotency-key-lifetime":"PT30M"}`},
		{"replace backend value",
			`{"idempotency-key-lifetime" : "PT5M", "defaults":{}}`,
			`{"idempotency-key-lifetime" : "PT30M", "defaults":{}}`},
		{"nested field untouched",
			`{"defaults":{"idempotency-key-lifetime":"PT1M"}}`,
			`{"defaults":{"idempotency-key-lifetime":"PT1M"},"idempotency-key-lifetime":"PT30M"}`},
		{"empty object", "{}\n", `{"idempotency-key-lifetime":"PT30M"}` + "\n"},
		{"non-string backend value replaced", `{"idempotency-key-lifetime":null}`, `{"idempotency-key-lifetime":"PT30M"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := setTopLevelField([]byte(tt.in), LifetimeField, "PT30M")
			if err != nil || string(got) != tt.want {
				t.Fatalf("got %s, %v\nwant %s", got, err, tt.want)
			}
		})
	}
	for _, bad := range []string{`[]`, `"x"`, `{"a":`, `{"a":1} {}`, ``} {
		if got, err := setTopLevelField([]byte(bad), LifetimeField, "PT30M"); err == nil {
			t.Errorf("setTopLevelField(%q) = %s, want an error", bad, got)
		}
	}
}
