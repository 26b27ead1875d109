package integration_test

// Issue 8, "nothing readable at rest", end to end: real Caddy processes with
// `secret {env.…}` in front of the counting backend, on PostgreSQL, MariaDB
// and (where nothing is read back from a database) the memory store. What is
// checked is what a client, the catalog, a database dump and the Caddy log
// show: a stored answer carrying vended credentials replays byte for byte,
// while the records table and the log hold neither those credentials nor
// the Authorization value nor any unkeyed SHA-256 of them; rotation keeps
// old records replaying until their secret is dropped; a record that cannot
// be decrypted (secret dropped, row moved to another key, node with another
// secret) is answered 500 CommitStateUnknownException and never executed
// again; a SQL store without a secret warns once that it stores in clear.
//
// The secrets reach Caddy through its process environment, as in
// production, so the Caddyfile (and the admin API's config) only ever hold
// the {env.…} placeholders.

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/testdb"
)

// The environment variables the tests put the secrets in.
const (
	secretEnvA = "ICEBERG_IDEMPOTENCY_TEST_SECRET_A"
	secretEnvB = "ICEBERG_IDEMPOTENCY_TEST_SECRET_B"
)

// createTablePath is a createTable: the kind of answer a credential-vending
// catalog fills with storage credentials.
const createTablePath = "/v1/namespaces/secrets/tables"

// createTableBody is a createTable request; only its bytes matter.
const createTableBody = `{"name":"vended","schema":{"type":"struct","schema-id":0,"fields":[{"id":1,"name":"id","type":"long","required":true}]}}`

// randomHex returns n random bytes, hex-encoded, behind prefix.
func randomHex(t testing.TB, prefix string, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return prefix + hex.EncodeToString(b)
}

// vendedAnswer is a createTable answer that vends storage credentials, the
// secret access key being sentinel.
func vendedAnswer(sentinel string) []byte {
	return []byte(`{"metadata-location":"s3://warehouse/secrets/vended/metadata/00000-1.metadata.json",` +
		`"metadata":{"format-version":2,"table-uuid":"0195f3d4-0000-7000-8000-000000000001","location":"s3://warehouse/secrets/vended"},` +
		`"config":{"s3.access-key-id":"AKIAIDEMPOTENCYTEST","s3.secret-access-key":"` + sentinel + `","s3.session-token":"FwoGZXIvYXdzEXAMPLE"}}`)
}

// secretStore is one store the tests run on: memory, or a fresh table on a
// SQL server.
type secretStore struct {
	name  string
	db    *sqlDB // nil for memory
	dsn   string
	table string
}

// block is the Caddyfile `store` subdirective.
func (s *secretStore) block() string {
	if s.db == nil {
		return "store memory"
	}
	return s.db.storeBlock(s.dsn, s.table)
}

// forEachSecretStore runs test once per SQL server, and on the memory store
// too when withMemory, as parallel subtests. Each SQL run gets a fresh table,
// created before test starts its nodes so it is dropped after they stop.
func forEachSecretStore(t *testing.T, withMemory bool, test func(t *testing.T, s *secretStore)) {
	t.Parallel()
	if withMemory {
		t.Run("memory", func(t *testing.T) {
			t.Parallel()
			test(t, &secretStore{name: "memory"})
		})
	}
	for _, db := range multiNodeDBs {
		t.Run(db.Name, func(t *testing.T) {
			t.Parallel()
			dsn := db.dsn(t)
			test(t, &secretStore{name: db.Name, db: db, dsn: dsn, table: db.newTable(t, dsn)})
		})
	}
}

// secretSite is a Caddyfile template guarding b with store and the handler
// options, with debug logs and the access log on, so that the log checks
// see everything the process could write about a request.
func secretSite(b *caddyproc.Backend, store string, options ...string) string {
	return caddyproc.Caddyfile("debug",
		"log\niceberg_idempotency {\n"+store+"\n"+strings.Join(options, "\n")+"\n}\nreverse_proxy "+b.Addr())
}

