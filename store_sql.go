package icebergidempotency

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	mysqldriver "github.com/go-sql-driver/mysql"
	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/mysql"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/postgres"
	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// SQLStoreConfig holds the options the PostgreSQL and MySQL stores share.
//
// The modules here only carry options from JSON and the Caddyfile to the
// store packages: each package's Config.WithDefaults is the one place where
// its options are defaulted and checked (the Caddyfile parser calls the same
// checks to name the line). The modules live in this package rather than in
// the store packages so that those stay plain Go libraries, usable and
// testable without Caddy. Only the defaults of on/off options, which a Go
// bool cannot leave unset, are decided here.
type SQLStoreConfig struct {
	// Connection string. Placeholders such as {env.ICEBERG_IDEMPOTENCY_DSN}
	// are expanded at provision time. Passwords never appear in logs or
	// errors. Required.
	DSN string `json:"dsn,omitempty"`

	// Records table; the schema version table is <table>_schema. Lowercase
	// letters, digits and underscores. Default: iceberg_idempotency_records.
	Table string `json:"table,omitempty"`

	// Most connections in the pool. Default: PostgreSQL 16 (or the DSN's
	// pool_max_conns), MySQL 10; chosen by measurement at 32 concurrent
	// clients (README, Performance).
	MaxConns int `json:"max_conns,omitempty"`

	// Apply missing schema versions at the first contact with the
	// database (when Caddy starts, or when the database first answers),
	// under a database lock so several nodes may start at once. Never at
	// provisioning: `caddy validate` writes nothing. When false, the first
	// contact only checks the schema, and until the file in sql/ it names
	// is applied, keyed requests get store errors. Default: true.
	AutoMigrate *bool `json:"auto_migrate,omitempty"`

	// Bound of each database call, connecting included. Default: 5s.
	StatementTimeout caddy.Duration `json:"statement_timeout,omitempty"`

	// How many batches of reservation and finalization statements a node
	// may have in flight at once; beyond that, the statements of
	// concurrent requests wait and commit together, one commit for the
	// batch. 0 (Caddyfile: off) runs each statement on its own. Default:
	// the store package's DefaultCombinedWrites, chosen by measurement
	// (README, Performance).
	CombinedWrites *int `json:"combined_writes,omitempty"`

	dsn string // DSN with placeholders expanded
}

// callTimeouts implements callBounder: statement_timeout bounds each
// call, connecting included.
func (c *SQLStoreConfig) callTimeouts() []namedTimeout {
	return []namedTimeout{{"statement_timeout", c.statementTimeout()}}
}

func (c *SQLStoreConfig) statementTimeout() time.Duration {
	if c.StatementTimeout == 0 {
		return sqlstore.DefaultStatementTimeout
	}
	return time.Duration(c.StatementTimeout)
}

// writeSettle is how long after a failed call a statement of this store
// may still commit: the statement timeout bounds it on the server too, once
// the statement arrived, and a Reserve or TakeOver arrives no later than
// the end of its call plus sqlstore.ClockMargin on the server's clock,
// whose reading may overstate the server's lead by up to one statement
// timeout (the read's own). See Handler.settleWindow.
func (c *SQLStoreConfig) writeSettle() time.Duration {
	return 2*c.statementTimeout() + sqlstore.ClockMargin
}

// provision expands the DSN and applies the defaults of the options a Go
// value cannot leave unset; combinedWrites is the backend's default.
func (c *SQLStoreConfig) provision(backend string, combinedWrites int) error {
	c.dsn = caddy.NewReplacer().ReplaceKnown(c.DSN, "")
	if c.dsn == "" {
		return emptyDSNError(backend, c.DSN)
	}
	// A part that expands to nothing (a password from an unset
	// variable) left a DSN that still parsed: the store connected without
	// it, or failed to authenticate at each attempt, until the build after
	// b35c62e. The Redis store's options are refused the same way.
	if name, why := emptyPlaceholder(c.DSN); name != "" {
		return fmt.Errorf("%s store: dsn: {%s} %s; leave the placeholder out if that part is meant to be empty", backend, name, why)
	}
	if c.AutoMigrate == nil {
		on := true
		c.AutoMigrate = &on
	}
	if c.CombinedWrites == nil {
		c.CombinedWrites = &combinedWrites
	}
	return nil
}

// envPlaceholder matches Caddy's {env.NAME} placeholders.
var envPlaceholder = regexp.MustCompile(`\{env\.([^{}]+)\}`)

