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
func writeError(w http.ResponseWriter, status int, typ, msg string, retryAfterSeconds int) {
	body, _ := json.Marshal(icebergError{Error: errorModel{Message: msg, Type: typ, Code: status}})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if retryAfterSeconds > 0 {
		h.Set("Retry-After", strconv.Itoa(retryAfterSeconds))
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
