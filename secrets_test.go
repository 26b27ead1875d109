package icebergidempotency

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// Secrets at rest, through ServeHTTP on the memory store: what the store
// holds with a secret set, rotation, records that cannot be opened, and
// records written before the secret was.

func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newSecretHandler is a handler on s with the given secret ("" for none)
// and previous secrets, written literally.
func newSecretHandler(t *testing.T, s stores.Store, secret string, previous ...string) *Handler {
	t.Helper()
	h := &Handler{store: s, logger: zap.NewNop(), Secret: secret, PreviousSecrets: previous}
	if err := h.prepare(); err != nil {
		t.Fatal(err)
	}
	return h
}

// vendedCredentials is a loadTable answer carrying a sentinel in place of a
// vended secret access key, and the Authorization value it was asked with.
func vendedCredentials(t *testing.T) (sentinel, auth string, up *upstream) {
	sentinel = "SENTINEL-" + randomHex(t, 12)
	auth = "Bearer token-" + randomHex(t, 12)
	body := `{"metadata-location":"s3://b/t/metadata/1.json","config":{"s3.access-key-id":"AKIA","s3.secret-access-key":"` + sentinel + `"}}`
	return sentinel, auth, answering(200, body, "Content-Type", "application/json", "ETag", `"e1"`)
}

// A sealed record replays byte-identically, while the store holds neither
// the vended credential, nor the Authorization value, nor an unkeyed
// SHA-256 of it, of the request or of the response.
func TestSealedRecordReplaysAndHidesEverything(t *testing.T) {
	s := newMemoryStore(t)
	h := newSecretHandler(t, s, "secret-A-"+randomHex(t, 16))
	sentinel, auth, up := vendedCredentials(t)
	key := storetest.NewKey(t)

	first := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth)
	retry := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth)
	if first.code() != 200 || !strings.Contains(first.body, sentinel) {
		t.Fatalf("first answer %d %q, want the catalog's", first.code(), first.body)
	}
	if retry.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
		t.Fatalf("retry replayed=%q, catalog called %d times; want a replay", retry.header.Get(ReplayedHeader), up.calls.Load())
	}
	if retry.code() != first.code() || retry.body != first.body ||
		retry.header.Get("Content-Type") != "application/json" || retry.header.Get("ETag") != `"e1"` ||
		retry.header.Get("Content-Length") != fmt.Sprint(len(first.body)) {
		t.Fatalf("replay %d %v %q differs from the first answer %d %q", retry.code(), retry.header, retry.body, first.code(), first.body)
	}

	rec, err := s.Load(context.Background(), key)
	if err != nil || rec == nil || rec.Response == nil {
		t.Fatalf("Load = %+v, %v", rec, err)
	}
	if rec.Response.KeyID == "" || rec.Response.Status != 0 || rec.Response.Header != nil {
		t.Fatalf("stored response = key id %q, status %d, header %v; want sealed", rec.Response.KeyID, rec.Response.Status, rec.Response.Header)
	}
	stored := [][]byte{[]byte(rec.Principal), []byte(rec.Fingerprint), rec.Response.Body, []byte(fmt.Sprintf("%+v", *rec))}
	for what, needle := range map[string]string{
		"the vended credential":           sentinel,
		"the Authorization value":         auth,
		"SHA-256 of Authorization":        sha256Hex([]byte(auth)),
		"SHA-256 of the response body":    sha256Hex([]byte(first.body)),
		"SHA-256 of the request body":     sha256Hex([]byte(commitBody)),
		"the unkeyed request fingerprint": requestFingerprint("POST", commitPath, "", []byte(commitBody)),
		"the response body's JSON":        `"s3.secret-access-key"`,
	} {
		for _, b := range stored {
			if bytes.Contains(b, []byte(needle)) {
				t.Errorf("the stored record contains %s", what)
			}
		}
	}
}

