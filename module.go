// Package icebergidempotency is a Caddy v2 module that gives any Apache
// Iceberg REST catalog the spec's Idempotency-Key semantics by sitting in
// front of it, before reverse_proxy.
//
// A table commit can succeed while its response is lost; the client retries,
// gets 409, and its cleanup deletes files the committed metadata still needs.
// With this handler the retry gets the original response instead.
package icebergidempotency

import "github.com/caddyserver/caddy/v2"

func init() {
	caddy.RegisterModule(Handler{})
	caddy.RegisterModule(new(App))
	caddy.RegisterModule(MemoryStore{})
	caddy.RegisterModule(PostgresStore{})
	caddy.RegisterModule(MySQLStore{})
	caddy.RegisterModule(RedisStore{})
	caddy.RegisterModule(AdminAPI{})
}