// emptyDSNError says why the DSN is empty: unset, or made only of
// placeholders that expanded to nothing, naming the environment variables
// to check. A DSN that expands to nothing has no literal text, so quoting
// it shows no secret.
func emptyDSNError(backend, raw string) error {
	if strings.TrimSpace(raw) == "" {
		return fmt.Errorf("%s store: dsn is required", backend)
	}
	// "dsn is required" first: it is what an operator searches for.
	return emptyAfterPlaceholders(fmt.Sprintf("%s store: dsn is required, and dsn %q is empty after replacing placeholders", backend, raw), raw)
}

// emptyPlaceholder returns the first placeholder of raw that Caddy knows at
// start and that expands to nothing, and why: an environment variable unset
// or empty, a file that cannot be read or is empty. "" when there is none.
func emptyPlaceholder(raw string) (name, why string) {
	known := caddy.NewReplacer()
	r := caddy.NewEmptyReplacer()
	r.Map(func(key string) (any, bool) {
		if name != "" {
			return "", true
		}
		v, ok := known.Get(key)
		if !ok || v != nil && fmt.Sprint(v) != "" {
			return "", true
		}
		name = key
		switch {
		case strings.HasPrefix(key, "env."):
			if _, set := os.LookupEnv(strings.TrimPrefix(key, "env.")); set {
				why = "is an empty environment variable"
			} else {
				why = "is an environment variable that is not set"
			}
		case strings.HasPrefix(key, "file."):
			if _, err := os.ReadFile(strings.TrimPrefix(key, "file.")); err != nil {
				why = fmt.Sprintf("names a file that cannot be read (%v)", err)
			} else {
				why = "names an empty file"
			}
		default:
			why = "expands to an empty value"
		}
		return "", true
	})
	r.ReplaceAll(raw, "")
	return name, why
}

// emptyAfterPlaceholders returns msg, which says that raw, a value given,
// expanded to nothing, naming the environment variables to check.
func emptyAfterPlaceholders(msg, raw string) error {
	var unset []string
	for _, m := range envPlaceholder.FindAllStringSubmatch(raw, -1) {
		if os.Getenv(m[1]) == "" && !slices.Contains(unset, m[1]) {
			unset = append(unset, m[1])
		}
	}
	switch len(unset) {
	case 0:
		if name, why := emptyPlaceholder(raw); name != "" {
			return fmt.Errorf("%s: {%s} %s", msg, name, why)
		}
		return errors.New(msg)
	case 1:
		return fmt.Errorf("%s: is the environment variable %s set?", msg, unset[0])
	default:
		return fmt.Errorf("%s: are the environment variables %s set?", msg, strings.Join(unset, ", "))
	}
}

// storeKey identifies the pool by everything that shapes it, with defaults
// applied (an unset table and the default table are one pool); the DSN and
// password only inside a MAC under a key this process drew at random, so
// the key can be logged and shown by the admin API. A plain hash of them
// would not do: anyone reading the logs could test guesses of a weak
// password against it. Pools live in one process, so the key need not
// mean the same in another.
func storeKey(backend, table string, parts ...string) string {
	h := hmac.New(sha256.New, storeKeySalt[:])
	for _, part := range parts {
		fmt.Fprintf(h, "%d:%s", len(part), part)
	}
	return backend + "/" + table + "/" + hex.EncodeToString(h.Sum(nil))[:16]
}

// storeKeySalt is the MAC key of storeKey, drawn once per process.
var storeKeySalt = func() (salt [32]byte) {
	_, _ = rand.Read(salt[:]) // crypto/rand.Read never fails
	return salt
}()

// unmarshalOption parses one shared option; false means it is not one.
func (c *SQLStoreConfig) unmarshalOption(d *caddyfile.Dispenser) (bool, error) {
	switch d.Val() {
	case "dsn":
		arg, err := singleArg(d)
		if err != nil {
			return true, err
		}
		c.DSN = arg
	case "table":
		arg, err := singleArg(d)
		if err != nil {
			return true, err
		}
		if err := sqlstore.ValidateTable(arg); err != nil { // the store's own check, with the line
			return true, d.Errf("table: %v", err)
		}
		c.Table = arg
	case "max_conns":
		arg, err := singleArg(d)
		if err != nil {
			return true, err
		}
		// pgxpool counts connections in an int32: a larger value was
		// refused only at start, without the line.
		n, err := strconv.Atoi(arg)
		if err != nil || n <= 0 || n > math.MaxInt32 {
			return true, d.Errf("max_conns must be a positive integer up to %d, got %q", math.MaxInt32, arg)
		}
		c.MaxConns = n
	case "auto_migrate":
		on, err := parseOnOff(d)
		if err != nil {
			return true, err
		}
		c.AutoMigrate = &on
	case "statement_timeout":
		if err := parseDuration(d, &c.StatementTimeout); err != nil {
			return true, err
		}
		// PostgreSQL counts it in whole milliseconds, where 0 means no
		// limit at all.
		if c.StatementTimeout < caddy.Duration(time.Millisecond) {
			return true, d.Errf("statement_timeout must be at least 1ms, got %v", time.Duration(c.StatementTimeout))
		}
		return true, nil
	case "combined_writes":
		n, err := parseCombinedWrites(d)
		c.CombinedWrites = &n
		return true, err
	default:
		return false, nil
	}
	return true, nil
}

