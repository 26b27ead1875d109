package sqlstore

import (
	"errors"
	"regexp"
	"strings"
)

// Mask replaces secrets in redacted text.
const Mask = "xxxxx"

var (
	// key=value connection strings (libpq): password='it''s' or password=x.
	kvSecret = regexp.MustCompile(`(?i)\b((?:ssl)?password|passwd|pwd)(\s*=\s*)('(?:[^'\\]|\\.)*'|\S*)`)
	// URL and MySQL DSN query parameters: ?password=x&...
	paramSecret = regexp.MustCompile(`(?i)([?&](?:ssl)?(?:password|passwd|pwd)=)[^&]*`)
	kvStart     = regexp.MustCompile(`^\s*[A-Za-z_]+\s*=`)
)

// RedactDSN returns dsn with its password replaced by Mask, whatever its
// form: URL (postgres://user:pw@host/db?sslpassword=pw), key=value
// (host=h user=u password=pw) or the MySQL driver's
// (user:pw@tcp(host:3306)/db?param=v). The rest stays, so that a redacted
// DSN still tells an operator which server and database were meant.
func RedactDSN(dsn string) string {
	if !strings.Contains(dsn, "://") && kvStart.MatchString(dsn) {
		return kvSecret.ReplaceAllString(dsn, "${1}${2}"+Mask)
	}
	body := dsn
	prefix := ""
	if i := strings.Index(dsn, "://"); i >= 0 {
		prefix, body = dsn[:i+3], dsn[i+3:]
	}
	// The user info ends at the last '@' before the query string: a
	// password may itself contain '@' (MySQL's parser allows it).
	head, query, hasQuery := strings.Cut(body, "?")
	if at := strings.LastIndex(head, "@"); at >= 0 {
		if colon := strings.Index(head[:at], ":"); colon >= 0 {
			head = head[:colon+1] + Mask + head[at:]
		}
	}
	out := prefix + head
	if hasQuery {
		out += paramSecret.ReplaceAllString("?"+query, "${1}"+Mask)
	}
	return out
}

// RedactError returns err with the DSN and the password removed from its
// message. It returns err itself when there was nothing to remove. The
// redacted error still matches errors.Is against what err matched (context
// errors in particular), but it does not unwrap: unwrapping would hand the
// unredacted message to whoever prints the inner error.
func RedactError(err error, dsn, password string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	out := msg
	if dsn != "" {
		out = strings.ReplaceAll(out, dsn, RedactDSN(dsn))
	}
	if password != "" {
		out = strings.ReplaceAll(out, password, Mask)
	}
	if out == msg {
		return err
	}
	return &redactedError{msg: out, err: err}
}

type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }

func (e *redactedError) Is(target error) bool { return errors.Is(e.err, target) }
