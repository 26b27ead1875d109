package redis

import goredis "github.com/redis/go-redis/v9"

// The record hash's fields. Times are milliseconds of the server's clock:
// Lua numbers are doubles, which hold them exactly, and Redis writes a
// number into a command with 14 significant digits, which a microsecond
// timestamp would exceed.
//
//	op, path, principal, fp  the binding
//	state                    in_flight | final
//	owner                    reservation token (in flight only)
//	lease                    lease end (in flight only)
//	created, expires         informational; the key's TTL does the expiring
//	status, headers, body    the response (final only); headers JSON
//	key_id                   sealing secret id ('' in clear)

// prelude is shared by every script: now() reads the server's clock, ms()
// writes a number without an exponent, and announce() tells waiting
// duplicates that a key changed. announce runs after the script's writes,
// which Redis does not undo when a later command fails, and a user denied
// the channel (Redis 7 gives an ACL user none unless told) fails PUBLISH:
// the change then stands and is only unannounced (the waiters re-read
// every NotifyFallback), so the failure must not fail the script.
const prelude = `
local function now()
	local t = redis.call('TIME')
	return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function ms(n) return string.format('%.0f', n) end
local function announce(channel, key) redis.pcall('PUBLISH', channel, key) end
local function owned(key, owner)
	local cur = redis.call('HMGET', key, 'state', 'owner')
	return cur[1] == 'in_flight' and cur[2] == owner
end
local function outlive(key, t, keep)
	local ttl = redis.call('PTTL', key)
	if ttl >= 0 and ttl < keep then
		redis.call('PEXPIRE', key, ms(keep))
		redis.call('HSET', key, 'expires', ms(t + keep))
	end
end
`

// reserveScript creates the in-flight record unless the key holds one,
// and returns {1, now} when it did, else {0, now, field, value, ...}; and
// {2, now}, writing nothing, when it runs after not-after (its caller gave
// up long ago: see deadline.go). ARGV: op, path, principal, fp, owner,
// lease ms, ttl ms, not-after ms (0: none).
var reserveScript = goredis.NewScript(prelude + `
local t = now()
local limit = tonumber(ARGV[8])
if limit > 0 and t > limit then return {2, t} end
local rec = redis.call('HGETALL', KEYS[1])
if #rec > 0 then
	local out = {0, t}
	for i = 1, #rec do out[#out + 1] = rec[i] end
	return out
end
redis.call('HSET', KEYS[1], 'op', ARGV[1], 'path', ARGV[2], 'principal', ARGV[3], 'fp', ARGV[4],
	'state', 'in_flight', 'owner', ARGV[5], 'lease', ms(t + tonumber(ARGV[6])),
	'created', ms(t), 'expires', ms(t + tonumber(ARGV[7])))
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return {1, t}
`)

// loadScript returns {now, field, value, ...}; just {now} when the key is
// absent (or expired, which Redis treats alike).
var loadScript = goredis.NewScript(prelude + `
local out = {now()}
local rec = redis.call('HGETALL', KEYS[1])
for i = 1, #rec do out[#out + 1] = rec[i] end
return out
`)

// finalizeScript stores the response if KEYS[1] is in flight under
// ARGV[1]; the key keeps its TTL. ARGV: owner, status, headers, body,
// key_id, channel, key. Returns 1 on success, 0 otherwise.
var finalizeScript = goredis.NewScript(prelude + `
if not owned(KEYS[1], ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'state', 'final', 'status', ARGV[2], 'headers', ARGV[3], 'body', ARGV[4], 'key_id', ARGV[5])
redis.call('HDEL', KEYS[1], 'owner', 'lease')
announce(ARGV[6], ARGV[7])
return 1
`)

// releaseScript deletes the in-flight record owned by ARGV[1].
// ARGV: owner, channel, key.
var releaseScript = goredis.NewScript(prelude + `
if not owned(KEYS[1], ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
announce(ARGV[2], ARGV[3])
return 1
`)

// extendScript renews the lease, and the key's TTL to the record's TTL
// past the lease's end when it would end sooner: a record whose owner
// still renews it does not expire under it, and one whose renewals stop
// reads as abandoned for its TTL (see stores.Reservation.RecordTTL).
// Returns {1, now}; {0, now} when the record is not ARGV[1]'s; {2, now},
// writing nothing, when it runs after not-after, as reserveScript. ARGV:
// owner, lease ms, lease plus TTL ms, not-after ms (0: none). No message:
// a waiter has nothing to learn from a renewed lease.
var extendScript = goredis.NewScript(prelude + `
local t = now()
local limit = tonumber(ARGV[4])
if limit > 0 and t > limit then return {2, t} end
if not owned(KEYS[1], ARGV[1]) then return {0, t} end
redis.call('HSET', KEYS[1], 'lease', ms(t + tonumber(ARGV[2])))
outlive(KEYS[1], t, tonumber(ARGV[3]))
return {1, t}
`)

// abandonScript ends the lease now (never extends it). ARGV: owner,
// channel, key.
var abandonScript = goredis.NewScript(prelude + `
if not owned(KEYS[1], ARGV[1]) then return 0 end
local t = now()
local lease = tonumber(redis.call('HGET', KEYS[1], 'lease'))
if lease == nil or lease > t then redis.call('HSET', KEYS[1], 'lease', ms(t)) end
announce(ARGV[2], ARGV[3])
return 1
`)

// takeOverScript hands an in-flight record whose lease lapsed from
// ARGV[1] to ARGV[2] with a fresh lease, the TTL moved as by extendScript,
// and returns {1, now}; {0, now} when the record is not ARGV[1]'s or its
// lease runs; {2, now}, writing nothing, when it runs after not-after, as
// reserveScript. ARGV: old owner, new owner, lease ms, channel, key, lease
// plus TTL ms, not-after ms (0: none).
var takeOverScript = goredis.NewScript(prelude + `
local t = now()
local limit = tonumber(ARGV[7])
if limit > 0 and t > limit then return {2, t} end
if not owned(KEYS[1], ARGV[1]) then return {0, t} end
local lease = tonumber(redis.call('HGET', KEYS[1], 'lease'))
if lease ~= nil and lease > t then return {0, t} end
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'lease', ms(t + tonumber(ARGV[3])))
outlive(KEYS[1], t, tonumber(ARGV[6]))
announce(ARGV[4], ARGV[5])
return {1, t}
`)