// Rotation: records sealed under A replay, and their retries still match,
// once the configuration says secret B, previous_secrets A; new records are
// sealed under B. When A is gone, an A record answers 500 unknown and is
// not executed again, not even under abandoned reexecute.
func TestSecretRotation(t *testing.T) {
	s := newMemoryStore(t)
	secretA, secretB := "secret-A-"+randomHex(t, 16), "secret-B-"+randomHex(t, 16)
	sentinel, auth, up := vendedCredentials(t)
	keyA, keyB := storetest.NewKey(t), storetest.NewKey(t)

	hA := newSecretHandler(t, s, secretA)
	firstA := serve(t, hA, up, "POST", commitPath, keyA, commitBody, "Authorization", auth)

	hB := newSecretHandler(t, s, secretB, secretA)
	if res := serve(t, hB, up, "POST", commitPath, keyA, commitBody, "Authorization", auth); res.header.Get(ReplayedHeader) != "true" ||
		res.body != firstA.body || up.calls.Load() != 1 {
		t.Fatalf("A record under B + previous A: %d replayed=%q calls=%d; want replayed", res.code(), res.header.Get(ReplayedHeader), up.calls.Load())
	}
	// Another body under the A record's key is still told it is another
	// request, not another principal.
	if res := serve(t, hB, up, "POST", commitPath, keyA, `{"other":1}`, "Authorization", auth); res.code() != 422 ||
		!strings.Contains(res.body, "different request body") {
		t.Fatalf("other body on an A record: %d %s", res.code(), res.body)
	}
	if res := serve(t, hB, up, "POST", commitPath, keyA, commitBody, "Authorization", "Bearer someone-else"); res.code() != 422 ||
		!strings.Contains(res.body, "another principal") {
		t.Fatalf("other principal on an A record: %d %s", res.code(), res.body)
	}
	firstB := serve(t, hB, up, "POST", commitPath, keyB, commitBody, "Authorization", auth)
	recA, _ := s.Load(context.Background(), keyA)
	recB, _ := s.Load(context.Background(), keyB)
	if recA.Response.KeyID != hA.keys.current.id || recB.Response.KeyID != hB.keys.current.id || recA.Response.KeyID == recB.Response.KeyID {
		t.Fatalf("key ids: A record %q, B record %q; want A's %q and B's %q", recA.Response.KeyID, recB.Response.KeyID,
			hA.keys.current.id, hB.keys.current.id)
	}
	if strings.Contains(recB.Response.KeyID, secretB) || !strings.Contains(firstB.body, sentinel) {
		t.Fatal("the key id shows the secret, or the B answer lost its body")
	}

	calls := up.calls.Load()
	for _, policy := range []string{abandonedUnknown, abandonedReexecute} {
		for name, h := range map[string]*Handler{"secret B": newSecretHandler(t, s, secretB), "no secret": newSecretHandler(t, s, "")} {
			h.Abandoned = policy
			core, logs := observer.New(zapcore.DebugLevel)
			h.logger = zap.New(core)
			res := serve(t, h, up, "POST", commitPath, keyA, commitBody, "Authorization", auth)
			if res.code() != 500 || res.errorType() != typeCommitStateUnknown || up.calls.Load() != calls || strings.Contains(res.body, sentinel) {
				t.Fatalf("%s, %s: A record after A was removed: %d %s, calls %d; want 500 unknown, not executed",
					name, policy, res.code(), res.body, up.calls.Load())
			}
			errs := logs.FilterLevelExact(zapcore.ErrorLevel).All()
			if len(errs) != 1 || errs[0].ContextMap()["key"] != keyA || errs[0].ContextMap()["key_id"] != recA.Response.KeyID {
				t.Fatalf("%s, %s: error log %+v; want one naming the key and the key id", name, policy, errs)
			}
			if logged, _ := json.Marshal(logs.All()); bytes.Contains(logged, []byte(sentinel)) || bytes.Contains(logged, []byte(auth)) ||
				bytes.Contains(logged, []byte(secretA)) || bytes.Contains(logged, []byte(secretB)) {
				t.Fatalf("the log shows a secret or contents: %s", logged)
			}
		}
	}
	if res := serve(t, newSecretHandler(t, s, secretB), up, "POST", commitPath, keyB, commitBody, "Authorization", auth); res.header.Get(ReplayedHeader) != "true" ||
		res.body != firstB.body {
		t.Fatalf("B record under B alone: %d %s", res.code(), res.body)
	}
}

