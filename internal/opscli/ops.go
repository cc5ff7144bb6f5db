// Package opscli holds the scheduler's operator commands: status, ls, show,
// held, expedite, cancel, park, replay, pause, resume, limit, targets,
// inflight and release.
// Each is a thin wrapper over files of the SQL runbook (sql/runbook), run
// with the variables an operator would pass to psql, so the CLI and the
// runbook cannot drift apart. Output is an aligned table, or JSON with
// --json; an error is one line on stderr (JSON with --json) and a non-zero
// exit: 2 for a usage error (nothing was attempted), 1 for anything else.
package opscli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/cmdflag"
	"github.com/deferq/scheduler/internal/operate"
	"github.com/deferq/scheduler/internal/pgconnect"
	"github.com/deferq/scheduler/internal/pgsession"
	"github.com/deferq/scheduler/sql/queries"
)

// opsConnectTimeout bounds connecting to the database: an operator asking a
// question during an incident wants "the database is down" at once, not a
// hang.
const opsConnectTimeout = 5 * time.Second

// messageStates are the values of deferred_message.state.
func messageStates() []string { return []string{"pending", "parked", "rejected"} }

// usageError marks a mistake in how a command was called (exit code 2).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// ops is what one operator command runs with.
type ops struct {
	name           string // the subcommand, for messages
	json           bool
	stdout, stderr io.Writer
	// local are the settings each transaction takes (inTx), set by
	// connect.
	local queries.SessionLocalParams
}

// newOps returns the command's state and a flag set with --json defined.
func newOps(name string, args []string, stdout, stderr io.Writer) (*ops, *flag.FlagSet) {
	o := &ops{name: name, stdout: stdout, stderr: stderr}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.BoolVar(&o.json, "json", false, "print JSON for scripts; errors too, as {\"error\": \"...\"} on stderr")
	// Known before parsing, so that a flag parse error is reported as JSON
	// when JSON was asked for.
	o.json = jsonRequested(args)
	return o, fs
}

// jsonRequested reports whether args ask for JSON output, before flags are
// parsed.
func jsonRequested(args []string) bool {
	for _, a := range args {
		if a == "--" {
			break
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && name == "json" {
			b, err := strconv.ParseBool(value)
			return !hasValue || (err == nil && b)
		}
	}
	return false
}

// parse parses flags wherever they stand among the arguments, as operators
// type them (scheduler cancel 5 6 --json), and returns the other arguments.
// "--" ends the flags. done means the caller returns code: help was asked
// for, or the arguments are wrong.
func (o *ops) parse(fs *flag.FlagSet, args []string, help string) (pos []string, done bool, code int) {
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	for {
		err := fs.Parse(args)
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(o.stdout, help)
			fmt.Fprint(o.stdout, "\nFlags:\n")
			cmdflag.PrintDefaults(o.stdout, fs)
			return nil, true, 0
		}
		if err != nil {
			return nil, true, o.exit(usageError{err})
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, false, 0
		}
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(pos, rest...), false, 0
		}
		pos, args = append(pos, rest[0]), rest[1:]
	}
}

// exit reports err, if any, and returns the exit code.
func (o *ops) exit(err error) int {
	if err == nil {
		return 0
	}
	code, msg := 1, err.Error()
	if errors.As(err, new(usageError)) {
		code = 2
		msg += " (see scheduler " + o.name + " --help)"
	}
	msg = oneLine(msg)
	if o.json {
		b, _ := json.Marshal(map[string]string{"error": msg}) // a map of strings always marshals
		fmt.Fprintf(o.stderr, "%s\n", b)
	} else {
		fmt.Fprintf(o.stderr, "scheduler %s: %s\n", o.name, msg)
	}
	return code
}

// oneLine joins the lines of a message (errors.Join, a connect error that
// lists each address tried) so that every error is one line. Repeated lines
// say nothing new and are dropped.
func oneLine(s string) string {
	var b strings.Builder
	var seen []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l == "" || slices.Contains(seen, l) {
			continue
		}
		seen = append(seen, l)
		switch {
		case b.Len() == 0:
		case strings.HasSuffix(b.String(), ":"):
			b.WriteString(" ")
		default:
			b.WriteString("; ")
		}
		b.WriteString(l)
	}
	return b.String()
}

