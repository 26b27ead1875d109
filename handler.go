package icebergidempotency

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"golang.org/x/net/http/httpguts"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
)

// Defaults of the handler's options.
const (
	DefaultLifetime         = 30 * time.Minute
	DefaultGrace            = 5 * time.Minute
	DefaultInFlightWait     = 10 * time.Second
	DefaultExecutionTimeout = 60 * time.Second
	DefaultLease            = 30 * time.Second
	DefaultRetryAfter       = 1 * time.Second
	DefaultMaxRequestSize   = 16 << 20
	DefaultMaxResponseSize  = 16 << 20
	DefaultPrincipal        = "{http.request.header.Authorization}"
)

var (
	defaultFinalizeStatuses = []string{"2xx", "4xx"}
	defaultReleaseStatuses  = []string{"5xx", "401", "403", "408", "419", "421", "425", "429", "499"}
	defaultReplayHeaders    = []string{"Content-Type", "ETag", "Location", "Cache-Control"}
)

// Handler gives the Iceberg REST catalog behind it the spec's
// Idempotency-Key semantics: the first request with a key executes, and every
// retry with that key gets the stored final response instead of executing
// again. Place it before reverse_proxy.
type Handler struct {
	// The store that keeps idempotency records. Default: the in-memory store
	// (`{"backend": "memory"}`), which is right for a single Caddy node.
	StoreRaw json.RawMessage `json:"store,omitempty" caddy:"namespace=iceberg_idempotency.stores inline_key=backend"`

	// How long clients may retry with a key; advertised in GET /v1/config as
	// the top-level "idempotency-key-lifetime". Default: 30m.
	Lifetime caddy.Duration `json:"lifetime,omitempty"`

	// Extra time a record is kept past Lifetime, for clock skew and slow
	// retries; 0 keeps records Lifetime past their execution (see
	// recordTTL). Default: 5m (when unset).
	Grace *caddy.Duration `json:"grace,omitempty"`

	// How long a duplicate of a request that is still executing waits for
	// its result before it is answered with InFlightStatus. Default: 10s.
	InFlightWait caddy.Duration `json:"in_flight_wait,omitempty"`

	// Status for a duplicate still in flight after InFlightWait: 503 (with
	// Retry-After, which the Iceberg Java client retries with the same key)
	// or 409 (the IETF draft's choice; Iceberg clients read 409 as a
	// conflict). Default: 503.
	InFlightStatus int `json:"in_flight_status,omitempty"`

	// Retry-After sent with 503 answers, rounded up to whole seconds.
	// Default: 1s.
	RetryAfter caddy.Duration `json:"retry_after,omitempty"`

	// Upper bound of the upstream call once a key is reserved. The call is
	// detached from the client's connection, so a client that disconnects
	// does not cancel a commit half-way; this bounds it instead. Default: 60s.
	ExecutionTimeout caddy.Duration `json:"execution_timeout,omitempty"`

	// How long a reservation holds without a heartbeat. The owner renews it
	// every quarter of it while the upstream call runs (a failed renewal
	// again a thirtieth of it later); a record whose lease
	// lapsed was abandoned (its node died). On the PostgreSQL and MySQL
	// stores it must be at least 4 times statement_timeout, on Redis 4
	// times the largest of its timeouts, so that a renewal taking its whole
	// timeout still lands in time; on every store at least 3ms.
	// Default: 30s.
	Lease caddy.Duration `json:"lease,omitempty"`

	// What to do with a duplicate of an abandoned request: "unknown" answers
	// 500 saying the outcome is unknown (Iceberg clients then neither retry
	// nor delete files); "reexecute" takes the reservation over and executes
	// again. Default: unknown.
	Abandoned string `json:"abandoned,omitempty"`

	// Largest request body accepted on a keyed mutation, in bytes; larger
	// ones get 413. Default: 16 MiB.
	MaxRequestSize int64 `json:"max_request_size,omitempty"`

	// Largest response stored, in bytes. A larger final response is
	// delivered untouched and not stored; the catalog executed, so the
	// key's outcome is unknown (logged as a warning), and a retry gets the
	// abandoned policy's answer: 500 under "unknown", a second execution
	// under "reexecute". Default: 16 MiB.
	MaxResponseSize int64 `json:"max_response_size,omitempty"`

	// UUID versions an Idempotency-Key may have, each 1 to 8 (RFC 9562).
	// The Iceberg REST spec asks for version 7, but some clients send
	// others: DuckDB's Iceberg extension sends version 4 keys, and catalogs
	// such as Lakekeeper accept any version. A key of another version is
	// refused with 400. Whatever the version, the key must be in the
	// hyphenated 36-character form with the RFC 9562 variant. In the
	// Caddyfile, `any` stands for 1 to 8. Default: [7].
	KeyVersions []int `json:"key_versions,omitempty"`

	// Reject mutations without an Idempotency-Key (400). Default: false.
	RequireKey bool `json:"require_key,omitempty"`

	// Path the catalog is mounted under, e.g. "/api/catalog" for
	// "/api/catalog/v1/...". Default: none.
	BasePath string `json:"base_path,omitempty"`

	// Placeholder expression naming who sends a request; keys are bound to
	// its SHA-256 (its HMAC-SHA-256 under Secret, when set), so one
	// principal can never replay another's response. Use
	// "{http.auth.user.id}" when Caddy authenticates. Default:
	// "{http.request.header.Authorization}". It must hold a placeholder:
	// a constant would make every caller one principal.
	Principal string `json:"principal,omitempty"`

	// Statuses whose responses are stored and replayed, as codes or classes.
	// It must cover every 2xx (a success not stored would be executed again
	// by its retry) and may not hold 1xx or 5xx (the Iceberg REST spec does
	// not finalize 5xx). Default: ["2xx", "4xx"].
	FinalizeStatuses []string `json:"finalize_statuses,omitempty"`

	// Statuses whose key is released so a retry executes again; they win
	// over FinalizeStatuses. Statuses in neither list are released too. No
	// 2xx may be released. An answer that says the commit may have landed
	// (see commitStateUnknown) leaves the key unknown whatever this holds.
	// Default: ["5xx", "401", "403", "408", "419", "421", "425", "429", "499"].
	// 421 (Misdirected Request) is one a client may send again "whether or
	// not the request method is idempotent" (RFC 9110, 15.5.20): the
	// server did not process it. Stored, every retry heard it for the
	// key's life.
	ReleaseStatuses []string `json:"release_statuses,omitempty"`

	// Response headers stored and replayed besides the body. Content-Encoding
	// is always kept when present, since the body cannot be read without it.
	// Content-Length, hop-by-hop headers, Set-Cookie and Authorization are
	// refused.
	// Default: ["Content-Type", "ETag", "Location", "Cache-Control"].
	ReplayHeaders []string `json:"replay_headers,omitempty"`

	// When the store fails, pass requests through unguarded (logged) instead
	// of answering 503. Default: false (fail closed).
	FailOpen bool `json:"fail_open,omitempty"`

	// Secret that protects records at rest: stored responses are sealed
	// with AES-256-GCM and principals and request fingerprints become
	// HMAC-SHA-256, all under keys derived from it (HKDF-SHA-256). Give a
	// placeholder such as "{env.ICEBERG_IDEMPOTENCY_SECRET}" or
	// "{file./run/secrets/idem}": it is expanded at provision, so the
	// configuration (the admin API, `caddy adapt`) holds only the
	// placeholder. Nodes sharing a store need the same secret. Default:
	// none (records stored in clear; a store outside the process logs a
	// warning).
	Secret string `json:"secret,omitempty"`

	// Secrets that were Secret before a rotation, as placeholders too:
	// records sealed under them still replay and their retries still match,
	// while new records use Secret. Drop one once lifetime + grace +
	// execution_timeout + lease has passed since it was replaced.
	// Default: none.
	PreviousSecrets []string `json:"previous_secrets,omitempty"`

	// Refuse to start with a store outside the process (PostgreSQL, MySQL,
	// Redis) when no Secret is set, instead of warning that records are stored in
	// clear. Default: false.
	RequireSecret bool `json:"require_secret,omitempty"`

	store    stores.Store
	pooled   *pooledStore // store's pool entry; nil in tests that set store directly
	storeKey string
	// storeLabel is storeKey as Provision set it, for log lines: requests
	// read it, so nothing writes it after Provision (see storeName).
	storeLabel string
	// retention is the floor of the records' TTL on the store's table
	// (see retentionFloors); releaseRetention lets this config's hold go.
	retention        *retentionFloor
	releaseRetention func()
	keyVersions      keyVersionSet // KeyVersions as a set
	basePath         string        // BasePath, normalized like request paths
	finalizeWindow   time.Duration // how long a failing Finalize is retried; tests shorten it
	settleWindow     time.Duration // how long a lost write may still commit (undoLostReply); tests shorten it
	repairWindow     time.Duration // how long undoLostReply retries a failing undo (lostReplyWindow); tests shorten it
	repairs          *repairQueue  // runs undoLostReply's undos, at most maxRepairs at once
	finalizeSet      statusSet
	releaseSet       statusSet
	replayHdrs       []string
	keys             keyring // derived from Secret and PreviousSecrets; never marshalled
	logger           *zap.Logger
	// principalHeader is the header Principal names when it is one
	// {http.request.header.*} placeholder (see principalOf), else "".
	principalHeader string
	// inProcessLeases is set for the memory store, whose records only
	// this process's requests hold: see executionLease.
	inProcessLeases bool
	// outsideBaseWarned is set (atomically) once catalog paths outside
	// base_path were warned of.
	outsideBaseWarned int32
	// keyBelowPrefixWarned and configBelowPrefixWarned are set
	// (atomically) once a keyed mutation, or a config request, below a
	// prefix the handler does not know was warned of.
	keyBelowPrefixWarned, configBelowPrefixWarned int32
	// nestedWarned is set (atomically) once a request passed through
	// because another handler guards its key in the same store.
	nestedWarned int32
	// askedAfterAnswerWarned is set (atomically) once a catalog call was
	// seen asking an upstream after an answer came back: see
	// warnAskedAfterAnswer.
	askedAfterAnswerWarned int32
	// resentWarned is set (atomically) once a catalog call was seen sent
	// again after an attempt that was written and never answered: see
	// warnResent.
	resentWarned int32
	// overrideResentWarned: the same, for a GET, HEAD, OPTIONS or TRACE
	// that X-HTTP-Method-Override makes a mutation (see
	// warnOverrideResent).
	overrideResentWarned int32
	// bodiesFullWarned is set (atomically) once a keyed request was
	// refused because the held bodies filled max_buffered_bytes.
	bodiesFullWarned int32
	// advertised is the config's shortest lifetime (App.noteLifetime),
	// which GET /v1/config advertises; nil in tests that build a handler
	// without an app, which advertise their own.
	advertised *atomic.Int64
	// tooLargeWarned is set (atomically) once a keyed request was refused
	// because its body passed max_request_size.
	tooLargeWarned int32
	// unknownFullWarned is when (seconds since warnEpoch, plus one; 0:
	// never) a keyed request was last warned of as refused because the
	// memory store holds max_entries records whose outcome is unknown: see
	// unknownFull.
	unknownFullWarned int32
	// bodies is the app's budget of held request bodies; nil (no bound)
	// in tests that build a handler without an app.
	bodies *bodyBudget
}

