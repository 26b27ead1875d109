package redis

import (
	"context"
	"strings"
	"sync"
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
announce(ARGV[1], ARGV[2])
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

// countScript reads a record's state without its body: 0 gone, 1 final,
// 2 abandoned (in flight, its lease lapsed), 3 in flight.
var countScript = goredis.NewScript(prelude + `
local cur = redis.call('HMGET', KEYS[1], 'state', 'lease')
if cur[1] == 'final' then return 1 end
if cur[1] ~= 'in_flight' then return 0 end
if tonumber(cur[2] or '0') <= now() then return 2 end
return 3
`)

// Count implements stores.Counter by scanning every key under the prefix
// (SCAN, in batches, so the server is never blocked) and reading each
// record's state: one round trip per record. It serves an operator's
// occasional look. On a Cluster it scans every master (concurrently): a keyless
// SCAN sent through the cluster client goes to any node, page by page,
// and a cursor of one node is meaningless on another.
func (s *Store) Count(ctx context.Context) (stores.Counts, error) {
	var (
		mu sync.Mutex
		c  stores.Counts
	)
	scan := func(ctx context.Context, node goredis.UniversalClient) error {
		var mine stores.Counts
		iter := node.Scan(ctx, 0, recordPattern(s.cfg.KeyPrefix), 1000).Iterator()
		for iter.Next(ctx) {
			n, err := countScript.Run(ctx, node, []string{iter.Val()}).Int()
			if err != nil {
				return err
			}
			switch n {
			case 1:
				mine.Final++
			case 2:
				mine.Abandoned++
			case 3:
				mine.InFlight++
			}
		}
		if err := iter.Err(); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		c.Final += mine.Final
		c.Abandoned += mine.Abandoned
		c.InFlight += mine.InFlight
		return nil
	}
	var err error
	if cluster, ok := s.client.(*goredis.ClusterClient); ok {
		err = cluster.ForEachMaster(ctx, func(ctx context.Context, node *goredis.Client) error { return scan(ctx, node) })
	} else {
		err = scan(ctx, s.client)
	}
	if err != nil {
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
