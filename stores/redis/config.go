// Package redis is a stores.Store in Redis or Valkey, shared by every Caddy
// node that points at the same server (or cluster).
//
// Each record is one hash under <KeyPrefix><idempotency key>, and every
// change to it is one Lua script on that one key. A script runs atomically
// on the server, so the compare-and-swap on the owner token needs no
// WATCH/MULTI round trips, and because a script touches a single key it
// runs unchanged on Redis Cluster and Valkey. Leases are judged by the
// server's clock (TIME inside the scripts), never the nodes', and records
// expire by the server's own key TTL, so there is nothing to purge.
//
// The client is github.com/redis/go-redis/v9: it is the maintained,
// official Go client; it runs scripts by EVALSHA and falls back to EVAL
// when the server's script cache lost them (restart, failover, SCRIPT
// FLUSH); it reconnects and resubscribes Pub/Sub on its own; and one
// options struct covers a single server, Cluster and TLS.
//
// Durability is the server's: without AOF (appendonly yes) a Redis restart
// loses every record, and a retry of a commit made before the restart may
// execute again.
package redis

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Defaults of the options.
const (
	DefaultKeyPrefix      = "iceberg_idempotency:"
	DefaultTimeout        = 5 * time.Second
	DefaultNotifyFallback = time.Second
	// MaxPoolSize bounds pool_size.
	MaxPoolSize = 100_000
)

// Config configures a Store.
type Config struct {
	// Addrs are host:port addresses. One address is a single server (or a
	// proxy in front of several); more than one is a Redis Cluster, whose
	// nodes are discovered from them. Required.
	Addrs []string
	// Cluster makes one address a Redis Cluster's too: a managed
	// service's configuration endpoint, through which the nodes are
	// discovered. Several addresses are a cluster's whatever it says.
	Cluster bool
	// Username and Password authenticate (ACL user, or only a password for
	// requirepass). The password never appears in errors or logs.
	Username, Password string
	// DB selects the logical database; a cluster has only database 0.
	DB int
	// KeyPrefix starts every key the store writes, and its Pub/Sub channel
	// (<KeyPrefix>changed). Default DefaultKeyPrefix.
	KeyPrefix string
	// TLS connects with TLS; TLSServerName overrides the name the server's
	// certificate is checked against (default: the address's host).
	TLS           bool
	TLSServerName string
	// DialTimeout, ReadTimeout and WriteTimeout bound connecting, and
	// waiting for a reply or to send a command. Each store call is bounded
	// by the largest of the three, so a dead server costs at most that.
	// Default DefaultTimeout each.
	DialTimeout, ReadTimeout, WriteTimeout time.Duration
	// PoolSize bounds the connections per server (0: go-redis's default,
	// 10 per CPU). Await's subscription uses one more per Store.
	PoolSize int
	// NotifyFallback is how often Await re-reads a record in case a change
	// message was lost. Default DefaultNotifyFallback.
	NotifyFallback time.Duration
}

// CheckAddress refuses an address that is not host:port. Its error never
// repeats the address: a redis:// URL, the form managed services hand out,
// may hold the password, and the error reaches logs and the admin API.
func CheckAddress(addr string) error {
	switch {
	case addr == "":
		return errors.New("empty address")
	case strings.Contains(addr, "://") || strings.Contains(addr, "@"):
		return errors.New("a URL, not host:port: give its host:port as the address, and its username and password as username and password")
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil || port == "" {
		return errors.New("not host:port (an IPv6 host goes in brackets: [::1]:6379)")
	}
	// Checked here rather than at the first command, where every keyed
	// request would get 503.
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return errors.New("the port must be a number from 1 to 65535")
	}
	return nil
}

// WithDefaults returns c with every unset option set to its default, or an
// error naming the first invalid option. Open applies it; the Caddy module
// calls it too, so that the store it shares across reloads is keyed by the
// values in force.
func (c Config) WithDefaults() (Config, error) {
	err := c.setDefaults()
	return c, err
}

func (c *Config) setDefaults() error {
	if len(c.Addrs) == 0 {
		return errors.New("redis: at least one address is required")
	}
	for i, a := range c.Addrs {
		if err := CheckAddress(a); err != nil {
			return fmt.Errorf("redis: address %d of %d: %w", i+1, len(c.Addrs), err)
		}
		// Two addresses make a cluster: the same server twice was taken
		// for one, and every command failed on a server without cluster
		// support.
		if j := slices.Index(c.Addrs[:i], a); j >= 0 {
			return fmt.Errorf("redis: address %d of %d repeats address %d", i+1, len(c.Addrs), j+1)
		}
	}
	if c.DB < 0 {
		return fmt.Errorf("redis: negative db %d", c.DB)
	}
	if (len(c.Addrs) > 1 || c.Cluster) && c.DB != 0 {
		return fmt.Errorf("redis: db %d on a cluster (several addresses, or cluster on): a cluster has only db 0", c.DB)
	}
	if err := stores.NegativeOption("redis",
		stores.Bound{Name: "dial_timeout", Value: int64(c.DialTimeout), Duration: true},
		stores.Bound{Name: "read_timeout", Value: int64(c.ReadTimeout), Duration: true},
		stores.Bound{Name: "write_timeout", Value: int64(c.WriteTimeout), Duration: true},
		stores.Bound{Name: "pool_size", Value: int64(c.PoolSize)},
		stores.Bound{Name: "notify_fallback", Value: int64(c.NotifyFallback), Duration: true},
	); err != nil {
		return err
	}
	// go-redis panics past an int32, and sizes its pool's bookkeeping
	// by it (38 s of CPU at 2147483647).
	if c.PoolSize > MaxPoolSize {
		return fmt.Errorf("redis: pool_size must be at most %d (a server takes 10000 clients by default), got %d", MaxPoolSize, c.PoolSize)
	}
	if c.KeyPrefix == "" {
		c.KeyPrefix = DefaultKeyPrefix
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = DefaultTimeout
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = DefaultTimeout
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = DefaultTimeout
	}
	if c.NotifyFallback == 0 {
		c.NotifyFallback = DefaultNotifyFallback
	}
	return nil
}

// opTimeout bounds one store call.
func (c *Config) opTimeout() time.Duration {
	return max(c.DialTimeout, c.ReadTimeout, c.WriteTimeout)
}
