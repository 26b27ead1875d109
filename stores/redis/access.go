package redis

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// accessScript runs, on a key of the store's own that no record pattern
// matches, every command the store's scripts run, and answers the first
// one the server refuses with its error, or nothing. An ACL user may be
// denied any of them: without DEL, say, Reserve and Finalize work and
// every Release fails, so a key whose request the catalog provably never
// saw (its 503, a refused connection) lapsed into "outcome unknown" and
// its retries got 500 for the record's life, where without the module
// they would have executed. PUBLISH is left out: a user denied the
// channel only goes without wake-ups (see prelude). The key is given a
// TTL right after it is written and deleted at the end; a user refused
// both PEXPIRE and DEL leaves it, one small key, without one. Not every
// error is a refusal: at maxmemory (OOM), on a replica (READONLY), after
// a failed save (MISCONF) the HSET fails too, and refusedByACL tells.
var accessScript = goredis.NewScript(`
local k = KEYS[1]
local function try(...)
	local r = redis.pcall(...)
	if type(r) == 'table' and r.err then return r.err end
	return nil
end
local err = try('TIME')
if err then return {'TIME', err} end
err = try('HSET', k, 'probe', '1')
if err then return {'HSET', err} end
for _, c in ipairs({{'PEXPIRE', k, 10000}, {'PTTL', k}, {'HGET', k, 'probe'}, {'HMGET', k, 'probe'},
		{'HGETALL', k}, {'HDEL', k, 'probe'}, {'HSET', k, 'probe', '1'}, {'DEL', k}}) do
	err = try(unpack(c))
	if err then
		redis.pcall('DEL', k)
		return {c[1], err}
	end
end
return {}
`)

// refusedByACL reports whether msg, the error of a command inside a
// script, is the ACL's refusal: "NOPERM ..." from Redis 7.2 on,
// "ERR The user executing the script can't run this command or
// subcommand" (or "can't access ... keys") before.
func refusedByACL(msg string) bool {
	return strings.HasPrefix(msg, "NOPERM") || strings.Contains(msg, "The user executing the script can't")
}

// accessRecheck is how often operations ask for a check again while the
// store's user is refused a command, or no check has had the server's
// answer: the store becomes ready by itself once the grant is made.
const accessRecheck = time.Second

// access is the verdict on the store's user's commands. Checks run in the
// background, never in an operation's time: one that waited for a stalled
// server would double the time an operation takes to fail. Until a check
// has had an answer from the server, operations run (a server down at
// start is an outage, as before); once one has, they fail at once, sending
// nothing, for as long as a command is refused. An ACL refusal of an
// operation (a grant revoked while the store runs) asks for a check again.
type access struct {
	checked atomic.Bool
	denied  atomic.Pointer[sqlstore.AccessError]
	mu      sync.Mutex
	lastAt  time.Time
	running bool // a check is under way
	closed  bool // the store closed: no check starts
}

// allowed is nil once the server has shown that the store's user may run
// every command the store needs, or while it has not answered; a not-sent
// *sqlstore.AccessError while it refuses one. Until the verdict is that
// every command is allowed, it starts a check in the background, at most
// once per accessRecheck.
func (s *Store) allowed() error {
	if s.access.checked.Load() && s.access.denied.Load() == nil {
		return nil
	}
	s.access.mu.Lock()
	if !s.access.closed && !s.access.running && time.Since(s.access.lastAt) >= accessRecheck {
		s.access.running = true
		s.access.lastAt = time.Now()
		s.checking.Add(1)
		go func() {
			defer s.checking.Done()
			s.checkAccess()
			s.access.mu.Lock()
			s.access.running = false
			s.access.mu.Unlock()
		}()
	}
	s.access.mu.Unlock()
	if denied := s.access.denied.Load(); denied != nil {
		return stores.MarkNotSent(denied)
	}
	return nil
}

// stopChecks keeps any check from starting once the store closes, so that
// Close can wait for the one under way.
func (s *Store) stopChecks() {
	s.access.mu.Lock()
	s.access.closed = true
	s.access.mu.Unlock()
}

// refusedAccess reports whether err, an operation's error, is the ACL's
// refusal: of EVALSHA itself, of its key, or of a command in the script.
func refusedAccess(err error) bool {
	return err != nil && (replyStarts(err, "NOPERM ") || refusedByACL(err.Error()))
}

// recheckAccess asks for a check: an operation was refused by the ACL,
// which the last check did not see.
func (s *Store) recheckAccess() {
	s.access.mu.Lock()
	s.access.checked.Store(false)
	s.access.lastAt = time.Time{}
	s.access.mu.Unlock()
	_ = s.allowed()
}

// checkAccess runs accessScript and records its verdict. An error that is
// not the server's verdict (no connection, a timeout, a refusal for now)
// leaves the last one.
func (s *Store) checkAccess() {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	v, err := accessScript.Run(ctx, s.client, []string{s.cfg.KeyPrefix + "access-check"}).StringSlice()
	var refusal string
	switch {
	case err == nil && len(v) == 2:
		if !refusedByACL(v[1]) {
			// The server refused it for now (OOM, READONLY, ...): no
			// verdict on the user's commands.
			return
		}
		refusal = fmt.Sprintf("%s: %s", v[0], v[1])
	case err == nil:
	case replyStarts(err, "NOPERM "):
		// EVAL or EVALSHA itself, or the key pattern: nothing ran.
		refusal = err.Error()
	default:
		// No connection, a timeout, or another reply of the server
		// (LOADING, BUSY): no verdict on the user's commands.
		return
	}
	was := s.access.denied.Load()
	if refusal == "" {
		s.access.denied.Store(nil)
		s.access.checked.Store(true)
		if was != nil {
			s.log.Info("redis grants the store's user every command it needs: store ready")
		}
		return
	}
	denied := &sqlstore.AccessError{Msg: fmt.Sprintf("redis: the store's user may not run a command the store needs (%s): %s", refusal, s.grantHint())}
	s.access.denied.Store(denied)
	s.access.checked.Store(true)
	if was == nil || was.Msg != denied.Msg {
		s.log.Error("redis refused the store's user a command, will retry", zap.Error(denied))
	}
}

// grantHint says what to grant the store's user.
func (s *Store) grantHint() string {
	return fmt.Sprintf("grant it +eval +evalsha +time +hset +hget +hmget +hgetall +hdel +del +pexpire +pttl on ~%s* (and +publish on &%schanged, "+
		"+subscribe for wake-ups, +scan for the admin API's counts), or +@all -@dangerous", s.cfg.KeyPrefix, s.cfg.KeyPrefix)
}
