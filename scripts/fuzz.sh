#!/usr/bin/env bash
# Runs every fuzz target of the given packages of the plugin module for a
# while each:
#
#   ./scripts/fuzz.sh [SECONDS] [PACKAGE...]    (defaults: 10, the root package)
#
# Targets are found with `go test -list '^Fuzz'`, so a new Fuzz* function is
# picked up without touching this script. `go test -fuzz` takes one target in
# one package per run, hence one run each. A failing input is saved under
# the package's testdata/fuzz/<target>/ (commit it: it becomes a regression
# seed) and fails the script once every target has run.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-10}
shift || true
[ $# -gt 0 ] || set -- .
case $seconds in '' | *[!0-9]*)
	echo "usage: $0 [SECONDS] [PACKAGE...]" >&2
	exit 2
	;;
esac

passed=0 failed=0
for pkg in "$@"; do
	listing=$(go test -run '^$' -list '^Fuzz' "$pkg")
	targets=$(grep -E '^Fuzz[A-Za-z0-9_]*$' <<<"$listing" || true)
	if [ -z "$targets" ]; then
		echo "no fuzz targets in $pkg" >&2
		failed=$((failed + 1))
		continue
	fi
	for target in $targets; do
		echo "=== fuzz $pkg $target for ${seconds}s"
		if go test -run '^$' -fuzz "^${target}\$" -fuzztime "${seconds}s" "$pkg"; then
			passed=$((passed + 1))
		else
			failed=$((failed + 1))
		fi
	done
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
