package sqlstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestRedactDSN(t *testing.T) {
	cases := []struct{ in, want string }{
		{"postgres://alice:s3cret@db.example:5432/idem?sslmode=require",
			"postgres://alice:xxxxx@db.example:5432/idem?sslmode=require"},
		{"postgresql://alice:p@ss:w/rd@h1,h2/db",
			"postgresql://alice:xxxxx@h1,h2/db"},
		{"postgres://alice@db/idem?password=s3cret&sslmode=disable&sslpassword=k3y",
			"postgres://alice@db/idem?password=xxxxx&sslmode=disable&sslpassword=xxxxx"},
		{"postgres://db/idem", "postgres://db/idem"},
		{"host=db user=alice password=s3cret dbname=idem",
			"host=db user=alice password=xxxxx dbname=idem"},
		{"host=db password = 'it\\'s secret' dbname=idem",
			"host=db password = xxxxx dbname=idem"},
		{"user=alice PASSWORD=s3cret", "user=alice PASSWORD=xxxxx"},
		{"root:s3cret@tcp(127.0.0.1:3306)/idem?parseTime=true",
			"root:xxxxx@tcp(127.0.0.1:3306)/idem?parseTime=true"},
		{"root:p@ss:word@tcp(db:3306)/idem", "root:xxxxx@tcp(db:3306)/idem"},
		{"root@tcp(127.0.0.1:3306)/idem", "root@tcp(127.0.0.1:3306)/idem"},
		{"root:@tcp(127.0.0.1:3306)/idem", "root:xxxxx@tcp(127.0.0.1:3306)/idem"},
		{"/idem", "/idem"},
		{"", ""},
	}
	for _, c := range cases {
		if got := RedactDSN(c.in); got != c.want {
			t.Errorf("RedactDSN(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestRedactError(t *testing.T) {
	dsn := "postgres://alice:s3cret@db/idem"
	inner := fmt.Errorf("dial %s: %w", dsn, context.DeadlineExceeded)
	err := RedactError(inner, dsn, "s3cret")
	if strings.Contains(err.Error(), "s3cret") {
		t.Fatalf("password in %q", err)
	}
	if !strings.Contains(err.Error(), "postgres://alice:xxxxx@db/idem") {
		t.Fatalf("redacted DSN missing from %q", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal("redacted error lost errors.Is")
	}
	if errors.Unwrap(err) != nil {
		t.Fatal("redacted error unwraps to the unredacted one")
	}
	plain := errors.New("connection refused")
	if RedactError(plain, dsn, "s3cret") != plain {
		t.Fatal("clean error was wrapped")
	}
}

func TestValidateTable(t *testing.T) {
	for _, ok := range []string{"iceberg_idempotency_records", "_t", "t1", strings.Repeat("a", MaxTableLen)} {
		if err := ValidateTable(ok); err != nil {
			t.Errorf("ValidateTable(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"", "1t", "T", "t-1", "t;drop table x", "a.b", "t ", "`t`", strings.Repeat("a", MaxTableLen+1)} {
		if err := ValidateTable(bad); err == nil {
			t.Errorf("ValidateTable(%q) accepted", bad)
		}
	}
}
