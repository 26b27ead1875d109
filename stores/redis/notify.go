package redis

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// listener holds one subscription to the store's change channel, whose
// messages name the key that changed, and wakes the Awaits of that key.
// One channel per store rather than one per key: a node subscribes once,
// and no SUBSCRIBE/UNSUBSCRIBE round trip rides on each Await. Messages
// are lost while the subscription is down; Await's fallback poll covers
// that, and every waiter is woken when it (re)subscribes, to re-check.
type listener struct {
	client  goredis.UniversalClient
	channel string
	user    string        // the ACL user, named in the fix for a denied channel
	idle    time.Duration // ping after this long without traffic
	log     *zap.Logger

	sqlstore.Wakers

	cancel context.CancelFunc
	done   chan struct{}

	// mu guards ps, the subscription being read, and stopped: stop closes
	// ps, since a read waiting for a message heeds no context and would
	// hold Close for up to idle.
	mu      sync.Mutex
	ps      *goredis.PubSub
	stopped bool
}

func startListener(client goredis.UniversalClient, channel, user string, idle time.Duration, log *zap.Logger) *listener {
	ctx, cancel := context.WithCancel(context.Background())
	l := &listener{client: client, channel: channel, user: cmp.Or(user, "default"), idle: max(idle, 100*time.Millisecond), log: log,
		cancel: cancel, done: make(chan struct{})}
	go l.run(ctx)
	return l
}

func (l *listener) run(ctx context.Context) {
	defer close(l.done)
	retry := sqlstore.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	warned := false // once per outage, not once per attempt
	for {
		ps := l.client.Subscribe(ctx, l.channel)
		if !l.track(ps) {
			_ = ps.Close()
			return
		}
		subscribed, err := l.serve(ctx, ps, &retry)
		l.track(nil)
		_ = ps.Close()
		l.WakeAll() // messages may be missed until the next subscription
		if ctx.Err() != nil {
			return
		}
		if subscribed {
			warned = false
		}
		if !warned {
			l.warnLost(err)
			warned = true
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(retry.Next()):
		}
	}
}

// warnLost says why the subscription is down. A user the server does not
// allow the channel is told so with the grant to make: Redis 7 gives an ACL
// user no channels unless told (acl-pubsub-default resetchannels), and
// until granted, waiting duplicates wake only at their fallback poll.
func (l *listener) warnLost(err error) {
	if err != nil && strings.HasPrefix(err.Error(), "NOPERM") && strings.Contains(err.Error(), "channel") {
		l.log.Warn("redis user may not use the store's change channel: waiting duplicates wake only at their fallback poll (1 s) instead of at once; grant it the channel",
			zap.Error(err), zap.String("channel", l.channel),
			zap.String("fix", fmt.Sprintf("ACL SETUSER %s &%s", l.user, l.channel)))
		return
	}
	l.log.Warn("redis subscription lost, resubscribing", zap.Error(err))
}

// serve reads the subscription until it fails. A connection that stays
// silent is pinged once; a ping left unanswered means the connection is
// dead even if TCP has not noticed (a partition), and serve returns so
// that run subscribes on a fresh one.
func (l *listener) serve(ctx context.Context, ps *goredis.PubSub, retry *sqlstore.Backoff) (subscribed bool, err error) {
	pinged := false
	for {
		msg, err := ps.ReceiveTimeout(ctx, l.idle)
		if err != nil {
			var ne net.Error
			if ctx.Err() == nil && !pinged && errors.As(err, &ne) && ne.Timeout() {
				pinged = true
				if err := ps.Ping(ctx); err != nil {
					return subscribed, err
				}
				continue
			}
			if rerr := goredis.Error(nil); pinged && subscribed && errors.As(err, &rerr) {
				// The server refused the ping (a user without PING,
				// which the README's list of commands does not name):
				// it answered, so the connection lives. Until the
				// build after d4fe47c this ended the subscription each
				// idle period, with a warning each time that asked for
				// a channel the user had.
				pinged = false
				continue
			}
			return subscribed, err
		}
		pinged = false
		switch m := msg.(type) {
		case *goredis.Subscription:
			if m.Kind == "subscribe" {
				subscribed = true
				*retry = sqlstore.Backoff{Min: retry.Min, Max: retry.Max}
				l.WakeAll() // changes before this were not heard
			}
		case *goredis.Message:
			l.Wake(m.Payload)
		}
	}
}

// track records ps as the subscription being read; false once stopped.
func (l *listener) track(ps *goredis.PubSub) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ps = ps
	return !l.stopped
}

func (l *listener) stop() {
	l.cancel()
	l.mu.Lock()
	l.stopped = true
	if l.ps != nil {
		_ = l.ps.Close()
	}
	l.mu.Unlock()
	<-l.done
}
