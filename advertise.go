package icebergidempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// LifetimeField is the top-level GET /v1/config field whose presence tells
// clients the server supports Idempotency-Key.
const LifetimeField = "idempotency-key-lifetime"

// maxConfigSize bounds the /v1/config response the handler will rewrite;
// larger ones pass through untouched.
const maxConfigSize = 1 << 20

// advertise adds the lifetime to a successful GET /v1/config response.
//
// The client's Accept-Encoding is dropped for the call: the field is added
// to the JSON text, and clients ask for codings a catalog may honour (gzip
// from Go's transport and the Java client's HttpClient 5; br and zstd from
// others). Caddy's transport then asks for gzip itself and decodes it. Caddy's encode handler,
// when configured, runs before this one and still compresses the answer for
// the client: it chose its encoding from the client's request already.
//
// The headers come off the request itself for the call, and go back after
// it, as callUpstream hides them, not off a copy: Go's server writes a
// request's trailers into the request it read once the body ends, and a
// copy sent the catalog their names without their values.
func (h *Handler) advertise(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	// Nor a switch of protocols, whose answer could not be rewritten (see
	// hideUpgrade).
	defer hideHeaders(r, "Accept-Encoding", "Upgrade", "Http2-Settings")()
	cw := newCaptureWriter(w, maxConfigSize)
	if err := next.ServeHTTP(cw, r); err != nil {
		return err
	}
	if cw.overflowed {
		h.logger.Warn("config response larger than the handler rewrites: passed on as it came, "+
			"idempotency-key-lifetime not advertised, so clients will not send keys",
			zap.Int("max_bytes", maxConfigSize))
		return nil
	}
	hdr := w.Header()
	mediaType, _, _ := mime.ParseMediaType(hdr.Get("Content-Type"))
	if cw.finalStatus() != http.StatusOK || mediaType != "application/json" {
		cw.deliver()
		return nil
	}
	doc := cw.buf.Bytes()
	if enc := hdr.Get("Content-Encoding"); enc != "" {
		// A catalog that compresses although not asked to.
		plain, err := decodeBody(enc, doc, maxConfigSize)
		if err != nil {
			h.logger.Warn("config response is compressed in an encoding the handler cannot read: "+
				"idempotency-key-lifetime not advertised, so clients will not send keys",
				zap.String("content_encoding", enc), zap.Error(err))
			cw.deliver()
			return nil
		}
		doc = plain
	}
	body, err := setTopLevelField(doc, LifetimeField, isoDuration(h.advertisedLifetime()))
	if err != nil {
		h.logger.Warn("config response is not a JSON object: idempotency-key-lifetime not advertised", zap.Error(err))
		cw.deliver()
		return nil
	}
	hdr.Del("Content-Encoding")
	hdr.Del("ETag") // the body changed
	// Trailers the catalog sent after the document go after it here too,
	// as plain reverse_proxy sends them (see captureWriter.deliver): left
	// in the header, they went out as headers. An answer with trailers
	// is chunked, as the catalog's was; a length would leave no room for
	// them over HTTP/1.
	trailers := takeTrailers(hdr)
	if trailers == nil {
		hdr.Set("Content-Length", strconv.Itoa(len(body)))
	} else {
		hdr.Del("Content-Length")
	}
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
	for name, vals := range trailers {
		hdr[name] = vals // net/http sends them after the body
	}
	return nil
}

// advertisedLifetime is the lifetime GET /v1/config advertises: the
// shortest of the config's handlers (see App.noteLifetime).
func (h *Handler) advertisedLifetime() time.Duration {
	d := time.Duration(h.Lifetime)
	if h.advertised != nil {
		if shortest := time.Duration(h.advertised.Load()); shortest > 0 {
			d = min(d, shortest)
		}
	}
	return d
}

// setTopLevelField sets name to the JSON string value in the object doc,
// replacing an existing value in place or appending the member, so that every
// other byte of the document is kept as the catalog wrote it. A name the
// catalog sent more than once has each of its values replaced: decoders
// differ on which one counts (Go's and Jackson's take the last), and one left
// as it was could be the one read.
func setTopLevelField(doc []byte, name, value string) ([]byte, error) {
	encoded, err := json.Marshal(value)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(doc))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, errors.New("not a JSON object")
	}
	members := 0
	var values [][2]int64 // where each of name's values starts and ends
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		keyEnd := dec.InputOffset()
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, err
		}
		valEnd := dec.InputOffset()
		members++
		if tok != name {
			continue
		}
		valStart := valEnd - int64(len(raw))
		if valStart < keyEnd || !bytes.Equal(doc[valStart:valEnd], raw) {
			return nil, fmt.Errorf("cannot locate the value of %q", name)
		}
		values = append(values, [2]int64{valStart, valEnd})
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, errors.New("malformed JSON object")
	}
	end := dec.InputOffset() - 1 // the closing brace
	if _, err := dec.Token(); err == nil {
		return nil, errors.New("trailing data after the JSON object")
	}
	if len(values) > 0 {
		var out []byte
		from := int64(0)
		for _, v := range values {
			out = append(append(out, doc[from:v[0]]...), encoded...)
			from = v[1]
		}
		return append(out, doc[from:]...), nil
	}
	member, _ := json.Marshal(name)
	member = append(append(member, ':'), encoded...)
	if members > 0 {
		member = append([]byte{','}, member...)
	}
	out := append([]byte(nil), doc[:end]...)
	out = append(out, member...)
	return append(out, doc[end:]...), nil
}

// isoDuration formats d as an ISO-8601 duration, the form the spec uses for
// idempotency-key-lifetime: 30m → PT30M, 2h → PT2H, 90m → PT1H30M. Hours are
// not folded into days: "PT24H" is what clients expect to read.
func isoDuration(d time.Duration) string {
	if d <= 0 {
		return "PT0S"
	}
	var b strings.Builder
	b.WriteString("PT")
	if h := d / time.Hour; h > 0 {
		b.WriteString(strconv.FormatInt(int64(h), 10) + "H")
		d -= h * time.Hour
	}
	if m := d / time.Minute; m > 0 {
		b.WriteString(strconv.FormatInt(int64(m), 10) + "M")
		d -= m * time.Minute
	}
	if d > 0 {
		// In integers: a float's digits are not the duration's (1.118s
		// formatted as 1.1179999999999999), and java.time.Duration.parse
		// refuses more than nine of them, which breaks the Java client's
		// whole config parse.
		b.WriteString(strconv.FormatInt(int64(d/time.Second), 10))
		if ns := d % time.Second; ns > 0 {
			b.WriteString("." + strings.TrimRight(fmt.Sprintf("%09d", ns), "0"))
		}
		b.WriteString("S")
	}
	return b.String()
}
