package icebergidempotency

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

// BenchmarkServeHTTP measures what the handler itself costs per request
// on the memory store, in process: the stand-in for reverse_proxy answers
// a 2 KB JSON body, and next_only is that stand-in alone, the floor every
// other case pays too. allocs/op and B/op do not depend on the machine, so
// they show a change to the request path exactly; end-to-end ratios
// against real reverse_proxy are integration/bench's BenchmarkProxy.
func BenchmarkServeHTTP(b *testing.B) {
	reqBody := bytes.Repeat([]byte("x"), 300)
	respBody := bytes.Repeat([]byte(`{"metadata-location":"s3://bucket/warehouse/ns/t/metadata/00002.metadata.json"}`), 24)
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(respBody)))
		w.WriteHeader(http.StatusOK)
		_, err := w.Write(respBody)
		return err
	})
	h := newTestHandler(b, instrumentStore(newMemoryStore(b), "memory"))
	h.inProcessLeases = true // as Provision sets it for the memory store
	request := func(key string) (*httptest.ResponseRecorder, *http.Request) {
		req := httptest.NewRequest(http.MethodPost, "/v1/namespaces", bytes.NewReader(reqBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer token")
		if key != "" {
			req.Header.Set(IdempotencyKeyHeader, key)
		}
		rec := httptest.NewRecorder()
		return rec, caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
	}
	run := func(b *testing.B, keys func(i int) string, serve func(w http.ResponseWriter, r *http.Request) error) {
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			w, r := request(keys(i))
			if err := serve(w, r); err != nil || w.Code != http.StatusOK {
				b.Fatalf("status %d, error %v", w.Code, err)
			}
		}
	}
	noKey := func(int) string { return "" }
	viaHandler := func(w http.ResponseWriter, r *http.Request) error { return h.ServeHTTP(w, r, next) }

	b.Run("next_only", func(b *testing.B) { run(b, noKey, next.ServeHTTP) })
	b.Run("no_key", func(b *testing.B) { run(b, noKey, viaHandler) })
	b.Run("fresh_key", func(b *testing.B) {
		keys := make([]string, 0, 1024)
		run(b, func(i int) string {
			if i%cap(keys) == 0 { // keys are made outside the handler's cost, in batches
				b.StopTimer()
				keys = keys[:0]
				for range cap(keys) {
					keys = append(keys, storetest.NewKey(b))
				}
				b.StartTimer()
			}
			return keys[i%cap(keys)]
		}, viaHandler)
	})
	b.Run("replay", func(b *testing.B) {
		key := storetest.NewKey(b)
		run(b, func(int) string { return key }, viaHandler)
	})
}

// BenchmarkPassThrough is what the handler adds to a request it only looks
// at, with a next handler that does nothing: a read, and a mutation sent
// without a key. Most of a catalog's traffic is such requests, so this is
// the handler's share of them, in ns and without allocations.
func BenchmarkPassThrough(b *testing.B) {
	h := newTestHandler(b, newMemoryStore(b))
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	w := httptest.NewRecorder()
	for _, method := range []string{http.MethodGet, http.MethodPost} {
		r := httptest.NewRequest(method, "/v1/wh/namespaces/ns/tables/t", nil)
		b.Run(method, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if err := h.ServeHTTP(w, r, next); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkClassify is the classification of a create's path, spelled
// plainly (no allocation) and oddly (every reading of it made).
func BenchmarkClassify(b *testing.B) {
	h := &Handler{}
	if err := h.prepare(); err != nil {
		b.Fatal(err)
	}
	for _, path := range []string{"/v1/wh/namespaces/ns/tables", "/v1;x/wh%2Fnamespaces/./ns//../ns/tables;y"} {
		b.Run(path, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if op, _ := h.classifyRequest("POST", path); op != "createTable" {
					b.Fatalf("%s = %q", path, op)
				}
			}
		})
	}
}
