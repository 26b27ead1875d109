package icebergidempotency

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	goredis "github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis"
)

// RedisStore configures the Redis/Valkey store (go-redis), shared by every
// Caddy node that points at the same server or cluster. Records expire by
// the server's key TTL, so the app has nothing to purge. See the README
// on durability: without AOF a server restart forgets every record.
type RedisStore struct {
	// host:port of the server; several addresses are the seed nodes of a
	// Redis Cluster. Placeholders are expanded. Required.
	Addresses []string `json:"addresses,omitempty"`

	// The one address is a Redis Cluster's configuration endpoint (as
	// managed services give one), through which the nodes are discovered.
	// Several addresses are a cluster's anyway. Default: false.
	Cluster bool `json:"cluster,omitempty"`

	// ACL user name, if any. Placeholders are expanded.
	Username string `json:"username,omitempty"`

	// Password (ACL or requirepass). Use a placeholder such as
	// {env.REDIS_PASSWORD}: it is expanded at provision time and never
	// logged.
	Password string `json:"password,omitempty"`

	// Logical database; 0 with a cluster. Default: 0.
	DB int `json:"db,omitempty"`

	// Prefix of every key the store writes and of its change channel, so
	// that several catalogs or applications can share one server.
	// Default: iceberg_idempotency:
	KeyPrefix string `json:"key_prefix,omitempty"`

	// Connect with TLS. Default: false.
	TLS bool `json:"tls,omitempty"`

	// Name the server's certificate is checked against, when it is not the
	// address's host. Implies tls.
	TLSServerName string `json:"tls_server_name,omitempty"`

	// Bounds of connecting, waiting for a reply and sending a command;
	// each store call is bounded by the largest. Default: 5s each.
	DialTimeout  caddy.Duration `json:"dial_timeout,omitempty"`
	ReadTimeout  caddy.Duration `json:"read_timeout,omitempty"`
	WriteTimeout caddy.Duration `json:"write_timeout,omitempty"`

	// Most connections per server. Default: go-redis's, 10 per CPU.
	PoolSize int `json:"pool_size,omitempty"`

	cfg redis.Config // placeholders expanded, defaults applied

	// byTimeout is set when a Caddyfile block gave none of the three
	// timeouts on its own, so that its timeout option (or the default)
	// sets them all: only then does lowering timeout change them. JSON
	// has no timeout option.
	byTimeout bool
}

var (
	_ StoreProvider         = (*RedisStore)(nil)
	_ caddy.Provisioner     = (*RedisStore)(nil)
	_ caddyfile.Unmarshaler = (*RedisStore)(nil)
)

// CaddyModule returns the Caddy module information.
func (RedisStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "iceberg_idempotency.stores.redis",
		New: func() caddy.Module { return new(RedisStore) },
	}
}

// Provision expands placeholders and applies the store's defaults.
func (r *RedisStore) Provision(caddy.Context) error {
	repl := caddy.NewReplacer()
	var addrs []string
	for i, a := range r.Addresses {
		// A placeholder may hold several addresses, space-separated.
		expanded := strings.Fields(repl.ReplaceKnown(a, ""))
		// One part expanding to nothing ({env.HOST}:6379 with HOST
		// unset) left ":6379", the local server (until the build after
		// b35c62e).
		if name, why := emptyPlaceholder(a); name != "" && len(expanded) > 0 {
			return fmt.Errorf("redis store: address %d: {%s} %s", i+1, name, why)
		}
		addrs = append(addrs, expanded...)
	}
	// A value given that expands to nothing fell back to no
	// authentication, or to the default prefix another catalog's store
	// shares: refused, as an empty dsn or secret is.
	var username, password, keyPrefix string
	for _, o := range []struct {
		name, raw string
		into      *string
	}{{"username", r.Username, &username}, {"password", r.Password, &password}, {"key_prefix", r.KeyPrefix, &keyPrefix}} {
		*o.into = repl.ReplaceKnown(o.raw, "")
		if o.raw != "" && *o.into == "" {
			return emptyAfterPlaceholders(fmt.Sprintf("redis store: %s %q is empty after replacing placeholders", o.name, o.raw), o.raw)
		}
		// So is a part of one ({env.A}{env.B} with B unset).
		if name, why := emptyPlaceholder(o.raw); name != "" {
			return fmt.Errorf("redis store: %s: {%s} %s", o.name, name, why)
		}
	}
	cfg, err := redis.Config{
		Addrs:         addrs,
		Cluster:       r.Cluster,
		Username:      username,
		Password:      password,
		DB:            r.DB,
		KeyPrefix:     keyPrefix,
		TLS:           r.TLS || r.TLSServerName != "",
		TLSServerName: repl.ReplaceKnown(r.TLSServerName, ""),
		DialTimeout:   time.Duration(r.DialTimeout),
		ReadTimeout:   time.Duration(r.ReadTimeout),
		WriteTimeout:  time.Duration(r.WriteTimeout),
		PoolSize:      r.PoolSize,
	}.WithDefaults()
	if err != nil {
		if len(r.Addresses) > 0 && len(addrs) == 0 {
			return fmt.Errorf("redis store: addresses %q are empty after replacing placeholders", r.Addresses)
		}
		return fmt.Errorf("redis store: %w", err)
	}
	r.cfg = cfg
	return nil
}