// A sealed response copied onto another key, with the same binding, does
// not open there: the key is part of what it is sealed to.
func TestSealedRecordMovedToAnotherKeyDoesNotOpen(t *testing.T) {
	s := newMemoryStore(t)
	h := newSecretHandler(t, s, "secret-A-"+randomHex(t, 16))
	core, logs := observer.New(zapcore.ErrorLevel)
	h.logger = zap.New(core)
	sentinel, auth, up := vendedCredentials(t)
	key, other := storetest.NewKey(t), storetest.NewKey(t)
	serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth)

	ctx := context.Background()
	rec, err := s.Load(ctx, key)
	if err != nil || rec == nil {
		t.Fatal(rec, err)
	}
	if _, err := s.Reserve(ctx, stores.Reservation{Key: other, Binding: rec.Binding, Owner: "copier", Lease: time.Minute, TTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if err := s.Finalize(ctx, other, "copier", *rec.Response); err != nil {
		t.Fatal(err)
	}
	res := serve(t, h, up, "POST", commitPath, other, commitBody, "Authorization", auth)
	if res.code() != 500 || res.errorType() != typeCommitStateUnknown || up.calls.Load() != 1 || strings.Contains(res.body, sentinel) {
		t.Fatalf("moved record: %d %s, calls %d; want 500 unknown, not executed", res.code(), res.body, up.calls.Load())
	}
	// Corrupted ciphertext on the record's own key fails the same way.
	garbled := *rec.Response
	garbled.Body = bytes.Clone(garbled.Body)
	garbled.Body[len(garbled.Body)-1] ^= 1
	third := storetest.NewKey(t)
	_, _ = s.Reserve(ctx, stores.Reservation{Key: third, Binding: rec.Binding, Owner: "o", Lease: time.Minute, TTL: time.Hour})
	sealedForThird, err := h.keys.current.seal(third, rec.Binding, stores.Response{Status: 200, Body: []byte("{}")})
	if err != nil {
		t.Fatal(err)
	}
	sealedForThird.Body[len(sealedForThird.Body)-1] ^= 1
	if err := s.Finalize(ctx, third, "o", sealedForThird); err != nil {
		t.Fatal(err)
	}
	if res := serve(t, h, up, "POST", commitPath, third, commitBody, "Authorization", auth); res.code() != 500 || up.calls.Load() != 1 {
		t.Fatalf("corrupted record: %d %s, calls %d", res.code(), res.body, up.calls.Load())
	}
	// The log says the secret is there and the seal is broken, not that
	// the secret is missing, which would send an operator looking for it.
	if n := logs.FilterMessageSnippet("does not open under the secret its key id names").Len(); n != 2 {
		t.Fatalf("%d log lines say the seal is broken, want 2 (moved, corrupted): %v", n, logs.All())
	}
}

// A record written in clear, before a secret was set, still matches its
// retry and replays once the secret is set; another request with its key is
// still refused.
func TestClearRecordReplaysAfterSecretIsSet(t *testing.T) {
	s := newMemoryStore(t)
	_, auth, up := vendedCredentials(t)
	key := storetest.NewKey(t)
	first := serve(t, newSecretHandler(t, s, ""), up, "POST", commitPath, key, commitBody, "Authorization", auth)
	if rec, _ := s.Load(context.Background(), key); rec == nil || rec.Response.KeyID != "" {
		t.Fatalf("record without a secret = %+v, want clear", rec)
	}

	h := newSecretHandler(t, s, "secret-A-"+randomHex(t, 16))
	res := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth)
	if res.header.Get(ReplayedHeader) != "true" || res.body != first.body || res.code() != 200 || up.calls.Load() != 1 {
		t.Fatalf("clear record under a secret: %d replayed=%q calls=%d", res.code(), res.header.Get(ReplayedHeader), up.calls.Load())
	}
	if res := serve(t, h, up, "POST", commitPath, key, `{"other":1}`, "Authorization", auth); res.code() != 422 {
		t.Fatalf("other body on a clear record under a secret: %d %s", res.code(), res.body)
	}
	if res := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", "Bearer other"); res.code() != 422 {
		t.Fatalf("other principal on a clear record under a secret: %d %s", res.code(), res.body)
	}
}

