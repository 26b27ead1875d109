package postgres

import (
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// BenchmarkAwaitWake measures how long after Finalize starts a waiting
// Await returns, polling versus LISTEN/NOTIFY. Each iteration waits a random
// 0–300ms (the execution time of the awaited request) before finalizing, so
// the polling backoff is sampled at all its phases. Run with e.g.
//
//	go test -run '^$' -bench AwaitWake -benchtime 400x ./stores/postgres/
func BenchmarkAwaitWake(b *testing.B) {
	for _, mode := range []struct {
		name   string
		notify bool
	}{{"poll", false}, {"notify", true}} {
		b.Run(mode.name, func(b *testing.B) {
			s, _ := openStore(b, func(c *Config) { c.ListenNotify = mode.notify })
			storetest.BenchAwaitWake(b, s)
		})
	}
}
