package icebergidempotency

import (
	"compress/gzip"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
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
		// Before, the seconds went through a float: PT30M1.1179999999999999S,
		// which java.time.Duration.parse refuses (nine digits at most).
		30*time.Minute + 1118*time.Millisecond:     "PT30M1.118S",
		1128 * time.Millisecond:                    "PT1.128S",
		time.Hour + 1003691*time.Microsecond:       "PT1H1.003691S",
		time.Nanosecond:                            "PT0.000000001S",
		59*time.Second + 999999999*time.Nanosecond: "PT59.999999999S",
	} {
		if got := isoDuration(d); got != want {
			t.Errorf("isoDuration(%v) = %q, want %q", d, got, want)
		}
	}
	// About every millisecond of two minutes, nanoseconds spread: what
	// Duration.parse accepts, and the duration itself read back.
	javaDuration := regexp.MustCompile(`^PT(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)(?:\.(\d{1,9}))?S)?$`)
	for d := time.Hour - time.Minute; d < time.Hour+time.Minute; d += 999_983 * time.Nanosecond {
		got := isoDuration(d)
		m := javaDuration.FindStringSubmatch(got)
		if m == nil {
			t.Fatalf("isoDuration(%v) = %q, which java.time.Duration.parse refuses", d, got)
		}
		var back time.Duration
		for i, unit := range []time.Duration{time.Hour, time.Minute, time.Second} {
			n, _ := strconv.ParseInt(m[i+1], 10, 64)
			back += time.Duration(n) * unit
		}
		if frac := m[4]; frac != "" {
			n, _ := strconv.ParseInt(frac+strings.Repeat("0", 9-len(frac)), 10, 64)
			back += time.Duration(n)
		}
		if back != d {
			t.Fatalf("isoDuration(%v) = %q, which reads back as %v", d, got, back)
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
		// Go's decoder, and Jackson's, read the last of duplicate names:
		// only the first was replaced, and clients read the catalog's.
		{"every duplicate replaced",
			`{"idempotency-key-lifetime":"PT1M","defaults":{},"idempotency-key-lifetime":"PT2M"}`,
			`{"idempotency-key-lifetime":"PT30M","defaults":{},"idempotency-key-lifetime":"PT30M"}`},
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

// gzipCatalog answers doc as JSON, compressed when the request asks for
// gzip (as Go's transport and the Java client's HttpClient 5 do by
// default), or always.
func gzipCatalog(t *testing.T, doc string, always bool) *countingCatalog {
	return newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if !always && !strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
			_, _ = io.WriteString(w, doc)
			return
		}
		w.Header().Set("Content-Encoding", "gzip")
		zw := gzip.NewWriter(w)
		_, _ = io.WriteString(zw, doc)
		_ = zw.Close()
	})
}

// The lifetime is advertised whatever the catalog's encoding. Before, a
// catalog that honoured the client's Accept-Encoding: gzip got nothing
// added, so Java clients never sent keys.
func TestAdvertiseCompressingCatalog(t *testing.T) {
	for _, always := range []bool{false, true} {
		h := newTestHandler(t, newMemoryStore(t))
		proxy := newReverseProxy(t, gzipCatalog(t, `{"defaults":{},"overrides":{}}`, always).addr())
		res := serve(t, h, proxy, "GET", "/v1/config", "", "", "Accept-Encoding", "gzip")
		if res.code() != http.StatusOK {
			t.Fatalf("always=%v: GET /v1/config = %d %v", always, res.code(), res.err)
		}
		body := res.body
		if res.header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			plain, _ := io.ReadAll(zr)
			body = string(plain)
		}
		var cfg map[string]any
		if err := json.Unmarshal([]byte(body), &cfg); err != nil {
			t.Fatalf("always=%v: config body %q: %v", always, body, err)
		}
		if cfg[LifetimeField] != "PT30M" {
			t.Fatalf("always=%v: config = %s, want top-level %s PT30M", always, body, LifetimeField)
		}
		if cl := res.header.Get("Content-Length"); cl != strconv.Itoa(len(res.body)) {
			t.Fatalf("always=%v: Content-Length %s for a %d-byte body", always, cl, len(res.body))
		}
	}
}

