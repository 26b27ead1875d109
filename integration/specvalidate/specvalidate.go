// Package specvalidate checks HTTP responses against the Iceberg REST catalog
// OpenAPI spec with kin-openapi, so that the integration tests can prove the
// iceberg_idempotency proxy (its replays, its own error bodies, the advertised
// lifetime in /v1/config) never hands a client something the spec forbids.
//
// The spec file is used as published, with one fix applied in memory at load
// time: it refers to the parameter `#/components/parameters/etag` where a
// response header object is expected. kin-openapi rightly refuses that, so
// Load copies the parameter into `components/headers/etag` (without the
// parameter-only fields `name` and `in`) and points those references there.
package specvalidate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"
	"go.yaml.in/yaml/v3"
)

// SpecEnv overrides the location of the spec file.
const SpecEnv = "ICEBERG_REST_SPEC"

// SpecPath locates rest-catalog-open-api.yaml: $ICEBERG_REST_SPEC if set,
// else the copy vendored in the integration module (integration/spec/, see
// its README for the origin). The path is derived from this source file, not
// the working directory, so it holds from any package's tests; it never
// leaves the repository, so a plain clone has everything it needs.
func SpecPath() (string, error) {
	if p := os.Getenv(SpecEnv); p != "" {
		return p, nil
	}
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("specvalidate: cannot locate own source file")
	}
	p := filepath.Join(filepath.Dir(file), "..", "spec", "rest-catalog-open-api.yaml")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("specvalidate: vendored spec not found (set %s to a copy): %w", SpecEnv, err)
	}
	return filepath.Clean(p), nil
}

// Validator validates responses against the loaded spec.
type Validator struct {
	doc    *openapi3.T
	router routers.Router
	allow  []Allowance
}

// Allowance excuses a validation failure that is the spec's own
// inconsistency rather than a fault of the server under test. Keep each one
// as narrow as possible: one operation, one status, one message fragment.
type Allowance struct {
	OperationID string // spec operationId, e.g. "createTable"
	Status      int    // response status; 0 matches any
	Contains    string // fragment of the validation error message
	Why         string // what in the spec is wrong, for whoever reads the code
}

// Load reads the spec at path, applies the etag header fix and prepares a
// router. allow lists the tolerated spec inconsistencies.
func Load(path string, allow ...Allowance) (*Validator, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("specvalidate: %w", err)
	}
	patched, err := patchETagHeader(raw)
	if err != nil {
		return nil, fmt.Errorf("specvalidate: patching %s: %w", path, err)
	}
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(patched)
	if err != nil {
		return nil, fmt.Errorf("specvalidate: loading %s: %w", path, err)
	}
	// The spec's server URL is a template for real deployments (its
	// basePath variable even lacks the default OpenAPI requires); the tests
	// talk to loopback ports, so routes match on the path alone.
	doc.Servers = nil
	// Examples are not checked: the spec's Transform schema (type string)
	// carries an array of transforms as its example, which kin-openapi
	// rightly flags. Examples are documentation, never served.
	if err := doc.Validate(loader.Context, openapi3.DisableExamplesValidation()); err != nil {
		return nil, fmt.Errorf("specvalidate: %s is not a valid document: %w", path, err)
	}
	router, err := gorillamux.NewRouter(doc)
	if err != nil {
		return nil, fmt.Errorf("specvalidate: router: %w", err)
	}
	return &Validator{doc: doc, router: router, allow: allow}, nil
}

// patchETagHeader moves the misplaced etag parameter into components/headers
// and repoints the response-header references to it. It works on the YAML
// node tree so every other byte of meaning (key order, integer status keys)
// is kept as written.
func patchETagHeader(raw []byte) ([]byte, error) {
	var root yaml.Node
	if err := yaml.Unmarshal(raw, &root); err != nil {
		return nil, err
	}
	if root.Kind != yaml.DocumentNode || len(root.Content) != 1 {
		return nil, errors.New("not a single YAML document")
	}
	components := mapValue(root.Content[0], "components")
	params := mapValue(components, "parameters")
	etag := mapValue(params, "etag")
	if etag == nil {
		return nil, errors.New("components/parameters/etag not found: the spec changed, revisit the patch")
	}
	header := &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
	for i := 0; i+1 < len(etag.Content); i += 2 {
		if k := etag.Content[i].Value; k == "name" || k == "in" {
			continue // a header object is named by its key and has no location
		}
		header.Content = append(header.Content, etag.Content[i], etag.Content[i+1])
	}
	headers := mapValue(components, "headers")
	if headers == nil {
		headers = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
		components.Content = append(components.Content, scalar("headers"), headers)
	}
	if mapValue(headers, "etag") != nil {
		return nil, errors.New("components/headers/etag already exists: the spec changed, revisit the patch")
	}
	headers.Content = append(headers.Content, scalar("etag"), header)

	n := repointHeaderRefs(root.Content[0], false)
	if n == 0 {
		return nil, errors.New("no header references to #/components/parameters/etag: the spec changed, revisit the patch")
	}
	return yaml.Marshal(&root)
}

