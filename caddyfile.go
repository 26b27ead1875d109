package icebergidempotency

import (
	"encoding/json"
	"fmt"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("iceberg_idempotency", parseHandler)
	// Keys must be checked before the request reaches the catalog, so no
	// `order` line is needed in the Caddyfile. Ordered before invoke (and
	// so before handle, handle_path, route and reverse_proxy, which come
	// after it), a site-level iceberg_idempotency guards a reverse_proxy
	// written inside any of those blocks or in a named route that invoke
	// calls: a handle's subroute and an invoked route terminate, so
	// anything sorted after them would never run. It still comes after
	// basic_auth and forward_auth, so that {http.auth.user.id} is set and
	// unauthenticated requests are rejected before they reach the store,
	// and after encode, so that a compressed answer is captured before it
	// is compressed.
	httpcaddyfile.RegisterDirectiveOrder("iceberg_idempotency", httpcaddyfile.Before, "invoke")
	httpcaddyfile.RegisterGlobalOption("iceberg_idempotency", parseApp)
}

var _ caddyfile.Unmarshaler = (*Handler)(nil)

func parseHandler(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	handler := new(Handler)
	given, directive, err := handler.parseDirective(h.Dispenser)
	if err != nil {
		return handler, err
	}
	// Against the global option, as Provision checks it, with a line: on
	// max_request_size's, or the directive's when it is the default.
	app := new(App)
	if opt, ok := h.Option("iceberg_idempotency").(httpcaddyfile.App); ok {
		if err := json.Unmarshal(opt.Value, app); err != nil {
			return handler, fmt.Errorf("reading the iceberg_idempotency global option: %w", err)
		}
	}
	if err := checkBufferedBytes(app.MaxBufferedBytes, handler.MaxRequestSize); err != nil {
		at, ok := given["max_request_size"]
		if !ok {
			at = directive
		}
		return handler, fmt.Errorf("%w, at %s", err, at)
	}
	return handler, nil
}

// UnmarshalCaddyfile parses the iceberg_idempotency directive:
//
//	iceberg_idempotency {
//	    store memory|postgres|mysql|redis [{ ... }]
//	    lifetime           <duration>
//	    grace              <duration>
//	    in_flight_wait     <duration>
//	    in_flight_status   503|409
//	    retry_after        <duration>
//	    execution_timeout  <duration>
//	    lease              <duration>
//	    abandoned          unknown|reexecute
//	    max_request_size   <size>
//	    max_response_size  <size>
//	    require_key        [on|off]
//	    key_versions       <version...>|any
//	    base_path          <path>
//	    principal          <placeholder expression>
//	    finalize_statuses  <status|class...>
//	    release_statuses   <status|class...>
//	    replay_headers     <header...>
//	    fail_open          [on|off]
//	    secret             <placeholder>
//	    previous_secrets   <placeholder...>
//	    require_secret     [on|off]
//	}
//
// Each option may be given once.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	_, _, err := h.parseDirective(d)
	return err
}