// Every spelling of GET /v1/config that normalizes to it is advertised on,
// as the handler guards every spelling of a mutation's path; other reads
// pass through untouched. Reads skip the normalization unless their decoded
// path names "config" (isConfigRequest), so the escaped spelling is the
// one that shows whether that shortcut reads the decoded path.
func TestAdvertiseOnEverySpellingOfConfig(t *testing.T) {
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"defaults":{},"overrides":{}}`)
	})
	h := newTestHandler(t, newMemoryStore(t))
	proxy := newReverseProxy(t, catalog.addr())
	for target, advertised := range map[string]bool{
		"/v1/config":          true,
		"/v1//config/":        true,
		"/v1/%63onfig":        true,
		"/v1/%63%6F%6efig":    true,
		"/v1/x/../config":     true,
		"/v1/./config?w=a":    true,
		"/v1/configs":         false,
		"/v1/config/x":        false,
		"/v1/namespaces":      false,
		"/v1/wh/config":       false,
		"/v2/config":          false,
		"/v1/namespaces/conf": false,
	} {
		res := serve(t, h, proxy, "GET", target, "", "")
		if res.code() != http.StatusOK {
			t.Fatalf("GET %s = %d %v", target, res.code(), res.err)
		}
		if got := strings.Contains(res.body, LifetimeField); got != advertised {
			t.Errorf("GET %s: body %s, advertised %v, want %v", target, res.body, got, advertised)
		}
	}
}

// A config answer too large to rewrite goes out as it came, and says so in
// the log: without the lifetime, clients send no keys at all. Before, it
// passed without a word.
func TestOversizeConfigIsLogged(t *testing.T) {
	doc := `{"defaults":{"padding":"` + strings.Repeat("x", maxConfigSize) + `"},"overrides":{}}`
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, doc)
	})
	h := newTestHandler(t, newMemoryStore(t))
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	res := serve(t, h, newReverseProxy(t, catalog.addr()), "GET", "/v1/config", "", "")
	if res.code() != http.StatusOK || len(res.body) != len(doc) {
		t.Fatalf("GET /v1/config = %d, %d bytes; want the catalog's %d bytes as they came", res.code(), len(res.body), len(doc))
	}
	if logs.FilterMessageSnippet("not advertised").Len() != 1 {
		t.Fatalf("log = %v; want one warning that the lifetime was not advertised", logs.All())
	}
}

// Every handler of a config advertises the shortest lifetime among them: a
// client may read /v1/config through one handler and send its commits
// through another whose records live less (nested directives on two
// stores, a handle block for /v1/config beside one for the rest). Until the
// build after b35c62e each advertised its own, and the outer of two nested
// ones wrote its own over the inner's: measured by an audit on two nodes,
// PT30M advertised, records on PostgreSQL kept 3.3 s, a retry at 15 s
// executed the commit again. A config whose lifetimes differ is warned of
// once, at start.
func TestConfigAdvertisesItsShortestLifetime(t *testing.T) {
	catalog := newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"defaults":{},"overrides":{}}`)
	})
	proxy := newReverseProxy(t, catalog.addr())
	for _, tt := range []struct {
		name      string
		lifetimes []time.Duration
		want      string
		warned    bool
	}{
		{"one handler", []time.Duration{30 * time.Minute}, "PT30M", false},
		{"the same lifetime", []time.Duration{30 * time.Minute, 30 * time.Minute}, "PT30M", false},
		{"a shorter one after", []time.Duration{30 * time.Minute, 10 * time.Minute}, "PT10M", true},
		{"a shorter one before", []time.Duration{10 * time.Minute, 2 * time.Hour}, "PT10M", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			app := &App{logger: zap.New(core)}
			var handlers []*Handler
			for _, d := range tt.lifetimes {
				h := newTestHandler(t, newMemoryStore(t))
				h.Lifetime = caddy.Duration(d)
				app.noteLifetime(d)
				h.advertised = &app.advertised
				handlers = append(handlers, h)
			}
			app.warnLifetimes()
			for i, h := range handlers {
				res := serve(t, h, proxy, "GET", "/v1/config", "", "")
				var doc map[string]any
				if err := json.Unmarshal([]byte(res.body), &doc); err != nil || doc[LifetimeField] != tt.want {
					t.Errorf("handler %d (lifetime %s) advertised %v, want %s: %s", i, tt.lifetimes[i], doc[LifetimeField], tt.want, res.body)
				}
			}
			if warned := logs.FilterMessageSnippet("have different lifetimes").Len(); warned != map[bool]int{false: 0, true: 1}[tt.warned] {
				t.Errorf("%d warnings of different lifetimes, want warned=%v", warned, tt.warned)
			}
		})
	}
}
