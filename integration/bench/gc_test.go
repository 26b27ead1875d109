package bench

import (
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/caddyproc"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/testdb"
)

// gcTraceLine is one line of GODEBUG=gctrace=1: its CPU times (ms) are
// assist + background/assist/idle mark + termination.
var gcTraceLine = regexp.MustCompile(`gc \d+ @[0-9.]+s \d+%: \S+ ms clock, ([0-9.]+)\+([0-9.]+)/([0-9.]+)/([0-9.]+)\+([0-9.]+) ms cpu`)

// gcCPUms adds up the CPU time of every collection cycle in logs.
func gcCPUms(logs string) float64 {
	total := 0.0
	for _, m := range gcTraceLine.FindAllStringSubmatch(logs, -1) {
		for _, f := range m[1:] {
			v, _ := strconv.ParseFloat(f, 64)
			total += v
		}
	}
	return total
}

// BenchmarkGCCost measures what the garbage collector of a Caddy process
// costs per request, from the process's own GODEBUG=gctrace=1 lines, with
// 32 clients sending fresh keyed mutations: on the memory store's route,
// on the plain reverse_proxy route of the same process (after the memory
// route filled the store a little), and on a Caddy without the module.
// Its cost depends on what the heap holds, not on the CPU's speed, so it
// shows a change to what the memory store keeps per record where a
// throughput ratio, shared with the client and the upstream, drowns it:
// each cycle marks every object of every record held, and every request
// of the process pays for it, the plain routes' too.
//
// The fourth side is a Caddy whose only route is the module on the
// MariaDB/MySQL store.
//
// Reported per side (memory, plain-same, plain-process, mysql): gc-us (GC CPU per
// request) and caddy-us (the process's CPU per request, from /proc), over
// ICEBERG_IDEMPOTENCY_BENCH_GC_REQUESTS requests (default 100,000) after a
// fifth as many to warm up.
func BenchmarkGCCost(b *testing.B) {
	n := envInt(b, "ICEBERG_IDEMPOTENCY_BENCH_GC_REQUESTS", 100_000)
	up := upstream(b)
	gctrace := caddyproc.Options{Env: []string{"GODEBUG=gctrace=1"}}
	module := caddyproc.StartWith(b, routedCaddyfile(up, [][2]string{{"memory", "memory"}}), gctrace)
	plain := caddyproc.StartWith(b, routedCaddyfile(up, nil), gctrace)
	// A Caddy whose only store is MariaDB/MySQL: what a SQL store's
	// request allocates on the way (the batch's text, the driver's
	// interpolation) is collected in a heap that holds no records.
	my := testdb.MySQL
	dsn, table := my.DSN(b), tableName()
	dropAtEnd(b, my, dsn, table)
	mysql := caddyproc.StartWith(b, routedCaddyfile(up, [][2]string{{"mysql", fmt.Sprintf("mysql {\ndsn %q\ntable %s\n}", dsn, table)}}), gctrace)
	b.ResetTimer()
	for _, c := range []struct {
		name  string
		caddy *caddyproc.Instance
		route string
	}{{"memory", module, "memory"}, {"plain-same", module, ""}, {"plain-process", plain, ""}, {"mysql", mysql, "mysql"}} {
		url := c.caddy.URL()
		run := func(n int) error {
			var wg sync.WaitGroup
			var left atomic.Int64
			var failed atomic.Pointer[error]
			left.Store(int64(n))
			for range 32 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for left.Add(-1) >= 0 && failed.Load() == nil {
						if err := send(http.MethodPost, url+floorPath, c.route, newKey(), http.StatusOK); err != nil {
							failed.CompareAndSwap(nil, &err)
						}
					}
				}()
			}
			wg.Wait()
			if err := failed.Load(); err != nil {
				return *err
			}
			return nil
		}
		if err := run(n / 5); err != nil {
			b.Fatal(err)
		}
		gc0, cpu0 := gcCPUms(c.caddy.Logs()), processCPU(b, c.caddy.Pid())
		if err := run(n); err != nil {
			b.Fatal(err)
		}
		gc, cpu := gcCPUms(c.caddy.Logs())-gc0, processCPU(b, c.caddy.Pid())-cpu0
		if gc == 0 {
			b.Fatalf("%s: no gctrace line in Caddy's output", c.name)
		}
		b.ReportMetric(gc*1000/float64(n), c.name+"-gc-us")
		b.ReportMetric(float64(cpu.Microseconds())/float64(n), c.name+"-caddy-us")
	}
}
