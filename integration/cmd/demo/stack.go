package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	// The Caddyfile adapter, Caddy's standard modules (reverse_proxy among
	// them) and the module under demonstration, all in this process: no
	// Caddy binary has to be built first.
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-iceberg/caddy-iceberg-idempotency"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/catalog"
)

// stack is the bundled Iceberg REST catalog and, in front of it, Caddy with
// iceberg_idempotency on the in-memory store, both in this process.
type stack struct {
	Catalog    *catalog.Server
	CatalogURL string
	ProxyURL   string
	LogFile    string // Caddy's own log, kept out of the walk-through's output

	dir     string
	ownsDir bool
	catHTTP *http.Server
}

// caddyfileTemplate is the whole Caddy configuration of the demo; the
// proxy's part is the two lines of the site block.
const caddyfileTemplate = `{
	admin off
	auto_https off
	persist_config off
	log {
		output file %q
		level INFO
	}
}

http://127.0.0.1:%d {
	iceberg_idempotency
	reverse_proxy %s
}
`

// startStack starts the catalog on a free loopback port and Caddy on
// proxyPort (0 picks a free one). dir holds the warehouse; "" makes a
// temporary one that Close removes.
func startStack(dir string, proxyPort int) (_ *stack, err error) {
	s := &stack{dir: dir}
	if s.dir == "" {
		if s.dir, err = os.MkdirTemp("", "iceberg-idempotency-demo-"); err != nil {
			return nil, err
		}
		s.ownsDir = true
	}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()

	if s.Catalog, err = catalog.New(catalog.Options{WarehouseDir: s.dir}); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s.CatalogURL = "http://" + ln.Addr().String()
	s.catHTTP = &http.Server{Handler: s.Catalog.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = s.catHTTP.Serve(ln) }()

	if proxyPort == 0 {
		if proxyPort, err = freePort(); err != nil {
			return nil, err
		}
	}
	s.ProxyURL = "http://127.0.0.1:" + strconv.Itoa(proxyPort)
	s.LogFile = s.dir + string(os.PathSeparator) + "caddy.log"
	caddyfile := fmt.Sprintf(caddyfileTemplate, s.LogFile, proxyPort, ln.Addr().String())
	cfg, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		return nil, fmt.Errorf("adapting the Caddyfile: %w", err)
	}
	for _, w := range warnings {
		return nil, fmt.Errorf("Caddyfile warning: %s", w)
	}
	if err := caddy.Load(cfg, true); err != nil {
		return nil, fmt.Errorf("starting Caddy: %w", err)
	}
	return s, waitListening(proxyPort)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitListening returns once Caddy accepts connections; caddy.Load starts
// the listeners before it returns, so this is a short safety net.
func waitListening(port int) error {
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			return c.Close()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("Caddy is not listening on %s: %w", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Close stops Caddy and the catalog and removes a temporary warehouse.
func (s *stack) Close() {
	// caddy.Stop is safe when nothing was loaded.
	_ = caddy.Stop()
	if s.catHTTP != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = s.catHTTP.Shutdown(ctx)
		cancel()
	}
	if s.Catalog != nil {
		if err := s.Catalog.Close(); err != nil && !errors.Is(err, context.Canceled) {
			fmt.Fprintf(os.Stderr, "closing the catalog: %v\n", err)
		}
	}
	if s.ownsDir {
		_ = os.RemoveAll(s.dir)
	}
}
