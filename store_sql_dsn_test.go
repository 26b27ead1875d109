package icebergidempotency

import (
	"strings"
	"testing"
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
