package icebergidempotency

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/redis/redistest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// Placeholders are expanded at provision time; the store key changes with
// every option that shapes the client and never shows the password.
func TestRedisStoreProvisionAndKey(t *testing.T) {
	t.Setenv("ICEBERG_TEST_REDIS_PASSWORD", "s3cr3t-redis")
	t.Setenv("ICEBERG_TEST_REDIS_ADDRS", "r1:6379 r2:6379")
	base := func() *RedisStore {
		return &RedisStore{Addresses: []string{"{env.ICEBERG_TEST_REDIS_ADDRS}"}, Password: "{env.ICEBERG_TEST_REDIS_PASSWORD}"}
	}
	p := base()
	if err := p.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(p.cfg.Addrs, ","); got != "r1:6379,r2:6379" || p.cfg.Password != "s3cr3t-redis" {
		t.Fatalf("expanded addresses %q, password %q", got, p.cfg.Password)
	}
	if p.cfg.KeyPrefix != redis.DefaultKeyPrefix || p.cfg.ReadTimeout != 5*time.Second {
		t.Fatalf("defaults not applied: %+v", p.cfg)
	}
	key := p.StoreKey()
	if strings.Contains(key, "s3cr3t") || !strings.HasPrefix(key, "redis/"+redis.DefaultKeyPrefix+"/") {
		t.Fatalf("store key = %q", key)
	}
	explicit := base()
	explicit.KeyPrefix, explicit.ReadTimeout = redis.DefaultKeyPrefix, 0
	if err := explicit.Provision(newCaddyContext(t)); err != nil || explicit.StoreKey() != key {
		t.Fatalf("defaults written out give another store: %v", err)
	}
	for name, mutate := range map[string]func(*RedisStore){
		"password":   func(r *RedisStore) { r.Password = "other" },
		"username":   func(r *RedisStore) { r.Username = "u" },
		"prefix":     func(r *RedisStore) { r.KeyPrefix = "other:" },
		"address":    func(r *RedisStore) { r.Addresses = []string{"r1:6379"} },
		"tls":        func(r *RedisStore) { r.TLS = true },
		"servername": func(r *RedisStore) { r.TLSServerName = "x" },
		"timeout":    func(r *RedisStore) { r.ReadTimeout = 1e9 },
		"pool":       func(r *RedisStore) { r.PoolSize = 3 },
	} {
		o := base()
		mutate(o)
		if err := o.Provision(newCaddyContext(t)); err != nil {
			t.Fatal(err)
		}
		if o.StoreKey() == key {
			t.Errorf("%s: same store key", name)
		}
	}

	empty := &RedisStore{Addresses: []string{"{env.ICEBERG_TEST_UNSET_REDIS}"}}
	if err := empty.Provision(newCaddyContext(t)); err == nil || !strings.Contains(err.Error(), "empty after replacing placeholders") {
		t.Fatalf("empty expanded address: %v", err)
	}
	// Given, and expanded to nothing: the store connected without
	// authentication, or shared the default prefix with another catalog.
	for name, mutate := range map[string]func(*RedisStore){
		"password":   func(r *RedisStore) { r.Password = "{env.ICEBERG_TEST_UNSET_REDIS}" },
		"username":   func(r *RedisStore) { r.Username = "{env.ICEBERG_TEST_UNSET_REDIS}" },
		"key_prefix": func(r *RedisStore) { r.KeyPrefix = "{env.ICEBERG_TEST_UNSET_REDIS}" },
	} {
		o := &RedisStore{Addresses: []string{"r1:6379"}}
		mutate(o)
		want := `redis store: ` + name + ` "{env.ICEBERG_TEST_UNSET_REDIS}" is empty after replacing placeholders: is the environment variable ICEBERG_TEST_UNSET_REDIS set?`
		if err := o.Provision(newCaddyContext(t)); err == nil || err.Error() != want {
			t.Errorf("%s expanded to nothing: %v, want %q", name, err, want)
		}
	}
	// A file that cannot be read says so: it read as "empty" alone, until
	// the build after b35c62e.
	missing := &RedisStore{Addresses: []string{"r1:6379"}, Password: "{file./nonexistent/iceberg-idempotency-redis-pw}"}
	if err := missing.Provision(newCaddyContext(t)); err == nil || !strings.Contains(err.Error(), "names a file that cannot be read (open /nonexistent/iceberg-idempotency-redis-pw") {
		t.Errorf("password from a missing file: %v", err)
	}
	// A part that expands to nothing, until the build after b35c62e: the
	// local server, a prefix shared with others, a shorter password.
	t.Setenv("ICEBERG_TEST_SET_REDIS", "abc")
	for want, r := range map[string]*RedisStore{
		"redis store: address 1: {env.ICEBERG_TEST_UNSET_REDIS} is an environment variable that is not set":  {Addresses: []string{"{env.ICEBERG_TEST_UNSET_REDIS}:6379"}},
		"redis store: key_prefix: {env.ICEBERG_TEST_UNSET_REDIS} is an environment variable that is not set": {Addresses: []string{"r1:6379"}, KeyPrefix: "{env.ICEBERG_TEST_UNSET_REDIS}:idem:"},
		"redis store: password: {env.ICEBERG_TEST_UNSET_REDIS} is an environment variable that is not set":   {Addresses: []string{"r1:6379"}, Password: "{env.ICEBERG_TEST_SET_REDIS}{env.ICEBERG_TEST_UNSET_REDIS}"},
	} {
		if err := r.Provision(newCaddyContext(t)); err == nil || err.Error() != want {
			t.Errorf("%+v provisioned: %v, want %q", r, err, want)
		}
	}
	// go-redis panicked past an int32; JSON reaches the store unparsed.
	for want, r := range map[string]*RedisStore{
		"redis: pool_size must be at most 100000": {Addresses: []string{"r1:6379"}, PoolSize: 3_000_000_000},
		"redis: address 3 of 3 repeats address 1": {Addresses: []string{"r1:6379", "r2:6379", "r1:6379"}},
	} {
		if err := r.Provision(newCaddyContext(t)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%+v provisioned: %v, want %q", r, err, want)
		}
	}
}