const (
	badETagRef  = "#/components/parameters/etag"
	goodETagRef = "#/components/headers/etag"
)

// repointHeaderRefs rewrites $ref values to the etag parameter found
// directly inside a `headers` map; references from `parameters` lists (none
// today) would stay valid and are left alone.
func repointHeaderRefs(n *yaml.Node, inHeaders bool) int {
	count := 0
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			key, val := n.Content[i], n.Content[i+1]
			if inHeaders && val.Kind == yaml.MappingNode {
				if ref := mapValue(val, "$ref"); ref != nil && ref.Value == badETagRef {
					ref.Value = goodETagRef
					count++
					continue
				}
			}
			count += repointHeaderRefs(val, key.Value == "headers")
		}
	case yaml.SequenceNode:
		for _, c := range n.Content {
			count += repointHeaderRefs(c, false)
		}
	}
	return count
}

func mapValue(n *yaml.Node, key string) *yaml.Node {
	if n == nil || n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	return nil
}

func scalar(v string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: v} }

// Failure is one response that did not validate.
type Failure struct {
	Method, Path string // of the request
	Route        string // spec path template and operationId, if routed
	Status       int
	Err          error
}

func (f Failure) String() string {
	return fmt.Sprintf("%s %s (%s) → %d: %v", f.Method, f.Path, f.Route, f.Status, f.Err)
}

// Check validates one response to req. body is the response body as
// received. It returns nil when the response conforms or an Allowance
// covers the failure.
func (v *Validator) Check(req *http.Request, status int, header http.Header, body []byte) *Failure {
	fail := func(route string, err error) *Failure {
		return &Failure{Method: req.Method, Path: req.URL.EscapedPath(), Route: route, Status: status, Err: err}
	}
	// The router matches on the URL alone; give it one without host so
	// that no server entry is needed.
	r := req.Clone(context.Background())
	r.Body = http.NoBody
	route, params, err := v.router.FindRoute(r)
	if errors.Is(err, routers.ErrPathNotFound) {
		// Deployments may leave out the optional {prefix} segment
		// (/v1/namespaces); the spec only has /v1/{prefix}/namespaces.
		if rest, ok := strings.CutPrefix(r.URL.Path, "/v1/"); ok {
			alt := r.Clone(context.Background())
			alt.URL.Path, alt.URL.RawPath = "/v1/_/"+rest, ""
			if rt, ps, altErr := v.router.FindRoute(alt); altErr == nil {
				route, params, err = rt, ps, nil
				r = alt
			}
		}
	}
	if err != nil {
		return fail("no route", err)
	}
	routeName := route.Path
	opID := ""
	if route.Operation != nil {
		opID = route.Operation.OperationID
		routeName += " " + opID
	}
	in := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: &openapi3filter.RequestValidationInput{
			Request:    r,
			PathParams: params,
			Route:      route,
			Options:    &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc},
		},
		Status: status,
		Header: header,
		Options: &openapi3filter.Options{
			// A status the operation does not list is as much a
			// contract breach as a malformed body.
			IncludeResponseStatus: true,
			MultiError:            true,
		},
	}
	in.SetBodyBytes(body)
	if err := openapi3filter.ValidateResponse(context.Background(), in); err != nil {
		if v.allowed(opID, status, err) {
			return nil
		}
		return fail(routeName, err)
	}
	return nil
}

func (v *Validator) allowed(opID string, status int, err error) bool {
	msg := err.Error()
	return slices.ContainsFunc(v.allow, func(a Allowance) bool {
		return a.OperationID == opID && (a.Status == 0 || a.Status == status) && strings.Contains(msg, a.Contains)
	})
}

// Transport is an http.RoundTripper that validates every response it
// carries and records the failures; the response reaches the caller
// unchanged.
type Transport struct {
	Base      http.RoundTripper // http.DefaultTransport if nil
	Validator *Validator

	mu       sync.Mutex
	checked  int
	failures []Failure
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	resp, err := base.RoundTrip(req)
	if err != nil {
		return resp, err
	}
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	t.Observe(req, resp.StatusCode, resp.Header, body)
	return resp, nil
}

// Observe validates a response obtained some other way (e.g. one a test
// sent by hand) and records the outcome like RoundTrip does.
func (t *Transport) Observe(req *http.Request, status int, header http.Header, body []byte) {
	f := t.Validator.Check(req, status, header, body)
	t.mu.Lock()
	defer t.mu.Unlock()
	t.checked++
	if f != nil {
		t.failures = append(t.failures, *f)
	}
}

// Checked is how many responses were validated.
func (t *Transport) Checked() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.checked
}

// Failures returns the responses that did not validate, in order.
func (t *Transport) Failures() []Failure {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.failures)
}
