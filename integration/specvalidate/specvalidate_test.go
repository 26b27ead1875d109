package specvalidate

import (
	"net/http"
	"path/filepath"
	"strings"
	"testing"
)

func load(t *testing.T, allow ...Allowance) *Validator {
	t.Helper()
	p, err := SpecPath()
	if err != nil {
		t.Fatal(err)
	}
	v, err := Load(p, allow...)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func jsonHeader() http.Header {
	return http.Header{"Content-Type": []string{"application/json"}}
}

// The validator must reject what the spec forbids, or a passing integration
// run would prove nothing.
func TestCheck(t *testing.T) {
	v := load(t)
	nsOK := `{"namespace":["a"],"properties":{}}`
	errBody := `{"error":{"message":"exists","type":"AlreadyExistsException","code":409}}`
	cases := []struct {
		name         string
		method, path string
		status       int
		body         string
		ok           bool
	}{
		{"createNamespace ok", "POST", "/v1/wh/namespaces", 200, nsOK, true},
		{"createNamespace without prefix", "POST", "/v1/namespaces", 200, nsOK, true},
		{"createNamespace bad body", "POST", "/v1/wh/namespaces", 200, `{"namespace":"a"}`, false},
		{"createNamespace error model", "POST", "/v1/wh/namespaces", 409, errBody, true},
		{"createNamespace error not a model", "POST", "/v1/wh/namespaces", 409, `{"message":"exists"}`, false},
		{"status not in the spec", "POST", "/v1/wh/namespaces", 302, nsOK, false},
		{"unknown route", "POST", "/v1/wh/nothing/here", 200, `{}`, false},
		{"config with lifetime", "GET", "/v1/config", 200,
			`{"defaults":{},"overrides":{},"idempotency-key-lifetime":"PT30M"}`, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, _ := http.NewRequest(c.method, "http://127.0.0.1:1"+c.path, nil)
			f := v.Check(req, c.status, jsonHeader(), []byte(c.body))
			if (f == nil) != c.ok {
				t.Errorf("Check = %v, want ok=%v", f, c.ok)
			}
		})
	}
}

func TestAllowanceIsNarrow(t *testing.T) {
	v := load(t, Allowance{OperationID: "createNamespace", Status: 200, Contains: "namespace", Why: "test"})
	req, _ := http.NewRequest("POST", "http://127.0.0.1:1/v1/wh/namespaces", nil)
	if f := v.Check(req, 200, jsonHeader(), []byte(`{"namespace":"a"}`)); f != nil {
		t.Errorf("allowed failure reported: %v", f)
	}
	req, _ = http.NewRequest("POST", "http://127.0.0.1:1/v1/wh/namespaces/a/properties", nil)
	if f := v.Check(req, 200, jsonHeader(), []byte(`{"updated":"x"}`)); f == nil {
		t.Error("failure of another operation was allowed")
	} else if !strings.Contains(f.Route, "updateProperties") {
		t.Errorf("failure names route %q, want updateProperties", f.Route)
	}
}

// A plain clone must be enough to run the tests: the spec is read from the
// copy vendored inside the integration module, never from beside the
// repository.
func TestSpecPathIsVendored(t *testing.T) {
	t.Setenv(SpecEnv, "")
	p, err := SpecPath()
	if err != nil {
		t.Fatal(err)
	}
	module, err := filepath.Abs("..") // tests run in the package directory
	if err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(module, p)
	if err != nil || rel != filepath.Join("spec", "rest-catalog-open-api.yaml") {
		t.Errorf("SpecPath() = %s, want %s inside the integration module (rel %q, %v)", p, filepath.Join("spec", "rest-catalog-open-api.yaml"), rel, err)
	}
}