var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.iceberg_idempotency",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision prepares the configuration and acquires the shared store.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if err := h.prepare(); err != nil {
		return err
	}
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}

	var provider StoreProvider = &MemoryStore{}
	if h.StoreRaw != nil {
		mod, err := ctx.LoadModule(h, "StoreRaw")
		if err != nil {
			return fmt.Errorf("loading store: %w", err)
		}
		provider = mod.(StoreProvider)
	} else if err := provider.(caddy.Provisioner).Provision(ctx); err != nil {
		return err
	}
	if err := h.checkAtRest(provider); err != nil {
		return err
	}
	// A lease below the least allowed gets that error, not advice to lower
	// the store's timeouts below it.
	if err := h.validateOption("lease"); err != nil {
		return err
	}
	if err := checkLease(time.Duration(h.Lease), provider); err != nil {
		return err
	}
	h.settleWindow = settleWindowFor(provider)
	_, h.inProcessLeases = provider.(*MemoryStore)

	appIface, err := ctx.App("iceberg_idempotency")
	if err != nil {
		return fmt.Errorf("loading iceberg_idempotency app: %w", err)
	}
	app := appIface.(*App)
	h.bodies = &app.bodies
	app.noteLifetime(time.Duration(h.Lifetime))
	h.advertised = &app.advertised
	if err := checkBufferedBytes(app.MaxBufferedBytes, h.MaxRequestSize); err != nil {
		return err
	}

	h.pooled, err = acquireStore(ctx, provider)
	if err != nil {
		return err
	}
	// Requests time their store calls through the decorator; the app
	// tracks the pool entry itself, and times its purges the same way.
	h.store = instrumentStore(h.pooled, h.pooled.backend)
	h.storeKey = provider.StoreKey()
	h.storeLabel = h.storeKey
	h.retention, h.releaseRetention = holdRetention(placeOf(h.storeKey), time.Duration(h.Lifetime+*h.Grace))
	app.track(h.storeKey, h.pooled)
	return nil
}

