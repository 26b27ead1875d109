package icebergidempotency

import (
	"bytes"
	"encoding/json"
	"regexp"
	"strconv"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// errLine is the position Dispenser.WrapErr appends to every parse error.
var errLine = regexp.MustCompile(`(?s), at Testfile:(\d+)( import chain \[.*\])?$`)

// FuzzUnmarshalCaddyfile: the iceberg_idempotency directive (and the store
// blocks inside it) never panics on any token stream, every error names the
// line it is about, and whatever parses also marshals to JSON.
//
// Inputs go through caddyfile.Tokenize and NewDispenser, which is what
// caddyfile.NewTestDispenser does minus two things that have no place in a
// fuzz target: it expands {$ENV} from the fuzzing process's environment, and
// it calls log.Fatalf on input the lexer rejects (an unterminated quote),
// which would end the fuzzer instead of skipping the input. The lexer's own
// errors are Caddy's, not this module's.
func FuzzUnmarshalCaddyfile(f *testing.F) {
	for _, s := range []string{
		"iceberg_idempotency",
		"iceberg_idempotency {\n}",
		"iceberg_idempotency {\n\tstore memory {\n\t\tmax_entries 500\n\t\tmax_bytes 64MiB\n\t}\n\tlifetime 2h\n\tgrace 10m\n" +
			"\tin_flight_wait 3s\n\tin_flight_status 409\n\tretry_after 2s\n\texecution_timeout 2m\n\tlease 15s\n" +
			"\tabandoned reexecute\n\tmax_request_size 8MiB\n\tmax_response_size 32MiB\n\trequire_key\n" +
			"\tbase_path /api/catalog\n\tprincipal {http.auth.user.id}\n\tfinalize_statuses 2xx 409 404\n" +
			"\trelease_statuses 5xx 401 403 429\n\treplay_headers Content-Type ETag X-Request-Id\n\tfail_open\n}",
		"iceberg_idempotency {\n\tstore postgres {\n\t\tdsn \"{env.DSN}\"\n\t\ttable t\n\t\tmax_conns 20\n\t\tauto_migrate off\n" +
			"\t\tstatement_timeout 2s\n\t\tlisten_notify off\n\t\tcombined_writes off\n\t}\n}",
		"iceberg_idempotency {\n\tstore mysql {\n\t\tdsn `root@tcp(db:3306)/x`\n\t\tauto_migrate on\n\t}\n}",
		"iceberg_idempotency {\n\tstore memory\n\tstore nothing\n}",
		"iceberg_idempotency {\n\tlifetime -1s\n\tin_flight_status 200\n}",
		"iceberg_idempotency {\n\tfinalize_statuses 2xx 6xx abc 99\n}",
		"iceberg_idempotency {\n\tbase_path /\n}",
		"iceberg_idempotency {\n\tmax_request_size 0\n\tmax_response_size 2PiB\n}",
		"iceberg_idempotency arg {\n\treplay_headers\n}",
		"iceberg_idempotency {\n\tstore memory {\n\t\tmax_entries\n\t}\n}",
		"iceberg_idempotency {\n\tprincipal <<EOF\n\tline\n\tEOF\n}",
		"iceberg_idempotency {\n\tstore\n}",
		"iceberg_idempotency {\n\t{\n}",
		"iceberg_idempotency {\n\tsecret {env.S}\n\tprevious_secrets {env.P1} {file./run/p2}\n\trequire_secret\n}",
		"iceberg_idempotency {\n\tsecret\n\tprevious_secrets {env.S} {env.S}\n\trequire_secret on\n}",
		"iceberg_idempotency {\n\tkey_versions 4 7\n}",
		"iceberg_idempotency {\n\tkey_versions any\n\tkey_versions\n}",
		"iceberg_idempotency {\n\tkey_versions any 9 -1 99999999999999999999\n}",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, input string) {
		tokens, err := caddyfile.Tokenize([]byte(input), "Testfile")
		if err != nil || len(tokens) == 0 {
			// The lexer's errors are its domain, see above; and Caddy
			// never hands a directive parser a stream without at least
			// the directive's own name (a Dispenser over no tokens
			// reports errors "at :0").
			return
		}
		maxLine := 0
		for _, tok := range tokens {
			maxLine = max(maxLine, tok.Line)
		}
		h := new(Handler)
		err = h.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens))
		if err != nil {
			m := errLine.FindStringSubmatch(err.Error())
			if m == nil {
				t.Fatalf("error without a line number: %v\ninput: %q", err, input)
			}
			line, _ := strconv.Atoi(m[1])
			if line < 1 || line > maxLine {
				t.Fatalf("error at line %d, input has tokens on lines 1..%d: %v\ninput: %q", line, maxLine, err, input)
			}
			return
		}
		// What Caddy loads is the JSON: it must read back as it was
		// written. Until the build after 28dfe25 only the marshalling was
		// checked, which nearly cannot fail.
		raw, err := json.Marshal(h)
		if err != nil {
			t.Fatalf("parsed handler does not marshal: %v\ninput: %q", err, input)
		}
		var back Handler
		if err := json.Unmarshal(raw, &back); err != nil {
			t.Fatalf("parsed handler's JSON does not load: %v\njson: %s\ninput: %q", err, raw, input)
		}
		if again, err := json.Marshal(&back); err != nil || !bytes.Equal(again, raw) {
			t.Fatalf("parsed handler's JSON changes when loaded: %s, then %s (%v)\ninput: %q", raw, again, err, input)
		}
	})
}