// parseDirective is UnmarshalCaddyfile, and returns where each option and
// the directive itself were given, for checks parseHandler makes against
// global options.
func (h *Handler) parseDirective(d *caddyfile.Dispenser) (given givenOptions, directive optionAt, err error) {
	d.Next() // directive name
	directive = optionAt{d.File(), d.Line()}
	if d.NextArg() {
		return nil, directive, d.Errf("iceberg_idempotency takes at most one matcher (*, a path beginning with /, or a named @matcher), then a block of options; got the argument %q", d.Val())
	}
	given = givenOptions{}
	var store caddyfile.Unmarshaler
	for d.NextBlock(0) {
		opt := d.Val()
		if err := given.once(d, opt); err != nil {
			return nil, directive, err
		}
		switch opt {
		case "store":
			if !d.NextArg() {
				return nil, directive, d.Errf("store needs a name: one of %s", strings.Join(storeNames(), ", "))
			}
			name := d.Val()
			if _, err := caddy.GetModule("iceberg_idempotency.stores." + name); err != nil {
				return nil, directive, d.Errf("unknown store %q: want one of %s", name, strings.Join(storeNames(), ", "))
			}
			unm, err := caddyfile.UnmarshalModule(d, "iceberg_idempotency.stores."+name)
			if err != nil {
				return nil, directive, err
			}
			h.StoreRaw = caddyconfig.JSONModuleObject(unm, "backend", name, nil)
			store = unm
		case "lifetime":
			if err := parseDuration(d, &h.Lifetime); err != nil {
				return nil, directive, err
			}
		case "grace":
			// 0 is a valid grace: records live exactly the lifetime.
			arg, err := singleArg(d)
			if err != nil {
				return nil, directive, err
			}
			grace, err := caddy.ParseDuration(arg)
			if err != nil || grace < 0 {
				return nil, directive, d.Errf("grace must be a duration like 5m, or 0 for none, got %q", arg)
			}
			g := caddy.Duration(grace)
			h.Grace = &g
		case "in_flight_wait":
			if err := parseDuration(d, &h.InFlightWait); err != nil {
				return nil, directive, err
			}
		case "retry_after":
			if err := parseDuration(d, &h.RetryAfter); err != nil {
				return nil, directive, err
			}
		case "execution_timeout":
			if err := parseDuration(d, &h.ExecutionTimeout); err != nil {
				return nil, directive, err
			}
		case "lease":
			if err := parseDuration(d, &h.Lease); err != nil {
				return nil, directive, err
			}
		case "in_flight_status":
			arg, err := singleArg(d)
			if err != nil {
				return nil, directive, err
			}
			code, err := strconv.Atoi(arg)
			if err != nil || code == 0 { // 0 would read as left out
				return nil, directive, d.Errf("in_flight_status must be 503 or 409, got %q", arg)
			}
			h.InFlightStatus = code
		case "abandoned":
			arg, err := singleArg(d)
			if err != nil {
				return nil, directive, err
			}
			h.Abandoned = arg
		case "max_request_size":
			if err := parseSize(d, &h.MaxRequestSize); err != nil {
				return nil, directive, err
			}
		case "max_response_size":
			if err := parseSize(d, &h.MaxResponseSize); err != nil {
				return nil, directive, err
			}
		case "require_key":
			on, err := parseFlag(d)
			if err != nil {
				return nil, directive, err
			}
			h.RequireKey = on
		case "key_versions":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, directive, d.Errf("key_versions needs UUID versions (1 to 8) or any")
			}
			if len(args) == 1 && args[0] == "any" {
				h.KeyVersions = nil
				for v := minKeyVersion; v <= maxKeyVersion; v++ {
					h.KeyVersions = append(h.KeyVersions, v)
				}
				break
			}
			h.KeyVersions = make([]int, 0, len(args))
			for _, arg := range args {
				v, err := strconv.Atoi(arg)
				if err != nil {
					return nil, directive, d.Errf("key_versions takes UUID versions (1 to 8) or a lone any, got %q", arg)
				}
				h.KeyVersions = append(h.KeyVersions, v)
			}
		case "fail_open":
			on, err := parseFlag(d)
			if err != nil {
				return nil, directive, err
			}
			h.FailOpen = on
		case "base_path":
			arg, err := singleArg(d)
			if err != nil {
				return nil, directive, err
			}
			h.BasePath = arg
		case "principal":
			arg, err := singleArg(d)
			if err != nil {
				return nil, directive, err
			}
			h.Principal = arg
		case "finalize_statuses", "release_statuses":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, directive, d.Errf("%s needs at least one status or class, e.g. 2xx 404", opt)
			}
			if opt == "finalize_statuses" {
				h.FinalizeStatuses = args
			} else {
				h.ReleaseStatuses = args
			}
		case "replay_headers":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, directive, d.Errf("%s needs at least one header name, e.g. Content-Type ETag", opt)
			}
			h.ReplayHeaders = args
		case "secret":
			// Never echoed in errors: it may be written literally.
			if !d.NextArg() {
				return nil, directive, d.Err("secret needs a value, e.g. {env.ICEBERG_IDEMPOTENCY_SECRET}")
			}
			h.Secret = d.Val()
			if d.NextArg() {
				return nil, directive, d.Err("secret takes a single value")
			}
			if h.Secret == "" {
				return nil, directive, emptyValue(d, opt)
			}
			if err := checkSecretPlaceholders(opt, h.Secret); err != nil {
				return nil, directive, d.Err(err.Error())
			}
		case "previous_secrets":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, directive, d.Errf("%s needs at least one secret, e.g. {env.ICEBERG_IDEMPOTENCY_OLD_SECRET}", opt)
			}
			if slices.Contains(args, "") {
				return nil, directive, emptyValue(d, opt)
			}
			for i, raw := range args {
				if err := checkSecretPlaceholders(fmt.Sprintf("%s[%d]", opt, i), raw); err != nil {
					return nil, directive, d.Err(err.Error())
				}
			}
			h.PreviousSecrets = args
		case "require_secret":
			on, err := parseFlag(d)
			if err != nil {
				return nil, directive, err
			}
			h.RequireSecret = on
		default:
			if opt == "{" {
				// "require_key {": the option before took no block.
				return nil, directive, d.Err("unexpected {: of the options only store takes a block")
			}
			return nil, directive, d.Errf("unknown iceberg_idempotency option %q", opt)
		}
		// Values are checked in one place, Validate's; here with the line.
		if err := h.validateOption(opt); err != nil {
			return nil, directive, d.Err(err.Error())
		}
	}
	// The lease against the store's timeouts, as Provision checks it, on
	// the line of the lease or, when it is the default, of the store.
	lease := time.Duration(h.Lease)
	if lease == 0 {
		lease = DefaultLease
	}
	if err := checkLease(lease, store); err != nil {
		if at, ok := given["lease"]; ok {
			return nil, directive, fmt.Errorf("%w, at %s", err, at)
		}
		return nil, directive, fmt.Errorf("%w (%v is the default lease), at %s", err, DefaultLease, given["store"])
	}
	// Provision refuses it too, where the error has no line.
	if _, inProcess := store.(*MemoryStore); h.RequireSecret && h.Secret == "" && store != nil && !inProcess {
		return nil, directive, fmt.Errorf("require_secret: the store keeps records outside this process, but no secret is set: set secret, or leave require_secret out, at %s", given["require_secret"])
	}
	return given, directive, nil
}

