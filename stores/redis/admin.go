package redis

import (
	"context"
	"strings"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

var (
	_ stores.Forgetter = (*Store)(nil)
	_ stores.Counter   = (*Store)(nil)
	_ stores.Inspector = (*Store)(nil)
)

// forgetScript deletes a record whatever its owner (unless ARGV[3] is
// '1', only an abandoned one: in flight, its lease lapsed) and tells the
// waiters, who then find no record and execute afresh. ARGV: channel,
// key, force.
var forgetScript = goredis.NewScript(prelude + `
if ARGV[3] ~= '1' then
	local cur = redis.call('HMGET', KEYS[1], 'state', 'lease')
	if cur[1] ~= 'in_flight' or tonumber(cur[2] or '0') > now() then return 0 end
end
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
`)

// Forget implements stores.Forgetter.
func (s *Store) Forget(ctx context.Context, key string, force bool) (bool, error) {
	flag := "0"
	if force {
		flag = "1"
	}
	return s.cas(ctx, "forget", forgetScript, key, s.channel, key, flag)
}

// Inspect implements stores.Inspector: the record and its lease left, by
// the server's clock.
func (s *Store) Inspect(ctx context.Context, key string) (*stores.Record, time.Duration, error) {
	return s.load(ctx, key)
}

// Count implements stores.Counter by scanning every key under the prefix
// (SCAN, in batches, so the server is never blocked) and reading each
// record: one round trip per record. It serves an operator's occasional
// look; on a Cluster it covers the node the client reaches for SCAN only.
func (s *Store) Count(ctx context.Context) (stores.Counts, error) {
	var c stores.Counts
	iter := s.client.Scan(ctx, 0, recordPattern(s.cfg.KeyPrefix), 1000).Iterator()
	for iter.Next(ctx) {
		key := strings.TrimPrefix(iter.Val(), s.cfg.KeyPrefix)
		rec, _, err := s.load(ctx, key)
		if err != nil {
			return stores.Counts{}, err
		}
		switch {
		case rec == nil:
		case rec.State == stores.StateFinal:
			c.Final++
		case rec.Abandoned:
			c.Abandoned++
		default:
			c.InFlight++
		}
	}
	if err := iter.Err(); err != nil {
		return stores.Counts{}, s.wrap("count", err)
	}
	return c, nil
}

// recordPattern matches the store's records, and nothing else, in SCAN's
// glob syntax: the prefix taken literally, then a key, 36 characters in
// the 8-4-4-4-12 form. Another catalog's prefix that extends this one
// (iceberg_idempotency:catalog_b:) adds characters and is left out, as are
// glob characters in the prefix itself.
func recordPattern(prefix string) string {
	var b strings.Builder
	for _, r := range prefix {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	for i, n := range []int{8, 4, 4, 4, 12} {
		if i > 0 {
			b.WriteByte('-')
		}
		b.WriteString(strings.Repeat("?", n))
	}
	return b.String()
}
