// Command caddy is Caddy with its standard modules plus iceberg_idempotency,
// so the module can be built with plain `go build ./cmd/caddy`.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-iceberg/caddy-iceberg-idempotency"
)

func main() {
	caddycmd.Main()
}
