package sqlstore

import (
	"errors"
	"net/url"
	"regexp"
	"strings"
	"unicode"
)

// Mask replaces secrets in redacted text.
const Mask = "xxxxx"

var (
	// key=value connection strings (libpq, pgx): password='it\'s' or
	// password=x, where an unquoted value may escape a space (a\ b), as
	// pgx's parser allows.
	kvSecret   = regexp.MustCompile(`(?i)\b((?:ssl)?password|passwd|pwd)(\s*=\s*)('(?:[^'\\]|\\.)*'?|(?:[^\s\\]|\\.?)*)`)
	kvStart    = regexp.MustCompile(`^\s*[A-Za-z_]+\s*=`)
	kvKey      = regexp.MustCompile(`^[A-Za-z_]+\s*=`)
	kvUnescape = strings.NewReplacer(`\\`, `\`, `\'`, `'`, `\ `, ` `)
	// The start of the next query parameter: a password parameter's value
	// runs until one, so that an '&' inside the password is masked too.
	nextParam = regexp.MustCompile(`&[A-Za-z0-9_.%-]+=`)
)

// secretParams are the query parameter names (lower case, percent-decoded)
// whose values are masked.
var secretParams = map[string]bool{"password": true, "sslpassword": true, "passwd": true, "pwd": true}

// RedactDSN returns dsn with its password replaced by Mask, whatever its
// form: URL (postgres://user:pw@host/db?sslpassword=pw), key=value
// (host=h user=u password=pw) or the MySQL driver's
// (user:pw@tcp(host:3306)/db?param=v). The rest stays, so that a redacted
// DSN still tells an operator which server and database were meant.
//
// Where a malformed DSN makes the end of the password ambiguous, more is
// masked rather than less: the user info is taken to end at the last '@'
// that could end it (a password may contain '@', '?', '/', ':' …).
func RedactDSN(dsn string) string {
	out, _ := redact(dsn)
	return out
}

// redact returns the redacted DSN and the raw text of each masked secret.
func redact(dsn string) (string, []string) {
	if !kvStart.MatchString(dsn) {
		return redactURL(dsn)
	}
	out, secrets := redactKV(dsn)
	if !strings.Contains(out, "@") {
		return out, secrets
	}
	// A MySQL user name may hold '=': "svc=reader:pw@tcp(db:3306)/x"
	// reads as key=value, has no password key, and was logged whole.
	// Its user info is masked too; in a true key=value DSN, a value with
	// an '@' and a ':' before it is masked that far, more rather than
	// less.
	out, more := redactURL(out)
	return out, append(secrets, more...)
}

// redactURL redacts a URL or MySQL-driver DSN.
func redactURL(dsn string) (string, []string) {
	var secrets []string
	prefix, body := "", dsn
	if i := strings.Index(dsn, "://"); i >= 0 {
		prefix, body = dsn[:i+3], dsn[i+3:]
	}
	// Where the user info ends. pgx ends it at the first '@' before a
	// '/', the MySQL driver at the last '@' before the last '/'; a DSN
	// either driver rejects may still have been meant with a password
	// containing '/', '?' or '@'. The last '@' of the whole URL covers
	// every reading. In the MySQL form (no scheme) the database name
	// follows the last '/' and never holds the user info.
	scope := body
	if prefix == "" {
		if slash := strings.LastIndex(body, "/"); slash >= 0 {
			scope = body[:slash]
		}
	}
	head, rest := "", body
	if at := strings.LastIndex(scope, "@"); at >= 0 {
		head, rest = body[:at], body[at:]
		if colon := strings.Index(head, ":"); colon >= 0 {
			if pw := head[colon+1:]; pw != "" {
				secrets = append(secrets, pw)
			}
			head = head[:colon+1] + Mask
		}
	}
	if q := strings.Index(rest, "?"); q >= 0 {
		query, qs := redactQuery(rest[q+1:])
		rest = rest[:q+1] + query
		secrets = append(secrets, qs...)
	}
	return prefix + head + rest, secrets
}

// redactKV redacts a key=value DSN. An unquoted value ends at a space for
// the drivers, so "password=Summer 2024! dbname=x" is a DSN they refuse
// and echo in their error; its password was meant to run up to the next
// key=value, and is masked that far (each word of it too, since the
// drivers' errors quote them one by one).
func redactKV(dsn string) (string, []string) {
	var b strings.Builder
	var secrets []string
	last := 0
	for _, m := range kvSecret.FindAllStringSubmatchIndex(dsn, -1) {
		if m[0] < last {
			continue // inside a value masked already
		}
		end := m[1]
		if m[7] > m[6] && dsn[m[6]] != '\'' {
			end = unquotedEnd(dsn, end)
			secrets = append(secrets, strings.Fields(dsn[m[1]:end])...)
		}
		if v := dsn[m[6]:end]; v != "" {
			secrets = append(secrets, v)
			// The value as the driver reads it: unquoted, unescaped.
			inner := strings.TrimSuffix(strings.TrimPrefix(v, "'"), "'")
			if inner = kvUnescape.Replace(inner); inner != "" && inner != v {
				secrets = append(secrets, inner)
			}
		}
		b.WriteString(dsn[last:m[5]] + Mask)
		last = end
	}
	b.WriteString(dsn[last:])
	return b.String(), secrets
}

// unquotedEnd returns where an unquoted value that the drivers end at end
// was meant to end: at the next word that starts a key=value, or at the
// end of dsn.
func unquotedEnd(dsn string, end int) int {
	for {
		i := end
		for i < len(dsn) && unicode.IsSpace(rune(dsn[i])) {
			i++
		}
		if i == len(dsn) || kvKey.MatchString(dsn[i:]) {
			return end
		}
		for i < len(dsn) && !unicode.IsSpace(rune(dsn[i])) {
			if dsn[i] == '\\' {
				i++
			}
			i++
		}
		end = min(i, len(dsn))
	}
}

// redactQuery masks the values of password parameters in a query string.
func redactQuery(query string) (string, []string) {
	var b strings.Builder
	var secrets []string
	for query != "" {
		// One parameter: up to the next '&'; a password's value up to the
		// next '&' that starts a parameter.
		end := strings.IndexByte(query, '&')
		if end < 0 {
			end = len(query)
		}
		key, _, hasValue := strings.Cut(query[:end], "=")
		name, err := url.QueryUnescape(key)
		if err != nil {
			name = key
		}
		if hasValue && secretParams[strings.ToLower(name)] {
			valStart := len(key) + 1
			end = len(query)
			if next := nextParam.FindStringIndex(query[valStart:]); next != nil {
				end = valStart + next[0]
			}
			if v := query[valStart:end]; v != "" {
				secrets = append(secrets, v)
			}
			b.WriteString(key + "=" + Mask)
		} else {
			b.WriteString(query[:end])
		}
		query = query[end:]
		if query != "" { // the '&'
			b.WriteByte('&')
			query = query[1:]
		}
	}
	return b.String(), secrets
}

// RedactError returns err with the DSN and the password removed from its
// message. It returns err itself when there was nothing to remove. The
// redacted error still matches errors.Is against what err matched (context
// errors in particular), but it does not unwrap: unwrapping would hand the
// unredacted message to whoever prints the inner error.
//
// Besides the DSN and password, every secret RedactDSN masks in dsn is
// removed as it was written (quoted, percent-encoded …): a driver that
// fails to parse a DSN may echo a part of it.
func RedactError(err error, dsn, password string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	out := msg
	if dsn != "" {
		redacted, secrets := redact(dsn)
		out = strings.ReplaceAll(out, dsn, redacted)
		for _, s := range secrets {
			out = strings.ReplaceAll(out, s, Mask)
			if u, uerr := url.PathUnescape(s); uerr == nil && u != s && u != "" {
				out = strings.ReplaceAll(out, u, Mask)
			}
		}
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
