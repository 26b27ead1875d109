package postgres

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// listener holds one LISTEN connection outside the pool and wakes the
// Awaits of the keys named in notifications. While it is disconnected
// notifications are lost; Await's fallback poll covers that, and every
// waiter is woken after a reconnect to re-check at once.
type listener struct {
	cfg     *pgx.ConnConfig
	channel string
	log     *zap.Logger

	sqlstore.Wakers

	cancel context.CancelFunc
	done   chan struct{}
}

// startListener connects and LISTENs before returning, so that no
// notification sent after Open returns is missed.
func startListener(ctx context.Context, cfg *pgx.ConnConfig, channel string, log *zap.Logger) (*listener, error) {
	l := &listener{cfg: cfg, channel: channel, log: log, done: make(chan struct{})}
	conn, err := l.connect(ctx)
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	go l.run(runCtx, conn)
	return l, nil
}

func (l *listener) connect(ctx context.Context) (*pgx.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.ConnectTimeout+5*time.Second)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, l.cfg)
	if err != nil {
		return nil, err
	}
	// The channel is derived from the validated table name.
	if _, err := conn.Exec(ctx, "LISTEN "+l.channel); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	// This session is idle whenever no change comes, and a role's or
	// database's idle_session_timeout (PostgreSQL 14+; NULL before) would
	// end it after that long, each time with a lost-connection warning and
	// a reconnect. Only this session turns it off. (Behind a pooler in
	// transaction mode the setting would stay with a server session other
	// clients get too; there LISTEN hears nothing anyway, and the store
	// stops listening once it finds that out: see Store.listen.)
	if _, err := conn.Exec(ctx, "SELECT set_config('idle_session_timeout', '0', false) WHERE current_setting('idle_session_timeout', true) IS NOT NULL"); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	return conn, nil
}

func (l *listener) run(ctx context.Context, conn *pgx.Conn) {
	defer close(l.done)
	retry := sqlstore.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for {
		for conn == nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(retry.Next()):
			}
			c, err := l.connect(ctx)
			if err != nil {
				if ctx.Err() == nil {
					l.log.Warn("postgres listen: reconnect failed", zap.Error(err))
				}
				continue
			}
			conn, retry = c, sqlstore.Backoff{Min: retry.Min, Max: retry.Max}
			l.log.Info("postgres listen: reconnected")
			l.WakeAll() // notifications may have been missed meanwhile
		}
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			conn.Close(context.Background())
			conn = nil
			if ctx.Err() != nil {
				return
			}
			l.log.Warn("postgres listen: connection lost", zap.Error(err))
			l.WakeAll()
			continue
		}
		l.Wake(n.Payload)
	}
}

// hears reports whether a notification that send puts on the channel
// reaches the listening connection before ctx ends. Behind a connection
// pooler in transaction or statement mode it does not: the LISTEN ran on
// a server session the pooler lent for that one statement, and the
// pooler drops what that session is sent later. The payload cannot be a
// key, so other nodes' listeners wake no one for it. A reconnect of the
// listener during the wait wakes every subscriber, this one included, and
// counts as heard: the fallback poll covers that rare mistake.
func (l *listener) hears(ctx context.Context, send func(ctx context.Context, payload string) error) (bool, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return false, err
	}
	payload := "probe " + hex.EncodeToString(b[:])
	heard, unsubscribe := l.Subscribe(payload)
	defer unsubscribe()
	if err := send(ctx, payload); err != nil {
		return false, err
	}
	select {
	case <-heard:
		return true, nil
	case <-ctx.Done():
		return false, nil
	}
}

func (l *listener) stop() {
	l.cancel()
	<-l.done
}