// checkAtRest refuses (require_secret) or warns about, once per
// provisioning, a store outside the process that would keep records in
// clear, where backups, replicas and database administrators read them.
// The memory store needs no secret: nothing it holds leaves the process.
func (h *Handler) checkAtRest(provider StoreProvider) error {
	if _, inProcess := provider.(*MemoryStore); inProcess || h.keys.current != nil {
		return nil
	}
	if h.RequireSecret {
		return errors.New("require_secret: the store keeps records outside this process, but no secret is set")
	}
	h.logger.Warn("records are stored in clear: response bodies (which may hold vended storage credentials) and unkeyed hashes of principals; set secret to encrypt them",
		zap.String("store", provider.StoreKey()))
	return nil
}

// prepare sets defaults and derives what requests need from the options.
// It touches nothing outside the handler, so tests use it as Provision does.
func (h *Handler) prepare() error {
	if h.logger == nil {
		h.logger = zap.NewNop()
	}
	h.setDefaults()
	h.finalizeWindow = defaultFinalizeWindow
	h.settleWindow = defaultSettleWindow
	h.repairWindow = lostReplyWindow
	h.repairs = new(repairQueue)
	h.basePath = ""
	if h.BasePath != "" {
		h.basePath = normalizePath(h.BasePath)
	}
	h.principalHeader = headerPlaceholder(h.Principal)
	h.keyVersions = newKeyVersionSet(h.KeyVersions)
	var err error
	if h.finalizeSet, err = parseStatusSet(h.FinalizeStatuses); err != nil {
		return fmt.Errorf("finalize_statuses: %w", err)
	}
	if h.releaseSet, err = parseStatusSet(h.ReleaseStatuses); err != nil {
		return fmt.Errorf("release_statuses: %w", err)
	}
	// Content-Encoding is always kept: the stored body is unreadable
	// without it. So is Content-Type: without it Go's server types a replay
	// from its bytes (text/plain for JSON), which a replay_headers that
	// left it out (JSON's [] too) did until the build after b35c62e.
	h.replayHdrs = []string{"Content-Encoding", "Content-Type"}
	for _, name := range h.ReplayHeaders {
		if name = http.CanonicalHeaderKey(name); !slices.Contains(h.replayHdrs, name) {
			h.replayHdrs = append(h.replayHdrs, name)
		}
	}
	keys, warnings, err := h.prepareKeys()
	if err != nil {
		return err
	}
	h.keys = keys
	for _, w := range warnings {
		h.logger.Warn(w)
	}
	return nil
}

