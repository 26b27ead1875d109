package icebergidempotency

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// bindingUnder is the binding a handler with secret ("" for none) gives
// the commit sent with auth.
func bindingUnder(t *testing.T, secret, auth string) stores.Binding {
	t.Helper()
	h := newSecretHandler(t, newMemoryStore(t), secret)
	parts := requestParts{principal: auth, method: http.MethodPost, path: commitPath, body: []byte(commitBody)}
	return parts.binding("updateTable", h.keys.current)
}

// A record that is not final yet, written under a secret no longer
// configured (dropped without keeping it in previous_secrets), matches its
// retry in nothing: the retry gets the answer its own record would give
// (in flight: 503; abandoned: outcome unknown), never 422 "another
// principal", which tells a commit client its commit failed when it may
// have happened. Another principal sending the same body is still told 422.
func TestRecordUnderDroppedSecretIsNotAnotherPrincipals(t *testing.T) {
	secretA := "secret-A-" + randomHex(t, 16)
	_, auth, up := vendedCredentials(t)
	for _, abandoned := range []bool{false, true} {
		for _, now := range []string{"secret-B-" + randomHex(t, 16), ""} {
			s := newMemoryStore(t)
			key := storetest.NewKey(t)
			ctx := context.Background()
			res, err := s.Reserve(ctx, stores.Reservation{Key: key, Binding: bindingUnder(t, secretA, auth), Owner: "o1", Lease: time.Minute, TTL: time.Hour})
			if err != nil || !res.Reserved {
				t.Fatal(res, err)
			}
			if abandoned {
				if err := s.Abandon(ctx, key, "o1"); err != nil {
					t.Fatal(err)
				}
			}
			h := newSecretHandler(t, s, now)
			h.InFlightWait = 1
			r := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth)
			want, wantType := http.StatusServiceUnavailable, typeUnavailable
			if abandoned {
				want, wantType = http.StatusInternalServerError, typeCommitStateUnknown
			}
			if r.code() != want || r.errorType() != wantType {
				t.Errorf("abandoned=%v, a secret now %v: retry answered %d %s, want %d %s", abandoned, now != "", r.code(), r.body, want, wantType)
			}
		}
	}
	if n := up.calls.Load(); n != 0 {
		t.Fatalf("the catalog was called %d times", n)
	}

	// Under the record's own secret, another principal with the same body
	// is told the key is another principal's.
	s := newMemoryStore(t)
	key := storetest.NewKey(t)
	if res, err := s.Reserve(context.Background(), stores.Reservation{Key: key, Binding: bindingUnder(t, secretA, auth), Owner: "o1", Lease: time.Minute, TTL: time.Hour}); err != nil || !res.Reserved {
		t.Fatal(res, err)
	}
	h := newSecretHandler(t, s, secretA)
	h.InFlightWait = 1
	r := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", "Bearer someone-else")
	if r.code() != http.StatusUnprocessableEntity || !strings.Contains(r.body, "another principal") {
		t.Fatalf("another principal answered %d %s, want 422 another principal", r.code(), r.body)
	}
}

