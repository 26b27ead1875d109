package memory

import (
	"net/http"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// recordOverhead approximates what a record costs beyond its strings and
// body: the entry and Record structs, the Response and its header map, the
// record's slot in the key map. Set so that TestCountedBytesTrackHeap
// counts about what the heap grows by per small final record (1.1-1.2 KiB
// for a 300-byte answer with a realistic key and binding).
const recordOverhead = 640

// headerValueOverhead approximates the slice and map slot of one header
// value beyond its characters.
const headerValueOverhead = 32

// finalList is the recency order of final records: an intrusive doubly
// linked list, most recently used at head, least recently used at tail. It
// needs no allocation per record, and expiry can scan it oldest first.
type finalList struct {
	head, tail *finalEntry
}

func (l *finalList) pushFront(e *finalEntry) {
	e.prev, e.next = nil, l.head
	if l.head != nil {
		l.head.prev = e
	}
	l.head = e
	if l.tail == nil {
		l.tail = e
	}
}

func (l *finalList) unlink(e *finalEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		l.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		l.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

func (l *finalList) moveToFront(e *finalEntry) {
	if l.head == e {
		return
	}
	l.unlink(e)
	l.pushFront(e)
}

// recordSize is what a final record counts against max_bytes: its body (a
// sealed response's ciphertext), key id, header names and values, key,
// binding and owner strings, plus a fixed per-record overhead. It is an estimate of heap use, not an exact figure.
func recordSize(rec *stores.Record) int64 {
	n := int64(recordOverhead + len(rec.Key) + len(rec.Operation) + len(rec.Path) +
		len(rec.Principal) + len(rec.Fingerprint) + len(rec.Owner))
	if rec.Response != nil {
		n += int64(len(rec.Response.Body)+len(rec.Response.KeyID)) + headerSize(rec.Response.Header)
	}
	return n
}

func headerSize(h http.Header) int64 {
	var n int64
	for name, vals := range h {
		n += int64(len(name))
		for _, v := range vals {
			n += int64(len(v) + headerValueOverhead)
		}
	}
	return n
}

// exactFit returns resp with a body whose capacity equals its length, so
// that what the record holds is what max_bytes counts. A body that already
// fits (the handler sizes its capture buffer from Content-Length) is kept
// as it is, which Finalize's contract allows; one in a buffer that grew by
// doubling is copied.
func exactFit(resp stores.Response) stores.Response {
	if cap(resp.Body) != len(resp.Body) {
		body := make([]byte, len(resp.Body))
		copy(body, resp.Body)
		resp.Body = body
	}
	return resp
}

// addFinal makes f a final record at the head of the recency order, first
// evicting least recently used final records until it fits both bounds.
// Caller holds s.mu and has checked that f alone fits max_bytes.
func (s *Store) addFinal(f *finalEntry, now time.Time) {
	key := f.key()
	if old, ok := s.final[key]; ok { // cannot happen: Reserve saw no live record
		s.dropFinal(old)
	}
	for len(s.final) >= s.limits.MaxEntries && s.lru.tail != nil {
		s.evictOldest(ReasonEntries, now)
	}
	for s.bytes+f.size > s.limits.MaxBytes && s.lru.tail != nil {
		s.evictOldest(ReasonBytes, now)
	}
	s.final[key] = f
	s.lru.pushFront(f)
	s.expiry.add(f)
	s.bytes += f.size
}

// makeRoom drops expired final records until one more record of size
// bytes fits both bounds, and reports whether it does: it evicts nothing
// that has not expired. Caller holds s.mu.
func (s *Store) makeRoom(size int64, now time.Time) bool {
	for len(s.final) >= s.limits.MaxEntries || s.bytes+size > s.limits.MaxBytes {
		f := s.expiry.expired(now)
		if f == nil {
			return false
		}
		s.dropFinal(f)
	}
	return true
}

// fit evicts least recently used final records until the bounds hold, after
// they shrank. Caller holds s.mu.
func (s *Store) fit(now time.Time) int {
	n := 0
	for len(s.final) > s.limits.MaxEntries {
		s.evictOldest(ReasonEntries, now)
		n++
	}
	for s.bytes > s.limits.MaxBytes && s.lru.tail != nil {
		s.evictOldest(ReasonBytes, now)
		n++
	}
	return n
}

// evictOldest makes room: it drops an expired final record if there is
// one, and the least recently used one otherwise. Only a record that had
// not expired yet is reported: its key will execute again on retry, which
// is what the bounds being too small costs.
func (s *Store) evictOldest(reason EvictReason, now time.Time) {
	f := s.expiry.expired(now)
	if f == nil {
		f = s.lru.tail
	}
	s.dropFinal(f)
	if !f.expiredAt(now) && s.onEvict != nil {
		s.onEvict(Eviction{Reason: reason, Limits: s.limits})
	}
}

// dropFinal removes a final record and wakes its waiters. Caller holds s.mu.
func (s *Store) dropFinal(f *finalEntry) {
	key := f.key()
	s.lru.unlink(f)
	s.expiry.remove(f)
	delete(s.final, key)
	s.bytes -= f.size
	s.notify(key)
}
