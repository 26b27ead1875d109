package catalog

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"testing"
)

// doJSON sends body (JSON-encoded unless nil) and returns status and raw body.
func doJSON(t *testing.T, method, url string, body any) (int, []byte) {
	t.Helper()
	var rdr io.Reader
	if body != nil {
		data, err := json.Marshal(body)
		if err != nil {
			t.Fatalf("marshal: %v", err)
		}
		rdr = bytes.NewReader(data)
	}
	req, err := http.NewRequest(method, url, rdr)
	if err != nil {
		t.Fatalf("new request: %v", err)
	}
	req.Header.Set("Content-Type", "application/json")
	rsp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer rsp.Body.Close()
	out, err := io.ReadAll(rsp.Body)
	if err != nil {
		t.Fatalf("read body: %v", err)
	}

	return rsp.StatusCode, out
}

// expectError asserts an IcebergErrorResponse with exactly the spec's fields.
func expectError(t *testing.T, status int, body []byte, wantStatus int, wantType string) {
	t.Helper()
	if status != wantStatus {
		t.Fatalf("status = %d, want %d (body %s)", status, wantStatus, body)
	}
	var outer map[string]json.RawMessage
	if err := json.Unmarshal(body, &outer); err != nil {
		t.Fatalf("error body is not JSON: %v: %s", err, body)
	}
	if len(outer) != 1 || outer["error"] == nil {
		t.Fatalf("error body must have exactly the key \"error\": %s", body)
	}
	var model struct {
		Message *string `json:"message"`
		Type    *string `json:"type"`
		Code    *int    `json:"code"`
	}
	if err := json.Unmarshal(outer["error"], &model); err != nil {
		t.Fatalf("error model: %v: %s", err, body)
	}
	if model.Message == nil || *model.Message == "" || model.Type == nil || model.Code == nil {
		t.Fatalf("error model lacks message/type/code: %s", body)
	}
	if *model.Type != wantType || *model.Code != wantStatus {
		t.Fatalf("error = %s/%d, want %s/%d (%s)", *model.Type, *model.Code, wantType, wantStatus, *model.Message)
	}
}

// decodeJSON unmarshals a success body.
func decodeJSON(t *testing.T, body []byte, v any) {
	t.Helper()
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("decode %s: %v", body, err)
	}
}
