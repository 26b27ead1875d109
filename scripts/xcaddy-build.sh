#!/usr/bin/env bash
# Builds Caddy with this checkout's iceberg_idempotency module through xcaddy,
# the way a user builds a custom Caddy, and checks that the binary lists the
# module's handler and app:
#
#   ./scripts/xcaddy-build.sh [OUTPUT]      (default OUTPUT: ./caddy)
#
# `xcaddy build --with <module>=.` asks the Go module proxy for the latest
# version of <module> before the local replacement applies; this module is not
# published, so a proxy that refuses unknown paths (403) fails that build.
# Naming the version in the replacement, as below, makes xcaddy's `go get` use
# the directory for exactly that version and ask the proxy nothing about this
# module; every other module (Caddy and its dependencies) is fetched and
# checksum-verified as usual. xcaddy works in its own temporary module, so the
# checkout's go.mod and go.sum are only read (checked at the end).
#
# Environment: XCADDY_VERSION (default v0.4.5); CADDY_VERSION (default: the
# version this module's go.mod requires); XCADDY_GO_BUILD_FLAGS as in xcaddy
# (default -trimpath, no debug symbols).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-caddy}
case $out in /*) ;; *) out="$PWD/$out" ;; esac
xcaddy_version=${XCADDY_VERSION:-v0.4.5}
module=$(cd "$root" && go list -m)
caddy_version=${CADDY_VERSION:-$(cd "$root" && go list -m -f '{{.Version}}' github.com/caddyserver/caddy/v2)}
# Any version works as long as the replacement names the same one; this is
# the pseudo-version Go itself gives a replaced module that has none.
local_version=v0.0.0-00010101000000-000000000000

work=$(mktemp -d "${TMPDIR:-/tmp}/xcaddy-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
sums_before=$(cd "$root" && sha256sum go.mod go.sum)

echo "--- installing xcaddy $xcaddy_version"
GOBIN="$work/bin" go install "github.com/caddyserver/xcaddy/cmd/xcaddy@$xcaddy_version"

echo "--- xcaddy build $caddy_version --with $module@$local_version=$root"
(cd "$work" && "$work/bin/xcaddy" build "$caddy_version" --output "$out" \
	--with "$module@$local_version=$root")

echo "--- checking $out"
if [ "$(cd "$root" && sha256sum go.mod go.sum)" != "$sums_before" ]; then
	echo "go.mod or go.sum in $root changed during the build" >&2
	exit 1
fi
modules=$("$out" list-modules)
for want in http.handlers.iceberg_idempotency iceberg_idempotency; do
	if ! grep -qx "$want" <<<"$modules"; then
		echo "$out list-modules lacks $want" >&2
		exit 1
	fi
done
echo "ok: $out ($("$out" version)) has http.handlers.iceberg_idempotency and iceberg_idempotency"
