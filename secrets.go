package icebergidempotency

// Secrets at rest: with the `secret` option, nothing a store holds can be
// read or tested against a guess without the secret. Each secret yields,
// through HKDF-SHA-256, an AES-256-GCM key that seals the stored response
// (status, replayed headers, body) and two HMAC-SHA-256 keys that replace
// the unkeyed SHA-256 of the principal and of the request fingerprint. A
// short key id, derived from the secret too, is stored with every sealed
// response so that a record written under a previous secret finds its key.

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// HKDF info strings: one per derived key, so that no key serves two
// purposes. The version suffix lets a future format derive fresh keys from
// the same secret.
const (
	infoSeal        = "iceberg_idempotency record seal v1"
	infoPrincipal   = "iceberg_idempotency principal v1"
	infoFingerprint = "iceberg_idempotency fingerprint v1"
	infoKeyID       = "iceberg_idempotency key id v1"
)

// hkdfSalt is fixed: the secret is the only input that must stay private,
// and a fixed salt keeps the derivation the same on every node.
var hkdfSalt = []byte("caddy-iceberg-idempotency")

// minSecretLen is the length below which a secret draws a warning: the keyed
// fingerprints are only as hard to guess as the secret itself.
const minSecretLen = 16

// secretKeys are the keys derived from one secret. Nothing here is
// marshalled: the handler's JSON keeps only the placeholder.
type secretKeys struct {
	id             string      // short, non-secret name stored with sealed records
	aead           cipher.AEAD // AES-256-GCM, random 12-byte nonce prepended
	principalKey   []byte
	fingerprintKey []byte
}

// deriveKeys derives the record, principal, fingerprint and key-id keys
// from secret.
func deriveKeys(secret string) (*secretKeys, error) {
	derive := func(info string) ([]byte, error) {
		return hkdf.Key(sha256.New, []byte(secret), hkdfSalt, info, 32)
	}
	sealKey, err := derive(infoSeal)
	if err != nil {
		return nil, fmt.Errorf("deriving the record key: %w", err)
	}
	block, err := aes.NewCipher(sealKey)
	if err != nil {
		return nil, fmt.Errorf("record cipher: %w", err)
	}
	aead, err := cipher.NewGCMWithRandomNonce(block)
	if err != nil {
		return nil, fmt.Errorf("record cipher: %w", err)
	}
	k := &secretKeys{aead: aead}
	if k.principalKey, err = derive(infoPrincipal); err != nil {
		return nil, fmt.Errorf("deriving the principal key: %w", err)
	}
	if k.fingerprintKey, err = derive(infoFingerprint); err != nil {
		return nil, fmt.Errorf("deriving the fingerprint key: %w", err)
	}
	idKey, err := derive(infoKeyID)
	if err != nil {
		return nil, fmt.Errorf("deriving the key id: %w", err)
	}
	mac := hmac.New(sha256.New, idKey)
	mac.Write([]byte("key-id"))
	k.id = hex.EncodeToString(mac.Sum(nil))[:8]
	return k, nil
}

// keyring holds the keys of the configured secrets: current seals new
// records and keys new bindings (nil without `secret`); previous only open
// and match what older configurations wrote.
type keyring struct {
	current  *secretKeys
	previous []*secretKeys
}

// byID finds the keys a sealed record names, current or previous.
func (kr keyring) byID(id string) *secretKeys {
	if kr.current != nil && kr.current.id == id {
		return kr.current
	}
	for _, k := range kr.previous {
		if k.id == id {
			return k
		}
	}
	return nil
}

// alternatives lists the keys, besides the current ones, under which a
// stored binding may have been written: each previous secret and, when a
// secret is set, none (nil: the unkeyed SHA-256 of records written before
// it was).
func (kr keyring) alternatives() []*secretKeys {
	alts := append([]*secretKeys(nil), kr.previous...)
	if kr.current != nil {
		alts = append(alts, nil)
	}
	return alts
}

// expandSecret expands the placeholders of one secret option. An empty
// result is an error that names the placeholders to check: a value that
// expands to nothing contains nothing but placeholders, so quoting it
// reveals nothing.
func expandSecret(opt, raw string) (string, error) {
	v := caddy.NewReplacer().ReplaceKnown(raw, "")
	if v == "" {
		return "", fmt.Errorf("%s %q expands to an empty value: is the variable or file it names set?", opt, raw)
	}
	return v, nil
}

