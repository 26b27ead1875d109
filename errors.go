package icebergidempotency

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// icebergError is the spec's IcebergErrorResponse body.
type icebergError struct {
	Error errorModel `json:"error"`
}

type errorModel struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Code    int    `json:"code"`
}

// Error types the handler answers with, beside Iceberg's own.
const (
	typeBadRequest         = "BadRequestException"
	typeUnprocessable      = "UnprocessableEntityException"
	typeUnavailable        = "ServiceUnavailableException"
	typeConflict           = "ConflictException"
	typeTooLarge           = "RequestEntityTooLargeException"
	typeURITooLong         = "URITooLongException"
	typeCommitStateUnknown = "CommitStateUnknownException"
	typeServiceFailure     = "ServiceFailureException"
	typeForbidden          = "ForbiddenException"
	typeRequestTimeout     = "RequestTimeoutException"
)

// writeError answers with an Iceberg error body. retryAfter > 0 adds a
// Retry-After header in whole seconds, which is what makes the Iceberg Java
// client retry a POST (on 503) with the same key.
//
// What describes another body goes first: a handle_response route's
// copy_response_headers puts the catalog's answer's headers on the map
// before the module answers for it (a route that writes nothing, or turns
// the answer into an error), and its Content-Encoding: gzip on this plain
// JSON made it unreadable to clients, its ETag named the catalog's bytes
// (until the build after b35c62e). Other headers (CORS, a header directive
// before the module) stay.
func writeError(w http.ResponseWriter, status int, typ, msg string, retryAfterSeconds int) {
	body, _ := json.Marshal(icebergError{Error: errorModel{Message: msg, Type: typ, Code: status}})
	h := w.Header()
	takeTrailers(h)
	dropEntityHeaders(h)
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if retryAfterSeconds > 0 {
		h.Set("Retry-After", strconv.Itoa(retryAfterSeconds))
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
