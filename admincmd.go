package icebergidempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"

	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "iceberg-idempotency",
		Usage: "key|forget|stats [<uuid>] [--force] [--address <listen>] [--config <path> [--adapter <name>]]",
		Short: "Inspects or forgets idempotency records through the admin API",
		Long: `
Talks to the admin API of a running Caddy (the admin.api.iceberg_idempotency
module) about the records of the iceberg_idempotency handler's stores.

  key <uuid>               prints the record of the key in each store in use:
                           state, operation, path, status, times; never the
                           body, header values or the principal
  forget <uuid> [--force]  deletes the record in every store in use, so a
                           later request with the key executes again; only
                           an abandoned record (outcome unknown) unless
                           --force: one whose request is executing, or
                           whose answer is stored, is refused
  stats                    counts each store's records by state (a full
                           table scan on the SQL stores)

It connects to the admin API at '` + caddy.DefaultAdminListen + `' unless
--address, or the admin address of the --config file, says otherwise. The
exit status is non-zero when the admin API answers with an error, for
example for an unknown key.`,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.PersistentFlags().StringP("address", "", "", "Address of the administration API listener (if --config is not used)")
			cmd.PersistentFlags().StringP("config", "c", "", "Configuration file (if --address is not used)")
			cmd.PersistentFlags().StringP("adapter", "a", "", "Name of config adapter to apply (if --config is used)")
			key := &cobra.Command{
				Use:   "key <uuid>",
				Short: "Prints a key's record in each store in use, as JSON",
				Args:  cobra.ExactArgs(1),
				RunE:  caddycmd.WrapCommandFuncForCobra(cmdKey),
			}
			forget := &cobra.Command{
				Use:   "forget <uuid>",
				Short: "Deletes a key's record in every store in use",
				Args:  cobra.ExactArgs(1),
				RunE:  caddycmd.WrapCommandFuncForCobra(cmdForget),
			}
			forget.Flags().BoolP("force", "f", false, "Forget a record whose request is still executing, or whose answer is stored")
			stats := &cobra.Command{
				Use:   "stats",
				Short: "Prints each store's record counts, as JSON",
				Args:  cobra.NoArgs,
				RunE:  caddycmd.WrapCommandFuncForCobra(cmdStats),
			}
			cmd.AddCommand(key, forget, stats)
			// Runnable, so that a mistyped subcommand is an error (non-zero
			// exit) rather than help and success.
			cmd.Args = cobra.NoArgs
			cmd.RunE = func(c *cobra.Command, _ []string) error {
				return fmt.Errorf("name a subcommand: key, forget or stats (see %s --help)", c.CommandPath())
			}
		},
	})
}

// cmdOut is where the commands print; tests capture it.
var cmdOut io.Writer = os.Stdout

// adminRequest sends one request to the admin API named by the flags and
// returns the response body. caddycmd.AdminAPIRequest turns an error
// status into an error carrying the admin API's message.
func adminRequest(fl caddycmd.Flags, method, uri string) ([]byte, error) {
	addr, err := caddycmd.DetermineAdminAPIAddress(fl.String("address"), nil, fl.String("config"), fl.String("adapter"))
	if err != nil {
		return nil, fmt.Errorf("finding the admin API address: %w", err)
	}
	resp, err := caddycmd.AdminAPIRequest(addr, method, uri, nil, nil)
	if err != nil {
		return nil, plainAPIError(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("reading the admin API's answer: %w", err)
	}
	return body, nil
}

// apiErrorText is how caddycmd.AdminAPIRequest words an error status: the
// admin API's JSON answer, quoted whole.
var apiErrorText = regexp.MustCompile(`(?s)^caddy responded with error: HTTP (\d+): (.*)$`)

// plainAPIError gives an error status's message as text: in the JSON
// answer, inside the JSON line Caddy's CLI logs it with, its quotes came
// out escaped and its advice hard to read.
func plainAPIError(err error) error {
	m := apiErrorText.FindStringSubmatch(err.Error())
	if m == nil {
		return err
	}
	var ans struct {
		Error string `json:"error"`
	}
	if json.Unmarshal([]byte(m[2]), &ans) != nil || ans.Error == "" {
		return err
	}
	return fmt.Errorf("admin API answered HTTP %s: %s", m[1], ans.Error)
}

// keyURI is the admin path of a key; the key is checked by the server, and
// only escaped here.
func keyURI(key string) string {
	return adminBase + "keys/" + url.PathEscape(key)
}

// printJSON writes an admin answer indented, for a person to read.
func printJSON(body []byte) error {
	var out bytes.Buffer
	if err := json.Indent(&out, body, "", "  "); err != nil {
		return fmt.Errorf("decoding the admin API's answer: %w", err)
	}
	out.WriteByte('\n')
	_, err := out.WriteTo(cmdOut)
	return err
}

// notAdminAnswer is the error for a 200 answer without the fields the
// admin API always sends: another server answered (a site's address given
// as --address, a catalog behind it), and its JSON says nothing of the key.
func notAdminAnswer(what string) error {
	return fmt.Errorf("the answer is not the iceberg_idempotency admin API's (it has no %s): is --address Caddy's admin endpoint (%s by default), not a site's?", what, caddy.DefaultAdminListen)
}

// decodeAnswer decodes a 200 answer into v. One that is not JSON (a
// site's HTML page) came from another server, as notAdminAnswer says.
func decodeAnswer(body []byte, v any) error {
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("decoding the admin API's answer: %w; is --address Caddy's admin endpoint (%s by default), not a site's?", err, caddy.DefaultAdminListen)
	}
	return nil
}