// writeSettle implements writeSettler: a script that reserves, takes over
// or renews runs on the server no later than the end of its call plus
// redis.ClockMargin on the server's clock, read by a call that may have
// overstated the server's lead by its own length, up to the longest
// timeout; and a call fails before its end when a shorter read_timeout
// or write_timeout fires. A script runs as it arrives (Redis takes no
// locks), so twice the longest timeout plus the margin bounds it. The
// default window of 10 s used to apply whatever the timeouts: with
// timeout 12s, a Reserve held up on its way could land after the undo had
// ended, and hold its key unknown.
func (r *RedisStore) writeSettle() time.Duration {
	var longest time.Duration
	for _, t := range r.callTimeouts() {
		longest = max(longest, t.timeout)
	}
	return 2*longest + redis.ClockMargin
}

// callTimeouts implements callBounder: the store bounds each call by the
// largest of the three timeouts.
func (r *RedisStore) callTimeouts() []namedTimeout {
	or := func(t caddy.Duration) time.Duration {
		if t == 0 {
			return redis.DefaultTimeout
		}
		return time.Duration(t)
	}
	dial, read, write := or(r.DialTimeout), or(r.ReadTimeout), or(r.WriteTimeout)
	if r.byTimeout && dial == read && read == write {
		return []namedTimeout{{"timeout", dial}} // as timeout sets them
	}
	return []namedTimeout{
		{"dial_timeout", dial},
		{"read_timeout", read},
		{"write_timeout", write},
	}
}

// StoreKey implements StoreProvider: every option that shapes the client,
// defaults applied; the password only inside the hash.
func (r *RedisStore) StoreKey() string {
	c := r.cfg
	parts := append([]string{}, c.Addrs...)
	parts = append(parts, "|", strconv.FormatBool(c.Cluster), c.Username, c.Password, strconv.Itoa(c.DB), c.KeyPrefix,
		strconv.FormatBool(c.TLS), c.TLSServerName, c.DialTimeout.String(), c.ReadTimeout.String(),
		c.WriteTimeout.String(), strconv.Itoa(c.PoolSize))
	return storeKey("redis", c.KeyPrefix, parts...)
}

// OpenStore implements StoreProvider. It needs no server: go-redis
// connects on the first command, so a config whose Redis is down still
// loads and keyed requests get 503 until it answers.
func (r *RedisStore) OpenStore(ctx caddy.Context) (stores.Store, error) {
	logger := ctx.Logger()
	// go-redis reports pool dial failures on a process-wide logger that
	// writes to stderr; send them through Caddy's logs instead.
	goredis.SetLogger(redisLog{logger.Named("client")})
	s, err := redis.Open(r.cfg, logger)
	if err == nil {
		logger.Info("opened redis store", zap.Strings("addresses", r.cfg.Addrs), zap.Bool("cluster", r.cfg.Cluster || len(r.cfg.Addrs) > 1), zap.String("key_prefix", r.cfg.KeyPrefix),
			zap.Int("db", r.cfg.DB), zap.Bool("tls", r.cfg.TLS), zap.Bool("password", r.cfg.Password != ""))
	}
	return s, err
}

// redisLog adapts a zap logger to go-redis's logger. Its messages carry
// addresses and errors, never credentials.
type redisLog struct{ l *zap.Logger }

func (r redisLog) Printf(_ context.Context, format string, v ...any) {
	r.l.Warn(fmt.Sprintf(format, v...))
}