// With a secret set every response is sealed, so a response in clear under
// a binding keyed by the secret was written by someone who cannot seal (a
// writer of the database): it is not replayed, and the retry hears the
// answer for a record that cannot be read. A clear record written before
// the secret was set, under an unkeyed binding, still replays.
func TestClearResponseUnderKeyedBindingIsNotReplayed(t *testing.T) {
	secret := "secret-A-" + randomHex(t, 16)
	_, auth, up := vendedCredentials(t)
	forged := `{"metadata-location":"s3://attacker/evil.json"}`
	for _, tt := range []struct {
		name, bindSecret string
		replays          bool
	}{
		{"keyed binding, clear response", secret, false},
		{"written before the secret", "", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := newMemoryStore(t)
			key := storetest.NewKey(t)
			ctx := context.Background()
			if res, err := s.Reserve(ctx, stores.Reservation{Key: key, Binding: bindingUnder(t, tt.bindSecret, auth), Owner: "o", Lease: time.Minute, TTL: time.Hour}); err != nil || !res.Reserved {
				t.Fatal(res, err)
			}
			if err := s.Finalize(ctx, key, "o", stores.Response{Status: 200, Body: []byte(forged)}); err != nil {
				t.Fatal(err)
			}
			// With the secret, and with encryption turned off the README's
			// way (secret dropped, kept in previous_secrets), where the
			// forged body was replayed before.
			for name, h := range map[string]*Handler{
				"secret":               newSecretHandler(t, s, secret),
				"encryption off, kept": newSecretHandler(t, s, "", secret),
			} {
				r := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth)
				if got := r.body == forged; got != tt.replays {
					t.Fatalf("%s: answered %d %s, want replayed=%v", name, r.code(), r.body, tt.replays)
				}
				if !tt.replays && (r.code() != http.StatusInternalServerError || r.errorType() != typeCommitStateUnknown) {
					t.Fatalf("%s: answered %d %s, want 500 CommitStateUnknownException", name, r.code(), r.body)
				}
			}
		})
	}
	if n := up.calls.Load(); n != 0 {
		t.Fatalf("the catalog was called %d times", n)
	}
}

// Encryption turned off the README's way (secret dropped, kept in
// previous_secrets) under abandoned reexecute: a takeover of a record
// bound under the old secret seals its answer under that secret, so that
// a node that still has it as secret (a rolling deploy) replays it too.
// Before, the answer was stored in clear under the keyed binding, which a
// node with the secret takes for an altered record: 500 unknown.
func TestTakeoverWithEncryptionOffSealsUnderTheMatchedSecret(t *testing.T) {
	old := "secret-A-" + randomHex(t, 16)
	_, auth, up := vendedCredentials(t)
	s := newMemoryStore(t)
	key := abandonedUnder(t, s, old, auth)
	ctx := context.Background()
	off := newSecretHandler(t, s, "", old)
	off.Abandoned = abandonedReexecute
	if first := serve(t, off, up, "POST", commitPath, key, commitBody, "Authorization", auth); first.code() != 200 {
		t.Fatalf("takeover answered %d %s", first.code(), first.body)
	}
	if rec, _ := s.Load(ctx, key); rec == nil || rec.Response == nil || rec.Response.KeyID == "" {
		t.Fatalf("the taken-over answer is stored in clear under a keyed binding: %+v", rec)
	}
	for name, h := range map[string]*Handler{"encryption off": off, "secret still on": newSecretHandler(t, s, old)} {
		if r := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth); r.header.Get(ReplayedHeader) != "true" {
			t.Errorf("%s: retry answered %d %s, want the replay", name, r.code(), r.body)
		}
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("the catalog was called %d times, want 1", n)
	}
}

// A record bound under secret A and taken over (abandoned reexecute) by a
// node with secret B and previous A keeps its binding under A, and the
// takeover extends its life. Once A is dropped, its retries cannot be
// matched: they get the 500 of a record that cannot be read, never 422
// (which a commit client reads as a failed commit) and never a second
// execution. Before, the answer was sealed under B: the record opened, the
// binding differed, and the retry of the executed commit heard 422
// "another principal".
func TestTakenOverRecordOnceItsSecretIsDropped(t *testing.T) {
	old, cur := "secret-A-"+randomHex(t, 16), "secret-B-"+randomHex(t, 16)
	_, auth, up := vendedCredentials(t)
	s := newMemoryStore(t)
	key := abandonedUnder(t, s, old, auth)
	h := newSecretHandler(t, s, cur, old)
	h.Abandoned = abandonedReexecute
	if first := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth); first.code() != 200 {
		t.Fatalf("takeover answered %d %s", first.code(), first.body)
	}
	if r := serve(t, newSecretHandler(t, s, cur, old), up, "POST", commitPath, key, commitBody, "Authorization", auth); r.header.Get(ReplayedHeader) != "true" {
		t.Fatalf("retry with A still in previous_secrets answered %d %s, want the replay", r.code(), r.body)
	}
	dropped := newSecretHandler(t, s, cur)
	dropped.Abandoned = abandonedReexecute
	r := serve(t, dropped, up, "POST", commitPath, key, commitBody, "Authorization", auth)
	if r.code() != http.StatusInternalServerError || r.errorType() != typeCommitStateUnknown {
		t.Errorf("retry once A is dropped answered %d %s, want 500 %s", r.code(), r.body, typeCommitStateUnknown)
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("the catalog was called %d times, want 1", n)
	}
}

