package icebergidempotency

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// switchingCatalog executes every request and, when asked to switch
// protocols, does so (101) and answers in the new protocol, as a catalog
// on a server that speaks h2c would. A stand-in: the catalogs the
// integration tests run do not switch protocols.
func switchingCatalog(t *testing.T) *countingCatalog {
	return newCountingCatalog(t, func(w http.ResponseWriter, r *http.Request) {
		if up := r.Header.Get("Upgrade"); up != "" {
			conn, buf, err := http.NewResponseController(w).Hijack()
			if err != nil {
				t.Errorf("hijack: %v", err)
				return
			}
			defer conn.Close()
			fmt.Fprintf(buf, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", up)
			_, _ = buf.WriteString("the answer, in frames of the new protocol")
			_ = buf.Flush()
			time.Sleep(50 * time.Millisecond)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"dropped":true}`)
	})
}

// sendRaw sends one HTTP/1.1 request as text on a new connection to front
// and returns the answer's status line.
func sendRaw(t *testing.T, front *httptest.Server, request string) string {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(front.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, request); err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line)
}

// A keyed request that asks to switch protocols (the JDK's HTTP client asks
// for h2c on http://) reaches the catalog without the ask, and its answer
// is stored as any other. Before, the catalog switched protocols after
// executing it, the client got the new protocol's bytes without a status
// line, the key was released (101 is not a final answer), and the retry
// executed the drop a second time.
func TestUpgradeAskIsNotPassedOn(t *testing.T) {
	catalog := switchingCatalog(t)
	front := handlerFront(t, catalog)

	key := storetest.NewKey(t)
	const path = "/v1/wh/namespaces/ns/tables/t"
	first := sendRaw(t, front, "DELETE "+path+" HTTP/1.1\r\nHost: catalog\r\nIdempotency-Key: "+key+
		"\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
	if first != "HTTP/1.1 200 OK" {
		t.Fatalf("first answer's status line = %q, want HTTP/1.1 200 OK", first)
	}
	req, _ := http.NewRequest("DELETE", front.URL+path, nil)
	req.Header.Set(IdempotencyKeyHeader, key)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if n := catalog.executed.Load(); n != 1 || res.Header.Get(ReplayedHeader) != "true" {
		t.Fatalf("retry = %d (replayed %q), catalog executed %d times; want the stored answer, once",
			res.StatusCode, res.Header.Get(ReplayedHeader), n)
	}

	// GET /v1/config asking for h2c gets its advertisement, in HTTP/1.1.
	cfg := sendRaw(t, front, "GET /v1/config HTTP/1.1\r\nHost: catalog\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
	if cfg != "HTTP/1.1 200 OK" {
		t.Fatalf("config answer's status line = %q, want HTTP/1.1 200 OK", cfg)
	}
}