// Secrets come from placeholders expanded at provision. A placeholder that
// expands to nothing, or two secrets that are the same, are errors that
// never show a secret; the JSON keeps the placeholder.
func TestSecretPlaceholders(t *testing.T) {
	value := "secret-" + randomHex(t, 16)
	t.Setenv("ICEBERG_IDEMPOTENCY_TEST_SECRET", value)
	t.Setenv("ICEBERG_IDEMPOTENCY_TEST_SAME", value)
	t.Setenv("ICEBERG_IDEMPOTENCY_TEST_EMPTY", "")

	h := newSecretHandler(t, newMemoryStore(t), "{env.ICEBERG_IDEMPOTENCY_TEST_SECRET}")
	literal := newSecretHandler(t, newMemoryStore(t), value)
	if h.keys.current == nil || h.keys.current.id != literal.keys.current.id {
		t.Fatal("the placeholder did not expand to the secret it names")
	}
	out, _ := json.Marshal(h)
	if bytes.Contains(out, []byte(value)) || !bytes.Contains(out, []byte("{env.ICEBERG_IDEMPOTENCY_TEST_SECRET}")) {
		t.Fatalf("handler JSON %s: want the placeholder, not the value", out)
	}

	for _, tt := range []struct {
		secret   string
		previous []string
		want     string
	}{
		{"{env.ICEBERG_IDEMPOTENCY_TEST_EMPTY}", nil, `secret "{env.ICEBERG_IDEMPOTENCY_TEST_EMPTY}" expands to an empty value`},
		{"{env.ICEBERG_IDEMPOTENCY_TEST_SECRET}", []string{"{env.ICEBERG_IDEMPOTENCY_TEST_UNSET}"}, `previous_secrets[0] "{env.ICEBERG_IDEMPOTENCY_TEST_UNSET}" expands to an empty value`},
		{"{env.ICEBERG_IDEMPOTENCY_TEST_SECRET}", []string{"{env.ICEBERG_IDEMPOTENCY_TEST_SAME}"}, "secret and previous_secrets[0] derive the same key id"},
		// One part of a composite value expanding to nothing left the
		// rest as the secret, until the build after b35c62e.
		{"{env.ICEBERG_IDEMPOTENCY_TEST_SECRET}{env.ICEBERG_IDEMPOTENCY_TEST_UNSET}", nil, "secret: {env.ICEBERG_IDEMPOTENCY_TEST_UNSET} expands to an empty value"},
		{"{env.ICEBERG_IDEMPOTENCY_TEST_SECRET}", []string{"{file./nonexistent/iceberg-idempotency-secret}{env.ICEBERG_IDEMPOTENCY_TEST_SECRET}"}, "previous_secrets[0]: {file./nonexistent/iceberg-idempotency-secret} expands to an empty value"},
		// In JSON too: placeholders not read at start, and stray braces.
		{"{http.request.header.X-Secret}", nil, "secret holds a {http.…} placeholder at byte 0 of its value, which is not read at start"},
		{"{env.ICEBERG_IDEMPOTENCY_TEST_SECRET", nil, "secret holds a placeholder that is not closed"},
		// Kept as written, it was taken for 21 literal bytes of the secret.
		{"{env.ICEBERG_IDEMPOTENCY_TEST_SECRET}{unknown.placeholder}", nil, "secret holds a placeholder in a namespace Caddy does not know (a misspelt {env.NAME}?) at byte 37"},
	} {
		h := &Handler{Secret: tt.secret, PreviousSecrets: tt.previous}
		err := h.prepare()
		if err == nil || !strings.Contains(err.Error(), tt.want) || strings.Contains(err.Error(), value) {
			t.Errorf("secret %q, previous %q: prepare = %v, want %q", tt.secret, tt.previous, err, tt.want)
		}
	}
	for _, tt := range []struct {
		h    Handler
		want string
	}{
		{Handler{Secret: "{env.A}", PreviousSecrets: []string{"{env.A}"}}, "previous_secrets[0] repeats secret"},
		{Handler{Secret: "{env.A}", PreviousSecrets: []string{"{env.B}", ""}}, "previous_secrets[1] is empty"},
		{Handler{PreviousSecrets: []string{"{env.B}", "{env.B}"}}, "previous_secrets[1] repeats previous_secrets[0]"},
	} {
		if err := tt.h.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Validate = %v, want %q", err, tt.want)
		}
	}
}