func (h *Handler) setDefaults() {
	setDuration(&h.Lifetime, DefaultLifetime)
	if h.Grace == nil {
		grace := caddy.Duration(DefaultGrace)
		h.Grace = &grace
	}
	setDuration(&h.InFlightWait, DefaultInFlightWait)
	setDuration(&h.RetryAfter, DefaultRetryAfter)
	setDuration(&h.ExecutionTimeout, DefaultExecutionTimeout)
	setDuration(&h.Lease, DefaultLease)
	if h.InFlightStatus == 0 {
		h.InFlightStatus = http.StatusServiceUnavailable
	}
	if h.Abandoned == "" {
		h.Abandoned = abandonedUnknown
	}
	if h.MaxRequestSize == 0 {
		h.MaxRequestSize = DefaultMaxRequestSize
	}
	if h.MaxResponseSize == 0 {
		h.MaxResponseSize = DefaultMaxResponseSize
	}
	if h.Principal == "" {
		h.Principal = DefaultPrincipal
	}
	if h.FinalizeStatuses == nil {
		h.FinalizeStatuses = defaultFinalizeStatuses
	}
	if h.ReleaseStatuses == nil {
		h.ReleaseStatuses = defaultReleaseStatuses
	}
	if h.ReplayHeaders == nil {
		h.ReplayHeaders = defaultReplayHeaders
	}
	if len(h.KeyVersions) == 0 {
		h.KeyVersions = []int{7}
	}
}

