package sqlstore

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"

	mysqldrv "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
)

func TestRedactDSN(t *testing.T) {
	cases := []struct{ in, want string }{
		// PostgreSQL URLs.
		{"postgres://alice:s3cret@db.example:5432/idem?sslmode=require",
			"postgres://alice:xxxxx@db.example:5432/idem?sslmode=require"},
		{"postgresql://alice:s3cret@db/idem", "postgresql://alice:xxxxx@db/idem"},
		{"postgres://alice@db:5432/idem", "postgres://alice@db:5432/idem"},
		{"postgres://alice:@db/idem", "postgres://alice:xxxxx@db/idem"},
		{"postgres://db/idem", "postgres://db/idem"},
		{"postgres://db", "postgres://db"},
		{"postgres:///idem?host=/var/run/postgresql", "postgres:///idem?host=/var/run/postgresql"},
		{"postgres://alice:s3cret@[::1]:5432/idem", "postgres://alice:xxxxx@[::1]:5432/idem"},
		{"postgresql://alice:p@ss:w/rd@h1,h2/db", "postgresql://alice:xxxxx@h1,h2/db"},
		{"postgres://caddy:s3cr?t@db/iceberg", "postgres://caddy:xxxxx@db/iceberg"},
		{"postgres://caddy:s3cr?t@db/iceberg?sslmode=verify-full", "postgres://caddy:xxxxx@db/iceberg?sslmode=verify-full"},
		{"postgres://caddy:a&b=c'd/e@db:5432/iceberg", "postgres://caddy:xxxxx@db:5432/iceberg"},
		{"postgres://caddy:p%40ss%3Fw@db/iceberg", "postgres://caddy:xxxxx@db/iceberg"},
		{"postgres://alice@db/idem?password=s3cret&sslmode=disable&sslpassword=k3y",
			"postgres://alice@db/idem?password=xxxxx&sslmode=disable&sslpassword=xxxxx"},
		{"postgres://alice@db/idem?sslmode=require&password=a&b&connect_timeout=5",
			"postgres://alice@db/idem?sslmode=require&password=xxxxx&connect_timeout=5"},
		{"postgres://alice@db/idem?pass%77ord=s3cret", "postgres://alice@db/idem?pass%77ord=xxxxx"},
		{"postgres://alice@db/idem?PASSWORD=s3cret", "postgres://alice@db/idem?PASSWORD=xxxxx"},
		{"postgres://alice:s3cret@db/idem?sslmode=verify-full&sslrootcert=/etc/ssl/ca.pem&sslkey=/k&sslcert=/c",
			"postgres://alice:xxxxx@db/idem?sslmode=verify-full&sslrootcert=/etc/ssl/ca.pem&sslkey=/k&sslcert=/c"},
		// key=value (libpq, pgx).
		{"host=db user=alice password=s3cret dbname=idem",
			"host=db user=alice password=xxxxx dbname=idem"},
		{"host=db password = 'it\\'s secret' dbname=idem",
			"host=db password = xxxxx dbname=idem"},
		{"host=db password='s3cr?t@x' dbname=idem", "host=db password=xxxxx dbname=idem"},
		{"host=db password=a\\ b dbname=idem", "host=db password=xxxxx dbname=idem"},
		{"host=db password='unterminated dbname=idem", "host=db password=xxxxx"},
		{"user=alice PASSWORD=s3cret", "user=alice PASSWORD=xxxxx"},
		{"host=db sslpassword=k3y sslmode=require", "host=db sslpassword=xxxxx sslmode=require"},
		{"host=db password=x://y@z dbname=idem", "host=db password=xxxxx dbname=idem"},
		{"  host=db user=alice", "  host=db user=alice"},
		// An unquoted password with spaces, which the drivers refuse: masked
		// up to the next key=value.
		{"host=db user=app password=Summer 2024! dbname=x", "host=db user=app password=xxxxx dbname=x"},
		{"host=db password=correct horse  battery", "host=db password=xxxxx"},
		{"host=db password=a\\ b c sslmode=require", "host=db password=xxxxx sslmode=require"},
		{"password=s3cret host=db", "password=xxxxx host=db"},
		// MySQL driver DSNs.
		{"root:s3cret@tcp(127.0.0.1:3306)/idem?parseTime=true",
			"root:xxxxx@tcp(127.0.0.1:3306)/idem?parseTime=true"},
		{"root:p@ss:word@tcp(db:3306)/idem", "root:xxxxx@tcp(db:3306)/idem"},
		{"caddy:s3cr?t@tcp(db)/iceberg", "caddy:xxxxx@tcp(db)/iceberg"},
		{"caddy:s3cr?t@tcp(db:3306)/iceberg?tls=true&timeout=5s", "caddy:xxxxx@tcp(db:3306)/iceberg?tls=true&timeout=5s"},
		{"caddy:a&b=c'd:e/f@tcp(db:3306)/iceberg", "caddy:xxxxx@tcp(db:3306)/iceberg"},
		{"caddy:s3cret@unix(/run/mysqld/mysqld.sock)/iceberg", "caddy:xxxxx@unix(/run/mysqld/mysqld.sock)/iceberg"},
		{"caddy:s3cret@/iceberg", "caddy:xxxxx@/iceberg"},
		{"caddy@/iceberg", "caddy@/iceberg"},
		{"root@tcp(127.0.0.1:3306)/idem", "root@tcp(127.0.0.1:3306)/idem"},
		{"root:@tcp(127.0.0.1:3306)/idem", "root:xxxxx@tcp(127.0.0.1:3306)/idem"},
		{"root@tcp(db)/idem?connectionAttributes=app:me@host", "root@tcp(db)/idem?connectionAttributes=app:me@host"},
		{"tcp(db)/idem", "tcp(db)/idem"},
		{"/idem", "/idem"},
		{"", ""},
		// An '@' in a query value moved the last '@' past the user info,
		// and a password parameter before it was logged whole.
		{"postgres://postgres@127.0.0.1/postgres?sslmode=disable&password=s3cret@1",
			"postgres://postgres@127.0.0.1/postgres?sslmode=disable&password=xxxxx"},
		{"postgres://postgres@127.0.0.1:5432/postgres?application_name=caddy@node1&password=s3cret",
			"postgres://postgres@127.0.0.1:xxxxx@node1&password=xxxxx"},
		// A MySQL password with "://" was read as a URL's scheme.
		{"caddy:ab://s3cret@tcp(127.0.0.1:3306)/iceberg", "caddy:xxxxx@tcp(127.0.0.1:3306)/iceberg"},
		// A MySQL DSN without /dbname whose password has a '/'.
		{"u:s3cret/x@tcp(127.0.0.1:3306)", "u:xxxxx@tcp(127.0.0.1:3306)"},
		// A quoted key=value password with an unescaped quote goes on
		// after the quote that ends it for the drivers.
		{"host=db password='it's-s3cret' dbname=idem", "host=db password=xxxxx dbname=idem"},
	}
	for _, c := range cases {
		if got := RedactDSN(c.in); got != c.want {
			t.Errorf("RedactDSN(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// Whatever the drivers' own parsers read as the password never survives
// redaction, across passwords with every delimiter either DSN form uses.
func TestRedactDSNAgainstDriverParsers(t *testing.T) {
	passwords := []string{"s3cret", "s3cr?t", "p@ss", "a:b", "a/b", "a&b=c", "it's", "x?y@z:w/v&u=t'", "%41bc"}
	for _, pw := range passwords {
		// MySQL: the driver takes the password verbatim.
		for _, dsn := range []string{
			"caddy:" + pw + "@tcp(db:3306)/iceberg?parseTime=true",
			"caddy:" + pw + "@unix(/run/mysqld/mysqld.sock)/iceberg",
			"caddy:" + pw + "@/iceberg",
			// A user name with '=' read as key=value before, and the
			// DSN was logged whole.
			"svc=reader:" + pw + "@tcp(db:3306)/iceberg",
		} {
			mc, err := mysqldrv.ParseDSN(dsn)
			if err != nil {
				t.Errorf("mysql.ParseDSN(%q): %v", dsn, err)
				continue
			}
			if mc.Passwd != pw {
				t.Errorf("mysql.ParseDSN(%q) password %q, want %q", dsn, mc.Passwd, pw)
			}
			if got := RedactDSN(dsn); strings.Contains(got, pw) {
				t.Errorf("RedactDSN(%q) = %q keeps the password", dsn, got)
			}
		}
		// PostgreSQL: URL with the password raw and percent-encoded, and
		// key=value quoted.
		quoted := "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(pw) + "'"
		for _, dsn := range []string{
			"postgres://caddy:" + pw + "@db:5432/iceberg?sslmode=disable",
			"postgres://caddy:" + url.QueryEscape(pw) + "@db/iceberg",
			"postgres://caddy@db/iceberg?sslmode=disable&password=" + url.QueryEscape(pw),
			"host=db user=caddy password=" + quoted + " dbname=iceberg",
		} {
			cfg, err := pgconn.ParseConfig(dsn)
			got := RedactDSN(dsn)
			if strings.Contains(got, pw) {
				t.Errorf("RedactDSN(%q) = %q keeps the password", dsn, got)
			}
			if err != nil {
				// pgx rejects it: its error must not show the password either.
				if msg := RedactError(err, dsn, "").Error(); strings.Contains(msg, pw) {
					t.Errorf("RedactError(pgx error for %q) = %q keeps the password", dsn, msg)
				}
				continue
			}
			if cfg.Password != "" && strings.Contains(got, cfg.Password) && len(cfg.Password) > 2 {
				t.Errorf("RedactDSN(%q) = %q keeps pgx's password %q", dsn, got, cfg.Password)
			}
		}
	}
}

// A key=value DSN whose unquoted password holds spaces is one pgx refuses,
// quoting the words after the first in its error: none of them may show.
func TestRedactErrorUnquotedPasswordWithSpaces(t *testing.T) {
	for _, pw := range []string{"Summer 2024!", "correct horse battery staple", "open s3s@me?/42"} {
		dsn := "host=db user=caddy password=" + pw + " dbname=iceberg"
		_, err := pgconn.ParseConfig(dsn)
		if err == nil {
			t.Fatalf("pgx accepted %q", dsn)
		}
		msg := RedactError(err, dsn, "").Error()
		for _, word := range strings.Fields(pw) {
			if strings.Contains(msg, word) {
				t.Errorf("RedactError(pgx error for %q) = %q shows %q of the password", dsn, msg, word)
			}
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

// Parse errors never show a piece of the password, in the DSN shapes a
// review found leaking one through the drivers' quoted fragments.
func TestRedactParseError(t *testing.T) {
	const pw = "SECRETPW"
	for _, c := range []struct {
		dsn   string
		parse func(string) error
	}{
		{"u:" + pw + "/x@tcp(127.0.0.1:3306)", mysqlParse},
		{"caddy:ab/" + pw + "%@tcp(127.0.0.1:3306)", mysqlParse},
		{"postgres://postgres@127.0.0.1:5432/postgres?password=abc&" + pw + "&sslmode=disable", pgParse},
		{"host=127.0.0.1 user=postgres password='it's-" + pw + "' dbname=postgres", pgParse},
		{"postgres://postgres:ab/" + pw + " x@127.0.0.1:5432/postgres", pgParse},
		{"host=127.0.0.1 password=Summer 2\"" + pw + " dbname=postgres", pgParse},
		{"postgres://postgres:" + pw + "@127.0.0.1:5432/postgres?sslmode=bogus", pgParse},
		{"postgres://u:" + pw + "@[::1", pgParse},
		// A quote in the password ended the driver's quoted fragment
		// early, and the rest showed.
		{"postgres://caddy:p\"" + pw + " Pass/x@db.example/idem", pgParse},
		{"postgres://caddy@db.example/idem?sslmode=disable&password=abc&\"" + pw, pgParse},
		{"caddy:x'" + pw + "/2@tcp(db.example:3306)", mysqlParse},
		{"caddy:x`" + pw + "/2@tcp(db.example:3306)", mysqlParse},
		// pgx quotes a fragment with "%s": a backslash before its
		// closing quote kept it open.
		{"postgres://caddy@db.example/idem?password=;\\Q&/" + pw + ";\\&sslmode=disable", pgParse},
	} {
		err := c.parse(c.dsn)
		if err == nil {
			t.Errorf("the driver accepted %q", c.dsn)
			continue
		}
		msg := RedactParseError(err, c.dsn).Error()
		for _, piece := range []string{pw, pw[:5], pw[3:]} {
			if strings.Contains(msg, piece) {
				t.Errorf("RedactParseError for %q = %q shows %q", c.dsn, msg, piece)
			}
		}
	}
	// Without a password anywhere, the driver's message stays whole.
	dsn := "postgres://127.0.0.1:5432/postgres?sslmode=bogus"
	if err := pgParse(dsn); RedactParseError(err, dsn) != err {
		t.Errorf("RedactParseError changed %q", err)
	}
}

func mysqlParse(dsn string) error { _, err := mysqldrv.ParseDSN(dsn); return err }
func pgParse(dsn string) error    { _, err := pgconn.ParseConfig(dsn); return err }

// A log line never shows the password the driver read, even from a DSN
// whose delimiters mislead RedactDSN, and never more of the DSN than
// RedactDSN shows.
func TestLoggedDSN(t *testing.T) {
	for _, c := range []struct {
		dsn      string
		password func(string) (string, error)
		want     string
	}{
		{"postgres://postgres:s3cret@127.0.0.1:5432/postgres", pgPassword, "postgres://postgres:xxxxx@127.0.0.1:5432/postgres"},
		{"postgres://postgres@127.0.0.1/postgres?sslmode=disable&password=s3cret@1", pgPassword, "postgres://postgres@127.0.0.1/postgres?sslmode=disable&password=xxxxx"},
		{"caddy:ab://s3cret@tcp(127.0.0.1:3306)/iceberg", mysqlPassword, "caddy:xxxxx@tcp(127.0.0.1:3306)/iceberg"},
		// RedactDSN reads "admin://x2y" as a URL's scheme and user, and
		// keeps the password's tail; the driver reads password "//x2y".
		{"admin://x2y@tcp(127.0.0.1:3306)/iceberg", mysqlPassword, "admin:xxxxx@tcp(127.0.0.1:3306)/iceberg"},
		// A password that is also part of the host.
		{"postgres://postgres:127@127.0.0.1:5432/postgres", pgPassword, "postgres://postgres:xxxxx@xxxxx.0.0.1:5432/postgres"},
		// pgx reads password "p" and host "ssw0rd@db.example": the part
		// of the password after its unescaped '@' stays masked.
		{"postgres://caddy:p@ssw0rd@db.example:5432/idem", pgPassword, "xxxxxostgres://caddy:xxxxx@db.examxxxxxle:5432/idem"},
		{"root@tcp(127.0.0.1:3306)/iceberg", mysqlPassword, "root@tcp(127.0.0.1:3306)/iceberg"},
		// The driver reads password "QZ" and database "s3cret@tcp(db:3306)".
		{"caddy:QZ@/s3cret@tcp(db:3306)", mysqlPassword, "caddy:xxxxx@tcp(db:3306)"},
	} {
		pw, err := c.password(c.dsn)
		if err != nil {
			t.Fatalf("parse %q: %v", c.dsn, err)
		}
		if got := LoggedDSN(c.dsn, pw); got != c.want {
			t.Errorf("LoggedDSN(%q) = %q, want %q", c.dsn, got, c.want)
		}
	}
}

func pgPassword(dsn string) (string, error) {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return "", err
	}
	return cfg.Password, nil
}

func mysqlPassword(dsn string) (string, error) {
	cfg, err := mysqldrv.ParseDSN(dsn)
	if err != nil {
		return "", err
	}
	return cfg.Passwd, nil
}
