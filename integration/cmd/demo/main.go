// Command demo shows iceberg_idempotency at work in one command:
//
//	cd integration && go run ./cmd/demo            # walk-through, then exit
//	cd integration && go run ./cmd/demo --serve    # ... then keep both running
//
// It starts the bundled Iceberg REST catalog (temporary warehouse) and, in
// the same process, Caddy with iceberg_idempotency in front of it on the
// in-memory store. Then it drives iceberg-go's REST client through the
// proxy: create a namespace, create a table, and append to it with a table
// commit whose answer is lost, so the client resends it with the same
// Idempotency-Key. It prints what the catalog executed, the statuses,
// whether the retry was replayed, and the snapshot count before and after.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	serve := flag.Bool("serve", false, "after the walk-through, keep the catalog and the proxy running until Ctrl-C")
	port := flag.Int("port", 0, "proxy port on 127.0.0.1 (default: a free one)")
	dir := flag.String("dir", "", "warehouse directory (default: a temporary one, removed at exit)")
	flag.Parse()

	if err := run(*serve, *port, *dir); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func run(serve bool, port int, dir string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	s, err := startStack(dir, port)
	if err != nil {
		return err
	}
	defer s.Close()

	rep, err := walkthrough(ctx, s, os.Stdout)
	if err != nil {
		return err
	}
	if rep.CommitExecutions != 1 || rep.SnapshotsAfter-rep.SnapshotsBefore != 1 {
		return fmt.Errorf("unexpected outcome: %d executions, %d new snapshots", rep.CommitExecutions, rep.SnapshotsAfter-rep.SnapshotsBefore)
	}
	if !serve {
		return nil
	}
	fmt.Println()
	fmt.Println("Serving until Ctrl-C:")
	fmt.Printf("  proxy (Caddy + iceberg_idempotency): %s\n", s.ProxyURL)
	fmt.Printf("  catalog (direct, unguarded):         %s\n", s.CatalogURL)
	fmt.Printf("  Caddy log:                           %s\n", s.LogFile)
	fmt.Println("Try:  curl -s " + s.ProxyURL + "/v1/config")
	<-ctx.Done()
	fmt.Println("\nstopping")
	return nil
}