func setDuration(d *caddy.Duration, def time.Duration) {
	if *d == 0 {
		*d = caddy.Duration(def)
	}
}

// Abandoned policies.
const (
	abandonedUnknown   = "unknown"
	abandonedReexecute = "reexecute"
)

// validatedOptions are the options Validate checks, in the order it
// reports them.
var validatedOptions = []string{
	"lifetime", "grace", "in_flight_wait", "retry_after", "execution_timeout", "lease", "in_flight_status",
	"abandoned", "key_versions", "max_request_size", "max_response_size", "base_path", "finalize_statuses", "release_statuses",
	"principal", "replay_headers", "secret", "previous_secrets",
}

// Validate checks the configuration.
func (h *Handler) Validate() error {
	for _, opt := range validatedOptions {
		if err := h.validateOption(opt); err != nil {
			return err
		}
	}
	return nil
}

// validateOption checks the value of one option, named as in the Caddyfile
// and JSON; an unset option (its zero value, before defaults) passes. It is
// the one place where option values are checked: Validate runs it for every
// option, and the Caddyfile parser for each option it reads, to name the
// line.
func (h *Handler) validateOption(opt string) error {
	switch opt {
	case "lifetime":
		// A retry after the record expired executes again; in JSON a bare
		// number is nanoseconds, so "lifetime": 1800 meant 1.8µs.
		if h.Lifetime > 0 && time.Duration(h.Lifetime) < minLifetime {
			return fmt.Errorf("lifetime must be at least %v, got %v: a retry after a record expires executes again (in JSON a bare number is nanoseconds: write \"30m\")", minLifetime, time.Duration(h.Lifetime))
		}
		return nonNegative(opt, h.Lifetime)
	case "grace":
		if h.Grace != nil {
			return nonNegative(opt, *h.Grace)
		}
	case "in_flight_wait":
		return nonNegative(opt, h.InFlightWait)
	case "retry_after":
		return nonNegative(opt, h.RetryAfter)
	case "execution_timeout":
		// In JSON a bare number is nanoseconds: "execution_timeout": 60
		// cut every catalog call off before it went out, and each keyed
		// mutation answered 504 with its key unknown for the lifetime.
		if h.ExecutionTimeout > 0 && time.Duration(h.ExecutionTimeout) < minExecutionTimeout {
			return fmt.Errorf("execution_timeout must be at least %v, got %v: every catalog call would be cut off, its key left unknown (in JSON a bare number is nanoseconds: write \"60s\")", minExecutionTimeout, time.Duration(h.ExecutionTimeout))
		}
		return nonNegative(opt, h.ExecutionTimeout)
	case "lease":
		if h.Lease != 0 && time.Duration(h.Lease) < 3*time.Millisecond {
			return fmt.Errorf("lease must be at least 3ms, got %v", time.Duration(h.Lease))
		}
		return nonNegative(opt, h.Lease)
	case "in_flight_status":
		if h.InFlightStatus != 0 && h.InFlightStatus != http.StatusServiceUnavailable && h.InFlightStatus != http.StatusConflict {
			return fmt.Errorf("in_flight_status must be 503 or 409, got %d", h.InFlightStatus)
		}
	case "abandoned":
		if h.Abandoned != "" && h.Abandoned != abandonedUnknown && h.Abandoned != abandonedReexecute {
			return fmt.Errorf("abandoned must be %q or %q, got %q", abandonedUnknown, abandonedReexecute, h.Abandoned)
		}
	case "key_versions":
		for i, v := range h.KeyVersions {
			if v < minKeyVersion || v > maxKeyVersion {
				return fmt.Errorf("key_versions[%d] must be a UUID version from %d to %d, got %d", i, minKeyVersion, maxKeyVersion, v)
			}
			if j := slices.Index(h.KeyVersions[:i], v); j >= 0 {
				return fmt.Errorf("key_versions[%d] repeats key_versions[%d] (%d)", i, j, v)
			}
		}
	case "max_request_size":
		if h.MaxRequestSize < 0 || h.MaxRequestSize > maxSize {
			return fmt.Errorf("max_request_size must be positive and at most 1TiB, got %d", h.MaxRequestSize)
		}
	case "max_response_size":
		if h.MaxResponseSize < 0 || h.MaxResponseSize > maxSize {
			return fmt.Errorf("max_response_size must be positive and at most 1TiB, got %d", h.MaxResponseSize)
		}
	case "base_path":
		if h.BasePath == "/" {
			return fmt.Errorf("base_path %q names no prefix: for a catalog at /v1, leave base_path out", h.BasePath)
		}
		if h.BasePath != "" && (len(h.BasePath) < 2 || !strings.HasPrefix(h.BasePath, "/") || strings.HasSuffix(h.BasePath, "/")) {
			return fmt.Errorf("base_path must start with / and not end with /, got %q", h.BasePath)
		}
		// Paths below it must start with /v1/ to be classified: a base
		// path that takes /v1 in, or normalizes to none at all, left every
		// mutation unguarded without a word. (Other spellings normalize to
		// the path they stand for, as request paths do.)
		if h.BasePath == "" {
			break
		}
		// Compared with request paths as written: a placeholder in it was
		// taken literally, no path was below it, and the mutations under
		// the prefix meant passed unguarded.
		if strings.ContainsAny(h.BasePath, "{}") {
			return fmt.Errorf("base_path is compared with request paths as written and takes no placeholders, got %q: write the prefix itself", h.BasePath)
		}
		// Likewise a matcher's wildcard, a query or a fragment: no request
		// path was below them. (Other characters are compared decoded,
		// so a raw "é" or space meets its escapes.)
		if strings.Contains(h.BasePath, "*") {
			return fmt.Errorf("base_path is a path prefix, not a matcher, got %q: leave out the *", h.BasePath)
		}
		if i := strings.IndexAny(h.BasePath, "?#"); i >= 0 {
			return fmt.Errorf("base_path is a path prefix, got %q: a query or fragment (from %q on) is not part of a path", h.BasePath, h.BasePath[i:i+1])
		}
		if i := strings.IndexFunc(h.BasePath, unicode.IsControl); i >= 0 {
			return fmt.Errorf("base_path holds a control character at byte %d, got %q", i, h.BasePath)
		}
		switch normal := normalizePath(h.BasePath); {
		case normal == "/":
			return fmt.Errorf("base_path %q names no prefix: for a catalog at /v1, leave base_path out", h.BasePath)
		case strings.EqualFold(path.Base(normal), "v1"): // paths meet it without case
			return fmt.Errorf("base_path is the part of the path before /v1, got %q: leave /v1 out", h.BasePath)
		}
	case "finalize_statuses":
		if h.FinalizeStatuses == nil {
			break
		}
		set, err := parseStatusSet(h.FinalizeStatuses)
		if err == nil {
			err = set.checkFinalize()
		}
		if err != nil {
			return fmt.Errorf("finalize_statuses: %w", err)
		}
	case "release_statuses":
		set, err := parseStatusSet(h.ReleaseStatuses)
		if err == nil {
			err = set.checkRelease()
		}
		if err != nil {
			return fmt.Errorf("release_statuses: %w", err)
		}
	case "principal":
		// A value without a placeholder is the same for every caller, who
		// could then replay each other's answers: most likely a
		// placeholder written without its braces.
		if h.Principal != "" && !perRequestPlaceholder(h.Principal) {
			return fmt.Errorf("principal %q has no placeholder that differs from request to request, so every caller would be one principal and could replay another's answers: write one such as {http.auth.user.id} or {http.request.header.Authorization}", h.Principal)
		}
		// Nor one made only of what the request says about itself, which
		// every caller sending that request says alike: accepted until
		// the build after b35c62e, {http.request.method} let a second
		// caller replay the first one's answer.
		if name := notACaller(h.Principal); name != "" {
			return fmt.Errorf("principal %q tells no caller from another: {%s} is the same for every caller sending the same request, so they could replay each other's answers: write one such as {http.auth.user.id} or {http.request.header.Authorization}", h.Principal, name)
		}
		// A retry after a lost answer comes on a new connection, and is
		// another request: a principal that changes with either refuses
		// it 422 as another caller's, which a commit client takes for a
		// failed commit although it landed.
		if name, why := perAttemptPlaceholder(h.Principal); name != "" {
			return fmt.Errorf("principal %q differs between a request and its retry: {%s} %s, so every retry would be refused as another principal's; use %s", h.Principal, name, why, "the caller's identity, such as {http.auth.user.id} or {http.request.header.Authorization}")
		}
	case "replay_headers":
		for i, name := range h.ReplayHeaders {
			if name == "" {
				return fmt.Errorf("replay_headers[%d] is empty", i)
			}
			// A name no response can carry was kept without a word, and
			// the header it was meant for went missing from every replay.
			if !httpguts.ValidHeaderFieldName(name) {
				if strings.Contains(name, ",") {
					return fmt.Errorf("replay_headers[%d] %q is not a header name: separate the names with spaces, not commas", i, name)
				}
				return fmt.Errorf("replay_headers[%d] %q is not a header name (a token: letters, digits and !#$%%&'*+-.^_`|~)", i, name)
			}
			if why, ok := unreplayableHeaders[http.CanonicalHeaderKey(name)]; ok {
				return fmt.Errorf("replay_headers cannot hold %s: %s", name, why)
			}
		}
	case "secret", "previous_secrets":
		// Values are checked as written, before their placeholders are
		// expanded (at provision): an error never shows a secret.
		for i, raw := range h.PreviousSecrets {
			if raw == "" {
				return fmt.Errorf("previous_secrets[%d] is empty", i)
			}
			if raw == h.Secret {
				return fmt.Errorf("previous_secrets[%d] repeats secret", i)
			}
			if j := slices.Index(h.PreviousSecrets[:i], raw); j >= 0 {
				return fmt.Errorf("previous_secrets[%d] repeats previous_secrets[%d]", i, j)
			}
		}
	}
	return nil
}

