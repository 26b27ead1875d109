package icebergidempotency

import (
	"strings"
	"testing"

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