func TestRedisStoreCaddyfile(t *testing.T) {
	r := new(RedisStore)
	d := caddyfile.NewTestDispenser(`redis {
		address a:1 b:2
		tls off
		timeout 1s
		write_timeout 2s
		db 0
	}`)
	if err := r.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if len(r.Addresses) != 2 || r.TLS || r.DialTimeout != 1e9 || r.ReadTimeout != 1e9 || r.WriteTimeout != 2e9 {
		t.Fatalf("parsed %+v", r)
	}
	// timeout fills the three, and one given on its own wins whichever
	// line comes first; address lines add up.
	r = new(RedisStore)
	d = caddyfile.NewTestDispenser("redis {\naddress a:1\nwrite_timeout 2s\ntimeout 1s\naddress b:2\n}")
	if err := r.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if len(r.Addresses) != 2 || r.DialTimeout != 1e9 || r.ReadTimeout != 1e9 || r.WriteTimeout != 2e9 {
		t.Fatalf("write_timeout before timeout: parsed %+v", r)
	}
	// One address of a cluster: a managed service's configuration
	// endpoint.
	r = new(RedisStore)
	if err := r.UnmarshalCaddyfile(caddyfile.NewTestDispenser("redis {\naddress a:1\ncluster\n}")); err != nil || !r.Cluster {
		t.Fatalf("cluster: parsed %+v, %v", r, err)
	}
	if err := r.Provision(newCaddyContext(t)); err != nil || !r.cfg.Cluster {
		t.Fatalf("cluster: provisioned %+v, %v", r.cfg, err)
	}
	plain := &RedisStore{Addresses: []string{"a:1"}}
	if err := plain.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	if r.StoreKey() == plain.StoreKey() {
		t.Fatal("StoreKey does not depend on cluster: a reload switching it would keep the old client")
	}
	for src, want := range map[string]string{
		`redis`:                                                   "needs an address",
		"redis {\naddress a:1\ncluster\ndb 1\n}":                  "Cluster has only db 0",
		"redis {\naddress a:1\ncluster maybe\n}":                  "cluster must be on or off",
		"redis {\naddress a:1\ntls off\ntls_server_name r\n}":     "tls off with tls_server_name",
		"redis {\naddress\n}":                                     "needs at least one",
		"redis {\naddress a:1 redis://default:s3cret@r:6379/0\n}": "address: value 2 of 2: a URL, not host:port",
		"redis {\naddress r\n}":                                   "not host:port",
		"redis {\naddress localhost:99999\n}":                     "the port must be a number from 1 to 65535",
		"redis {\naddress localhost:redis\n}":                     "the port must be a number from 1 to 65535",
		"redis {\naddress a:1\ndb x\n}":                           "db must be a non-negative integer",
		"redis {\naddress a:1 b:1\ndb 2\n}":                       "Cluster has only db 0",
		"redis {\naddress a:1\ntls maybe\n}":                      "tls must be on or off",
		"redis {\naddress a:1\ntimeout 0s\n}":                     "positive duration",
		"redis {\naddress a:1\npool_size 0\n}":                    "pool_size must be a positive integer",
		"redis {\naddress a:1\npool_size 3000000000\n}":           "pool_size must be a positive integer up to 100000",
		// Several addresses are a cluster's: with cluster off every
		// command failed on a server without cluster support.
		"redis {\naddress a:1 b:1\ncluster off\n}":        "cluster off with 2 addresses",
		"redis {\naddress a:1\naddress a:1\n}":            "address 2 of 2 repeats address 1",
		"redis {\naddress a:1\nsentinel x\n}":             `unknown redis store option "sentinel"`,
		"redis {\naddress a:1\npassword a b\n}":           "takes a single value",
		"redis {\naddress a:1\ntimeout 1s\ntimeout 2s\n}": "timeout given twice (first on line 3)",
	} {
		err := new(RedisStore).UnmarshalCaddyfile(caddyfile.NewTestDispenser(src))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want %q", src, err, want)
		}
		if err != nil && strings.Contains(err.Error(), "s3cret") {
			t.Errorf("%q: error %v shows the password", src, err)
		}
	}
}