// givenOptions remembers the line of each option read in one block, to
// refuse an option given twice. The second would silently replace the
// first, and the one an operator reads first is what they believe runs: a
// `store memory` below a `store postgres` block would guard every node with
// its own memory.
type givenOptions map[string]optionAt

// listOptions are the options that take several values.
var listOptions = map[string]bool{
	"key_versions": true, "finalize_statuses": true, "release_statuses": true,
	"replay_headers": true, "previous_secrets": true,
}

// maxExactJSONInt is the largest integer a float64 holds exactly: the
// Caddyfile adapter carries a store module's config through one.
const maxExactJSONInt = 1 << 53

// optionAt is where an option was given.
type optionAt struct {
	file string
	line int
}

func (at optionAt) String() string { return fmt.Sprintf("%s:%d", at.file, at.line) }

// once records the option name at the dispenser's position, or says where
// it was given before: on which line, and in which file when an import
// brought it from another.
func (g givenOptions) once(d *caddyfile.Dispenser, name string) error {
	if at, ok := g[name]; ok {
		where := fmt.Sprintf("first on line %d", at.line)
		if at.file != d.File() {
			where = "first at " + at.String()
		}
		if listOptions[name] {
			// "Keep one" would tell an operator to drop, say, an old
			// secret whose records then stop replaying.
			return d.Errf("%s given twice (%s): it takes several values, give them all on one line", name, where)
		}
		return d.Errf("%s given twice (%s): keep one", name, where)
	}
	g[name] = optionAt{d.File(), d.Line()}
	return nil
}

// parseFlag reads a handler flag: on alone, or with on, off, true or
// false after it, the spellings the store switches take, so that a
// Caddyfile may spell every switch alike (until the build after a2ea714
// "require_key on" was an argument-count error).
func parseFlag(d *caddyfile.Dispenser) (bool, error) {
	if !d.NextArg() {
		return true, nil
	}
	d.Prev()
	return parseOnOff(d)
}

// singleArg returns the option's one value, which must not be empty: an
// empty value would read as the option left out, so that a quoted "{$VAR}"
// whose variable is unset silently meant the default (for secret: no
// encryption at all).
func singleArg(d *caddyfile.Dispenser) (string, error) {
	opt := d.Val()
	if !d.NextArg() {
		return "", d.Errf("%s needs a value", opt)
	}
	arg := d.Val()
	if d.NextArg() {
		return "", d.Errf("%s takes a single value", opt)
	}
	if arg == "" {
		return "", emptyValue(d, opt)
	}
	return arg, nil
}

func emptyValue(d *caddyfile.Dispenser, opt string) error {
	return d.Errf("%s is empty (a quoted {$VAR} whose environment variable is unset?): give it a value, or leave the option out for its default", opt)
}