// takeOverReplyLost commits a TakeOver but reports false, as a Redis
// cluster client that resends the script after a network error does.
type takeOverReplyLost struct{ stores.Store }

func (s takeOverReplyLost) TakeOver(ctx context.Context, key, oldOwner, newOwner string, lease, ttl time.Duration) (bool, error) {
	_, err := s.Store.TakeOver(ctx, key, oldOwner, newOwner, lease, ttl)
	return false, err
}

// A takeover (abandoned reexecute) of a record bound under the previous
// secret whose TakeOver committed but reported false: the next round finds
// the request's own record and executes it, under that record's binding,
// so that the answer opens and replays. Before, the round's binding was the
// request's own under the current secret: the answer was sealed against a
// binding the row does not hold, and every retry heard 500 "unknown".
func TestOwnRecordAfterALostTakeOverReplyKeepsItsBinding(t *testing.T) {
	old, cur := "secret-A-"+randomHex(t, 16), "secret-B-"+randomHex(t, 16)
	_, auth, up := vendedCredentials(t)
	s := newMemoryStore(t)
	key := abandonedUnder(t, s, old, auth)
	h := newSecretHandler(t, takeOverReplyLost{s}, cur, old)
	h.Abandoned = abandonedReexecute
	if first := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth); first.code() != 200 || up.calls.Load() != 1 {
		t.Fatalf("takeover answered %d %s, catalog called %d times; want 200 once", first.code(), first.body, up.calls.Load())
	}
	retry := serve(t, newSecretHandler(t, s, cur, old), up, "POST", commitPath, key, commitBody, "Authorization", auth)
	if retry.header.Get(ReplayedHeader) != "true" || up.calls.Load() != 1 {
		t.Fatalf("retry answered %d %s, catalog called %d times; want the replay of the one execution", retry.code(), retry.body, up.calls.Load())
	}
}

// abandonedUnder reserves a new key in s for the commit sent with auth,
// bound under secret, abandons it and returns the key.
func abandonedUnder(t *testing.T, s stores.Store, secret, auth string) string {
	t.Helper()
	key := storetest.NewKey(t)
	ctx := context.Background()
	if res, err := s.Reserve(ctx, stores.Reservation{Key: key, Binding: bindingUnder(t, secret, auth), Owner: "o1", Lease: time.Minute, TTL: time.Hour}); err != nil || !res.Reserved {
		t.Fatal(res, err)
	}
	if err := s.Abandon(ctx, key, "o1"); err != nil {
		t.Fatal(err)
	}
	return key
}

