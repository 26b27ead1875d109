package sqlstore

import (
	"errors"
	"net/url"
	"regexp"
	"slices"
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
	var spans [][2]int // of dsn, masked
	prefix := 0
	if m := urlScheme.FindStringIndex(dsn); m != nil {
		prefix = m[1]
	}
	body := dsn[prefix:]
	// Where the user info ends. pgx ends it at the first '@' before a
	// '/', the MySQL driver at the last '@' before the last '/'; a DSN
	// either driver rejects may still have been meant with a password
	// containing '/', '?' or '@'. The last '@' of the whole URL covers
	// every reading. In the MySQL form (no scheme) the database name
	// follows the last '/' and never holds the user info, unless no '@'
	// comes before that '/' (a DSN without its /dbname, or a password
	// with a '/': the driver refuses it and echoes parts).
	// And a database name with an '@' in it ("u:p@/x@tcp(db)": the
	// driver reads password "p" and database "x@tcp(db)") was meant as
	// more user info.
	scope := body
	if prefix == 0 {
		if slash := strings.LastIndex(body, "/"); slash >= 0 && strings.Contains(body[:slash], "@") {
			dbname, _, _ := strings.Cut(body[slash:], "?")
			if !strings.Contains(dbname, "@") {
				scope = body[:slash]
			}
		}
	}
	if at := strings.LastIndex(scope, "@"); at >= 0 {
		if colon := strings.IndexByte(body[:at], ':'); colon >= 0 {
			spans = append(spans, [2]int{prefix + colon + 1, prefix + at})
		}
	}
	// Password parameters wherever they are: an '@' in a query value
	// (application_name=app@node, or an unescaped password=p@ss) moves
	// the last '@' into the query, past the user info.
	spans = append(spans, queryPasswordSpans(dsn)...)
	return maskSpans(dsn, spans)
}

// urlScheme is a URL's scheme and "//". A MySQL DSN's "user:pa://ss@…"
// has a ':' before its "://", which no scheme has.
var urlScheme = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*://`)

// queryParam is the start of a query parameter and its name.
var queryParam = regexp.MustCompile(`[?&]([^?&=]*)=`)

// queryPasswordSpans returns the values of password parameters in dsn: each
// runs to the next '&' that starts a parameter, so that an '&' inside the
// password is masked too.
func queryPasswordSpans(dsn string) [][2]int {
	var spans [][2]int
	for _, m := range queryParam.FindAllStringSubmatchIndex(dsn, -1) {
		name, err := url.QueryUnescape(dsn[m[2]:m[3]])
		if err != nil {
			name = dsn[m[2]:m[3]]
		}
		if !secretParams[strings.ToLower(name)] {
			continue
		}
		end := len(dsn)
		if next := nextParam.FindStringIndex(dsn[m[1]:]); next != nil {
			end = m[1] + next[0]
		}
		spans = append(spans, [2]int{m[1], end})
	}
	return spans
}

// maskSpans replaces each span of s, overlapping ones merged, with Mask
// (an empty span too: "root:@…" says a password was given, empty), and
// returns the text of each.
func maskSpans(s string, spans [][2]int) (string, []string) {
	if len(spans) == 0 {
		return s, nil
	}
	slices.SortFunc(spans, func(a, b [2]int) int { return a[0] - b[0] })
	merged := spans[:1]
	for _, sp := range spans[1:] {
		if last := &merged[len(merged)-1]; sp[0] <= last[1] {
			last[1] = max(last[1], sp[1])
			continue
		}
		merged = append(merged, sp)
	}
	var b strings.Builder
	var secrets []string
	at := 0
	for _, sp := range merged {
		b.WriteString(s[at:sp[0]] + Mask)
		if sp[1] > sp[0] {
			secrets = append(secrets, s[sp[0]:sp[1]])
		}
		at = sp[1]
	}
	b.WriteString(s[at:])
	return b.String(), secrets
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
		// A quoted value that goes on after its closing quote held an
		// unescaped quote ('it's'): the drivers refuse it and echo the
		// rest, which was meant as password too.
		quoted := m[7] > m[6] && dsn[m[6]] == '\''
		goesOn := end < len(dsn) && !unicode.IsSpace(rune(dsn[end]))
		if m[7] > m[6] && (!quoted || goesOn) {
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

// RedactParseError returns a driver's refusal to parse dsn for an error
// message. The password is unknown then, and a DSN the driver could not
// parse is one whose password RedactDSN may not find either: the drivers
// quote the fragment they stopped at (`…`, "…", '…'), which may be a piece
// of it. So, on top of RedactError, every quoted fragment is left out when
// dsn could hold a password at all; the error names the dsn option's line,
// which shows the operator what was written. A DSN with a quote character
// (or a backslash, which pgx quotes raw before a closing quote) could hold
// one in its password, which would end a fragment early, or keep it open,
// and show the rest: then everything from the message's first quote to
// its last is left out.
func RedactParseError(err error, dsn string) error {
	if err == nil {
		return nil
	}
	r := RedactError(err, dsn, "")
	if !mayHoldPassword.MatchString(dsn) {
		return r
	}
	msg := r.Error()
	if strings.ContainsAny(dsn, quoteChars+`\`) {
		if i := strings.IndexAny(msg, quoteChars); i >= 0 {
			msg = msg[:i] + "…" + msg[strings.LastIndexAny(msg, quoteChars)+1:]
		}
	} else {
		msg = quotedFragment.ReplaceAllStringFunc(msg, func(q string) string {
			return q[:1] + "…" + q[len(q)-1:]
		})
	}
	if msg == err.Error() {
		return err
	}
	return &redactedError{msg: msg + " (quoted parts left out: they may hold the password)", err: err}
}

// quoteChars are the characters the drivers quote fragments with.
const quoteChars = "`'\""

var (
	// mayHoldPassword matches a DSN with user info or a password key.
	mayHoldPassword = regexp.MustCompile(`(?i)@|pass|pwd`)
	// quotedFragment is a fragment a driver's message quotes: in
	// backticks, in single quotes, or in Go's double-quoted form, whose
	// escaped quotes do not end it.
	quotedFragment = regexp.MustCompile("`[^`]*`|\"(?:[^\"\\\\]|\\\\.)*\"|'[^']*'")
)

// LoggedDSN is dsn as log lines show it: RedactDSN's form, which keeps what
// tells an operator the server and database, with every occurrence of the
// password the driver read from dsn masked too (in each form a DSN writes
// it), where it still shows: a DSN whose delimiters mislead the form-based
// masking ("admin://x@tcp(db)/x" is a MySQL user admin with password
// "//x"), or a password that also occurs elsewhere, as "1" does in
// "127.0.0.1". It masks more than RedactDSN, never less: text built from
// the driver's reading would show what the driver took for the host when
// an unescaped '@' split the password ("p@ssw0rd" read as password "p",
// host "ssw0rd@db").
func LoggedDSN(dsn, password string) string {
	r := RedactDSN(dsn)
	if password == "" {
		return r
	}
	return strings.NewReplacer(password, Mask, url.QueryEscape(password), Mask, url.PathEscape(password), Mask).Replace(r)
}