func parseOnOff(d *caddyfile.Dispenser) (bool, error) {
	opt := d.Val()
	arg, err := singleArg(d)
	if err != nil {
		return false, err
	}
	switch arg {
	case "on", "true":
		return true, nil
	case "off", "false":
		return false, nil
	}
	return false, d.Errf("%s must be on or off, got %q", opt, arg)
}

func unmarshalSQLStore(d *caddyfile.Dispenser, backend string, c *SQLStoreConfig, more func(*caddyfile.Dispenser) (bool, error)) error {
	d.Next() // store type name
	// Made here, on the store's line and with any import chain, and
	// returned if the block gives no dsn: made at the end, it named the
	// block's closing brace (until the build after b35c62e).
	noDSN := d.Errf("%s store needs a dsn", backend)
	if d.NextArg() {
		return d.ArgErr()
	}
	given := givenOptions{}
	for d.NextBlock(0) {
		if err := given.once(d, d.Val()); err != nil {
			return err
		}
		ok, err := c.unmarshalOption(d)
		if !ok && err == nil && more != nil {
			ok, err = more(d)
		}
		if err != nil {
			return err
		}
		if !ok {
			return d.Errf("unknown %s store option %q", backend, d.Val())
		}
	}
	if c.DSN == "" {
		return noDSN
	}
	return nil
}

// PostgresStore configures the PostgreSQL store (pgx), shared by every Caddy
// node that points at the same database.
type PostgresStore struct {
	SQLStoreConfig

	// Wake waiting duplicates with LISTEN/NOTIFY instead of polling alone;
	// costs one extra connection per node and no extra statement per
	// request. Default: true.
	ListenNotify *bool `json:"listen_notify,omitempty"`

	cfg postgres.Config // with defaults applied
}

// MySQLStore configures the MySQL/MariaDB store (go-sql-driver/mysql),
// shared by every Caddy node that points at the same database.
type MySQLStore struct {
	SQLStoreConfig

	cfg mysql.Config // with defaults applied
}

var (
	_ StoreProvider         = (*PostgresStore)(nil)
	_ caddy.Provisioner     = (*PostgresStore)(nil)
	_ caddyfile.Unmarshaler = (*PostgresStore)(nil)
	_ StoreProvider         = (*MySQLStore)(nil)
	_ caddy.Provisioner     = (*MySQLStore)(nil)
	_ caddyfile.Unmarshaler = (*MySQLStore)(nil)
	_ idleReleaser          = (*postgres.Store)(nil)
	_ idleReleaser          = (*mysql.Store)(nil)
)

// CaddyModule returns the Caddy module information.
func (PostgresStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "iceberg_idempotency.stores.postgres",
		New: func() caddy.Module { return new(PostgresStore) },
	}
}

// Provision expands placeholders and applies the store's defaults.
func (p *PostgresStore) Provision(caddy.Context) error {
	if p.ListenNotify == nil {
		on := true
		p.ListenNotify = &on
	}
	if err := p.provision("postgres", postgres.DefaultCombinedWrites); err != nil {
		return err
	}
	cfg, err := postgres.Config{
		DSN:              p.dsn,
		Table:            p.Table,
		MaxConns:         p.MaxConns,
		AutoMigrate:      *p.AutoMigrate,
		StatementTimeout: time.Duration(p.StatementTimeout),
		ListenNotify:     *p.ListenNotify,
		CombinedWrites:   *p.CombinedWrites,
	}.WithDefaults()
	if err != nil {
		return fmt.Errorf("postgres store: %w", err)
	}
	p.cfg = cfg
	return nil
}

// StoreKey implements StoreProvider.
func (p *PostgresStore) StoreKey() string {
	c := p.cfg
	return storeKey("postgres", c.Table, c.DSN, c.Table, strconv.Itoa(c.MaxConns), strconv.FormatBool(c.AutoMigrate),
		c.StatementTimeout.String(), strconv.FormatBool(c.ListenNotify), strconv.Itoa(c.CombinedWrites))
}