// A sealed final record whose stored binding was rewritten in the database
// (its principal, fingerprint or path) no longer opens: its AEAD's
// associated data is the binding as stored. Its retry now hears the answer
// for a record that cannot be read, as for any altered record, where the
// binding's comparison came first and told it 422 ("another principal",
// "different request body"), which a commit client reads as a failed
// commit (until the build after b35c62e). A request that does differ from
// an intact record is still told 422.
func TestSealedRecordWithAlteredBindingIsUnreadable(t *testing.T) {
	secret := "secret-A-" + randomHex(t, 16)
	_, auth, up := vendedCredentials(t)
	first := newSecretHandler(t, newMemoryStore(t), secret)
	key := storetest.NewKey(t)
	serve(t, first, up, "POST", commitPath, key, commitBody, "Authorization", auth)
	rec, err := first.store.Load(context.Background(), key)
	if err != nil || rec == nil || rec.Response == nil || rec.Response.KeyID == "" {
		t.Fatalf("sealed record = %+v, %v", rec, err)
	}
	other := bindingUnder(t, secret, "Bearer someone-else")
	for _, tt := range []struct {
		name  string
		alter func(*stores.Binding)
	}{
		{"principal", func(b *stores.Binding) { b.Principal = other.Principal }},
		{"fingerprint", func(b *stores.Binding) { b.Fingerprint = strings.Repeat("0", len(b.Fingerprint)) }},
		{"path", func(b *stores.Binding) { b.Path += "x" }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := newMemoryStore(t)
			b := rec.Binding
			tt.alter(&b)
			ctx := context.Background()
			if res, err := s.Reserve(ctx, stores.Reservation{Key: key, Binding: b, Owner: "o", Lease: time.Minute, TTL: time.Hour}); err != nil || !res.Reserved {
				t.Fatal(res, err)
			}
			if err := s.Finalize(ctx, key, "o", *rec.Response); err != nil {
				t.Fatal(err)
			}
			h := newSecretHandler(t, s, secret)
			res := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth)
			if res.code() != http.StatusInternalServerError || res.errorType() != typeCommitStateUnknown {
				t.Fatalf("retry on a record whose %s was altered = %d %s, want 500 CommitStateUnknownException", tt.name, res.code(), res.body)
			}
		})
	}
	// Intact, the record still tells another principal 422.
	if res := serve(t, first, up, "POST", commitPath, key, commitBody, "Authorization", "Bearer someone-else"); res.code() != http.StatusUnprocessableEntity {
		t.Fatalf("another principal on an intact sealed record = %d %s, want 422", res.code(), res.body)
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("the catalog was called %d times, want 1", n)
	}
}

// With require_secret and a secret, every node seals what it stores, so a
// response in clear can only be a writer of the database's: one who knows
// a request's principal and body can rewrite its sealed record as one
// stored before the secret was set (the unkeyed binding, no key id, a body
// of their own). It is not replayed: its retry, and a request that differs
// from it, hear the answer for a record that cannot be read. Until the
// build after b35c62e it replayed the forged body. Without require_secret
// such a record still replays, so that turning a secret on loses none.
func TestRequireSecretRefusesResponsesInClear(t *testing.T) {
	secret := "secret-A-" + randomHex(t, 16)
	_, auth, up := vendedCredentials(t)
	forged := `{"metadata-location":"s3://attacker/evil.json"}`
	for _, require := range []bool{false, true} {
		t.Run(fmt.Sprint("require_secret=", require), func(t *testing.T) {
			s := newMemoryStore(t)
			key := storetest.NewKey(t)
			ctx := context.Background()
			if res, err := s.Reserve(ctx, stores.Reservation{Key: key, Binding: bindingUnder(t, "", auth), Owner: "o", Lease: time.Minute, TTL: time.Hour}); err != nil || !res.Reserved {
				t.Fatal(res, err)
			}
			if err := s.Finalize(ctx, key, "o", stores.Response{Status: 200, Body: []byte(forged)}); err != nil {
				t.Fatal(err)
			}
			h := newSecretHandler(t, s, secret)
			h.RequireSecret = require
			core, logs := observer.New(zapcore.ErrorLevel)
			h.logger = zap.New(core)
			retry := serve(t, h, up, "POST", commitPath, key, commitBody, "Authorization", auth)
			differs := serve(t, h, up, "POST", commitPath, key, `{"other":1}`, "Authorization", auth)
			if !require {
				if retry.body != forged || differs.code() != http.StatusUnprocessableEntity {
					t.Fatalf("without require_secret: retry %d %s, other body %d; want the record in clear replayed, 422", retry.code(), retry.body, differs.code())
				}
				return
			}
			for name, res := range map[string]result{"retry": retry, "other body": differs} {
				if res.code() != http.StatusInternalServerError || res.errorType() != typeCommitStateUnknown || strings.Contains(res.body, "attacker") {
					t.Fatalf("%s under require_secret = %d %s, want 500 CommitStateUnknownException", name, res.code(), res.body)
				}
			}
			// The log says what it is, not that a secret is missing.
			if n := logs.FilterMessageSnippet("in clear where this handler takes only sealed ones").Len(); n != 2 {
				t.Fatalf("%d log lines name a response in clear, want 2: %v", n, logs.All())
			}
		})
	}
	if n := up.calls.Load(); n != 0 {
		t.Fatalf("the catalog was called %d times, want 0", n)
	}
}
