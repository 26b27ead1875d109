#!/usr/bin/env bash
# Measures the handler against plain reverse_proxy, and the SQL stores
# against their floor loop, in one run on real Caddy processes, and prints
# one Markdown table per benchmark (medians over COUNT rounds; every ratio
# is taken within a round). Needs the local PostgreSQL, MariaDB and Redis
# (see README "Tests").
#
#   scripts/bench.sh                    # everything
#   scripts/bench.sh --baseline main~3  # also run the proxy cases on a
#                                       # Caddy built from that commit
#   BENCH_GROUPS=proxy scripts/bench.sh       # only the load cases
#
# Environment: BENCH_GROUPS (of proxy, bursts, stores; default all), BENCHTIME (load cases, default
# 2s), COUNT (rounds, default 3), ICEBERG_IDEMPOTENCY_BENCH_CLIENTS (default
# 1,32), ICEBERG_IDEMPOTENCY_BENCH_MAX_CONNS (SQL pool size, default the
# stores' default), ICEBERG_IDEMPOTENCY_BENCH_PAIR_TIME (each pair of
# BenchmarkPaired, default 8s). The raw go test output is kept in $OUT
# (default bench-out/) beside the tables.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
baseline=""
if [[ "${1:-}" == "--baseline" ]]; then
	baseline="${2:?--baseline needs a commit}"
	shift 2
fi
groups="${BENCH_GROUPS:-proxy,bursts,stores}"
benchtime="${BENCHTIME:-2s}"
count="${COUNT:-3}"
out="${OUT:-$root/bench-out}"
mkdir -p "$out"
work="$(mktemp -d)"
cleanup() {
	if [[ -n "$baseline" ]]; then
		git -C "$root" worktree remove --force "$work/baseline" >/dev/null 2>&1 || true
	fi
	rm -rf "$work"
}
trap cleanup EXIT

echo "building caddy from the working tree" >&2
(cd "$root" && go build -o "$work/caddy" ./cmd/caddy)
export CADDY_BINARY="$work/caddy"
if [[ -n "$baseline" ]]; then
	rev="$(git -C "$root" rev-parse --short "$baseline")"
	echo "building the baseline caddy from $baseline ($rev)" >&2
	git -C "$root" worktree add --detach "$work/baseline" "$rev" >/dev/null
	(cd "$work/baseline" && go build -o "$work/caddy-baseline" ./cmd/caddy)
	export ICEBERG_IDEMPOTENCY_BENCH_BASELINE_BINARY="$work/caddy-baseline"
fi

raw="$out/raw.txt"
: >"$raw"
{
	echo "machine: $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM;" \
		"$(psql -X -At -d "${ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}" -c 'SHOW server_version' 2>/dev/null | sed 's/^/PostgreSQL /' || true)," \
		"$(mysql -h 127.0.0.1 -u root -N -e 'SELECT VERSION()' 2>/dev/null | sed 's/^/MariaDB /' || true)," \
		"$(redis-cli -u "redis://${ICEBERG_IDEMPOTENCY_TEST_REDIS_ADDR:-127.0.0.1:6379}" INFO server 2>/dev/null | awk -F: '/^redis_version/ {print "Redis " $2}' | tr -d '\r' || true);" \
		"baseline: ${baseline:-none}; commit: $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo +dirty)"
} | tee "$out/machine.txt" >&2

run() { # dir, bench regexp, benchtime, count, packages...
	local dir="$1" re="$2" time="$3" n="$4"
	shift 4
	(cd "$dir" && go test -run '^$' -bench "$re" -benchtime "$time" -count "$n" -timeout 60m "$@") | tee -a "$raw" >&2
}

has() { [[ ",$groups," == *",$1,"* ]]; }
# Load cases, repeated in rounds. Each round is its own go test run: with
# -count N, go test repeats every case N times before the next one, so the
# cases a ratio compares would be minutes apart and the machine's drift
# would land in the ratio; one round at a time keeps them seconds apart.
# BenchmarkPaired goes further: the two sides of each ratio alternate in
# 250 ms slices.
if has proxy; then
	for _ in $(seq "$count"); do
		run "$root/integration" 'Benchmark(Proxy|Secret)$' "$benchtime" 1 ./bench/
		run "$root/integration" 'BenchmarkPaired$' 1x 1 ./bench/
	done
	# GC CPU per request, from gctrace: one run says it, as it does not
	# depend on the CPU's speed.
	run "$root/integration" 'BenchmarkGCCost$' 1x 1 ./bench/
fi
# Bursts and phases that are one measurement each.
if has bursts; then
	run "$root/integration" 'Benchmark(Contention|PurgeUnderLoad|Growth)$' 1x 1 ./bench/
fi
# Store level: cost growth with the table's size, and waiters' wake-up.
if has stores; then
	run "$root" 'BenchmarkGrowth$' 1x 1 ./stores/...
	run "$root" 'BenchmarkAwaitWake$' 60x 1 ./stores/...
	run "$root" 'BenchmarkFinalizeNotify$' "$benchtime" "$count" ./stores/postgres/
fi

{
	echo
	echo "_$(cat "$out/machine.txt")_"
	echo
	(cd "$root/integration" && go run ./cmd/benchtable <"$raw" 2>/dev/null)
} | tee "$out/table.md"