// checkSecretPlaceholders refuses a secret option that holds a
// placeholder not read at start: one in a namespace Caddy fills per
// request ({http.*}), or with what anyone can read ({system.*}, {time.*}),
// one in a namespace Caddy does not know ({evn.X}, {ENV.X}: a misspelt
// {env.X}), and one left open ({env.X). Each stayed in the secret as
// written, or as what everyone can read, until the build after b35c62e,
// and the records were sealed under a key derived from text in the config,
// with a warning that read like the one for a secret written literally.
// Braces that make no placeholder name (no "word." after the brace), as a
// literal secret may hold, are the secret's own text, as before. A name may
// be a piece of a literal secret: the error gives its namespace and its
// place in the value, never the rest of its text.
func checkSecretPlaceholders(opt, raw string) error {
	var problem error
	r := caddy.NewEmptyReplacer()
	r.Map(func(key string) (any, bool) {
		ns, _, dotted := strings.Cut(key, ".")
		switch {
		case problem != nil || !dotted || !placeholderNamespace.MatchString(ns):
			return nil, false // not a placeholder name: the secret's own text
		case ns == "env" || ns == "file":
		case strings.HasPrefix(key, "http.request.uri.path.file."):
			name := strings.TrimPrefix(key, "http.request.uri.path.file.")
			problem = fmt.Errorf("%s: the Caddyfile reads {file.%s} (a name without \"/\" or \".\") as the request path's file name, "+
				"not as a file to read at start; name the file by its path, e.g. {file./etc/caddy/%s}", opt, name, name)
		case ns == "http" || ns == "system" || ns == "time":
			problem = fmt.Errorf("%s holds a {%s.…} placeholder at byte %d of its value, which is not read at start: a secret may hold only "+
				"{env.NAME} and {file./path} placeholders", opt, ns, strings.Index(raw, "{"+key+"}"))
		default:
			problem = fmt.Errorf("%s holds a placeholder in a namespace Caddy does not know (a misspelt {env.NAME}?) at byte %d of its value: "+
				"a secret may hold only {env.NAME} and {file./path} placeholders; put a secret that holds braces in a file",
				opt, strings.Index(raw, "{"+key+"}"))
		}
		return "", true
	})
	rest := r.ReplaceAll(raw, "")
	if problem != nil {
		return problem
	}
	if loc := unclosedPlaceholder.FindStringIndex(rest); loc != nil {
		return fmt.Errorf("%s holds a placeholder that is not closed (a { with no }): a secret may hold only "+
			"{env.NAME} and {file./path} placeholders; put a secret that holds braces in a file", opt)
	}
	return nil
}

