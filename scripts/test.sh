#!/usr/bin/env bash
# Runs every Go module's tests in this repository (the plugin, then
# integration/), with the race detector. Tests find PostgreSQL and MariaDB
# through ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN / ICEBERG_IDEMPOTENCY_TEST_MYSQL_DSN
# (defaults: the local servers); with CI=true an unreachable server fails the
# run instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
# The integration fault suite writes its summary table here (go test shows a
# passing package's output only with -v); it is printed at the end.
export ICEBERG_IDEMPOTENCY_FAULT_SUMMARY="${ICEBERG_IDEMPOTENCY_FAULT_SUMMARY:-$(mktemp -u "${TMPDIR:-/tmp}/iceberg-idempotency-fault-summary.XXXXXX.md")}"
for mod in $(git ls-files --cached --others --exclude-standard '*go.mod' | sort); do
	dir=$(dirname "$mod")
	echo "=== go test -race ./... in $dir"
	(cd "$dir" && go test -race -count=1 -timeout 30m "$@" ./...) || status=1
done
if [ -s "$ICEBERG_IDEMPOTENCY_FAULT_SUMMARY" ]; then
	cat "$ICEBERG_IDEMPOTENCY_FAULT_SUMMARY"
	rm -f "$ICEBERG_IDEMPOTENCY_FAULT_SUMMARY"
fi
exit $status