// OpenStore implements StoreProvider. It needs no database: the store
// connects and migrates when the app starts or a request needs it, so a
// config whose database is down still loads.
func (p *PostgresStore) OpenStore(ctx caddy.Context) (stores.Store, error) {
	logger := ctx.Logger()
	s, err := postgres.Open(ctx, p.cfg, logger)
	if err == nil {
		logger.Info("opened postgres store", zap.String("dsn", s.LoggedDSN()), zap.String("table", p.cfg.Table))
	}
	return s, err
}

// UnmarshalCaddyfile parses
//
//	store postgres {
//	    dsn               <dsn>
//	    table             <name>
//	    max_conns         <n>
//	    auto_migrate      on|off
//	    statement_timeout <duration>
//	    listen_notify     on|off
//	    combined_writes   <n>|off
//	}
func (p *PostgresStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return unmarshalSQLStore(d, "postgres", &p.SQLStoreConfig, func(d *caddyfile.Dispenser) (bool, error) {
		if d.Val() != "listen_notify" {
			return false, nil
		}
		on, err := parseOnOff(d)
		p.ListenNotify = &on
		return true, err
	})
}

// parseCombinedWrites reads combined_writes' one argument: a count of
// batches, or off (0).
func parseCombinedWrites(d *caddyfile.Dispenser) (int, error) {
	arg, err := singleArg(d)
	if err != nil || arg == "off" {
		return 0, err
	}
	// The adapter carries a store's numbers as JSON floats, exact only
	// to 2^53: past it, a value came out rounded.
	n, err := strconv.Atoi(arg)
	if err != nil || n <= 0 || n > maxExactJSONInt {
		return 0, d.Errf("combined_writes must be a positive integer up to %d or off, got %q", maxExactJSONInt, arg)
	}
	return n, nil
}

// CaddyModule returns the Caddy module information.
func (MySQLStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "iceberg_idempotency.stores.mysql",
		New: func() caddy.Module { return new(MySQLStore) },
	}
}

// Provision expands placeholders and applies the store's defaults.
func (m *MySQLStore) Provision(caddy.Context) error {
	if err := m.provision("mysql", mysql.DefaultCombinedWrites); err != nil {
		return err
	}
	cfg, err := mysql.Config{
		DSN:              m.dsn,
		Table:            m.Table,
		MaxConns:         m.MaxConns,
		AutoMigrate:      *m.AutoMigrate,
		StatementTimeout: time.Duration(m.StatementTimeout),
		CombinedWrites:   *m.CombinedWrites,
	}.WithDefaults()
	if err != nil {
		return fmt.Errorf("mysql store: %w", err)
	}
	m.cfg = cfg
	return nil
}

// writeSettle implements writeSettler: a statement may also wait for a row
// lock on the server as long as the DSN's own innodb_lock_wait_timeout, and
// commit then, having arrived as late as SQLStoreConfig.writeSettle says,
// or later by as much as a DSN's readTimeout or writeTimeout below
// statement_timeout ends the call before its end (until the build after
// f2207cc not counted: with readTimeout=1s and the default 5 s, 4 s short).
func (m *MySQLStore) writeSettle() time.Duration {
	return max(m.SQLStoreConfig.writeSettle(), m.cfg.ServerLockWait()+m.statementTimeout()+sqlstore.ClockMargin) +
		m.cfg.DriverCutsShort()
}

// StoreKey implements StoreProvider.
func (m *MySQLStore) StoreKey() string {
	c := m.cfg
	return storeKey("mysql", c.Table, c.DSN, c.Table, strconv.Itoa(c.MaxConns), strconv.FormatBool(c.AutoMigrate),
		c.StatementTimeout.String(), strconv.Itoa(c.CombinedWrites))
}

// OpenStore implements StoreProvider. It needs no database: see
// PostgresStore.OpenStore.
func (m *MySQLStore) OpenStore(ctx caddy.Context) (stores.Store, error) {
	logger := ctx.Logger()
	// The driver reports dropped connections on its own process-wide logger,
	// which writes to stderr; send those lines through Caddy's logs instead.
	_ = mysqldriver.SetLogger(zap.NewStdLog(logger.Named("driver")))
	s, err := mysql.Open(ctx, m.cfg, logger)
	if err == nil {
		logger.Info("opened mysql store", zap.String("dsn", s.LoggedDSN()), zap.String("table", m.cfg.Table))
	}
	return s, err
}

// UnmarshalCaddyfile parses
//
//	store mysql {
//	    dsn               <dsn>
//	    table             <name>
//	    max_conns         <n>
//	    auto_migrate      on|off
//	    statement_timeout <duration>
//	    combined_writes   <n>|off
//	}
func (m *MySQLStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return unmarshalSQLStore(d, "mysql", &m.SQLStoreConfig, nil)
}
