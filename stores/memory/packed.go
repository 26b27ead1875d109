package memory

import (
	"encoding/binary"
	"math"
	"math/bits"
	"net/http"
	"time"
	"unsafe"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// finalEntry is a final record, packed so that the garbage collector has
// little to follow: a store holding its default 256 MiB keeps hundreds of
// thousands of them, and every collection cycle marks each of their objects
// again. As a stores.Record with its header map, a final record with a
// two-value header was ten objects (the entry, its strings, the map, its
// slots, a slice per header value); packed it is at most three, the entry,
// its packed text and the body (TestFinalRecordIsFewObjects).
// BenchmarkServeHTTP's fresh keys spent about as much time marking the
// records of a full store as serving the request through the handler.
//
// packed holds the key, the binding, the key id and the header, in that
// order (see packFinal), and is never written once built: the strings a
// record read from it carries point into it (see text).
type finalEntry struct {
	packed []byte
	body   []byte
	// ends are the offsets in packed at which the key, operation, path,
	// principal, fingerprint and key id end; the header follows.
	ends      [6]uint32
	status    int32
	hasHeader bool  // the response had a header (possibly empty); nil otherwise
	createdAt int64 // Unix nanoseconds
	expiresAt int64 // on the store's clock: see since
	size      int64 // counted bytes (recordSize)
	// prev and next order the final records by recency (finalList),
	// expPrev and expNext link one into its bucket of the expiry index,
	// expSec.
	prev, next       *finalEntry
	expPrev, expNext *finalEntry
	expSec           int64
}

// packFinal builds the final form of rec (in flight until now) with resp,
// whose body it keeps as it is: the caller hands it over.
func packFinal(rec *stores.Record, resp stores.Response, size int64) *finalEntry {
	n := len(rec.Key) + len(rec.Operation) + len(rec.Path) + len(rec.Principal) + len(rec.Fingerprint) + len(resp.KeyID)
	values := 0
	if resp.Header != nil {
		for name, vals := range resp.Header {
			n += uvarintLen(len(name)) + len(name) + uvarintLen(len(vals))
			for _, v := range vals {
				n += uvarintLen(len(v)) + len(v)
			}
			values += len(vals)
		}
		n += uvarintLen(len(resp.Header)) + uvarintLen(values)
	}
	buf := make([]byte, 0, n)
	f := &finalEntry{
		body:      resp.Body,
		status:    int32(resp.Status),
		hasHeader: resp.Header != nil,
		createdAt: unixNano(rec.CreatedAt),
		expiresAt: since(rec.ExpiresAt),
		size:      size,
	}
	for i, s := range [6]string{rec.Key, rec.Operation, rec.Path, rec.Principal, rec.Fingerprint, resp.KeyID} {
		buf = append(buf, s...)
		f.ends[i] = uint32(len(buf))
	}
	if resp.Header != nil {
		buf = binary.AppendUvarint(buf, uint64(len(resp.Header)))
		buf = binary.AppendUvarint(buf, uint64(values))
		for name, vals := range resp.Header {
			buf = appendText(buf, name)
			buf = binary.AppendUvarint(buf, uint64(len(vals)))
			for _, v := range vals {
				buf = appendText(buf, v)
			}
		}
	}
	f.packed = buf
	return f
}

// unixNano is t in Unix nanoseconds, held to the range they cover (years
// 1678 to 2262): past it UnixNano wraps, and a record kept for a lifetime
// of centuries would read as long expired.
func unixNano(t time.Time) int64 {
	switch {
	case t.After(maxUnixNano):
		return math.MaxInt64
	case t.Before(minUnixNano):
		return math.MinInt64
	}
	return t.UnixNano()
}

var (
	maxUnixNano = time.Unix(0, math.MaxInt64)
	minUnixNano = time.Unix(0, math.MinInt64)
)

// uvarintLen is how many bytes binary.AppendUvarint takes for x: the
// packed text is allocated at its exact size, as it is kept for the
// record's lifetime.
func uvarintLen(x int) int { return (bits.Len64(uint64(x)|1) + 6) / 7 }

func appendText(buf []byte, s string) []byte {
	buf = binary.AppendUvarint(buf, uint64(len(s)))
	return append(buf, s...)
}

// text is packed[from:to] as a string without a copy. packed is never
// written after packFinal, so the string cannot change under its reader,
// and it keeps packed alive for as long as it is held.
func (f *finalEntry) text(from, to uint32) string {
	if from == to {
		return ""
	}
	return unsafe.String(&f.packed[from], int(to-from))
}

// key is the record's key; the store's map of final records is keyed by
// it, so the key costs no object of its own.
func (f *finalEntry) key() string { return f.text(0, f.ends[0]) }

// clockOrigin is the instant the store's clock counts from.
var clockOrigin = time.Now()

// since is t on the store's clock: nanoseconds from clockOrigin, measured
// on the monotonic clock when t carries its reading, as time.Now's do. A
// final record's expiry is kept so, not as a wall-clock instant: a system
// clock stepped forward (NTP, a VM resumed) by an hour would otherwise
// expire, at once, every record with less than an hour left, and their
// retries would execute again. The in-flight records compare time.Time
// values, which use the monotonic reading by themselves. Times without it
// (a test's clock) count by the wall clock.
func since(t time.Time) int64 { return int64(t.Sub(clockOrigin)) }

func (f *finalEntry) expiry() time.Time { return clockOrigin.Add(time.Duration(f.expiresAt)) }

// expiredAt reports whether the record has expired at now.
func (f *finalEntry) expiredAt(now time.Time) bool { return f.expiresAt <= since(now) }

// snapshot is the record for a caller: a new Record, Response and header
// each time (callers may change them), whose strings and body are shared.
func (f *finalEntry) snapshot() *stores.Record {
	out := &struct {
		rec  stores.Record
		resp stores.Response
	}{}
	e := f.ends
	out.rec = stores.Record{
		Key: f.key(),
		Binding: stores.Binding{
			Operation:   f.text(e[0], e[1]),
			Path:        f.text(e[1], e[2]),
			Principal:   f.text(e[2], e[3]),
			Fingerprint: f.text(e[3], e[4]),
		},
		State:     stores.StateFinal,
		Response:  &out.resp,
		CreatedAt: time.Unix(0, f.createdAt),
		ExpiresAt: f.expiry(),
	}
	out.resp = stores.Response{Status: int(f.status), Body: f.body, KeyID: f.text(e[4], e[5])}
	if f.hasHeader {
		out.resp.Header = f.header(e[5])
	}
	return &out.rec
}

// header decodes the header packed from offset at.
func (f *finalEntry) header(at uint32) http.Header {
	p := at
	uvarint := func() uint32 {
		v, n := binary.Uvarint(f.packed[p:])
		p += uint32(n)
		return uint32(v)
	}
	str := func() string {
		n := uvarint()
		s := f.text(p, p+n)
		p += n
		return s
	}
	names := uvarint()
	h := make(http.Header, names)
	// One array holds every value, each name's a full slice of it, so
	// that an append to one cannot spill into the next.
	values := make([]string, uvarint())
	for range names {
		name := str()
		n := uvarint()
		if n == 0 {
			h[name] = nil // as replayHeaders keeps a name without values
			continue
		}
		vals := values[:n:n]
		values = values[n:]
		for i := range vals {
			vals[i] = str()
		}
		h[name] = vals
	}
	return h
}