// placeholderPattern matches a Caddy placeholder: a name between braces.
var placeholderPattern = regexp.MustCompile(`\{([^{}\s]+)\}`)

// perRequestPlaceholder reports whether expr holds a placeholder that can
// differ between requests: not only the process-wide ones ({env.*},
// {file.*}, {system.*}, {time.*}), which are the same for every caller,
// and not a brace left unclosed.
func perRequestPlaceholder(expr string) bool {
	for _, m := range placeholderPattern.FindAllStringSubmatch(expr, -1) {
		if !processWide(m[1]) {
			return true
		}
	}
	return false
}

// processWide reports whether the placeholder name is the same for every
// request of the process: {env.*}, {file.*}, {system.*}, {time.*}.
func processWide(name string) bool {
	return strings.HasPrefix(name, "env.") || strings.HasPrefix(name, "file.") ||
		strings.HasPrefix(name, "system.") || strings.HasPrefix(name, "time.")
}

// sameForEveryCaller are request placeholders that the request's own
// method, address and connection settle, whoever sends it; with a
// placeholder prefix, each name under it too. (So does its Idempotency-Key
// header, in any letter case; not the URI or query, which may carry a
// token.)
var sameForEveryCaller = []string{
	"http.request.method", "http.request.orig_method", "http.request.scheme", "http.request.proto",
	"http.request.host", "http.request.hostport", "http.request.port", "http.request.host.labels.",
	"http.request.uri.path", "http.request.uri.path.", "http.request.orig_uri.path", "http.request.orig_uri.path.",
	"http.request.local", "http.request.local.", "http.request.body", "http.request.body_base64",
	"http.request.tls.version", "http.request.tls.cipher_suite", "http.request.tls.proto",
	"http.request.tls.proto_mutual", "http.request.tls.server_name",
}

