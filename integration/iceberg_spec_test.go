package integration_test

// The module's own answers (not the catalog's) must conform to the REST spec
// as well: its 400 for a malformed key and its 422 for a key reused with
// another body are IcebergErrorResponse documents on statuses the spec
// lists for the operation.

import (
	"bytes"
	"io"
	"net/http"
	"testing"

	"github.com/google/uuid"
)

func TestIcebergSpecModuleErrors(t *testing.T) {
	st := startIcebergStack(t, true)
	cl := &http.Client{Transport: st.Spec}
	base := st.Caddy.URL() + "/v1/" + stackPrefix
	post := func(path, key, body string) int {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, base+path, bytes.NewReader([]byte(body)))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := cl.Do(req)
		if err != nil {
			t.Fatalf("POST %s: %v", path, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode
	}

	// A v4 UUID is not a valid key: 400 BadRequestException.
	if s := post("/namespaces", uuid.NewString(), `{"namespace":["spec_ns"]}`); s != http.StatusBadRequest {
		t.Errorf("createNamespace with a v4 key: %d, want 400", s)
	}
	if s := post("/namespaces", "", `{"namespace":["spec_ns"]}`); s != http.StatusOK {
		t.Fatalf("createNamespace: %d, want 200", s)
	}
	// updateProperties lists 422; the module answers a key reused with
	// another body with one.
	key := uuid.Must(uuid.NewV7()).String()
	if s := post("/namespaces/spec_ns/properties", key, `{"updates":{"a":"1"}}`); s != http.StatusOK {
		t.Errorf("updateProperties: %d, want 200", s)
	}
	if s := post("/namespaces/spec_ns/properties", key, `{"updates":{"a":"2"}}`); s != http.StatusUnprocessableEntity {
		t.Errorf("updateProperties, same key, other body: %d, want 422", s)
	}
	// The spec transport validated all four; failures surface at cleanup.
}
