#!/usr/bin/env bash
# Measures the handler against plain reverse_proxy in one run: real Caddy
# processes, one upstream, sequential keep-alive requests. Needs the local
# PostgreSQL, MariaDB and Redis (see README "Tests"). Extra arguments go to
# go test.
set -euo pipefail
cd "$(dirname "$0")/../integration"
go test -run '^$' -bench . -benchtime "${BENCHTIME:-3000x}" -count 1 "$@" ./bench/