// notACaller returns a placeholder of expr when every placeholder in it is
// process-wide or in sameForEveryCaller, so that it names no caller; ""
// when one of them can tell callers apart (or expr has none, which
// perRequestPlaceholder refuses).
func notACaller(expr string) string {
	var first string
	for _, m := range placeholderPattern.FindAllStringSubmatch(expr, -1) {
		name := m[1]
		if processWide(name) {
			continue
		}
		if !slices.ContainsFunc(sameForEveryCaller, func(p string) bool {
			return name == p || strings.HasSuffix(p, ".") && strings.HasPrefix(name, p)
		}) && !strings.EqualFold(name, "http.request.header."+IdempotencyKeyHeader) {
			return ""
		}
		if first == "" {
			first = name
		}
	}
	return first
}

// perAttemptPlaceholders are Caddy placeholders that differ between a
// request and its retry, with why.
var perAttemptPlaceholders = map[string]string{
	"http.request.remote":      "changes with every connection",
	"http.request.remote.port": "changes with every connection",
	"http.request.uuid":        "changes with every request",
	"http.request.duration":    "changes with every request",
	"http.request.duration_ms": "changes with every request",
	"http.request.tls.resumed": "changes with the connection's TLS session",
}

// perAttemptPlaceholder returns the first placeholder in expr that differs
// between a request and its retry, and why; "" if there is none.
func perAttemptPlaceholder(expr string) (name, why string) {
	for _, m := range placeholderPattern.FindAllStringSubmatch(expr, -1) {
		if why, ok := perAttemptPlaceholders[m[1]]; ok {
			return m[1], why
		}
		if strings.HasPrefix(m[1], "time.") {
			return m[1], "changes with the time"
		}
	}
	return "", ""
}

