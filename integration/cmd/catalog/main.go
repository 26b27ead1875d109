// Command catalog runs the test Iceberg REST catalog standalone, for demos
// and manual testing of the Idempotency-Key proxy in front of it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/integration/catalog"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8181", "listen address")
	dir := flag.String("dir", "", "warehouse directory (default: a new temporary directory)")
	prefix := flag.String("prefix", "", "optional catalog prefix advertised in /v1/config")
	flag.Parse()

	if err := run(*addr, *dir, *prefix); err != nil {
		log.Fatal(err)
	}
}

func run(addr, dir, prefix string) error {
	if dir == "" {
		tmp, err := os.MkdirTemp("", "iceberg-catalog-")
		if err != nil {
			return err
		}
		dir = tmp
	}
	srv, err := catalog.New(catalog.Options{WarehouseDir: dir, Prefix: prefix})
	if err != nil {
		return err
	}
	defer srv.Close()

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = hs.Shutdown(shutdown)
	}()

	fmt.Printf("Iceberg REST catalog listening on http://%s (warehouse %s)\n", ln.Addr(), dir)
	if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}

	return nil
}