// A store outside the process without a secret: one warning, or with
// require_secret a refusal to start. The memory store needs neither.
func TestRecordsInClearWarningAndRequireSecret(t *testing.T) {
	for _, tt := range []struct {
		name     string
		provider StoreProvider
		secret   string
		require  bool
		warn     bool
		refuse   bool
	}{
		{"memory", &MemoryStore{}, "", false, false, false},
		{"memory, require_secret", &MemoryStore{}, "", true, false, false},
		{"postgres", &PostgresStore{}, "", false, true, false},
		{"mysql", &MySQLStore{}, "", false, true, false},
		{"postgres, require_secret", &PostgresStore{}, "", true, false, true},
		{"mysql, require_secret", &MySQLStore{}, "", true, false, true},
		{"postgres with a secret", &PostgresStore{}, "secret-" + randomHex(t, 16), true, false, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := &Handler{Secret: tt.secret, RequireSecret: tt.require}
			if err := h.prepare(); err != nil {
				t.Fatal(err)
			}
			core, logs := observer.New(zapcore.WarnLevel)
			h.logger = zap.New(core)
			err := h.checkAtRest(tt.provider)
			if refused := err != nil; refused != tt.refuse {
				t.Fatalf("checkAtRest = %v, want refused=%v", err, tt.refuse)
			}
			warned := logs.FilterMessageSnippet("records are stored in clear").Len()
			if tt.warn && warned != 1 || !tt.warn && warned != 0 {
				t.Fatalf("%d clear-text warnings, want warn=%v", warned, tt.warn)
			}
		})
	}

	// Through Provision, as Caddy runs it.
	h := &Handler{
		StoreRaw:      json.RawMessage(`{"backend": "postgres", "dsn": "postgres://caddy@127.0.0.1:1/none"}`),
		RequireSecret: true,
	}
	if err := h.Provision(newCaddyContext(t)); err == nil || !strings.Contains(err.Error(), "require_secret") {
		t.Fatalf("Provision with require_secret and no secret on postgres = %v, want refused", err)
	}
	_ = h.Cleanup()
}

// The Caddyfile options: placeholders kept as written, errors on their line.
func TestSecretCaddyfile(t *testing.T) {
	out, err := adapt(t, ":8080 {\n\ticeberg_idempotency {\n\t\tsecret {env.S}\n\t\tprevious_secrets {env.P1} {file./run/p2}\n\t\trequire_secret\n\t}\n\treverse_proxy 127.0.0.1:1\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"secret":"{env.S}"`, `"previous_secrets":["{env.P1}","{file./run/p2}"]`, `"require_secret":true`} {
		if !strings.Contains(string(out), want) {
			t.Errorf("adapted JSON lacks %s: %s", want, out)
		}
	}
	literal := "literal-" + randomHex(t, 8)
	for _, tt := range []struct{ name, block, want, at string }{
		{"secret without value", "iceberg_idempotency {\n\t\tsecret\n\t}", "secret needs a value", "at Caddyfile:3"},
		{"secret two values", "iceberg_idempotency {\n\t\tsecret " + literal + " x\n\t}", "secret takes a single value", "at Caddyfile:3"},
		{"previous without value", "iceberg_idempotency {\n\t\tprevious_secrets\n\t}", "previous_secrets needs at least one secret", "at Caddyfile:3"},
		{"require_secret argument", "iceberg_idempotency {\n\t\trequire_secret yes\n\t}", `require_secret must be on or off, got "yes"`, "at Caddyfile:3"},
		{"previous repeats secret", "iceberg_idempotency {\n\t\tsecret {env.S}\n\t\tprevious_secrets {env.S}\n\t}", "previous_secrets[0] repeats secret", "at Caddyfile:4"},
		// A secret kept as written, or as what anyone can read, until the
		// build after b35c62e, with a warning only: a relative file name
		// (the Caddyfile's shorthand for the request path's file), a
		// misspelt or unclosed placeholder, one not read at start.
		{"relative file", "iceberg_idempotency {\n\t\tsecret {file.idem_secret}\n\t}", "reads {file.idem_secret} (a name without", "at Caddyfile:3"},
		{"misspelt namespace", "iceberg_idempotency {\n\t\tsecret {evn.S}\n\t}", "holds a placeholder in a namespace Caddy does not know (a misspelt {env.NAME}?) at byte 0", "at Caddyfile:3"},
		{"unclosed", "iceberg_idempotency {\n\t\tsecret {env.S\n\t}", "holds a placeholder that is not closed", "at Caddyfile:3"},
		{"previous not read at start", "iceberg_idempotency {\n\t\tsecret {env.S}\n\t\tprevious_secrets {env.P} {system.hostname}\n\t}", "previous_secrets[1] holds a {system.…} placeholder at byte 0 of its value", "at Caddyfile:4"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := adapt(t, ":8080 {\n\t"+tt.block+"\n\treverse_proxy 127.0.0.1:1\n}\n")
			if err == nil || !strings.Contains(err.Error(), tt.want) || !strings.HasSuffix(err.Error(), tt.at) || strings.Contains(err.Error(), literal) {
				t.Fatalf("error = %v, want it to contain %q and end with %q, without the value", err, tt.want, tt.at)
			}
		})
	}
}

