package icebergidempotency

import (
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/rewrite"
)

// normalizePath returns the form of an escaped URL path that the handler
// classifies and binds keys to, so that every spelling a catalog treats as
// one path is guarded as that path:
//
//   - percent-encoded unreserved characters (RFC 3986: ALPHA, DIGIT, "-", ".",
//     "_", "~") are decoded, since decoding them never changes a URI's meaning:
//     "/v1/wh/%6Eamespaces" is "/v1/wh/namespaces";
//   - other escapes keep their encoding with upper-case hex digits ("%2f" and
//     "%2F" are one character): "%2F" and "%1F" stay inside their segment, as
//     Iceberg's namespace separator must;
//   - path parameters (";jsessionid=…", RFC 3986 section 3.3) are cut from
//     each segment: servlet containers and JAX-RS, on which the Java
//     catalogs run, route "/v1/namespaces;x" as "/v1/namespaces" (an
//     escaped "%3B" is data and stays);
//   - empty segments ("//") and a trailing "/" are dropped, and "." and ".."
//     segments are resolved: servlet containers, Go's ServeMux and most web
//     frameworks route such paths to the same handler or redirect to it, so a
//     guard that missed them could be walked around. A path the catalog
//     rejects instead (404) gains nothing from this but a stored 404.
//
// Reading more paths as mutations than the catalog does costs at most a
// stored 4xx; reading fewer would let a retry execute twice.
func normalizePath(escaped string) string {
	if escaped == "" {
		return "/"
	}
	if alreadyNormal(escaped) {
		// The common case, without the allocations of a rebuild.
		return escaped
	}
	return rebuildPath(escaped)
}

// rebuildPath is normalizePath by splitting and joining every segment.
func rebuildPath(escaped string) string {
	segs := strings.Split(escaped, "/")
	out := make([]string, 0, len(segs))
	for _, seg := range segs {
		seg, _, _ = strings.Cut(seg, ";")
		seg = normalizeEscapes(seg)
		switch seg {
		case "", ".":
			continue
		case "..":
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
			continue
		}
		out = append(out, seg)
	}
	return "/" + strings.Join(out, "/")
}

// alreadyNormal reports whether normalizePath would return p unchanged: it
// starts with "/", has no escape, no path parameter, no empty, "." or ".."
// segment and no trailing "/".
func alreadyNormal(p string) bool {
	if p == "/" {
		return true
	}
	if p[0] != '/' || p[len(p)-1] == '/' || strings.IndexAny(p, "%;") >= 0 {
		return false
	}
	for rest := p[1:]; ; {
		seg, tail, more := strings.Cut(rest, "/")
		if seg == "" || seg == "." || seg == ".." {
			return false
		}
		if !more {
			return true
		}
		rest = tail
	}
}

// normalizeEscapes decodes escaped unreserved characters in one path segment
// and upper-cases the hex digits of the escapes it keeps. A '%' that starts
// no valid escape becomes "%25", so that decoding what follows it cannot
// form a new escape ("%a%41" must not become "%aA").
func normalizeEscapes(seg string) string {
	if !strings.Contains(seg, "%") {
		return seg
	}
	var b strings.Builder
	b.Grow(len(seg))
	for i := 0; i < len(seg); i++ {
		c := seg[i]
		if c != '%' {
			b.WriteByte(c)
			continue
		}
		hi, lo := -1, -1
		if i+2 < len(seg) {
			hi, lo = unhex(seg[i+1]), unhex(seg[i+2])
		}
		if hi < 0 || lo < 0 {
			b.WriteString("%25")
			continue
		}
		decoded := byte(hi<<4 | lo)
		if isUnreserved(decoded) {
			b.WriteByte(decoded)
		} else {
			b.WriteByte('%')
			b.WriteByte(upperHex[hi])
			b.WriteByte(upperHex[lo])
		}
		i += 2
	}
	return b.String()
}

const upperHex = "0123456789ABCDEF"

func unhex(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'a' <= c && c <= 'f':
		return int(c - 'a' + 10)
	case 'A' <= c && c <= 'F':
		return int(c - 'A' + 10)
	}
	return -1
}

func isUnreserved(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
		c == '-' || c == '.' || c == '_' || c == '~'
}

// cutPrefixFold is strings.CutPrefix comparing decoded bytes (an escape
// "%XY" is the byte it encodes) and ASCII letters without case, as
// Caddy's path matcher compares a prefix. path and prefix are normalized,
// so an escape in either is valid and upper-case.
func cutPrefixFold(path, prefix string) (string, bool) {
	i := 0
	for j := 0; j < len(prefix); {
		if i >= len(path) {
			return "", false
		}
		p, pn := decodedByte(path[i:])
		q, qn := decodedByte(prefix[j:])
		if lowerASCII(p) != lowerASCII(q) {
			return "", false
		}
		i, j = i+pn, j+qn
	}
	return path[i:], true
}

// decodedByte is the first byte s stands for and how many of its bytes
// spell it: three for a valid escape, else one.
func decodedByte(s string) (byte, int) {
	if len(s) >= 3 && s[0] == '%' {
		if hi, lo := unhex(s[1]), unhex(s[2]); hi >= 0 && lo >= 0 {
			return byte(hi<<4 | lo), 3
		}
	}
	return s[0], 1
}

