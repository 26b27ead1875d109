package icebergidempotency

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// statusSet matches response statuses given as exact codes ("409") or
// classes ("4xx").
type statusSet struct {
	codes   map[int]bool
	classes map[int]bool
}

func parseStatusSet(items []string) (statusSet, error) {
	s := statusSet{codes: map[int]bool{}, classes: map[int]bool{}}
	for _, it := range items {
		it = strings.ToLower(strings.TrimSpace(it))
		if len(it) == 3 && strings.HasSuffix(it, "xx") && it[0] >= '1' && it[0] <= '5' {
			s.classes[int(it[0]-'0')] = true
			continue
		}
		code, err := strconv.Atoi(it)
		if err != nil || code < 100 || code > 599 {
			return s, fmt.Errorf("invalid status %q: want a code like 409 or a class like 4xx", it)
		}
		s.codes[code] = true
	}
	return s, nil
}

func (s statusSet) has(code int) bool {
	return s.codes[code] || s.classes[code/100]
}

// checkFinalize refuses a finalize list that would let a retry execute a
// mutation again or replay an answer the spec forbids storing: every 2xx
// must be stored (a success not stored is released, and its retry commits
// a second time, or hears 409 and cleans up files the first commit still
// uses), and no 1xx (never final) or 5xx (the spec: "Do not finalize").
func (s statusSet) checkFinalize() error {
	if len(s.codes) == 0 && len(s.classes) == 0 {
		return fmt.Errorf("empty list: every success would be executed again on retry; give at least 2xx")
	}
	for code := 200; code <= 299; code++ {
		if !s.has(code) {
			return fmt.Errorf("leaves out %d: a success that is not stored is executed again on retry; give 2xx", code)
		}
	}
	for code := range s.codes {
		if code < 200 || code >= 500 {
			return fmt.Errorf("has %d: %s", code, notFinal(code))
		}
	}
	for class := range s.classes {
		if class == 1 || class == 5 {
			return fmt.Errorf("has %dxx: %s", class, notFinal(class*100))
		}
	}
	return nil
}

// checkRelease refuses a release list with a success in it: the catalog
// executed, and releasing the key would let a retry execute again.
func (s statusSet) checkRelease() error {
	if s.classes[2] {
		return fmt.Errorf("has 2xx: a released success is executed again on retry")
	}
	for code := range s.codes {
		if code/100 == 2 {
			return fmt.Errorf("has %d: a released success is executed again on retry", code)
		}
	}
	return nil
}

func notFinal(code int) string {
	if code < 200 {
		return "a 1xx response is never final, so it cannot be stored"
	}
	return "the Iceberg REST spec says 5xx answers are not finalized; they are released so a retry can execute"
}

// commitStateUnknown reports whether a catalog's answer says that it may
// have executed the request although the answer is an error: the key's
// outcome is then unknown, neither stored (the spec forbids storing a 5xx)
// nor released (a retry would execute the commit again, and after a commit
// that landed, hear 409 and delete files the table still uses:
// apache/iceberg#13867). That is so when
//   - the answer is a 500, 502 or 504 to a commit (updateTable,
//     commitTransaction, replaceView), which the spec defines as "the
//     commit state is unknown" and the Java client reads so, whoever sent
//     it: the catalog, or a gateway between Caddy and the catalog that
//     gave up waiting;
//   - or any 5xx whose body is an Iceberg error of type
//     CommitStateUnknownException: the catalog said so itself.
//
// body is the answer as the catalog sent it (encoded per its
// Content-Encoding); complete is false when it was too large to hold.
func commitStateUnknown(operation string, status int, contentEncoding string, body []byte, complete bool) bool {
	if status < 500 || status > 599 {
		return false
	}
	if isCommit(operation) && (status == 500 || status == 502 || status == 504) {
		return true
	}
	if !complete || len(body) == 0 {
		return false
	}
	if contentEncoding != "" {
		plain, err := decodeBody(contentEncoding, body, maxErrorBodySize)
		if err != nil {
			return false
		}
		body = plain
	}
	var answer struct {
		Error struct {
			Type string `json:"type"`
		} `json:"error"`
	}
	return json.Unmarshal(body, &answer) == nil && answer.Error.Type == typeCommitStateUnknown
}

// maxErrorBodySize bounds how much of a compressed error answer is decoded
// to read its type.
const maxErrorBodySize = 1 << 20

// isCommit reports whether operation is one whose 500, 502 and 504 the spec
// defines as "the commit state is unknown". A path that reads as a commit
// and as another mutation (a table named ".", sent as "…/tables/%2E": the
// normalized reading is createTable; a prefix and names that spell a
// template word) is guarded as the commit: read as the other, its 502
// would release the key, and a retry would commit again. Read as a commit
// by mistake, a 5xx leaves the key unknown instead, the safe side.
func isCommit(operation string) bool {
	return operation == "updateTable" || operation == "commitTransaction" || operation == "replaceView"
}
