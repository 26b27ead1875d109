package icebergidempotency

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// A DSN made of placeholders that expand to nothing names the placeholder
// and the environment variables to check, instead of only "dsn is
// required".
func TestSQLStoreEmptyDSNNamesThePlaceholder(t *testing.T) {
	t.Setenv("ICEBERG_TEST_SET_DSN_PART", "x")
	cases := []struct {
		dsn  string
		want []string
		not  []string
	}{
		{"{env.ICEBERG_TEST_UNSET_DSN}", []string{
			`postgres store: dsn is required`,
			`"{env.ICEBERG_TEST_UNSET_DSN}" is empty after replacing placeholders`,
			`is the environment variable ICEBERG_TEST_UNSET_DSN set?`,
		}, nil},
		{"{env.ICEBERG_TEST_UNSET_A}{env.ICEBERG_TEST_UNSET_B}{env.ICEBERG_TEST_UNSET_A}", []string{
			`are the environment variables ICEBERG_TEST_UNSET_A, ICEBERG_TEST_UNSET_B set?`,
		}, nil},
		{"", []string{"postgres store: dsn is required"}, []string{"placeholder"}},
		// A part expanding to nothing, the password from an unset variable,
		// left a DSN that still parsed, until the build after b35c62e.
		{"postgres://caddy:{env.ICEBERG_TEST_UNSET_PW}@127.0.0.1:1/db", []string{
			`postgres store: dsn: {env.ICEBERG_TEST_UNSET_PW} is an environment variable that is not set`,
		}, nil},
		{"postgres://caddy:{file./nonexistent/iceberg-idempotency-pw}@127.0.0.1:1/db", []string{
			`dsn: {file./nonexistent/iceberg-idempotency-pw} names a file that cannot be read (open /nonexistent/iceberg-idempotency-pw: no such file or directory)`,
		}, nil},
	}
	for _, c := range cases {
		p := &PostgresStore{SQLStoreConfig: SQLStoreConfig{DSN: c.dsn}}
		err := p.Provision(newCaddyContext(t))
		if err == nil {
			t.Fatalf("dsn %q: Provision succeeded", c.dsn)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("dsn %q: error %q does not say %q", c.dsn, err, w)
			}
		}
		for _, n := range c.not {
			if strings.Contains(err.Error(), n) {
				t.Errorf("dsn %q: error %q says %q", c.dsn, err, n)
			}
		}
	}
	m := &MySQLStore{SQLStoreConfig: SQLStoreConfig{DSN: "{env.ICEBERG_TEST_UNSET_DSN}"}}
	if err := m.Provision(newCaddyContext(t)); err == nil || !strings.HasPrefix(err.Error(), "mysql store: ") ||
		!strings.Contains(err.Error(), "ICEBERG_TEST_UNSET_DSN set?") {
		t.Fatalf("mysql: %v", err)
	}
}

// The store key, which logs and the admin API show, holds the DSN and the
// password only inside a MAC under a key drawn by this process: one
// config gives one key (one pool), another password another key, and
// without the process's key nobody can test a guessed password against a
// logged store key.
func TestStoreKeyHidesThePassword(t *testing.T) {
	provision := func(p interface {
		StoreProvider
		caddy.Provisioner
	}) string {
		t.Helper()
		if err := p.Provision(newCaddyContext(t)); err != nil {
			t.Fatal(err)
		}
		return p.StoreKey()
	}
	redisWith := func(pw string) string {
		return provision(&RedisStore{Addresses: []string{"redis:6379"}, Password: pw})
	}
	pgWith := func(pw string) string {
		return provision(&PostgresStore{SQLStoreConfig: SQLStoreConfig{DSN: "postgres://app:" + pw + "@db:5432/catalog"}})
	}
	for name, with := range map[string]func(string) string{"redis": redisWith, "postgres": pgWith} {
		key := with("Summer2024!")
		if with("Summer2024!") != key {
			t.Fatalf("%s: one config, two store keys: its handlers would not share a pool", name)
		}
		if with("Winter2024!") == key {
			t.Fatalf("%s: two passwords, one store key", name)
		}
		saved := storeKeySalt
		storeKeySalt = [32]byte{} // what anyone without this process's key can compute
		guessed := with("Summer2024!")
		storeKeySalt = saved
		if guessed == key {
			t.Fatalf("%s: the store key %s can be recomputed from a guessed password", name, key)
		}
	}
}

// A JSON config gets no max_conns that the Caddyfile refuses: past
// 2147483647 both SQL stores refuse it at provisioning, naming the field.
// Until the build after 9db81f6 the MySQL store took it from JSON (the
// bound was the Caddyfile parser's alone).
func TestSQLStoreJSONMaxConnsBound(t *testing.T) {
	for _, tt := range []struct {
		module string
		store  interface{ Provision(caddy.Context) error }
	}{
		{"postgres", &PostgresStore{}},
		{"mysql", &MySQLStore{}},
	} {
		if err := json.Unmarshal([]byte(`{"dsn":"x@tcp(127.0.0.1:1)/db","max_conns":3000000000}`), tt.store); err != nil {
			t.Fatal(err)
		}
		err := tt.store.Provision(newCaddyContext(t))
		if err == nil || !strings.Contains(err.Error(), "max_conns 3000000000 is more than 2147483647") {
			t.Errorf("%s: max_conns 3000000000 from JSON: %v, want it refused, naming max_conns and the bound", tt.module, err)
		}
	}
}

// A negative option from a JSON config (the Caddyfile parser refuses them
// before) is refused naming the option and its value. Until the build after
// f89bcb4 the error named none: "negative max_conns, combined_writes,
// timeout or interval", and Redis's "negative timeout, interval or pool
// size".
func TestStoreJSONNegativeOptionNamed(t *testing.T) {
	for _, tt := range []struct {
		config string
		store  interface{ Provision(caddy.Context) error }
		want   string
	}{
		{`{"dsn":"postgres://127.0.0.1:1/db","max_conns":-2}`, &PostgresStore{}, "postgres: max_conns must not be negative, got -2"},
		{`{"dsn":"postgres://127.0.0.1:1/db","statement_timeout":"-5s"}`, &PostgresStore{}, "postgres: statement_timeout must not be negative, got -5s"},
		{`{"dsn":"x@tcp(127.0.0.1:1)/db","combined_writes":-1}`, &MySQLStore{}, "mysql: combined_writes must not be negative, got -1"},
		{`{"dsn":"x@tcp(127.0.0.1:1)/db","statement_timeout":"-1ms"}`, &MySQLStore{}, "mysql: statement_timeout must not be negative, got -1ms"},
		{`{"addresses":["127.0.0.1:1"],"read_timeout":"-3s"}`, &RedisStore{}, "redis: read_timeout must not be negative, got -3s"},
		{`{"addresses":["127.0.0.1:1"],"pool_size":-4}`, &RedisStore{}, "redis: pool_size must not be negative, got -4"},
	} {
		if err := json.Unmarshal([]byte(tt.config), tt.store); err != nil {
			t.Fatal(err)
		}
		if err := tt.store.Provision(newCaddyContext(t)); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want an error containing %q", tt.config, err, tt.want)
		}
	}
}