// A literal secret may hold braces that make no placeholder name, as
// before the placeholder checks (which at first refused them, and quoted the
// piece between them in the error); one that looks like a placeholder in an
// unknown namespace is refused without its text.
func TestLiteralSecretWithBraces(t *testing.T) {
	for _, raw := range []string{"Xy7q{pa55-w0rd}Zr9Lm2Nb4Vc6", "Ab3}cD9{eF7-gH5iJ1kL", "a\\{b\\}c-" + randomHex(t, 16)} {
		h := &Handler{Secret: raw}
		if err := h.prepare(); err != nil || h.keys.current == nil {
			t.Errorf("literal secret with braces: prepare = %v", err)
		}
	}
	for _, raw := range []string{"Xy7q{pa55.w0rd}Zr9Lm2Nb4Vc6", "Kx7{http.vars.w0rdpa55}q"} {
		h := &Handler{Secret: raw}
		if err := h.prepare(); err == nil || strings.Contains(err.Error(), "pa55") || strings.Contains(err.Error(), "w0rd") {
			t.Errorf("a secret holding %s: prepare = %v, want an error that does not quote it", raw, err)
		}
	}
}

// The stored binding with a secret is keyed: without the secret, it cannot
// be recomputed from a guessed Authorization value.
func TestKeyedBinding(t *testing.T) {
	parts := requestParts{principal: "Basic dXNlcjpwYXNz", method: "POST", path: commitPath, body: []byte(commitBody)}
	a, _ := deriveKeys("secret-A-0123456789abcdef")
	b, _ := deriveKeys("secret-B-0123456789abcdef")
	clear := parts.binding("updateTable", nil)
	ba, bb := parts.binding("updateTable", a), parts.binding("updateTable", b)
	if clear.Principal != sha256Hex([]byte(parts.principal)) || ba.Principal == clear.Principal || ba.Principal == bb.Principal ||
		ba.Fingerprint == clear.Fingerprint || ba.Fingerprint == bb.Fingerprint || ba.Principal == ba.Fingerprint {
		t.Fatalf("bindings: clear %+v, A %+v, B %+v; want each keyed apart", clear, ba, bb)
	}
	if again, _ := deriveKeys("secret-A-0123456789abcdef"); again.id != a.id || parts.binding("updateTable", again) != ba || len(a.id) != 8 {
		t.Fatal("key derivation is not stable")
	}
}

