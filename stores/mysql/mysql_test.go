package mysql

import (
	"bytes"
	"context"
	"math/rand/v2"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s, _ := openStore(t, nil)
		return storetest.Harness{Store: s, Advance: time.Sleep}
	})
}

func TestBinaryBodyRoundTrip(t *testing.T) {
	s, _ := openStore(t, nil)
	ctx := context.Background()
	body := make([]byte, 0, 1<<20+512)
	for i := range 512 {
		body = append(body, byte(i)) // every byte value, NUL and 0xFF included
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for len(body) < cap(body) {
		body = append(body, byte(rng.Uint32()))
	}
	body = append(body, 0, 0xff, 0)
	key := storetest.NewKey(t)
	r := storetest.Reservation(key, storetest.Long, storetest.Long)
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	resp := stores.Response{Status: 201, Header: http.Header{"Content-Type": {"application/octet-stream"}, "X-Multi": {"a", "b"}}, Body: body}
	if err := s.Finalize(ctx, key, r.Owner, resp); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Load(ctx, key)
	if err != nil || rec == nil || !bytes.Equal(rec.Response.Body, body) {
		t.Fatalf("Load: body differs (err %v)", err)
	}
	if got := rec.Response.Header["X-Multi"]; len(got) != 2 || got[0] != "a" || got[1] != "b" {
		t.Fatalf("headers = %v", rec.Response.Header)
	}
	res, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, storetest.Long))
	if err != nil || res.Existing == nil || !bytes.Equal(res.Existing.Response.Body, body) || res.Existing.Response.Status != 201 {
		t.Fatalf("replay: body differs (err %v)", err)
	}
}

func TestReserveOverExpiredRebinds(t *testing.T) {
	s, _ := openStore(t, nil)
	ctx := context.Background()
	key := storetest.NewKey(t)
	if _, err := s.Reserve(ctx, storetest.Reservation(key, storetest.Long, 300*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond)
	r := storetest.Reservation(key, storetest.Long, storetest.Long)
	r.Binding.Path = "/v1/other"
	if res, err := s.Reserve(ctx, r); err != nil || !res.Reserved {
		t.Fatalf("Reserve over expired = %+v, %v", res, err)
	}
	rec, err := s.Load(ctx, key)
	if err != nil || rec.Binding != r.Binding || rec.Owner != r.Owner || rec.Abandoned || rec.Response != nil {
		t.Fatalf("record = %+v, %v", rec, err)
	}
}

func TestKeyTooLong(t *testing.T) {
	s, _ := openStore(t, nil)
	r := storetest.Reservation(storetest.NewKey(t)+"x", storetest.Long, storetest.Long)
	if _, err := s.Reserve(context.Background(), r); err == nil {
		t.Fatal("a 37-byte key was accepted")
	}
}