// OpenStore needs no server: a Redis that is down yields a store whose
// calls fail transiently (the handler answers 503), and the store is
// self-expiring, so the app has nothing to purge.
func TestRedisStoreOpensWithServerDown(t *testing.T) {
	r := &RedisStore{Addresses: []string{"127.0.0.1:1"}, DialTimeout: 2e8, ReadTimeout: 2e8, WriteTimeout: 2e8}
	if err := r.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	s, err := r.OpenStore(newCaddyContext(t))
	if err != nil {
		t.Fatalf("OpenStore with the server down: %v", err)
	}
	defer s.Close()
	_, err = s.Reserve(context.Background(), storetest.Reservation(storetest.NewKey(t), time.Second, time.Second))
	var tr interface{ Transient() bool }
	if err == nil || !errors.As(err, &tr) || !tr.Transient() {
		t.Fatalf("Reserve with the server down = %v, want a transient error", err)
	}
	if se, ok := s.(stores.SelfExpiring); !ok || !se.SelfExpiring() {
		t.Fatal("redis store is not self-expiring")
	}
}

// A store whose user the server refuses a command the store needs (a
// grant missing) is no outage: fail_open does not pass keyed requests
// through it, since the records it holds answer the retries of commits
// that landed. In 839bbe8, whose access check made such a store refuse
// every operation, fail_open passed every keyed request unguarded, the
// retries of answered keys too; the PostgreSQL and MySQL stores'
// AccessError (a grant missing) did so from the build after 068a81b.
func TestFailOpenDoesNotPassAStoreItsUserMayNotUse(t *testing.T) {
	prefix := redistest.Prefix(t)
	user, password := "iceberg_idempotency_test_nodel_"+strings.TrimSuffix(strings.TrimPrefix(prefix, "iceberg_idempotency_test_"), ":"), "pw"
	admin := redistest.Admin(t)
	ctx := context.Background()
	if err := admin.Do(ctx, "ACL", "SETUSER", user, "on", ">"+password, "~"+prefix+"*", "&"+prefix+"*", "+@all", "-@dangerous", "-del").Err(); err != nil {
		t.Skipf("the test server refuses ACL SETUSER: %v", err)
	}
	t.Cleanup(func() { admin.Do(context.Background(), "ACL", "DELUSER", user) })
	r := &RedisStore{Addresses: []string{redistest.Addr(t)}, Username: user, Password: password, KeyPrefix: prefix}
	if err := r.Provision(newCaddyContext(t)); err != nil {
		t.Fatal(err)
	}
	s, err := r.OpenStore(newCaddyContext(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// The app warms its stores at start; the check of the user's
	// commands runs in the background, and here its verdict is awaited.
	s.(interface{ Warm() }).Warm()
	redistest.AwaitRefusal(t, s)
	failOpenRefuses(t, s, "through a store whose user may not run DEL")
}
