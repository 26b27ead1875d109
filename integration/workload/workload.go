// Package workload is the request and the answer the performance tools
// measure, integration/bench and cmd/instructions alike, so that their
// figures describe the same requests: a small Iceberg table commit and its
// CommitTableResponse.
package workload

import (
	"bytes"
	"io"
	"net/http"
)

// CommitBody is about the size of a small table commit request, and
// ResponseBody of its CommitTableResponse (2 KB).
var (
	CommitBody   = []byte(`{"requirements":[{"type":"assert-ref-snapshot-id","ref":"main","snapshot-id":1}],"updates":[{"action":"add-snapshot","snapshot":{"snapshot-id":2,"sequence-number":2,"timestamp-ms":1700000000000,"manifest-list":"s3://bucket/warehouse/ns/t/metadata/snap-2.avro","summary":{"operation":"append"}}}]}`)
	ResponseBody = bytes.Repeat([]byte(`{"metadata-location":"s3://bucket/warehouse/ns/t/metadata/00002.metadata.json"}`), 24)
)

// CommitPath is where commits go (updateTable), ReadPath what reads get
// (loadNamespaceMetadata).
const (
	CommitPath = "/v1/namespaces/ns/tables/t"
	ReadPath   = "/v1/namespaces/ns"
)

// Answer is the upstream: it reads the request and answers ResponseBody
// as JSON.
func Answer(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(ResponseBody)
}

// NewRequest is a request of method to url: a POST carries CommitBody as
// JSON, and key, when set, goes in Idempotency-Key.
func NewRequest(method, url, key string) (*http.Request, error) {
	var body io.Reader
	if method == http.MethodPost {
		body = bytes.NewReader(CommitBody)
	}
	req, err := http.NewRequest(method, url, body)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	return req, nil
}
