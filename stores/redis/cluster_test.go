package redis

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore/sqltest"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// startCluster starts a Redis Cluster of three masters, each a
// redis-server process of this test's own (the shared test server is a
// single node), and returns their addresses. It skips without
// redis-server and redis-cli, and fails under CI=true.
func startCluster(t *testing.T) []string {
	t.Helper()
	for _, bin := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(bin); err != nil {
			unavailable(t, fmt.Errorf("%s not found: %w", bin, err))
		}
	}
	dir := t.TempDir()
	var addrs []string
	for _, port := range clusterPorts(t, 3) {
		addr := "127.0.0.1:" + strconv.Itoa(port)
		cmd := exec.Command("redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
			"--cluster-enabled", "yes", "--cluster-config-file", fmt.Sprintf("nodes-%d.conf", port),
			"--save", "", "--appendonly", "no", "--dir", dir)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		addrs = append(addrs, addr)
	}
	for _, addr := range addrs {
		waitFor(t, addr, func(c *goredis.Client) bool { return c.Ping(context.Background()).Err() == nil })
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, addr := range addrs {
		waitFor(t, addr, func(c *goredis.Client) bool {
			info, err := c.ClusterInfo(context.Background()).Result()
			return err == nil && strings.Contains(info, "cluster_state:ok")
		})
	}
	return addrs
}

func unavailable(t *testing.T, err error) {
	t.Helper()
	if testing.Short() {
		t.Skip(err)
	}
	sqltest.Missing(t, "a Redis Cluster for this test needs redis-server and redis-cli on PATH: "+err.Error())
}

// clusterPorts returns n free ports whose cluster bus ports (port + 10000)
// are free too.
func clusterPorts(t *testing.T, n int) []int {
	t.Helper()
	var ports []int
	for port := 21000 + int(time.Now().UnixNano()%4000); len(ports) < n && port < 30000; port++ {
		if free(port) && free(port+10000) {
			ports = append(ports, port)
		}
	}
	if len(ports) < n {
		t.Fatal("no free ports for a Redis Cluster")
	}
	return ports
}

func free(port int) bool {
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		return false
	}
	ln.Close()
	return true
}

func waitFor(t *testing.T, addr string, ok func(*goredis.Client) bool) {
	t.Helper()
	c := goredis.NewClient(&goredis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	for deadline := time.Now().Add(20 * time.Second); !ok(c); {
		if time.Now().After(deadline) {
			t.Fatalf("Redis Cluster node %s not ready", addr)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The store passes the conformance suite on a real cluster, reached both
// through its three nodes and through one with cluster on (a managed
// service's configuration endpoint). Count covers every master, every
// time: before, the cluster client sent each SCAN page to any node, so a
// count mixed nodes' cursors and changed from call to call, and one
// address of a cluster was a single server's client, which most keys'
// MOVED replies failed.
func TestCluster(t *testing.T) {
	addrs := startCluster(t)
	t.Run("conformance", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) storetest.Harness {
			s, _ := openStore(t, func(c *Config) { c.Addrs = addrs })
			return storetest.Harness{Store: s, Advance: time.Sleep}
		})
	})
	t.Run("count", func(t *testing.T) {
		s, _ := openStore(t, func(c *Config) { c.Addrs = addrs })
		ctx := context.Background()
		const final, inFlight = 300, 30
		for i := range final + inFlight {
			r := storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)
			if _, err := s.Reserve(ctx, r); err != nil {
				t.Fatal(err)
			}
			if i < final {
				if err := s.Finalize(ctx, r.Key, r.Owner, stores.Response{Status: 200, Body: []byte("{}")}); err != nil {
					t.Fatalf("Finalize: %v", err)
				}
			}
		}
		for range 3 {
			c, err := s.Count(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if c.Final != final || c.InFlight != inFlight || c.Abandoned != 0 {
				t.Fatalf("Count = %+v, want %d final and %d in flight", c, final, inFlight)
			}
		}
	})
	t.Run("one address", func(t *testing.T) {
		ctx := context.Background()
		single, _ := openStore(t, func(c *Config) { c.Addrs = addrs[:1] })
		var moved error
		for range 30 {
			if _, err := single.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)); err != nil {
				moved = err
				break
			}
		}
		if moved == nil || !strings.Contains(moved.Error(), "set cluster on") || !stores.NotSent(moved) {
			t.Fatalf("a single-server client on a cluster node: err = %v, NotSent = %v; want MOVED, not sent, naming cluster on", moved, stores.NotSent(moved))
		}
		s, _ := openStore(t, func(c *Config) { c.Addrs, c.Cluster = addrs[:1], true })
		for range 30 {
			if _, err := s.Reserve(ctx, storetest.Reservation(storetest.NewKey(t), storetest.Long, storetest.Long)); err != nil {
				t.Fatalf("Reserve through one address with cluster on: %v", err)
			}
		}
	})
}