func (o *ops) printJSON(v any) error {
	enc := json.NewEncoder(o.stdout)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// connect opens one connection to DATABASE_URL, failing within
// opsConnectTimeout when the database does not answer, and sets o.local,
// the settings each of its transactions takes (inTx).
func (o *ops) connect(ctx context.Context, environ []string) (*pgx.Conn, error) {
	// Only DATABASE_URL: an operator command must not fail over a Kafka
	// setting it never uses.
	dbURL := cmdflag.Lookup(environ, "DATABASE_URL")
	if dbURL == "" {
		return nil, usagef("DATABASE_URL is not set: want a PostgreSQL URL, e.g. postgres://user:pass@host:5432/db")
	}
	cc, err := pgx.ParseConfig(dbURL)
	if err != nil {
		return nil, usageError{fmt.Errorf("DATABASE_URL is not a valid PostgreSQL URL: %w", err)}
	}
	if err := pgsession.ReadCommitted(cc.RuntimeParams, "DATABASE_URL"); err != nil {
		return nil, usageError{err}
	}
	// A row locked by someone else (a dispatcher finalizing, an open psql
	// session) must give a clear error, not a hang. These are defaults:
	// an operator who set one in DATABASE_URL (a cancel of a million rows
	// may need more than 30s) gets theirs.
	o.local = queries.SessionLocalParams{}
	for _, d := range []struct{ name, value string }{{"lock_timeout", "5s"}, {"statement_timeout", "30s"}} {
		if _, ok := pgsession.Setting(cc.RuntimeParams, d.name); !ok {
			o.local.Names = append(o.local.Names, d.name)
			o.local.Values = append(o.local.Values, d.value)
		}
	}
	// Reads may go to a standby; a change there fails with the server's
	// own "read-only transaction".
	conn, err := pgconnect.Connect(ctx, dbURL, pgconnect.Options{
		Source: "DATABASE_URL", AppName: "defer-scheduler-" + o.name, AppNameFixed: true, Timeout: opsConnectTimeout, AllowReadOnly: true})
	if err != nil {
		return nil, err
	}
	return conn.Conn, nil
}

// withConn connects and runs f, closing the connection after.
func (o *ops) withConn(ctx context.Context, environ []string, f func(conn *pgx.Conn) error) error {
	conn, err := o.connect(ctx, environ)
	if err != nil {
		return err
	}
	defer func() {
		// Closing sends a goodbye; bound it, since the command's own
		// context may be cancelled already and the network may be gone.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		conn.Close(cctx)
	}()
	return operate.ExplainNoSchema(ctx, conn, f(conn))
}

// inTx runs f in a transaction that commits only if f succeeds, so a
// command that finds a problem halfway changes nothing. The transaction
// first takes o.local, the command's timeouts, for itself alone: sent as
// startup parameters they would be refused by a pooler, and a session's
// SET would stay behind on a pooler's server session.
func (o *ops) inTx(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions, f func(tx pgx.Tx) error) error {
	tx, err := conn.BeginTx(ctx, opts)
	if err != nil {
		return fmt.Errorf("begin transaction: %w", err)
	}
	if len(o.local.Names) > 0 {
		err = queries.SessionLocal(ctx, tx, o.local)
	}
	if err == nil {
		err = f(tx)
	}
	if err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx)) // the error that matters is f's
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// readCommitted is the level of the commands' changes, named where each
// transaction begins: the head triggers need it whatever the server's
// default (docs/design.md, "Only in READ COMMITTED").
func readCommitted() pgx.TxOptions { return pgx.TxOptions{IsoLevel: pgx.ReadCommitted} }

// readOnly gives commands that run several statements one consistent
// snapshot.
func readOnly() pgx.TxOptions {
	return pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}
}

// parseIDs parses message ids given as arguments, each one id or a
// comma-separated list, and returns them without duplicates, in order.
func parseIDs(args []string) ([]int64, error) {
	var ids []int64
	for _, a := range args {
		for _, s := range strings.Split(a, ",") {
			id, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
			if err != nil || id <= 0 {
				return nil, usagef("%q is not a message id: want a positive integer", s)
			}
			if !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
	}
	return ids, nil
}

// idArgs joins the ids given as arguments and those of --id (flagIDs),
// without duplicates, in order: every command that takes ids takes both.
func idArgs(pos []string, flagIDs []int64) ([]int64, error) {
	ids, err := parseIDs(pos)
	if err != nil {
		return nil, err
	}
	for _, id := range flagIDs {
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// idList is the :'ids' variable of the id runbook files.
func idList(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ",")
}

// showRunbook runs the runbook file on a fresh connection and prints its
// rows: as JSON with --json; else empty when there are none (if empty is
// set); else through print. done is false only when the rows were printed
// as a table, for a caller that adds a footer; code is the exit code.
func showRunbook[T any](ctx context.Context, o *ops, environ []string, file string, vars map[string]string,
	empty string, print func(io.Writer, []T)) (rows []T, code int, done bool) {
	err := o.withConn(ctx, environ, func(conn *pgx.Conn) (err error) {
		return o.inTx(ctx, conn, readCommitted(), func(tx pgx.Tx) (err error) {
			rows, err = operate.Rows[T](ctx, tx, file, vars)
			return err
		})
	})
	switch {
	case err != nil:
		return nil, o.exit(err), true
	case o.json:
		return rows, o.exit(o.printJSON(rows)), true
	case len(rows) == 0 && empty != "":
		fmt.Fprintln(o.stdout, empty)
		return rows, 0, true
	}
	print(o.stdout, rows)
	return rows, 0, false
}