// keyReply is what the commands read of an answer about a key (keyAnswer
// as sent); a field left out of the JSON stays nil.
type keyReply struct {
	Key       *string          `json:"key"`
	Records   *json.RawMessage `json:"records"`
	Forgotten *int             `json:"forgotten"`
	Errors    []storeError     `json:"errors"`
}

// readKeyReply decodes an answer about the key asked and checks that it is
// the admin API's: it names that key (lower-cased, as the handler compares
// keys) and lists records.
func readKeyReply(body []byte, asked string) (keyReply, error) {
	var ans keyReply
	if err := decodeAnswer(body, &ans); err != nil {
		return ans, err
	}
	if ans.Key == nil {
		return ans, notAdminAnswer(`"key"`)
	}
	if !strings.EqualFold(*ans.Key, asked) {
		return ans, fmt.Errorf("the admin API answered about key %q, not %q", *ans.Key, asked)
	}
	if ans.Records == nil {
		return ans, notAdminAnswer(`"records"`)
	}
	return ans, nil
}

func cmdKey(fl caddycmd.Flags) (int, error) {
	body, err := adminRequest(fl, http.MethodGet, keyURI(fl.Arg(0)))
	if err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	ans, err := readKeyReply(body, fl.Arg(0))
	if err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	if err := printJSON(body); err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	// A store that failed may hold the key too: the answer is partial.
	if len(ans.Errors) > 0 {
		return caddy.ExitCodeFailedStartup, fmt.Errorf("%d store(s) could not be asked: the key may be there too", len(ans.Errors))
	}
	return caddy.ExitCodeSuccess, nil
}

func cmdForget(fl caddycmd.Flags) (int, error) {
	uri := keyURI(fl.Arg(0))
	if fl.Bool("force") {
		uri += "?force=true"
	}
	body, err := adminRequest(fl, http.MethodDelete, uri)
	if err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	ans, err := readKeyReply(body, fl.Arg(0))
	if err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	if ans.Forgotten == nil {
		return caddy.ExitCodeFailedStartup, notAdminAnswer(`"forgotten"`)
	}
	if len(ans.Errors) > 0 {
		fmt.Fprintf(cmdOut, "forgot key %s in %d store(s)\n", *ans.Key, *ans.Forgotten)
		return caddy.ExitCodeFailedStartup, fmt.Errorf("%d store(s) could not forget key %s: %s", len(ans.Errors), *ans.Key, body)
	}
	if *ans.Forgotten == 0 {
		// Only a forced delete answers so: the record it looked up was
		// gone by its delete (another forget, or the purge), which is
		// what was asked, but "forgot in 0 stores" reads as a failure.
		fmt.Fprintf(cmdOut, "key %s: no store held it any more when deleting (forgotten by another call, or expired, since it was looked up)\n", *ans.Key)
		return caddy.ExitCodeSuccess, nil
	}
	fmt.Fprintf(cmdOut, "forgot key %s in %d store(s)\n", *ans.Key, *ans.Forgotten)
	return caddy.ExitCodeSuccess, nil
}

func cmdStats(fl caddycmd.Flags) (int, error) {
	body, err := adminRequest(fl, http.MethodGet, adminBase+"stats")
	if err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	var ans struct {
		Stores *[]storeStats `json:"stores"`
	}
	if err := decodeAnswer(body, &ans); err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	if ans.Stores == nil {
		return caddy.ExitCodeFailedStartup, notAdminAnswer(`"stores"`)
	}
	if err := printJSON(body); err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	if len(*ans.Stores) == 0 {
		return caddy.ExitCodeFailedStartup, errors.New(noStoreInUseText)
	}
	var failed []string
	for _, s := range *ans.Stores {
		if s.Error != "" {
			failed = append(failed, s.Store+": "+s.Error)
		}
	}
	if len(failed) > 0 {
		return caddy.ExitCodeFailedStartup, fmt.Errorf("%d store(s) could not count: %s", len(failed), strings.Join(failed, "; "))
	}
	return caddy.ExitCodeSuccess, nil
}