func lowerASCII(c byte) byte {
	if 'A' <= c && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// strippedPath returns the escaped path that "uri strip_prefix base" leaves
// of escaped, as sent on by reverse_proxy, and whether it strips anything.
// It asks Caddy's own rewrite: how it cuts an escaped prefix and cleans
// what is left has changed between Caddy releases, and the path the
// catalog gets is whatever this build's does.
func strippedPath(escaped, base string) (string, bool) {
	decoded, err := url.PathUnescape(escaped)
	if err != nil {
		return "", false // Go's server refuses such a request line
	}
	r := &http.Request{URL: &url.URL{Path: decoded, RawPath: escaped}}
	rewrite.Rewrite{StripPathPrefix: base}.Rewrite(r, caddy.NewEmptyReplacer())
	// Unstripped, the rewrite leaves the path as it cleans it before
	// looking for the prefix.
	rest := r.URL.EscapedPath()
	return rest, rest != caddyhttp.CleanPath(escaped, !strings.Contains(base, "//"))
}

// readingStep is one thing a catalog's server may do to a path before it
// routes it (see readingPick.otherReadings).
type readingStep uint8

const (
	// cutParams cuts ";…" from each segment (servlet containers, JAX-RS,
	// Spring MVC).
	cutParams readingStep = iota
	// decodeSlash decodes "%2F" into a separator (Starlette, Spring MVC,
	// getPathInfo).
	decodeSlash
	// dropDots drops empty segments, then resolves "." and ".."
	// (servlet containers' normalization, as normalizePath does).
	dropDots
	// rfcDots resolves "." and ".." with empty segments kept until then
	// (RFC 3986 section 5.2.4, Vert.x's normalizePath, Jetty's
	// canonicalPath): "/a//../b" is "/a/b".
	rfcDots
)

// numReadingOrders is len(readingOrders), checked by TestReadingOrders.
const numReadingOrders = 27

// readingOrders are the orders in which a server may take those steps:
// each of cutParams and decodeSlash taken or not, at most one of the dot
// steps, in any order. The readings the handler made before the build
// after 051e419 come first, so that a path one of them guards keeps the
// key binding it had: as sent, and with "%2F" decoded, normalized or as
// sent (normalizePath's reading, cutParams then dropDots, is the caller's).
var readingOrders = func() (orders [][]readingStep) {
	orders = [][]readingStep{nil, {decodeSlash, cutParams, dropDots}, {decodeSlash}}
	var permute func(prefix, rest []readingStep)
	permute = func(prefix, rest []readingStep) {
		if len(rest) == 0 {
			if !slices.ContainsFunc(orders, func(o []readingStep) bool { return slices.Equal(o, prefix) }) {
				orders = append(orders, slices.Clone(prefix))
			}
			return
		}
		for i := range rest {
			others := append(slices.Clone(rest[:i]), rest[i+1:]...)
			permute(append(prefix, rest[i]), others)
		}
	}
	for _, dots := range [][]readingStep{nil, {dropDots}, {rfcDots}} {
		for _, steps := range [][]readingStep{nil, {cutParams}, {decodeSlash}, {cutParams, decodeSlash}} {
			permute(nil, append(slices.Clone(steps), dots...))
		}
	}
	return orders
}()

// readingSegments returns escaped's segments, escapes normalized as
// normalizePath does, and room for readingOf to work in.
func readingSegments(escaped string) (segs, scratch []string) {
	segs = strings.Split(escaped, "/")
	for i, seg := range segs {
		segs[i] = normalizeEscapes(seg)
	}
	// decodeSlash adds a segment for each "%2F"
	n := len(segs) + strings.Count(escaped, "%2") + 1
	return segs, make([]string, 0, 2*n)
}

// readingOf is the path, given as readingSegments' segments, as a server
// that takes steps, in order, reads it, empty segments dropped at the end.
// It works in scratch, whose room readingSegments made.
func readingOf(segs []string, steps []readingStep, scratch []string) string {
	half := cap(scratch) / 2
	cur := append(scratch[:0], segs...)
	other := scratch[half:half]
	for _, step := range steps {
		switch step {
		case cutParams:
			for i, seg := range cur {
				cur[i], _, _ = strings.Cut(seg, ";")
			}
		case decodeSlash:
			out := other[:0]
			for _, seg := range cur {
				for {
					i := strings.Index(seg, "%2F")
					if i < 0 {
						break
					}
					out = append(out, seg[:i])
					seg = seg[i+3:]
				}
				out = append(out, seg)
			}
			cur, other = out, cur[:0]
		case dropDots, rfcDots:
			out := cur[:0] // in place: it writes no faster than it reads
			for _, seg := range cur {
				switch {
				case seg == "" && step == dropDots, seg == ".":
				case seg == "..":
					if len(out) > 0 {
						out = out[:len(out)-1]
					}
				default:
					out = append(out, seg)
				}
			}
			cur = out
		}
	}
	size := 1
	for _, seg := range cur {
		size += len(seg) + 1
	}
	var b strings.Builder
	b.Grow(size)
	for _, seg := range cur {
		if seg != "" {
			b.WriteByte('/')
			b.WriteString(seg)
		}
	}
	if b.Len() == 0 {
		return "/"
	}
	return b.String()
}
