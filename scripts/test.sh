#!/usr/bin/env bash
# Runs every Go module's tests in this repository (the plugin, then
# integration/), with the race detector. Tests find PostgreSQL and MariaDB
# through ICEBERG_IDEMPOTENCY_TEST_POSTGRES_DSN / ICEBERG_IDEMPOTENCY_TEST_MYSQL_DSN
# (defaults: the local servers); with CI=true an unreachable server fails the
# run instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
for mod in $(git ls-files --cached --others --exclude-standard '*go.mod' | sort); do
	dir=$(dirname "$mod")
	echo "=== go test -race ./... in $dir"
	(cd "$dir" && go test -race -count=1 -timeout 30m "$@" ./...) || status=1
done
exit $status