// The cost of sealing and opening a stored response, for the README.
func BenchmarkSealOpen(b *testing.B) {
	k, err := deriveKeys("bench-secret-0123456789abcdef")
	if err != nil {
		b.Fatal(err)
	}
	binding := stores.Binding{Operation: "updateTable", Path: commitPath, Principal: strings.Repeat("a", 64), Fingerprint: strings.Repeat("b", 64)}
	key := "01890a5d-ac96-774b-bcce-b302099a8057"
	for _, size := range []int{2 << 10, 1 << 20} {
		body := bytes.Repeat([]byte("x"), size)
		resp := stores.Response{Status: http.StatusOK, Header: http.Header{"Content-Type": {"application/json"}, "Etag": {`"v1"`}}, Body: body}
		b.Run(fmt.Sprintf("%dB", size), func(b *testing.B) {
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				sealed, err := k.seal(key, binding, resp)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := k.open(key, binding, sealed.Body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// seal and open round-trip every status, header and body exactly, and a
// truncated or foreign ciphertext does not open.
func TestSealRoundTrip(t *testing.T) {
	k, _ := deriveKeys("secret-A-0123456789abcdef")
	other, _ := deriveKeys("secret-B-0123456789abcdef")
	key := storetest.NewKey(t)
	b := stores.Binding{Operation: "updateTable", Path: commitPath, Principal: "p", Fingerprint: "f"}
	for _, resp := range []stores.Response{
		{Status: 204, Header: http.Header{}},
		{Status: 200, Header: http.Header{"Content-Type": {"application/json"}, "Cache-Control": {"no-store", "private"}, "Etag": {""}}, Body: []byte(`{"a":1}`)},
		{Status: 409, Body: bytes.Repeat([]byte{0, 0xff}, 4096)},
	} {
		sealed, err := k.seal(key, b, resp)
		if err != nil {
			t.Fatal(err)
		}
		again, _ := k.seal(key, b, resp)
		if bytes.Equal(sealed.Body, again.Body) {
			t.Fatal("two seals of one response are equal: the nonce is not fresh")
		}
		opened, err := k.open(key, b, sealed.Body)
		if err != nil {
			t.Fatal(err)
		}
		if opened.Status != resp.Status || !bytes.Equal(opened.Body, resp.Body) || len(opened.Header) != len(resp.Header) {
			t.Fatalf("opened %d %v %q, want %d %v %q", opened.Status, opened.Header, opened.Body, resp.Status, resp.Header, resp.Body)
		}
		for name, vals := range resp.Header {
			if fmt.Sprint(opened.Header[name]) != fmt.Sprint(vals) {
				t.Fatalf("header %s = %q, want %q", name, opened.Header[name], vals)
			}
		}
		changed := b
		changed.Fingerprint = "g"
		for what, err := range map[string]error{
			"truncated":          func() error { _, err := k.open(key, b, sealed.Body[:len(sealed.Body)-1]); return err }(),
			"another secret":     func() error { _, err := other.open(key, b, sealed.Body); return err }(),
			"another binding":    func() error { _, err := k.open(key, changed, sealed.Body); return err }(),
			"another record key": func() error { _, err := k.open(storetest.NewKey(t), b, sealed.Body); return err }(),
		} {
			if err == nil {
				t.Errorf("%s: opened", what)
			}
		}
	}
}

// A retry that matched an in-flight record written before a secret was set
// (through the unkeyed alternative) and waited, then found the key
// released, reserves it under the current secret. Before, it kept the
// binding it had adopted from the released record: its own record carried
// the unkeyed SHA-256 of Authorization, which a store under a secret must
// not hold. If the retry reaches Reserve before the release (a slow
// machine), it executes under its own binding anyway: the test cannot fail
// for that reason, only miss the case.
func TestRetryAfterReleaseBindsUnderCurrentSecret(t *testing.T) {
	s := newMemoryStore(t)
	auth := "Bearer token-" + randomHex(t, 12)
	key := storetest.NewKey(t)

	// A config without a secret holds the first request in flight; after a
	// reload that turns secret B on, the retry matches its clear record
	// through the unkeyed alternative and waits until it is released.
	hSecret := newSecretHandler(t, s, "secret-B-"+randomHex(t, 16))
	r := retryAfterRelease(t, newSecretHandler(t, s, ""), hSecret, answering(200, `{"ok":true}`), key, auth)
	rec, _ := s.Load(context.Background(), key)
	unkeyed := sha256Hex([]byte(auth))
	if r.code() != http.StatusOK || rec == nil || rec.Response == nil || rec.Response.KeyID == "" {
		t.Fatalf("retry = %d, record %+v; want it executed and its answer sealed", r.code(), rec)
	}
	if rec.Principal == unkeyed {
		t.Fatalf("record reserved under secret B carries the unkeyed SHA-256 of Authorization as its principal")
	}
}

// The same during a rotation from A to B: the record the retry creates is
// bound under B, as it is sealed, so once A is dropped (the last step of a
// rotation) the next retry is replayed. Before, it was bound under A and
// that retry was refused 422 "already in use by another principal".
func TestRetryAfterReleaseReplaysOnceOldSecretIsDropped(t *testing.T) {
	s := newMemoryStore(t)
	auth := "Bearer token-" + randomHex(t, 12)
	key := storetest.NewKey(t)
	secretA, secretB := "secret-A-"+randomHex(t, 16), "secret-B-"+randomHex(t, 16)

	up := answering(200, `{"ok":true}`)
	hB := newSecretHandler(t, s, secretB, secretA)
	if r := retryAfterRelease(t, newSecretHandler(t, s, secretA), hB, up, key, auth); r.code() != 200 {
		t.Fatalf("executing retry = %d", r.code())
	}
	// Rotation finished: A dropped.
	hBonly := newSecretHandler(t, s, secretB)
	r := serve(t, hBonly, up, "POST", commitPath, key, commitBody, "Authorization", auth)
	if r.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
		t.Fatalf("retry once A is dropped = %d %s (replayed %q, catalog called %d times); want the stored answer replayed",
			r.code(), r.body, r.header.Get(ReplayedHeader), up.calls.Load())
	}
}

// retryAfterRelease sends a keyed commit through first and holds it at the
// catalog, sends its retry through retry (which waits for it), then lets
// the catalog answer the first 503, which releases the key: the retry
// executes against up, and its answer is returned.
func retryAfterRelease(t *testing.T, first, retry *Handler, up *upstream, key, auth string) result {
	t.Helper()
	arrived, answer := make(chan struct{}), make(chan struct{})
	held := &upstream{answer: func(w http.ResponseWriter, r *http.Request) error {
		_, _ = io.ReadAll(r.Body)
		close(arrived)
		<-answer
		w.WriteHeader(http.StatusServiceUnavailable)
		return nil
	}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		serve(t, first, held, "POST", commitPath, key, commitBody, "Authorization", auth)
	}()
	<-arrived
	retry.InFlightWait = caddy.Duration(5 * time.Second)
	res := make(chan result, 1)
	go func() { res <- serve(t, retry, up, "POST", commitPath, key, commitBody, "Authorization", auth) }()
	time.Sleep(50 * time.Millisecond) // the retry waits meanwhile; if not yet, it reserves after the release
	close(answer)
	<-done
	return <-res
}

// Sealed records, keyed bindings and key ids outlive the build that wrote
// them: nodes of different builds share a store during a rolling upgrade,
// and a rollback reads what the newer build wrote. So what a secret
// derives, what a binding hashes and how a response is sealed never change
// without a new sealFormat (and the old layout still read): a record
// sealed by the build of 2026-12-05 under a known secret must open to
// its answer, under the same key id and binding. The seal layout changed
// once without that (13ddade), and records of the builds on either side of
// it could not read one another's: 500 on every retry.
func TestSealedRecordLayoutIsStable(t *testing.T) {
	k, err := deriveKeys("golden-secret-0123456789")
	if err != nil {
		t.Fatal(err)
	}
	if k.id != "02c46e53" {
		t.Fatalf("key id %s, want 02c46e53", k.id)
	}
	p := requestParts{principal: "Bearer x", method: "POST", path: "/v1/wh/namespaces/ns/tables/t", body: []byte(`{"updates":[]}`)}
	b := p.binding("updateTable", k)
	if b.Principal != "d9f82fc8a7d813af7fb676d8baae41e69f4f88e2bad660d8f5f9b475e7cd9996" ||
		b.Fingerprint != "a607ce049e903220c91bb9e82dcd5b52d4697895023f3c81647e994268e36b0d" {
		t.Fatalf("binding %+v changed", b)
	}
	sealed, _ := hex.DecodeString("4cf7a3023df79f697e629f455ae5eba8bb3f08025346980f66e7bde45ebabec2c356fdbac9da15fceb002abee7d5cab374798553fb75542665532aaaf1aa9e57086bfd637a56605a73e0e7ae03112fbeb2700506d5bb8c9ec16f774bd478ba64d37aa49609c67845a53076f9f25117291e7b12")
	resp, err := k.open("019386a4-1b2c-7d3e-8f40-123456789abc", b, sealed)
	if err != nil {
		t.Fatalf("a record sealed by an earlier build does not open: %v", err)
	}
	want := stores.Response{Status: 200, Header: http.Header{"Content-Type": {"application/json"}, "Etag": {`"e1"`}},
		Body: []byte(`{"metadata-location":"s3://w/t/m/1.json"}`)}
	if resp.Status != want.Status || !reflect.DeepEqual(resp.Header, want.Header) || !bytes.Equal(resp.Body, want.Body) {
		t.Fatalf("opened %d %v %s, want %d %v %s", resp.Status, resp.Header, resp.Body, want.Status, want.Header, want.Body)
	}
}

// A secret is warned of when the configuration holds it, or part of it:
// until the build after 068a81b, "AUDIT{env.X}" got no warning, though the
// admin API and caddy adapt show its literal part.
func TestSecretWrittenLiterallyWarning(t *testing.T) {
	t.Setenv("ICEBERG_TEST_SECRET", "secret-"+randomHex(t, 16))
	for _, tt := range []struct{ raw, want string }{
		{"{env.ICEBERG_TEST_SECRET}", ""},
		{"secret-" + randomHex(t, 16), "secret is written literally"},
		{"prefix-{env.ICEBERG_TEST_SECRET}", "7 bytes of secret are written literally"},
	} {
		h := &Handler{Secret: tt.raw}
		_, warnings, err := h.prepareKeys()
		if err != nil {
			t.Fatal(err)
		}
		got := strings.Join(warnings, "\n")
		if tt.want == "" && strings.Contains(got, "literally") || tt.want != "" && !strings.Contains(got, tt.want) {
			t.Errorf("%q: warnings %q, want %q", tt.raw, got, tt.want)
		}
		if strings.Contains(got, os.Getenv("ICEBERG_TEST_SECRET")) {
			t.Errorf("%q: a warning shows the secret", tt.raw)
		}
	}
}
