package icebergidempotency

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/postgres"
)

// {env.*} placeholders in the DSN are expanded at provision time, and the
// pool key derived from the DSN does not carry the password.
func TestSQLStoreDSNPlaceholdersAndKey(t *testing.T) {
	t.Setenv("ICEBERG_TEST_PG_PASSWORD", "s3cr3t-pw")
	p := &PostgresStore{SQLStoreConfig: SQLStoreConfig{DSN: "postgres://caddy:{env.ICEBERG_TEST_PG_PASSWORD}@db:5432/iceberg"}}
	if err := p.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	if p.dsn != "postgres://caddy:s3cr3t-pw@db:5432/iceberg" {
		t.Fatalf("expanded dsn = %q", p.dsn)
	}
	key := p.StoreKey()
	if strings.Contains(key, "s3cr3t-pw") || !strings.HasPrefix(key, "postgres/iceberg_idempotency_records/") {
		t.Fatalf("store key = %q", key)
	}
	if !*p.AutoMigrate || !*p.ListenNotify {
		t.Fatal("auto_migrate and listen_notify must default to on")
	}
	if p.cfg.CombinedWrites != postgres.DefaultCombinedWrites {
		t.Fatalf("combined_writes defaults to %d, want %d", p.cfg.CombinedWrites, postgres.DefaultCombinedWrites)
	}

	other := &PostgresStore{SQLStoreConfig: SQLStoreConfig{DSN: p.DSN, Table: "other_records"}}
	if err := other.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	if other.StoreKey() == key {
		t.Fatal("two tables share a store key")
	}

	missing := &MySQLStore{SQLStoreConfig: SQLStoreConfig{DSN: "{env.ICEBERG_TEST_UNSET_DSN}"}}
	if err := missing.Provision(newCaddyContext(t)); err == nil || !strings.Contains(err.Error(), "dsn is required") {
		t.Fatalf("empty expanded dsn: %v", err)
	}
}

// The switches take on and off, and true and false as the same (a
// Caddyfile written with them before the README named only on and off keeps
// loading); anything else is refused, by TestCaddyfileErrors.
func TestSQLStoreSwitchSpellings(t *testing.T) {
	for _, tt := range []struct {
		arg  string
		want bool
	}{{"on", true}, {"true", true}, {"off", false}, {"false", false}} {
		p := &PostgresStore{}
		d := caddyfile.NewTestDispenser("postgres {\ndsn x\nauto_migrate " + tt.arg + "\nlisten_notify " + tt.arg + "\n}")
		if err := p.UnmarshalCaddyfile(d); err != nil {
			t.Fatalf("%s: %v", tt.arg, err)
		}
		if *p.AutoMigrate != tt.want || *p.ListenNotify != tt.want {
			t.Fatalf("%s: auto_migrate %v, listen_notify %v; want %v", tt.arg, *p.AutoMigrate, *p.ListenNotify, tt.want)
		}
	}
}