// unreplayableHeaders are response headers replay_headers refuses, with why.
var unreplayableHeaders = map[string]string{
	"Content-Length":      "it is computed from the stored body",
	"Transfer-Encoding":   "framing belongs to one connection",
	"Connection":          "it is hop-by-hop",
	"Keep-Alive":          "it is hop-by-hop",
	"Proxy-Connection":    "it is hop-by-hop",
	"Upgrade":             "it is hop-by-hop",
	"Trailer":             "it is hop-by-hop",
	"Te":                  "it is hop-by-hop",
	"Set-Cookie":          "it would keep session credentials in the store and hand them out again",
	"Authorization":       "it would keep credentials in the store and hand them out again",
	"Proxy-Authenticate":  "it is hop-by-hop",
	"Proxy-Authorization": "it is hop-by-hop",
}

// checkBufferedBytes refuses a max_request_size (0: the default) the
// global max_buffered_bytes (0: the default) cannot hold: a body's buffer
// is copied as it grows, so the largest body needs up to twice its size;
// less, and it gets 503 for ever.
func checkBufferedBytes(maxBuffered, maxRequest int64) error {
	if maxBuffered == 0 {
		maxBuffered = DefaultMaxBufferedBytes
	}
	if maxRequest == 0 {
		maxRequest = DefaultMaxRequestSize
	}
	if maxRequest > maxBuffered/2 {
		return fmt.Errorf("the iceberg_idempotency global option max_buffered_bytes must be at least twice max_request_size "+
			"(a body's buffer is copied as it grows): max_buffered_bytes is %d, max_request_size %d", maxBuffered, maxRequest)
	}
	return nil
}

func nonNegative(opt string, d caddy.Duration) error {
	if d < 0 {
		return fmt.Errorf("%s must not be negative, got %v", opt, time.Duration(d))
	}
	if d > maxDuration {
		return fmt.Errorf("%s must be at most %v (ten years), got %v", opt, time.Duration(maxDuration), time.Duration(d))
	}
	return nil
}

// minLifetime bounds lifetime from below: the spec's retries come seconds
// apart.
const minLifetime = time.Second

// minExecutionTimeout bounds execution_timeout from below: a catalog commit
// writes metadata files to object storage, which takes longer; bare JSON
// numbers (nanoseconds) such as 60 or 60000 fall far below it.
const minExecutionTimeout = 100 * time.Millisecond

// maxDuration bounds every duration option: a record's TTL adds lifetime,
// grace, execution_timeout and lease, and a sum past time.Duration's 292
// years would wrap to a negative TTL, a record expired as it is made, and
// every retry would execute again.
const maxDuration = caddy.Duration(10 * 365 * 24 * time.Hour)

// Cleanup gives the store back to the pool; the last user closes it. It
// copes with a Provision that failed before the store was acquired.
func (h *Handler) Cleanup() error {
	if h.releaseRetention != nil {
		h.releaseRetention()
	}
	if h.storeKey == "" {
		return nil
	}
	_, err := storePool.Delete(h.storeKey)
	h.storeKey = "" // a second Cleanup must not drop another handler's reference
	return err
}

// ServeHTTP implements caddyhttp.MiddlewareHandler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if !mutationMethod(r.Method) && !mutationMethod(methodOverride(r)) {
		// Reads are most of a catalog's traffic, and only one of them
		// concerns the handler.
		if r.Method == http.MethodGet && h.isConfigRequest(r) {
			return h.advertise(w, r, next)
		}
		return next.ServeHTTP(w, r)
	}
	op, path := h.classifyHTTP(r, r.URL.EscapedPath())
	if op == "" {
		if len(r.Header[IdempotencyKeyHeader]) > 0 && atomic.LoadInt32(&h.keyBelowPrefixWarned) == 0 {
			h.warnKeyBelowPrefix(r)
		}
		return next.ServeHTTP(w, r)
	}
	return h.admit(w, r, next, op, path)
}
