// Package sqlstore holds the pieces the PostgreSQL and MySQL stores share:
// identifier and key checks, DSN redaction, the polling Await loop and the
// encoding of replayed headers. It knows no SQL dialect.
package sqlstore