// placeholderNamespace is what the first part of a placeholder's name
// looks like; unclosedPlaceholder, a brace opening one that never closes.
var (
	placeholderNamespace = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_]*$`)
	unclosedPlaceholder  = regexp.MustCompile(`\{[A-Za-z][A-Za-z0-9_]*\.[^{}]*$`)
)

// expandSecretParts is expandSecret's check of each placeholder in a
// composite value ({env.A}{env.B}): one expanding to nothing left the rest
// as the secret, shorter than meant and without an error, until the build
// after b35c62e.
func expandSecretParts(opt, raw string) error {
	if name, why := emptyPlaceholder(raw); name != "" {
		return fmt.Errorf("%s: {%s} expands to an empty value: it %s", opt, name, why)
	}
	return nil
}

// withoutKnownPlaceholders is raw with the placeholders that expandSecret
// expands taken out, and those it leaves as written (unknown ones) kept.
func withoutKnownPlaceholders(raw string) string {
	known := caddy.NewReplacer()
	r := caddy.NewEmptyReplacer()
	r.Map(func(key string) (any, bool) {
		_, ok := known.Get(key)
		return "", ok
	})
	return r.ReplaceKnown(raw, "")
}

// prepareKeys expands and derives the handler's secrets. Two secrets that
// derive the same key id are refused: a sealed record must name one key.
func (h *Handler) prepareKeys() (keyring, []string, error) {
	var kr keyring
	var warnings []string
	seen := map[string]string{}
	add := func(opt, raw string) (*secretKeys, error) {
		if err := checkSecretPlaceholders(opt, raw); err != nil {
			return nil, err
		}
		secret, err := expandSecret(opt, raw)
		if err != nil {
			return nil, err
		}
		if err := expandSecretParts(opt, raw); err != nil {
			return nil, err
		}
		if len(secret) < minSecretLen {
			warnings = append(warnings, fmt.Sprintf("%s is shorter than %d bytes: keyed fingerprints are only as hard to guess as the secret", opt, minSecretLen))
		}
		// What is left of raw without the placeholders that expand is in
		// the configuration for anyone who reads it.
		switch literal := withoutKnownPlaceholders(raw); {
		case secret == raw:
			warnings = append(warnings, opt+" is written literally in the configuration, where the admin API and `caddy adapt` show it: use a placeholder such as {env.ICEBERG_IDEMPOTENCY_SECRET}")
		case literal != "":
			warnings = append(warnings, fmt.Sprintf("%d bytes of %s are written literally in the configuration, beside its placeholders, where the admin API and `caddy adapt` show them: put the whole secret in the variable or file", len(literal), opt))
		}
		k, err := deriveKeys(secret)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", opt, err)
		}
		if other, dup := seen[k.id]; dup {
			return nil, fmt.Errorf("%s and %s derive the same key id %s: the same secret is listed twice", other, opt, k.id)
		}
		seen[k.id] = opt
		return k, nil
	}
	if h.Secret != "" {
		k, err := add("secret", h.Secret)
		if err != nil {
			return keyring{}, nil, err
		}
		kr.current = k
	}
	for i, raw := range h.PreviousSecrets {
		k, err := add(fmt.Sprintf("previous_secrets[%d]", i), raw)
		if err != nil {
			return keyring{}, nil, err
		}
		kr.previous = append(kr.previous, k)
	}
	return kr, warnings, nil
}

// requestParts are what a key is bound to, before they are hashed: kept so
// that, on a mismatch, the binding can be recomputed under another secret.
type requestParts struct {
	principal string // the expanded principal expression
	method    string
	path      string
	query     string
	body      []byte
}

// binding hashes p under k: HMAC-SHA-256 with k's derived keys, or the
// unkeyed SHA-256 when k is nil (no secret).
func (p *requestParts) binding(op string, k *secretKeys) stores.Binding {
	return stores.Binding{
		Operation:   op,
		Path:        p.path,
		Principal:   p.principalHash(k),
		Fingerprint: p.fingerprint(k),
	}
}

func (p *requestParts) principalHash(k *secretKeys) string {
	if k == nil {
		return sha256Hex([]byte(p.principal))
	}
	mac := hmac.New(sha256.New, k.principalKey)
	mac.Write([]byte(p.principal))
	var sum [sha256.Size]byte
	return hexSum([sha256.Size]byte(mac.Sum(sum[:0])))
}

func (p *requestParts) fingerprint(k *secretKeys) string {
	if k == nil {
		return requestFingerprint(p.method, p.path, p.query, p.body)
	}
	return fingerprintWith(hmac.New(sha256.New, k.fingerprintKey), p.method, p.path, p.query, p.body)
}

// fingerprintWith writes the request's parts, each prefixed with its length
// so that no two different requests share an input, into hash.
func fingerprintWith(hash hash.Hash, method, path, query string, body []byte) string {
	// One buffer for the small parts and their lengths; the body follows
	// without a copy. (The buffer escapes through hash.Write whatever its
	// declaration, so it is sized for common paths.)
	hash.Write(appendFingerprintParts(make([]byte, 0, 128), method, path, query, len(body)))
	hash.Write(body)
	var sum [sha256.Size]byte
	return hexSum([sha256.Size]byte(hash.Sum(sum[:0])))
}

// appendFingerprintParts appends what a fingerprint hashes before the body:
// method, path and query written as "<len>:<part>" each, exactly as
// fmt.Fprintf("%d:") did, then "<len(body)>:". Records in shared stores
// outlive upgrades, so these bytes never change (TestRequestFingerprintLayout).
func appendFingerprintParts(buf []byte, method, path, query string, bodyLen int) []byte {
	for _, part := range [...]string{method, path, query} {
		buf = strconv.AppendInt(buf, int64(len(part)), 10)
		buf = append(buf, ':')
		buf = append(buf, part...)
	}
	buf = strconv.AppendInt(buf, int64(bodyLen), 10)
	return append(buf, ':')
}

// sealFormat is the first byte of a sealed plaintext: the layout of what
// follows it.
const sealFormat = 1

// sealAAD is the associated data of a record's seal: its key and its binding
// as stored, length-prefixed. A sealed response moved onto another key, or
// under another binding, does not open.
func sealAAD(key string, b stores.Binding) []byte {
	var aad []byte
	for _, part := range []string{key, b.Operation, b.Path, b.Principal, b.Fingerprint} {
		aad = appendString(aad, part)
	}
	return aad
}

// seal encrypts resp for the record of key bound to b. The plaintext is the
// format byte, the status, the headers (see appendHeader), then the body.
func (k *secretKeys) seal(key string, b stores.Binding, resp stores.Response) (stores.Response, error) {
	if resp.Status < 100 || resp.Status > 999 {
		return stores.Response{}, fmt.Errorf("sealing a response with status %d", resp.Status)
	}
	size := 1 + binary.MaxVarintLen64 + len(resp.Body)
	for name, vals := range resp.Header {
		size += 2*binary.MaxVarintLen64 + len(name)
		for _, v := range vals {
			size += binary.MaxVarintLen64 + len(v)
		}
	}
	pt := make([]byte, 0, size+binary.MaxVarintLen64)
	pt = append(pt, sealFormat)
	pt = binary.AppendUvarint(pt, uint64(resp.Status))
	pt = appendHeader(pt, resp.Header)
	pt = append(pt, resp.Body...)
	sealed := k.aead.Seal(make([]byte, 0, len(pt)+k.aead.Overhead()), nil, pt, sealAAD(key, b))
	return stores.Response{KeyID: k.id, Body: sealed}, nil
}

// appendHeader appends hdr as a count of names, then each name (sorted, so
// the same response seals to the same plaintext) with its count of values
// and the values, every string prefixed with its length.
func appendHeader(buf []byte, hdr http.Header) []byte {
	buf = binary.AppendUvarint(buf, uint64(len(hdr)))
	for _, name := range slices.Sorted(maps.Keys(hdr)) {
		buf = appendString(buf, name)
		buf = binary.AppendUvarint(buf, uint64(len(hdr[name])))
		for _, v := range hdr[name] {
			buf = appendString(buf, v)
		}
	}
	return buf
}

func appendString(buf []byte, s string) []byte {
	return append(binary.AppendUvarint(buf, uint64(len(s))), s...)
}

// errUnsealable says a sealed record's plaintext is not in a known layout.
var errUnsealable = errors.New("sealed record has an unknown layout")

// plainReader reads what seal wrote, failing on any truncation.
type plainReader struct {
	rest []byte
	bad  bool
}

func (r *plainReader) uvarint() uint64 {
	v, n := binary.Uvarint(r.rest)
	if n <= 0 {
		r.bad = true
		return 0
	}
	r.rest = r.rest[n:]
	return v
}

func (r *plainReader) string() string {
	n := r.uvarint()
	if r.bad || n > uint64(len(r.rest)) {
		r.bad = true
		return ""
	}
	s := string(r.rest[:n])
	r.rest = r.rest[n:]
	return s
}

// open decrypts a response sealed for the record of key bound to b.
func (k *secretKeys) open(key string, b stores.Binding, sealed []byte) (*stores.Response, error) {
	pt, err := k.aead.Open(nil, nil, sealed, sealAAD(key, b))
	if err != nil {
		return nil, err
	}
	if len(pt) == 0 || pt[0] != sealFormat {
		return nil, errUnsealable
	}
	r := &plainReader{rest: pt[1:]}
	status := r.uvarint()
	names := r.uvarint()
	if r.bad || status < 100 || status > 999 || names > uint64(len(r.rest)) {
		return nil, errUnsealable
	}
	hdr := make(http.Header, names)
	for range names {
		name := r.string()
		count := r.uvarint()
		if r.bad || count > uint64(len(r.rest)) {
			return nil, errUnsealable
		}
		vals := make([]string, 0, count)
		for range count {
			vals = append(vals, r.string())
		}
		hdr[name] = vals
	}
	if r.bad {
		return nil, errUnsealable
	}
	return &stores.Response{Status: int(status), Header: hdr, Body: r.rest}, nil
}
