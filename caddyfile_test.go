package icebergidempotency

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/caddyauth"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/encode"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/encode/gzip"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

var update = flag.Bool("update", false, "rewrite the golden JSON files")

func adapt(t *testing.T, caddyfile string) ([]byte, error) {
	t.Helper()
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	return out, err
}

// Each testdata/caddyfile/*.caddyfile adapts to the JSON beside it.
func TestCaddyfileGolden(t *testing.T) {
	files, err := filepath.Glob("testdata/caddyfile/*.caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden inputs: %v", err)
	}
	for _, in := range files {
		t.Run(filepath.Base(in), func(t *testing.T) {
			src, err := os.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			out, err := adapt(t, string(src))
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			var pretty bytes.Buffer
			if err := json.Indent(&pretty, out, "", "\t"); err != nil {
				t.Fatal(err)
			}
			pretty.WriteByte('\n')
			golden := strings.TrimSuffix(in, ".caddyfile") + ".json"
			if *update {
				if err := os.WriteFile(golden, pretty.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test -run TestCaddyfileGolden -update)", err)
			}
			if !bytes.Equal(pretty.Bytes(), want) {
				t.Fatalf("adapted JSON differs from %s:\n%s", golden, pretty.String())
			}
		})
	}
}

// The handler is ordered before reverse_proxy without an order line, even
// when written after it.
func TestDirectiveOrderedBeforeReverseProxy(t *testing.T) {
	out, err := adapt(t, ":8080 {\n\treverse_proxy 127.0.0.1:1\n\ticeberg_idempotency\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	i, j := strings.Index(s, `"iceberg_idempotency"`), strings.Index(s, `"reverse_proxy"`)
	if i < 0 || j < 0 || i > j {
		t.Fatalf("iceberg_idempotency not before reverse_proxy: %s", s)
	}
}

// handlerSequence lists the handlers of an adapted config in the order a
// request that matches every route would meet them: routes in order,
// subroutes (handle, handle_path, route) entered where they stand.
func handlerSequence(t *testing.T, adapted []byte) []string {
	t.Helper()
	var cfg struct {
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Routes []json.RawMessage `json:"routes"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(adapted, &cfg); err != nil {
		t.Fatal(err)
	}
	var seq []string
	var walkRoutes func(routes []json.RawMessage)
	walkRoutes = func(routes []json.RawMessage) {
		for _, raw := range routes {
			var route struct {
				Handle []struct {
					Handler string            `json:"handler"`
					Routes  []json.RawMessage `json:"routes"`
				} `json:"handle"`
			}
			if err := json.Unmarshal(raw, &route); err != nil {
				t.Fatal(err)
			}
			for _, h := range route.Handle {
				if h.Handler == "subroute" {
					walkRoutes(h.Routes)
					continue
				}
				seq = append(seq, h.Handler)
			}
		}
	}
	for _, srv := range cfg.Apps.HTTP.Servers {
		walkRoutes(srv.Routes)
	}
	return seq
}

// Whatever shape a Caddyfile has, the handler runs before the
// reverse_proxy that reaches the catalog, and after authentication and
// encode. Before, a site-level iceberg_idempotency with reverse_proxy inside
// a handle block adapted to a config where the handle's subroute ran first
// and terminated: the module never ran. The same held, until it was ordered
// before invoke, for a reverse_proxy in a named route that invoke calls.
func TestDirectiveOrderGuardsEveryShape(t *testing.T) {
	files, err := filepath.Glob("testdata/caddyfile/shape_*.caddyfile")
	if err != nil || len(files) < 5 {
		t.Fatalf("shape inputs: %v %v", files, err)
	}
	for _, in := range files {
		t.Run(filepath.Base(in), func(t *testing.T) {
			src, err := os.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			out, err := adapt(t, string(src))
			if err != nil {
				t.Fatal(err)
			}
			seq := handlerSequence(t, out)
			at := func(name string) int { return slices.Index(seq, name) }
			guard, proxy := at("iceberg_idempotency"), at("reverse_proxy")
			if proxy < 0 {
				// A named route's handlers are not in the site's routes:
				// invoke is where the request goes to reverse_proxy.
				proxy = at("invoke")
			}
			if guard < 0 || proxy < 0 || guard > proxy {
				t.Fatalf("handlers in order %v: iceberg_idempotency must come before reverse_proxy", seq)
			}
			for _, before := range []string{"authentication", "encode"} {
				if i := at(before); i >= 0 && i > guard {
					t.Fatalf("handlers in order %v: %s must come before iceberg_idempotency", seq, before)
				}
			}
		})
	}
}

func TestCaddyfileErrors(t *testing.T) {
	tests := []struct{ name, block, want, at string }{
		{"unknown option", "iceberg_idempotency {\n\t\tlifetyme 30m\n\t}", `unknown iceberg_idempotency option "lifetyme"`, "at Caddyfile:3"},
		{"bad duration", "iceberg_idempotency {\n\t\tlifetime soon\n\t}", `lifetime must be a positive duration`, "at Caddyfile:3"},
		{"negative duration", "iceberg_idempotency {\n\t\tin_flight_wait -1s\n\t}", `in_flight_wait must be a positive duration`, "at Caddyfile:3"},
		{"duration past ten years", "iceberg_idempotency {\n\t\tlifetime 3651d\n\t}", `lifetime must be at most 87600h0m0s (ten years)`, "at Caddyfile:3"},
		{"lease past ten years", "iceberg_idempotency {\n\t\tlease 3651d\n\t}", `lease must be at most 87600h0m0s (ten years)`, "at Caddyfile:3"},
		{"execution_timeout below 100ms", "iceberg_idempotency {\n\t\tlifetime 30m\n\t\texecution_timeout 50ms\n\t}", `execution_timeout must be at least 100ms, got 50ms`, "at Caddyfile:4"},
		{"missing value", "iceberg_idempotency {\n\t\tgrace\n\t}", `grace needs a value`, "at Caddyfile:3"},
		{"negative grace", "iceberg_idempotency {\n\t\tgrace -1s\n\t}", `grace must be a duration`, "at Caddyfile:3"},
		{"two values", "iceberg_idempotency {\n\t\tlease 1s 2s\n\t}", `lease takes a single value`, "at Caddyfile:3"},
		{"in flight status", "iceberg_idempotency {\n\t\tin_flight_status 429\n\t}", `in_flight_status must be 503 or 409`, "at Caddyfile:3"},
		{"abandoned", "iceberg_idempotency {\n\t\tabandoned retry\n\t}", `abandoned must be`, "at Caddyfile:3"},
		{"bad size", "iceberg_idempotency {\n\t\tmax_response_size lots\n\t}", `max_response_size must be a positive size`, "at Caddyfile:3"},
		{"bad status", "iceberg_idempotency {\n\t\trelease_statuses 5xx 7xx\n\t}", `release_statuses: invalid status "7xx"`, "at Caddyfile:3"},
		{"base path", "iceberg_idempotency {\n\t\tbase_path api/\n\t}", `base_path must start with /`, "at Caddyfile:3"},
		// Taken literally, it matched no path: the mutations under the
		// prefix meant passed unguarded.
		{"base path placeholder", "iceberg_idempotency {\n\t\tbase_path /{env.PREFIX}\n\t}", `base_path is compared with request paths as written and takes no placeholders`, "at Caddyfile:3"},
		// A matcher's wildcard matched no request path: a keyed commit
		// sent twice ran twice.
		{"base path matcher", "iceberg_idempotency {\n\t\tbase_path /api/catalog/*\n\t}", `base_path is a path prefix, not a matcher`, "at Caddyfile:3"},
		{"replay header comma", "iceberg_idempotency {\n\t\treplay_headers Content-Type, ETag\n\t}", `replay_headers[0] "Content-Type," is not a header name: separate the names with spaces`, "at Caddyfile:3"},
		{"replay headers empty", "iceberg_idempotency {\n\t\treplay_headers\n\t}", `replay_headers needs at least one header name`, "at Caddyfile:3"},
		{"statuses empty", "iceberg_idempotency {\n\t\tfinalize_statuses\n\t}", `finalize_statuses needs at least one status or class`, "at Caddyfile:3"},
		// A block after a flag read as an option named "{".
		{"block after a flag", "iceberg_idempotency {\n\t\trequire_key {\n\t\t}\n\t}", `unexpected {: of the options only store takes a block`, "at Caddyfile:3"},
		// The error said "positive" of a positive size.
		{"size past 1TiB", "iceberg_idempotency {\n\t\tmax_request_size 2TiB\n\t}", `max_request_size must be a positive size of at most 1TiB`, "at Caddyfile:3"},
		// humanize dropped the fraction: 1 byte, and every keyed request
		// with a body was answered 413.
		{"size with a fraction of a byte", "iceberg_idempotency {\n\t\tmax_request_size 1.9\n\t}", `max_request_size must be a whole number of bytes, got "1.9" (1.9 bytes): give a unit, like 1.5MiB`, "at Caddyfile:3"},
		{"size with a fraction of a byte in a unit", "iceberg_idempotency {\n\t\tmax_request_size 1.3KiB\n\t}", `got "1.3KiB" (1331.2 bytes)`, "at Caddyfile:3"},
		{"size under a byte", "iceberg_idempotency {\n\t\tmax_request_size 0.0001KiB\n\t}", `got "0.0001KiB" (0.1024 bytes)`, "at Caddyfile:3"},
		// humanize read the comma as a thousands separator: 15MiB.
		{"size with a decimal comma", "iceberg_idempotency {\n\t\tmax_request_size 1,5MiB\n\t}", `max_request_size takes no commas, got "1,5MiB"`, "at Caddyfile:3"},
		{"size in exponent notation", "iceberg_idempotency {\n\t\tmax_request_size 1e3\n\t}", `max_request_size must be a positive size`, "at Caddyfile:3"},
		{"memory size with a fraction of a byte", "iceberg_idempotency {\n\t\tstore memory {\n\t\t\tmax_bytes 2.5B\n\t\t}\n\t}", `max_bytes must be a whole number of bytes`, "at Caddyfile:4"},
		{"unknown store", "iceberg_idempotency {\n\t\tstore rediss\n\t}", `unknown store "rediss": want one of memory`, "at Caddyfile:3"},
		{"memory store option", "iceberg_idempotency {\n\t\tstore memory {\n\t\t\tmax_entrys 5\n\t\t}\n\t}", `unknown memory store option "max_entrys"`, "at Caddyfile:4"},
		// The adapter carries a store's numbers as JSON floats: this one
		// came out rounded, and the handler refused it without a line.
		{"memory store entries past 2^53", "iceberg_idempotency {\n\t\tstore memory {\n\t\t\tmax_entries 9007199254740993\n\t\t}\n\t}", `max_entries must be a positive integer up to 9007199254740992`, "at Caddyfile:4"},
		{"combined_writes past 2^53", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\tcombined_writes 9223372036854775807\n\t\t}\n\t}", `combined_writes must be a positive integer up to 9007199254740992 or off`, "at Caddyfile:4"},
		// On the line of the address or of cluster, not of the block's end.
		{"redis address repeated", "iceberg_idempotency {\n\t\tstore redis {\n\t\t\taddress a:1\n\t\t\taddress b:1 a:1\n\t\t}\n\t}", `address 3 of 3 repeats address 1`, "at Caddyfile:5"},
		{"redis cluster off", "iceberg_idempotency {\n\t\tstore redis {\n\t\t\taddress a:1 b:1\n\t\t\tcluster off\n\t\t\tdb 0\n\t\t}\n\t}", `cluster off with 2 addresses`, "at Caddyfile:5"},
		{"memory store size", "iceberg_idempotency {\n\t\tstore memory {\n\t\t\tmax_entries 0\n\t\t}\n\t}", `max_entries must be a positive integer`, "at Caddyfile:4"},
		{"redis without address", "iceberg_idempotency {\n\t\tstore redis {\n\t\t\tkey_prefix p\n\t\t}\n\t}", `redis store needs an address`, "at Caddyfile:3"},
		{"postgres without dsn", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\ttable t\n\t\t}\n\t}", `postgres store needs a dsn`, "at Caddyfile:3"}, // the store's line: the closing brace's (5) until the build after b35c62e
		{"postgres bad table", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\ttable Bad-Name\n\t\t}\n\t}", `table: `, "at Caddyfile:4"},
		// PostgreSQL counts it in whole milliseconds: 500µs was sent as 0,
		// no limit at all.
		{"statement_timeout below 1ms", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\tstatement_timeout 500us\n\t\t}\n\t}", `statement_timeout must be at least 1ms, got 500µs`, "at Caddyfile:4"},
		// pgxpool counts connections in an int32: refused only at start,
		// without the line, before.
		{"max_conns past int32", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\tdsn x\n\t\t\tmax_conns 3000000000\n\t\t}\n\t}", `max_conns must be a positive integer up to 2147483647, got "3000000000"`, "at Caddyfile:5"},
		{"combined_writes value", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\tcombined_writes 0\n\t\t}\n\t}", `combined_writes must be a positive integer up to 9007199254740992 or off, got "0"`, "at Caddyfile:4"},
		{"combined_writes mysql", "iceberg_idempotency {\n\t\tstore mysql {\n\t\t\tdsn x\n\t\t\tcombined_writes many\n\t\t}\n\t}", `combined_writes must be a positive integer up to 9007199254740992 or off, got "many"`, "at Caddyfile:5"},
		{"mysql unknown option", "iceberg_idempotency {\n\t\tstore mysql {\n\t\t\tdsn x\n\t\t\tlisten_notify on\n\t\t}\n\t}", `unknown mysql store option "listen_notify"`, "at Caddyfile:5"},
		{"auto_migrate value", "iceberg_idempotency {\n\t\tstore mysql {\n\t\t\tauto_migrate maybe\n\t\t}\n\t}", `auto_migrate must be on or off`, "at Caddyfile:4"},
		{"key_versions empty", "iceberg_idempotency {\n\t\tkey_versions\n\t}", `key_versions needs UUID versions (1 to 8) or any`, "at Caddyfile:3"},
		{"key_versions word", "iceberg_idempotency {\n\t\tkey_versions 4 seven\n\t}", `key_versions takes UUID versions (1 to 8) or a lone any, got "seven"`, "at Caddyfile:3"},
		{"key_versions any and more", "iceberg_idempotency {\n\t\tkey_versions any 4\n\t}", `or a lone any, got "any"`, "at Caddyfile:3"},
		{"key_versions range", "iceberg_idempotency {\n\t\tkey_versions 7 9\n\t}", `key_versions[1] must be a UUID version from 1 to 8, got 9`, "at Caddyfile:3"},
		{"key_versions repeated", "iceberg_idempotency {\n\t\tkey_versions 7 7\n\t}", `key_versions[1] repeats key_versions[0]`, "at Caddyfile:3"},
		// Caddy's "wrong argument count" until the build after 797bdb9,
		// naming neither the choices nor what was wrong.
		{"directive argument", "iceberg_idempotency on", `iceberg_idempotency takes at most one matcher (*, a path beginning with /, or a named @matcher), then a block of options; got the argument "on"`, "at Caddyfile:2"},
		{"store without a name", "iceberg_idempotency {\n\t\tstore\n\t}", `store needs a name: one of memory, mysql, postgres, redis`, "at Caddyfile:3"},
		// An empty value read as the option left out: a quoted {$VAR}
		// whose variable is unset turned encryption off without a word.
		{"secret from an unset variable", "iceberg_idempotency {\n\t\tsecret \"{$ICEBERG_IDEMPOTENCY_TEST_UNSET_SECRET}\"\n\t}", `secret is empty (a quoted {$VAR} whose environment variable is unset?)`, "at Caddyfile:3"},
		{"empty previous secret", "iceberg_idempotency {\n\t\tsecret {env.A}\n\t\tprevious_secrets {env.B} \"\"\n\t}", `previous_secrets is empty`, "at Caddyfile:4"},
		{"empty principal", "iceberg_idempotency {\n\t\tprincipal \"\"\n\t}", `principal is empty`, "at Caddyfile:3"},
		{"empty dsn", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\tdsn \"{$ICEBERG_IDEMPOTENCY_TEST_UNSET_DSN}\"\n\t\t}\n\t}", `dsn is empty`, "at Caddyfile:4"},
		{"in flight status 0", "iceberg_idempotency {\n\t\tin_flight_status 0\n\t}", `in_flight_status must be 503 or 409, got "0"`, "at Caddyfile:3"},
		{"empty replay header", "iceberg_idempotency {\n\t\treplay_headers ETag \"\"\n\t}", `replay_headers`, "at Caddyfile:3"},
		{"empty status", "iceberg_idempotency {\n\t\trelease_statuses 5xx \"\"\n\t}", `release_statuses`, "at Caddyfile:3"},
		// Status lists that would execute a success twice, or store a 5xx.
		{"release a success class", "iceberg_idempotency {\n\t\trelease_statuses 5xx 2xx\n\t}", `release_statuses: has 2xx: a released success is executed again on retry`, "at Caddyfile:3"},
		{"release a success", "iceberg_idempotency {\n\t\trelease_statuses 5xx 201\n\t}", `release_statuses: has 201`, "at Caddyfile:3"},
		{"finalize a 5xx", "iceberg_idempotency {\n\t\tfinalize_statuses 2xx 4xx 503\n\t}", `finalize_statuses: has 503: the Iceberg REST spec says 5xx answers are not finalized`, "at Caddyfile:3"},
		{"finalize 5xx", "iceberg_idempotency {\n\t\tfinalize_statuses 2xx 5xx\n\t}", `finalize_statuses: has 5xx`, "at Caddyfile:3"},
		{"finalize some successes", "iceberg_idempotency {\n\t\tfinalize_statuses 200 201 204 4xx\n\t}", `finalize_statuses: leaves out 202: a success that is not stored is executed again on retry; give 2xx`, "at Caddyfile:3"},
		{"finalize no successes", "iceberg_idempotency {\n\t\tfinalize_statuses 409\n\t}", `finalize_statuses: leaves out 200`, "at Caddyfile:3"},
		{"finalize 1xx", "iceberg_idempotency {\n\t\tfinalize_statuses 2xx 1xx\n\t}", `finalize_statuses: has 1xx: a 1xx response is never final`, "at Caddyfile:3"},
		{"principal without placeholder", "iceberg_idempotency {\n\t\tprincipal http.auth.user.id\n\t}", `principal "http.auth.user.id" has no placeholder that differs from request to request, so every caller would be one principal`, "at Caddyfile:3"},
		{"principal brace unclosed", "iceberg_idempotency {\n\t\tprincipal {http.request.header.Authorization\n\t}", `principal "{http.request.header.Authorization" has no placeholder that differs`, "at Caddyfile:3"},
		{"principal spaced braces", "iceberg_idempotency {\n\t\tprincipal \"{ http.auth.user.id }\"\n\t}", `has no placeholder that differs`, "at Caddyfile:3"},
		// A retry comes on a new connection: a principal that changes with
		// it refused the retry of a commit 422, which tells a commit client
		// its commit failed although it landed.
		{"principal per connection", "iceberg_idempotency {\n\t\tprincipal {remote}\n\t}", `principal "{http.request.remote}" differs between a request and its retry: {http.request.remote} changes with every connection`, "at Caddyfile:3"},
		{"principal per attempt", "iceberg_idempotency {\n\t\tprincipal {http.auth.user.id}/{http.request.uuid}\n\t}", `{http.request.uuid} changes with every request`, "at Caddyfile:3"},
		{"principal with the time", "iceberg_idempotency {\n\t\tprincipal {http.auth.user.id}/{time.now.unix}\n\t}", `{time.now.unix} changes with the time`, "at Caddyfile:3"},
		{"principal process-wide", "iceberg_idempotency {\n\t\tprincipal {env.TENANT}\n\t}", `principal "{env.TENANT}" has no placeholder that differs`, "at Caddyfile:3"},
		// Accepted until the build after b35c62e: a second caller replayed
		// the first one's answer.
		{"principal the request's method", "iceberg_idempotency {\n\t\tprincipal {method}\n\t}", `tells no caller from another: {http.request.method} is the same for every caller`, "at Caddyfile:3"},
		{"principal the key itself", "iceberg_idempotency {\n\t\tprincipal {header.idempotency-key}\n\t}", `tells no caller from another: {http.request.header.idempotency-key}`, "at Caddyfile:3"},
		{"principal host and path", "iceberg_idempotency {\n\t\tprincipal {host}{path.1}{env.TENANT}\n\t}", `tells no caller from another: {http.request.host}`, "at Caddyfile:3"},
		{"list option twice", "iceberg_idempotency {\n\t\tsecret {env.A}\n\t\tprevious_secrets {env.B}\n\t\tprevious_secrets {env.C}\n\t}", `previous_secrets given twice (first on line 4): it takes several values, give them all on one line`, "at Caddyfile:5"},
		{"replay Set-Cookie", "iceberg_idempotency {\n\t\treplay_headers Content-Type set-cookie\n\t}", `replay_headers cannot hold set-cookie: it would keep session credentials in the store`, "at Caddyfile:3"},
		{"replay Content-Length", "iceberg_idempotency {\n\t\treplay_headers Content-Length\n\t}", `replay_headers cannot hold Content-Length: it is computed from the stored body`, "at Caddyfile:3"},
		// An option given twice would silently replace the first.
		{"store twice", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\tdsn postgres://db/x\n\t\t}\n\t\tstore memory\n\t}", `store given twice (first on line 3): keep one`, "at Caddyfile:6"},
		{"lifetime twice", "iceberg_idempotency {\n\t\tlifetime 1h\n\t\tlease 1m\n\t\tlifetime 2h\n\t}", `lifetime given twice (first on line 3)`, "at Caddyfile:5"},
		{"secret twice", "iceberg_idempotency {\n\t\tsecret {env.A}\n\t\tsecret {env.B}\n\t}", `secret given twice (first on line 3)`, "at Caddyfile:4"},
		{"flag twice", "iceberg_idempotency {\n\t\tfail_open\n\t\tfail_open\n\t}", `fail_open given twice`, "at Caddyfile:4"},
		{"flag misspelt", "iceberg_idempotency {\n\t\trequire_key yes\n\t}", `require_key must be on or off, got "yes"`, "at Caddyfile:3"},
		{"flag with two values", "iceberg_idempotency {\n\t\tfail_open on off\n\t}", `fail_open takes a single value`, "at Caddyfile:3"},
		{"dsn twice", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\tdsn postgres://a/x\n\t\t\tdsn postgres://b/x\n\t\t}\n\t}", `dsn given twice (first on line 4)`, "at Caddyfile:5"},
		{"table twice", "iceberg_idempotency {\n\t\tstore mysql {\n\t\t\tdsn x\n\t\t\ttable a\n\t\t\ttable b\n\t\t}\n\t}", `table given twice (first on line 5)`, "at Caddyfile:6"},
		{"listen_notify twice", "iceberg_idempotency {\n\t\tstore postgres {\n\t\t\tdsn x\n\t\t\tlisten_notify on\n\t\t\tlisten_notify off\n\t\t}\n\t}", `listen_notify given twice`, "at Caddyfile:6"},
		{"memory option twice", "iceberg_idempotency {\n\t\tstore memory {\n\t\t\tmax_entries 5\n\t\t\tmax_entries 6\n\t\t}\n\t}", `max_entries given twice (first on line 4)`, "at Caddyfile:5"},
		{"redis option twice", "iceberg_idempotency {\n\t\tstore redis {\n\t\t\taddress a:1\n\t\t\tkey_prefix p\n\t\t\tkey_prefix q\n\t\t}\n\t}", `key_prefix given twice (first on line 5)`, "at Caddyfile:6"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := adapt(t, ":8080 {\n\t"+tt.block+"\n\treverse_proxy 127.0.0.1:1\n}\n")
			if err == nil || !strings.Contains(err.Error(), tt.want) || !strings.HasSuffix(err.Error(), tt.at) {
				t.Fatalf("error = %v, want it to contain %q and end with %q", err, tt.want, tt.at)
			}
		})
	}
	for _, tt := range []struct{ name, global, want, at string }{
		{"bad value", "iceberg_idempotency {\n\t\tcleanup_batch none\n\t}", "cleanup_batch must be a positive integer", "at Caddyfile:3"},
		{"no body budget", "iceberg_idempotency {\n\t\tmax_buffered_bytes 0\n\t}", `max_buffered_bytes must be a positive size of at most 1TiB, like 16MiB, got "0"`, "at Caddyfile:3"},
		// 1ns kept PostgreSQL at 15,000 purge statements/s.
		{"interval below a second", "iceberg_idempotency {\n\t\tcleanup_interval 500ms\n\t}", "cleanup_interval must be at least 1s, got 500ms", "at Caddyfile:3"},
		// Past 265 years the jitter wrapped the timer negative: purges ran
		// back to back.
		{"interval past ten years", "iceberg_idempotency {\n\t\tcleanup_interval 2500000h\n\t}", "cleanup_interval must be at most 87600h0m0s (ten years), got 2500000h0m0s", "at Caddyfile:3"},
		{"option twice", "iceberg_idempotency {\n\t\tcleanup_batch 5\n\t\tcleanup_batch 6\n\t}", "cleanup_batch given twice (first on line 3)", "at Caddyfile:4"},
		// Caddy would keep only the second block.
		{"block twice", "iceberg_idempotency {\n\t\tcleanup_batch 5\n\t}\n\ticeberg_idempotency {\n\t\tcleanup_interval 1m\n\t}", "iceberg_idempotency global option given twice", "at Caddyfile:5"},
	} {
		t.Run("global "+tt.name, func(t *testing.T) {
			_, err := adapt(t, "{\n\t"+tt.global+"\n}\n:8080 {\n\treverse_proxy 127.0.0.1:1\n}\n")
			if err == nil || !strings.Contains(err.Error(), tt.want) || !strings.HasSuffix(err.Error(), tt.at) {
				t.Fatalf("error = %v, want it to contain %q and end with %q", err, tt.want, tt.at)
			}
		})
	}
	// Checks Provision makes too, which had no line there: the directive
	// against the global option, and require_secret against the store.
	for _, tt := range []struct{ name, src, want, at string }{
		{"request size past the global budget", "{\n\ticeberg_idempotency {\n\t\tmax_buffered_bytes 16MiB\n\t}\n}\n:8080 {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:1\n}\n",
			"max_buffered_bytes must be at least twice max_request_size", "at Caddyfile:7"},
		{"request size past the default budget", ":8080 {\n\ticeberg_idempotency {\n\t\tlifetime 30m\n\t\tmax_request_size 600MiB\n\t}\n\treverse_proxy 127.0.0.1:1\n}\n",
			"max_buffered_bytes is 1073741824, max_request_size 629145600", "at Caddyfile:4"},
		{"require_secret without secret", ":8080 {\n\ticeberg_idempotency {\n\t\tstore postgres {\n\t\t\tdsn x\n\t\t}\n\t\trequire_secret\n\t}\n\treverse_proxy 127.0.0.1:1\n}\n",
			"require_secret: the store keeps records outside this process, but no secret is set", "at Caddyfile:6"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := adapt(t, tt.src)
			if err == nil || !strings.Contains(err.Error(), tt.want) || !strings.HasSuffix(err.Error(), tt.at) {
				t.Fatalf("error = %v, want it to contain %q and end with %q", err, tt.want, tt.at)
			}
		})
	}
	for _, src := range []string{
		"{\n\ticeberg_idempotency {\n\t\tmax_buffered_bytes 2GiB\n\t}\n}\n:8080 {\n\ticeberg_idempotency {\n\t\tmax_request_size 1GiB\n\t}\n\treverse_proxy 127.0.0.1:1\n}\n",
		":8080 {\n\ticeberg_idempotency {\n\t\trequire_secret\n\t}\n\treverse_proxy 127.0.0.1:1\n}\n",
	} {
		if _, err := adapt(t, src); err != nil {
			t.Errorf("adapt(%q): %v", src, err)
		}
	}
}

// TestCaddyfileFlagSpellings: a handler flag alone is on, and takes the
// store switches' spellings after it. Until the build after a2ea714,
// "require_key on" was "wrong argument count".
func TestCaddyfileFlagSpellings(t *testing.T) {
	for _, tt := range []struct {
		arg  string
		want bool
	}{{"", true}, {" on", true}, {" true", true}, {" off", false}, {" false", false}} {
		var h Handler
		d := caddyfile.NewTestDispenser("iceberg_idempotency {\nrequire_key" + tt.arg + "\nfail_open" + tt.arg + "\nrequire_secret" + tt.arg + "\n}")
		if err := h.UnmarshalCaddyfile(d); err != nil {
			t.Fatalf("%q: %v", tt.arg, err)
		}
		if h.RequireKey != tt.want || h.FailOpen != tt.want || h.RequireSecret != tt.want {
			t.Fatalf("%q: require_key %v, fail_open %v, require_secret %v; want %v", tt.arg, h.RequireKey, h.FailOpen, h.RequireSecret, tt.want)
		}
	}
}

// TestCaddyfileSizes: a size is read exactly, a fraction of a unit
// included, so long as it comes to whole bytes.
func TestCaddyfileSizes(t *testing.T) {
	for arg, want := range map[string]int64{"1536": 1536, "1.5KiB": 1536, "2b": 2, "16MiB": 16 << 20, "0.5MB": 500_000,
		// Read through a float, these were 8199999 and 2009999 bytes.
		"8.2MB": 8_200_000, "2.01MB": 2_010_000, "1.": 1, ".5KiB": 512, "1TiB": 1 << 40} {
		var h Handler
		d := caddyfile.NewTestDispenser("iceberg_idempotency {\nmax_request_size " + arg + "\n}")
		if err := h.UnmarshalCaddyfile(d); err != nil {
			t.Fatalf("%q: %v", arg, err)
		}
		if h.MaxRequestSize != want {
			t.Fatalf("%q: %d bytes, want %d", arg, h.MaxRequestSize, want)
		}
	}
}

// The shipped examples must stay valid.
func TestExamplesAdapt(t *testing.T) {
	files, err := filepath.Glob("examples/Caddyfile*")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples: %v", err)
	}
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := adapt(t, string(src)); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
}

// The README's Caddyfile snippets must stay valid too: an operator copies
// them. Fragments are wrapped the way the README places them: a store
// block inside the directive, the directive inside a site, a global block
// before one. The option summary (its values are alternatives) is skipped.
func TestReadmeCaddyfilesAdapt(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	const fence = "```caddyfile\n"
	rest, n := string(readme), 0
	for {
		i := strings.Index(rest, fence)
		if i < 0 {
			break
		}
		rest = rest[i+len(fence):]
		end := strings.Index(rest, "\n```")
		if end < 0 {
			t.Fatal("unclosed caddyfile block")
		}
		block := rest[:end+1]
		rest = rest[end:]
		n++
		if strings.Contains(block, "|") {
			continue
		}
		// One block may show the store blocks of several kinds, one
		// after the other: each is its own snippet.
		for i, snippet := range strings.Split(block, "\n\nstore ") {
			if i > 0 {
				snippet = "store " + snippet
			}
			if !strings.HasSuffix(snippet, "\n") {
				snippet += "\n"
			}
			src := snippet
			switch {
			case strings.HasPrefix(snippet, "store "):
				src = ":8080 {\n\ticeberg_idempotency {\n" + snippet + "\t}\n\treverse_proxy 127.0.0.1:8181\n}\n"
			case strings.HasPrefix(snippet, "iceberg_idempotency "):
				src = ":8080 {\n" + snippet + "\treverse_proxy 127.0.0.1:8181\n}\n"
			case strings.HasPrefix(snippet, "{"):
				src = snippet + ":8080 {\n\ticeberg_idempotency\n\treverse_proxy 127.0.0.1:8181\n}\n"
			}
			if _, err := adapt(t, src); err != nil {
				t.Errorf("README caddyfile block %d:\n%s\n%v", n, snippet, err)
			}
		}
	}
	if n < 5 {
		t.Fatalf("found %d caddyfile blocks in README.md, want the README's snippets", n)
	}
}

// A store block without its dsn or address, in an imported snippet, names
// the store's line and the import: made at the block's end, the error
// named its closing brace and no import chain (until the build after
// b35c62e), and a snippet imported twice did not say which import.
func TestStoreWithoutDSNInASnippetNamesTheImport(t *testing.T) {
	for backend, block := range map[string]string{
		"postgres store needs a dsn":   "store postgres {\n\t\ttable recs\n\t}",
		"redis store needs an address": "store redis {\n\t\tkey_prefix idem:\n\t}",
	} {
		_, err := adapt(t, "(idem) {\n\ticeberg_idempotency {\n\t"+block+"\n\t}\n}\n:8080 {\n\timport idem\n\treverse_proxy 127.0.0.1:1\n}\n")
		if err == nil || !strings.Contains(err.Error(), backend+", at Caddyfile:3 import chain") {
			t.Errorf("%s: error = %v, want it on the store's line (3) with the import chain", backend, err)
		}
	}
}