func parseDuration(d *caddyfile.Dispenser, into *caddy.Duration) error {
	opt := d.Val()
	arg, err := singleArg(d)
	if err != nil {
		return err
	}
	dur, err := caddy.ParseDuration(arg)
	if err != nil || dur <= 0 {
		return d.Errf("%s must be a positive duration like 30s or 10m, got %q", opt, arg)
	}
	*into = caddy.Duration(dur)
	return nil
}

func parseSize(d *caddyfile.Dispenser, into *int64) error {
	opt := d.Val()
	arg, err := singleArg(d)
	if err != nil {
		return err
	}
	// humanize reads a comma as a thousands separator: "1,5MiB", a
	// decimal comma, was 15MiB.
	if strings.Contains(arg, ",") {
		return d.Errf("%s takes no commas, got %q: write 1.5MiB or 1536", opt, arg)
	}
	// humanize.ParseBytes drops a fraction silently: "max_request_size
	// 1.9", meant as 1.9 of some unit, was one byte, and every keyed
	// request with a body was answered 413. It also reads through a
	// float, so that 8.2MB was 8199999 bytes.
	exact := bytesOf(arg)
	if exact != nil && !exact.IsInt() {
		return d.Errf("%s must be a whole number of bytes, got %q (%s bytes): give a unit, like 1.5MiB", opt, arg,
			strings.TrimRight(exact.FloatString(9), "0"))
	}
	if exact == nil || exact.Sign() <= 0 || exact.Cmp(new(big.Rat).SetInt64(1<<40)) > 0 {
		return d.Errf("%s must be a positive size of at most 1TiB, like 16MiB, got %q", opt, arg)
	}
	*into = exact.Num().Int64()
	return nil
}

// bytesOf is the exact number of bytes a size names, or nil if it cannot be
// read: a decimal number, then a unit humanize knows (B, kB, KiB, MB, MiB,
// …, in any case) or none.
func bytesOf(size string) *big.Rat {
	end := strings.IndexFunc(size, func(r rune) bool { return !unicode.IsDigit(r) && r != '.' })
	if end < 0 {
		end = len(size)
	}
	num, ok := new(big.Rat).SetString(size[:end])
	if !ok {
		return nil
	}
	unit, err := humanize.ParseBigBytes("1" + size[end:])
	if err != nil {
		return nil
	}
	return num.Mul(num, new(big.Rat).SetInt(unit))
}

// parseApp parses the global option block:
//
//	{
//	    iceberg_idempotency {
//	        cleanup_interval <duration>
//	        cleanup_batch    <n>
//	        max_buffered_bytes <size>
//	    }
//	}
func parseApp(d *caddyfile.Dispenser, existing any) (any, error) {
	app := new(App)
	d.Next() // option name
	if existing != nil {
		// Caddy would keep only the second block, silently.
		return nil, d.Err("iceberg_idempotency global option given twice: merge the blocks into one")
	}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	given := givenOptions{}
	for d.NextBlock(0) {
		if err := given.once(d, d.Val()); err != nil {
			return nil, err
		}
		switch d.Val() {
		case "cleanup_interval":
			if err := parseDuration(d, &app.CleanupInterval); err != nil {
				return nil, err
			}
			if app.CleanupInterval < caddy.Duration(minCleanupInterval) {
				return nil, d.Errf("cleanup_interval must be at least %v, got %v", minCleanupInterval, time.Duration(app.CleanupInterval))
			}
			if app.CleanupInterval > maxDuration {
				return nil, d.Errf("cleanup_interval must be at most %v (ten years), got %v", time.Duration(maxDuration), time.Duration(app.CleanupInterval))
			}
		case "cleanup_batch":
			arg, err := singleArg(d)
			if err != nil {
				return nil, err
			}
			n, err := strconv.Atoi(arg)
			if err != nil || n <= 0 {
				return nil, d.Errf("cleanup_batch must be a positive integer, got %q", arg)
			}
			app.CleanupBatch = n
		case "max_buffered_bytes":
			if err := parseSize(d, &app.MaxBufferedBytes); err != nil {
				return nil, err
			}
		default:
			return nil, d.Errf("unknown iceberg_idempotency global option %q", d.Val())
		}
	}
	return httpcaddyfile.App{
		Name:  "iceberg_idempotency",
		Value: caddyconfig.JSON(app, nil),
	}, nil
}

// storeNames lists the registered store backends, for error messages.
func storeNames() []string {
	var names []string
	for _, info := range caddy.GetModules("iceberg_idempotency.stores") {
		names = append(names, info.ID.Name())
	}
	return names
}