// UnmarshalCaddyfile parses
//
//	store redis {
//	    address         <host:port>...
//	    cluster         [on|off]
//	    username        <name>
//	    password        <password>
//	    db              <n>
//	    key_prefix      <prefix>
//	    tls             [on|off]
//	    tls_server_name <name>
//	    timeout         <duration>
//	    dial_timeout    <duration>
//	    read_timeout    <duration>
//	    write_timeout   <duration>
//	    pool_size       <n>
//	}
//
// timeout sets the dial, read and write timeouts at once; one of them
// given on its own wins over it, whichever line comes first. address lines
// add to each other; every other option may be given once.
func (r *RedisStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // store type name
	// On the store's line, with any import chain: see unmarshalSQLStore.
	noAddress := d.Err("redis store needs an address")
	if d.NextArg() {
		return d.ArgErr()
	}
	given := givenOptions{}
	var timeout caddy.Duration
	var addressAt []optionAt // of each address, for the errors below
	for d.NextBlock(0) {
		opt := d.Val()
		// Address lines add to each other; every other option once.
		if opt != "address" && opt != "addresses" {
			if err := given.once(d, opt); err != nil {
				return err
			}
		}
		var err error
		switch opt {
		case "address", "addresses":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.Errf("%s needs at least one host:port", opt)
			}
			for i, a := range args {
				// One written with placeholders is checked once they are
				// replaced, at provisioning. The error does not repeat it:
				// a redis:// URL may hold the password.
				if !strings.Contains(a, "{") {
					if err := redis.CheckAddress(a); err != nil {
						return d.Errf("%s: value %d of %d: %v", opt, i+1, len(args), err)
					}
				}
			}
			r.Addresses = append(r.Addresses, args...)
			for range args {
				addressAt = append(addressAt, optionAt{d.File(), d.Line()})
			}
		case "cluster":
			r.Cluster = true
			if d.CountRemainingArgs() > 0 {
				r.Cluster, err = parseOnOff(d)
			}
		case "username":
			r.Username, err = singleArg(d)
		case "password":
			r.Password, err = singleArg(d)
		case "db":
			var arg string
			if arg, err = singleArg(d); err == nil {
				n, aerr := strconv.Atoi(arg)
				if aerr != nil || n < 0 {
					return d.Errf("db must be a non-negative integer, got %q", arg)
				}
				r.DB = n
			}
		case "key_prefix":
			r.KeyPrefix, err = singleArg(d)
		case "tls":
			r.TLS = true
			if d.CountRemainingArgs() > 0 {
				r.TLS, err = parseOnOff(d)
			}
		case "tls_server_name":
			r.TLSServerName, err = singleArg(d)
		case "timeout":
			err = parseDuration(d, &timeout)
		case "dial_timeout":
			err = parseDuration(d, &r.DialTimeout)
		case "read_timeout":
			err = parseDuration(d, &r.ReadTimeout)
		case "write_timeout":
			err = parseDuration(d, &r.WriteTimeout)
		case "pool_size":
			var arg string
			if arg, err = singleArg(d); err == nil {
				n, aerr := strconv.Atoi(arg)
				if aerr != nil || n <= 0 || n > redis.MaxPoolSize {
					return d.Errf("pool_size must be a positive integer up to %d, got %q", redis.MaxPoolSize, arg)
				}
				r.PoolSize = n
			}
		default:
			return d.Errf("unknown redis store option %q", opt)
		}
		if err != nil {
			return err
		}
	}
	// timeout fills the three it stands for, whichever line comes first:
	// one given on its own wins.
	r.byTimeout = r.DialTimeout == 0 && r.ReadTimeout == 0 && r.WriteTimeout == 0
	for _, t := range []*caddy.Duration{&r.DialTimeout, &r.ReadTimeout, &r.WriteTimeout} {
		if *t == 0 {
			*t = timeout
		}
	}
	if len(r.Addresses) == 0 {
		return noAddress
	}
	for i, a := range r.Addresses {
		if j := slices.Index(r.Addresses[:i], a); j >= 0 {
			return fmt.Errorf("address %d of %d repeats address %d: two addresses are a cluster's seed nodes, at %s", i+1, len(r.Addresses), j+1, addressAt[i])
		}
	}
	if _, off := given["tls"]; off && !r.TLS && r.TLSServerName != "" {
		return d.Errf("tls off with tls_server_name, which implies tls: leave one out")
	}
	if at, off := given["cluster"]; off && !r.Cluster && len(r.Addresses) > 1 {
		return fmt.Errorf("cluster off with %d addresses, which are a cluster's seed nodes whatever cluster says: give one address for a single server, at %s", len(r.Addresses), at)
	}
	if (len(r.Addresses) > 1 || r.Cluster) && r.DB != 0 {
		return d.Errf("db %d on a cluster (several addresses, or cluster on): a Redis Cluster has only db 0", r.DB)
	}
	return nil
}