// secretEnv is the process environment carrying the secrets.
func secretEnv(secrets map[string]string) caddyproc.Options {
	var env []string
	for k, v := range secrets {
		env = append(env, k+"="+v)
	}
	return caddyproc.Options{Env: env}
}

// keyed sends a keyed POST with an Authorization header.
func keyed(t *testing.T, node *caddyproc.Instance, path, body, key, auth string) response {
	t.Helper()
	return send(t, http.MethodPost, node.URL()+path, body, keyHeader, key, "Authorization", auth)
}

// wantSameReplay checks a replay byte for byte: status, body and the
// replayed headers.
func wantSameReplay(t *testing.T, what string, r, orig response) {
	t.Helper()
	wantReplayOf(t, what, r, orig)
	for _, h := range replayHeaders {
		if got, want := r.Header.Values(h), orig.Header.Values(h); strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Errorf("%s: replayed %s = %q, original %q", what, h, got, want)
		}
	}
}

// unkeyedFingerprint is the request fingerprint as the module computed it
// before issue 8 (plain SHA-256 over length-prefixed method, path, query
// and body): what a dump must no longer let anyone test a guess against.
func unkeyedFingerprint(method, path, query, body string) string {
	h := sha256.New()
	for _, part := range []string{method, path, query, body} {
		fmt.Fprintf(h, "%d:%s", len(part), part)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func sha256String(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// leakNeedles are what must appear neither in a records dump nor in the log,
// by what they are: the vended credential, the Authorization value and the
// token in it, the secrets, and every unkeyed SHA-256 an offline guess could
// be tested against. Each is also looked for hex-encoded (how PostgreSQL
// renders bytea).
func leakNeedles(sentinel, auth, token, reqBody string, respBody []byte, path string, secrets ...string) map[string]string {
	n := map[string]string{
		"vended credential sentinel":                           sentinel,
		"Authorization value":                                  auth,
		"bearer token":                                         token,
		"SHA-256 of the Authorization value":                   sha256String(auth),
		"SHA-256 of the bearer token":                          sha256String(token),
		"SHA-256 of the request body":                          sha256String(reqBody),
		"SHA-256 of the response body":                         sha256String(string(respBody)),
		"unkeyed request fingerprint (pre-issue-8 SHA-256)":    unkeyedFingerprint(http.MethodPost, path, "", reqBody),
		"hex of the vended credential sentinel":                hex.EncodeToString([]byte(sentinel)),
		"hex of the Authorization value":                       hex.EncodeToString([]byte(auth)),
		"hex of the response body's first 32 bytes (in bytea)": hex.EncodeToString(respBody[:32]),
	}
	for i, s := range secrets {
		n[fmt.Sprintf("secret %d", i+1)] = s
		n[fmt.Sprintf("hex of secret %d", i+1)] = hex.EncodeToString([]byte(s))
	}
	return n
}

// wantNoLeak fails for every needle found in text (case-insensitively: hex
// may be rendered in either case), showing where.
func wantNoLeak(t *testing.T, where, text string, needles map[string]string) {
	t.Helper()
	lower := strings.ToLower(text)
	for name, needle := range needles {
		if i := strings.Index(lower, strings.ToLower(needle)); i >= 0 {
			t.Errorf("%s contains the %s: …%q…", where, name, text[max(0, i-200):min(len(text), i+len(needle)+50)])
		}
	}
}

// dumpRecords renders every row and column of the records table as text,
// as a database dump or a DBA's SELECT * would show it. PostgreSQL renders
// bytea in escape form (printable bytes as themselves) for this session
// only, so a clear-text body shows as text; MySQL values come as raw bytes.
func dumpRecords(t *testing.T, s *secretStore) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out string
	var err error
	switch s.db {
	case postgresDB:
		out, err = pgDump(ctx, s.dsn, s.table)
	case mysqlDB:
		out, err = myDump(ctx, s.dsn, s.table)
	default:
		t.Fatalf("no dump for store %s", s.name)
	}
	if err != nil {
		t.Fatalf("dumping %s: %v", s.table, err)
	}
	return out
}

func pgDump(ctx context.Context, dsn, table string) (string, error) {
	cmd := exec.CommandContext(ctx, "psql", "-X", "-q", "-A", "-v", "ON_ERROR_STOP=1", "-d", dsn,
		"-c", "SET bytea_output = 'escape'", "-c", "SELECT * FROM "+table)
	cmd.Env = append(os.Environ(), "PGCONNECT_TIMEOUT=5")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("psql: %v: %s", err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

func myDump(ctx context.Context, dsn, table string) (string, error) {
	db, _, err := testdb.OpenMySQL(dsn)
	if err != nil {
		return "", err
	}
	defer db.Close()
	rows, err := db.QueryContext(ctx, "SELECT * FROM "+table)
	if err != nil {
		return "", err
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString(strings.Join(cols, "|") + "\n")
	vals := make([]sql.RawBytes, len(cols))
	ptrs := make([]any, len(cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	for rows.Next() {
		if err := rows.Scan(ptrs...); err != nil {
			return "", err
		}
		for i, v := range vals {
			if i > 0 {
				b.WriteByte('|')
			}
			b.Write(v)
		}
		b.WriteByte('\n')
	}
	return b.String(), rows.Err()
}

// moveRecord rewrites a row's key column, as someone with write access to
// the database could.
func moveRecord(t *testing.T, s *secretStore, from, to string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	col := `"key"`
	if s.db == mysqlDB {
		col = "`key`"
	}
	stmt := fmt.Sprintf("UPDATE %s SET %s = '%s' WHERE %s = '%s'", s.table, col, to, col, from)
	if err := s.db.Exec(ctx, s.dsn, stmt); err != nil {
		t.Fatalf("moving the record: %v", err)
	}
	if dump := dumpRecords(t, s); !strings.Contains(dump, to) || strings.Contains(dump, from) {
		t.Fatalf("the record was not moved from %s to %s:\n%s", from, to, dump)
	}
}

// clearTextWarning matches a warning whose message says records are stored
// unencrypted (only the message: a test's temporary path may say ClearText).
var clearTextWarning = regexp.MustCompile(`(?i)"level":"warn"[^\n]*"msg":"[^"]*(in clear|clear[- ]?text|unencrypted|not encrypted|plain[- ]?text)`)

func countClearTextWarnings(logs string) int {
	return len(clearTextWarning.FindAllString(logs, -1))
}

// errorLinesWith counts the error-level log lines holding substr.
func errorLinesWith(node *caddyproc.Instance, substr string) int {
	return countLogLines([]*caddyproc.Instance{node}, `"level":"error"`, substr)
}

// TestSecretsNothingReadableAtRest: with a secret, a catalog answer vending
// credentials is replayed byte for byte (status, body, replayed headers),
// while the records table, dumped whole, and the Caddy log (debug and
// access log) hold neither the credential, nor the Authorization value,
// nor an unkeyed SHA-256 of either or of the bodies, nor the secret; the
// admin API's config shows the placeholder, not the secret.
func TestSecretsNothingReadableAtRest(t *testing.T) {
	forEachSecretStore(t, true, func(t *testing.T, s *secretStore) {
		secret := randomHex(t, "idem-secret-", 32)
		sentinel := randomHex(t, "SENTINEL-", 16)
		token := randomHex(t, "tok-", 16)
		auth := "Bearer " + token
		answer := vendedAnswer(sentinel)

		b := caddyproc.NewBackend(t)
		b.Script(createTablePath, caddyproc.Reply{Body: answer})
		node := caddyproc.StartWith(t, secretSite(b, s.block(), "secret {env."+secretEnvA+"}"),
			secretEnv(map[string]string{secretEnvA: secret}))

		key := newKey(t)
		orig := keyed(t, node, createTablePath, createTableBody, key, auth)
		wantStatus(t, "createTable", orig, http.StatusOK)
		wantExecuted(t, "createTable", orig)
		if string(orig.Body) != string(answer) {
			t.Fatalf("createTable answered %q, want the catalog's answer %q", orig.Body, answer)
		}
		for i := range 2 {
			wantSameReplay(t, fmt.Sprintf("retry %d", i+1), keyed(t, node, createTablePath, createTableBody, key, auth), orig)
		}
		// The same key with another body: a mismatch, which the module
		// explains in its log with the key.
		wantStatus(t, "another body", keyed(t, node, createTablePath, createTableBody+" ", key, auth),
			http.StatusUnprocessableEntity)
		wantCount(t, b, createTablePath, 1)

		needles := leakNeedles(sentinel, auth, token, createTableBody, answer, createTablePath, secret)
		if s.db != nil {
			dump := dumpRecords(t, s)
			if !strings.Contains(dump, key) {
				t.Fatalf("the dump of %s does not hold the key %s in clear (the `key` column is part of the contract):\n%s", s.table, key, dump)
			}
			wantNoLeak(t, "the records table dump", dump, needles)
		}

		waitLogs(t, node, "replaying stored response")
		waitLogs(t, node, "http.log.access")
		waitLogs(t, node, key)
		wantNoLeak(t, "the Caddy log", node.Logs(), needles)

		cfg := string(node.Config(t))
		if !strings.Contains(cfg, "{env."+secretEnvA+"}") {
			t.Errorf("the admin API's config does not show the secret's placeholder: %s", cfg)
		}
		wantNoLeak(t, "the admin API's config", cfg, map[string]string{"secret": secret})
	})
}

// TestSecretsRotation: records written under secret A replay once the
// config says `secret B` + `previous_secrets A` (loaded through the admin
// API), next to records written under B. With A dropped, a retry of A's
// record is answered 500 CommitStateUnknownException, every time, the
// catalog is not called again, and the error log names the key; B's record
// still replays.
func TestSecretsRotation(t *testing.T) {
	forEachSecretStore(t, true, func(t *testing.T, s *secretStore) {
		secretA, secretB := randomHex(t, "idem-a-", 32), randomHex(t, "idem-b-", 32)
		b := caddyproc.NewBackend(t)
		underA := secretSite(b, s.block(), "secret {env."+secretEnvA+"}")
		rotated := secretSite(b, s.block(), "secret {env."+secretEnvB+"}", "previous_secrets {env."+secretEnvA+"}")
		onlyB := secretSite(b, s.block(), "secret {env."+secretEnvB+"}")
		node := caddyproc.StartWith(t, underA, secretEnv(map[string]string{secretEnvA: secretA, secretEnvB: secretB}))
		const auth = "Bearer rotation"

		pathA, pathB := multiNodePath("rotation-a"), multiNodePath("rotation-b")
		keyA, keyB := newKey(t), newKey(t)
		origA := keyed(t, node, pathA, multiNodeBody, keyA, auth)
		wantStatus(t, "commit under A", origA, http.StatusOK)
		wantExecuted(t, "commit under A", origA)

		reload(t, node, rotated)
		wantSameReplay(t, "retry of A's record under secret B + previous_secrets A",
			keyed(t, node, pathA, multiNodeBody, keyA, auth), origA)
		origB := keyed(t, node, pathB, multiNodeBody, keyB, auth)
		wantStatus(t, "commit under B", origB, http.StatusOK)
		wantExecuted(t, "commit under B", origB)
		wantSameReplay(t, "retry of B's record", keyed(t, node, pathB, multiNodeBody, keyB, auth), origB)
		wantCount(t, b, pathA, 1)

		reload(t, node, onlyB)
		y := newTally()
		for i := range 3 {
			r := keyed(t, node, pathA, multiNodeBody, keyA, auth)
			y.add(pathA, keyA, r.Status)
			wantUnknown(t, fmt.Sprintf("retry %d of A's record after A was dropped", i+1), r)
		}
		wantCount(t, b, pathA, 1)
		wantSameReplay(t, "retry of B's record with only B", keyed(t, node, pathB, multiNodeBody, keyB, auth), origB)
		wantCount(t, b, pathB, 1)

		deadline := time.Now().Add(10 * time.Second)
		for errorLinesWith(node, keyA) == 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if errorLinesWith(node, keyA) == 0 {
			t.Errorf("no error-level log line names the undecryptable record's key %s", keyA)
		}
		wantNoLeak(t, "the Caddy log", node.Logs(), map[string]string{"secret A": secretA, "secret B": secretB})
		wantNoDuplicates(t, y.record("record's secret dropped from the config ("+s.name+")", b.Count(pathA), b.Count,
			"retries of a record sealed under a removed secret: 500 CommitStateUnknownException, never re-executed"))
	})
}

// TestSecretsRowMovedToAnotherKey: a record's row copied onto another key
// (UPDATE of the key column) does not decrypt under that key: a retry with
// the new key and the very same request is answered 500
// CommitStateUnknownException and the catalog is not called.
func TestSecretsRowMovedToAnotherKey(t *testing.T) {
	forEachSecretStore(t, false, func(t *testing.T, s *secretStore) {
		secret := randomHex(t, "idem-secret-", 32)
		b := caddyproc.NewBackend(t)
		node := caddyproc.StartWith(t, secretSite(b, s.block(), "secret {env."+secretEnvA+"}"),
			secretEnv(map[string]string{secretEnvA: secret}))
		const auth = "Bearer mover"

		path := multiNodePath("moved")
		from, to := newKey(t), newKey(t)
		orig := keyed(t, node, path, multiNodeBody, from, auth)
		wantStatus(t, "first commit", orig, http.StatusOK)
		wantExecuted(t, "first commit", orig)

		moveRecord(t, s, from, to)
		y := newTally()
		y.add(path, from, orig.Status)
		for i := range 3 {
			r := keyed(t, node, path, multiNodeBody, to, auth)
			y.add(path, to, r.Status)
			wantUnknown(t, fmt.Sprintf("request %d with the key the row was moved to", i+1), r)
		}
		wantCount(t, b, path, 1)
		row := y.record("row moved to another key ("+s.name+")", b.Count(path), b.Count,
			"the moved row does not decrypt under its new key: 500 CommitStateUnknownException, not executed")
		// Two keys, one execution: duplicates counted per key would hide a
		// second execution here, so count them against the one commit.
		if row.Executions != 1 {
			t.Errorf("%d executions, want 1", row.Executions)
		}
	})
}

// TestSecretsTwoNodes: two nodes sharing a table and a secret replay each
// other's records; a third node on the same table with another secret
// cannot read them and answers 500 CommitStateUnknownException without
// calling the catalog, and its attempt leaves the record intact for the
// nodes that can read it.
func TestSecretsTwoNodes(t *testing.T) {
	forEachSecretStore(t, false, func(t *testing.T, s *secretStore) {
		shared, other := randomHex(t, "idem-shared-", 32), randomHex(t, "idem-other-", 32)
		b := caddyproc.NewBackend(t)
		env := secretEnv(map[string]string{secretEnvA: shared, secretEnvB: other})
		sameSecret := secretSite(b, s.block(), "secret {env."+secretEnvA+"}")
		nodeA := caddyproc.StartWith(t, sameSecret, env)
		nodeB := caddyproc.StartWith(t, sameSecret, env)
		nodeC := caddyproc.StartWith(t, secretSite(b, s.block(), "secret {env."+secretEnvB+"}"), env)
		const auth = "Bearer shared"

		path := multiNodePath("shared")
		key := newKey(t)
		y := newTally()
		orig := keyed(t, nodeA, path, multiNodeBody, key, auth)
		y.add(path, key, orig.Status)
		wantStatus(t, "commit on A", orig, http.StatusOK)
		wantExecuted(t, "commit on A", orig)
		r := keyed(t, nodeB, path, multiNodeBody, key, auth)
		y.add(path, key, r.Status)
		wantSameReplay(t, "retry on B (same secret)", r, orig)
		for i := range 2 {
			r := keyed(t, nodeC, path, multiNodeBody, key, auth)
			y.add(path, key, r.Status)
			wantUnknown(t, fmt.Sprintf("retry %d on C (another secret)", i+1), r)
		}
		wantCount(t, b, path, 1)
		for _, n := range []*caddyproc.Instance{nodeA, nodeB} {
			r := keyed(t, n, path, multiNodeBody, key, auth)
			y.add(path, key, r.Status)
			wantSameReplay(t, fmt.Sprintf("retry on :%d after C's attempts", n.Port), r, orig)
		}
		wantCount(t, b, path, 1)
		wantNoDuplicates(t, y.record("node with another secret on a shared table ("+s.name+")", b.Count(path), b.Count,
			"same secret: replayed across nodes; other secret: 500 CommitStateUnknownException, never executed"))
	})
}

// TestSecretsClearTextWarning: a SQL store without a secret works as before
// and warns exactly once at startup that records are stored in clear; with
// a secret it does not warn. `require_secret` makes a secret-less SQL config
// fail to load (the running config keeps serving), and a secret whose
// placeholder expands to nothing fails to load with an error that names the
// placeholder, not a value.
func TestSecretsClearTextWarning(t *testing.T) {
	forEachSecretStore(t, false, func(t *testing.T, s *secretStore) {
		secret := randomHex(t, "idem-secret-", 32)
		b := caddyproc.NewBackend(t)
		node := caddyproc.StartWith(t, secretSite(b, s.block()), secretEnv(map[string]string{secretEnvA: secret}))

		path := multiNodePath("clear")
		key := newKey(t)
		orig := keyed(t, node, path, multiNodeBody, key, "Bearer clear")
		wantStatus(t, "commit without a secret", orig, http.StatusOK)
		wantSameReplay(t, "retry without a secret", keyed(t, node, path, multiNodeBody, key, "Bearer clear"), orig)
		waitLogs(t, node, s.db.openedLog)
		deadline := time.Now().Add(5 * time.Second)
		for countClearTextWarnings(node.Logs()) == 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if n := countClearTextWarnings(node.Logs()); n != 1 {
			t.Errorf("%d warnings that records are stored in clear, want exactly 1; warn lines:\n%s",
				n, strings.Join(grepLines(node.Logs(), `"level":"warn"`), "\n"))
		}

		withSecret := caddyproc.StartWith(t, secretSite(b, s.block(), "secret {env."+secretEnvA+"}"),
			secretEnv(map[string]string{secretEnvA: secret}))
		wantStatus(t, "commit with a secret", keyed(t, withSecret, path, multiNodeBody, newKey(t), "Bearer clear"), http.StatusOK)
		waitLogs(t, withSecret, s.db.openedLog)
		if n := countClearTextWarnings(withSecret.Logs()); n != 0 {
			t.Errorf("with a secret: %d warnings that records are stored in clear, want none", n)
		}

		before := len(node.Logs())
		if err := node.Load(secretSite(b, s.block(), "require_secret")); err == nil {
			t.Errorf("a %s store with require_secret and no secret loaded", s.name)
		}
		const unset = "ICEBERG_IDEMPOTENCY_TEST_SECRET_UNSET"
		err := node.Load(secretSite(b, s.block(), "secret {env."+unset+"}"))
		if err == nil {
			t.Errorf("a secret expanding to nothing ({env.%s}) loaded", unset)
		} else if !strings.Contains(err.Error(), unset) {
			t.Errorf("the error for an empty secret does not name its placeholder {env.%s}: %v", unset, err)
		}
		client.CloseIdleConnections()
		wantSameReplay(t, "retry after the refused loads", keyed(t, node, path, multiNodeBody, key, "Bearer clear"), orig)
		wantCount(t, b, path, 2)
		wantNoLeak(t, "the Caddy log", node.Logs()[before:], map[string]string{"secret": secret})
	})
}

// TestSecretsMemoryNoWarning: the memory store keeps records in the process
// only, so it needs no secret and does not warn without one.
func TestSecretsMemoryNoWarning(t *testing.T) {
	t.Parallel()
	b := caddyproc.NewBackend(t)
	node := caddyproc.Start(t, secretSite(b, "store memory"))
	key := newKey(t)
	path := multiNodePath("memory")
	orig := keyed(t, node, path, multiNodeBody, key, "Bearer memory")
	wantStatus(t, "commit", orig, http.StatusOK)
	wantSameReplay(t, "retry", keyed(t, node, path, multiNodeBody, key, "Bearer memory"), orig)
	waitLogs(t, node, "replaying stored response")
	if n := countClearTextWarnings(node.Logs()); n != 0 {
		t.Errorf("memory store: %d warnings that records are stored in clear, want none:\n%s",
			n, strings.Join(grepLines(node.Logs(), `"level":"warn"`), "\n"))
	}
}

// grepLines returns the lines of logs holding substr.
func grepLines(logs, substr string) []string {
	var out []string
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, substr) {
			out = append(out, line)
		}
	}
	return out
}

// TestSecretsClearRecordsAfterSecretAdded: turning a secret on in a running
// deployment (reload through the admin API) keeps the records written in
// clear before it replaying for their retries, byte for byte and without
// executing again, while records written from then on are sealed: the dump
// shows the earlier answer's sentinel and not the later one's.
func TestSecretsClearRecordsAfterSecretAdded(t *testing.T) {
	forEachSecretStore(t, true, func(t *testing.T, s *secretStore) {
		secret := randomHex(t, "idem-secret-", 32)
		before, after := randomHex(t, "SENTINEL-", 16), randomHex(t, "SENTINEL-", 16)
		b := caddyproc.NewBackend(t)
		// Distinct createTable paths: the backend scripts answers per path.
		pathBefore, pathAfter := "/v1/namespaces/before/tables", "/v1/namespaces/after/tables"
		b.Script(pathBefore, caddyproc.Reply{Body: vendedAnswer(before)})
		b.Script(pathAfter, caddyproc.Reply{Body: vendedAnswer(after)})
		node := caddyproc.StartWith(t, secretSite(b, s.block()), secretEnv(map[string]string{secretEnvA: secret}))
		const auth = "Bearer upgrade"

		keyBefore, keyAfter := newKey(t), newKey(t)
		origBefore := keyed(t, node, pathBefore, createTableBody, keyBefore, auth)
		wantStatus(t, "createTable without a secret", origBefore, http.StatusOK)

		reload(t, node, secretSite(b, s.block(), "secret {env."+secretEnvA+"}"))
		for i := range 2 {
			wantSameReplay(t, fmt.Sprintf("retry %d of the clear record with the secret set", i+1),
				keyed(t, node, pathBefore, createTableBody, keyBefore, auth), origBefore)
		}
		wantStatus(t, "another principal on the clear record",
			keyed(t, node, pathBefore, createTableBody, keyBefore, "Bearer someone-else"), http.StatusUnprocessableEntity)
		// Another caller for the sealed record: the clear record's row
		// holds the unkeyed hash of the first one's Authorization.
		const authAfter = "Bearer upgraded"
		origAfter := keyed(t, node, pathAfter, createTableBody, keyAfter, authAfter)
		wantStatus(t, "createTable with the secret", origAfter, http.StatusOK)
		wantSameReplay(t, "retry of the sealed record", keyed(t, node, pathAfter, createTableBody, keyAfter, authAfter), origAfter)
		wantCount(t, b, pathBefore, 1)
		wantCount(t, b, pathAfter, 1)

		if s.db != nil {
			dump := dumpRecords(t, s)
			if !strings.Contains(dump, before) {
				t.Errorf("the dump does not show the answer stored before the secret was set; is the dump readable at all?\n%s", dump)
			}
			wantNoLeak(t, "the records table dump", dump,
				leakNeedles(after, authAfter, "upgraded", createTableBody, vendedAnswer(after), pathAfter, secret))
		}
	})
}
