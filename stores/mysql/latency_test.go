package mysql

import (
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// BenchmarkAwaitWake measures how long after Finalize starts a waiting
// (polling) Await returns. Each iteration waits a random
// 0–300ms (the execution time of the awaited request) before finalizing, so
// the polling backoff is sampled at all its phases. Run with e.g.
//
//	go test -run '^$' -bench AwaitWake -benchtime 400x ./stores/mysql/
func BenchmarkAwaitWake(b *testing.B) {
	s, _ := openStore(b, nil)
	storetest.BenchAwaitWake(b, s)
}
