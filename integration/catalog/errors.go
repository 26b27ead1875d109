package catalog

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/apache/iceberg-go"
	icecat "github.com/apache/iceberg-go/catalog"
	"github.com/apache/iceberg-go/table"
)

// Error types of the REST spec's ErrorModel. Clients (iceberg-go, Java,
// PyIceberg) branch on the status code first and on these names second, so
// they must be spelled exactly.
const (
	typeBadRequest         = "BadRequestException"
	typeNoSuchTable        = "NoSuchTableException"
	typeNoSuchNamespace    = "NoSuchNamespaceException"
	typeNoSuchView         = "NoSuchViewException"
	typeAlreadyExists      = "AlreadyExistsException"
	typeNamespaceNotEmpty  = "NamespaceNotEmptyException"
	typeCommitFailed       = "CommitFailedException"
	typeCommitUnknown      = "CommitStateUnknownException"
	typeUnprocessable      = "UnprocessableEntityException"
	typeServiceUnavailable = "ServiceUnavailableException"
	typeNotImplemented     = "NotImplementedException"
	typeInternal           = "InternalServerError"
	typeNotFound           = "NotFoundException"
)

// apiError is an error that already knows its HTTP status and spec type.
type apiError struct {
	status int
	typ    string
	msg    string
}

func (e *apiError) Error() string { return e.typ + ": " + e.msg }

func newAPIError(status int, typ, format string, args ...any) *apiError {
	return &apiError{status: status, typ: typ, msg: fmt.Sprintf(format, args...)}
}

func badRequest(format string, args ...any) error {
	return newAPIError(http.StatusBadRequest, typeBadRequest, format, args...)
}

// commitFailed marks a failed requirement; the client must refresh and retry.
func commitFailed(err error) error {
	return newAPIError(http.StatusConflict, typeCommitFailed, "%s", err.Error())
}

// errorModel and errorResponse are the spec's ErrorModel and
// IcebergErrorResponse.
type errorModel struct {
	Message string   `json:"message"`
	Type    string   `json:"type"`
	Code    int      `json:"code"`
	Stack   []string `json:"stack,omitempty"`
}

type errorResponse struct {
	Error errorModel `json:"error"`
}

// toAPIError maps an error from iceberg-go (or from this package) to the
// status and type the spec prescribes. iceberg-go's SQL catalog reports most
// conditions through sentinel errors, but failed commit requirements come back
// as plain errors whose text starts with "requirement failed", so those are
// recognised by text as a last resort.
func toAPIError(err error) *apiError {
	var ae *apiError
	if errors.As(err, &ae) {
		return ae
	}
	msg := err.Error()
	switch {
	case errors.Is(err, icecat.ErrNoSuchTable):
		return &apiError{http.StatusNotFound, typeNoSuchTable, msg}
	case errors.Is(err, icecat.ErrNoSuchView):
		return &apiError{http.StatusNotFound, typeNoSuchView, msg}
	case errors.Is(err, icecat.ErrNoSuchNamespace):
		return &apiError{http.StatusNotFound, typeNoSuchNamespace, msg}
	case errors.Is(err, icecat.ErrTableAlreadyExists),
		errors.Is(err, icecat.ErrViewAlreadyExists),
		errors.Is(err, icecat.ErrNamespaceAlreadyExists):
		return &apiError{http.StatusConflict, typeAlreadyExists, msg}
	case errors.Is(err, icecat.ErrNamespaceNotEmpty):
		return &apiError{http.StatusConflict, typeNamespaceNotEmpty, msg}
	case errors.Is(err, table.ErrCommitFailed), isRequirementFailure(err):
		return &apiError{http.StatusConflict, typeCommitFailed, msg}
	case errors.Is(err, iceberg.ErrNotImplemented):
		return &apiError{http.StatusNotImplemented, typeNotImplemented, msg}
	case errors.Is(err, iceberg.ErrInvalidArgument),
		errors.Is(err, icecat.ErrInvalidIdentifier),
		errors.Is(err, table.ErrInvalidRequirement),
		errors.Is(err, iceberg.ErrInvalidSchema),
		errors.Is(err, iceberg.ErrInvalidPartitionSpec):
		return &apiError{http.StatusBadRequest, typeBadRequest, msg}
	default:
		return &apiError{http.StatusInternalServerError, typeInternal, msg}
	}
}

// isRequirementFailure recognises iceberg-go's requirement Validate errors,
// which are created with errors.New/fmt.Errorf and carry no sentinel, also
// when the SQL catalog wraps them.
func isRequirementFailure(err error) bool {
	return strings.Contains(strings.ToLower(err.Error()), "requirement failed")
}

// writeError sends the IcebergErrorResponse body for err. The message never
// contains request bodies: only error text from the catalog.
func writeError(w http.ResponseWriter, err error) {
	ae := toAPIError(err)
	writeJSON(w, ae.status, errorResponse{Error: errorModel{Message: ae.msg, Type: ae.typ, Code: ae.status}})
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	data, err := json.Marshal(body)
	if err != nil {
		status = http.StatusInternalServerError
		data, _ = json.Marshal(errorResponse{Error: errorModel{
			Message: "encoding response: " + err.Error(), Type: typeInternal, Code: status,
		}})
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(data)
}
