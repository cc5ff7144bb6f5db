// Package pgsession explains a first connection that failed because the
// server refused a session setting the connection string carried.
//
// pgx sends every parameter of a connection string that is not one of its
// own (jit, work_mem, options, application_name, ...) to the server in the
// startup message; libpq, and so psql, takes only those it knows, options
// among them (README, "Session settings"). The server refuses a name it
// does not know, a value it does not accept or a setting the role may not
// make, and its message names the parameter but not where it came from:
// an operator reading "parameter "jit" requires a Boolean value" has to
// guess that it was DATABASE_URL. Carried and Refused make the error say
// so.
//
// Setting reads what a connection string sets, wherever in it, as the
// server will, so that a program's own defaults (the operator commands'
// timeouts) yield to the operator's; ReadCommitted refuses a connection
// string that asks for an isolation level the scheduler's triggers cannot
// work under.
package pgsession

import (
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

// Carried lists the session settings of params (a parsed connection
// string's RuntimeParams: what pgx did not take for itself) as name=value,
// sorted, comma-separated; "" when there are none. Call it before the
// program adds settings of its own, so that only the string's are named.
func Carried(params map[string]string) string {
	list := make([]string, 0, len(params))
	for k, v := range params {
		list = append(list, k+"="+v)
	}
	sort.Strings(list)
	return strings.Join(list, ", ")
}

// Refused returns the error to report when err, from a first connection to
// the server at host:port, is that server refusing a session setting and
// the connection string (named by source, e.g. "DATABASE_URL") carried
// some (carried, from Carried): it names source and the settings, and
// wraps err, whose message has the server's reason. Otherwise it returns
// nil, and the caller reports err as it would have.
//
// A bad value (22023), an unknown name (42704) and a setting that needs a
// restart (55P02) can only be settings at connection time. A permission
// error (42501) can also be the role's want of CONNECT on the database, so
// it counts only when the server's message quotes a name the settings
// carried (`permission denied to set parameter "x"`; quoted names survive
// translation of the message).
func Refused(err error, source, host string, port uint16, carried string) error {
	var pe *pgconn.PgError
	if carried == "" || !errors.As(err, &pe) {
		return nil
	}
	switch pe.Code {
	case pgerrcode.InvalidParameterValue, pgerrcode.UndefinedObject, pgerrcode.CantChangeRuntimeParam:
	case pgerrcode.InsufficientPrivilege:
		if !quotesName(pe.Message, carried) {
			return nil
		}
	default:
		return nil
	}
	return fmt.Errorf("the database at %s:%d refused a session setting in %s (%s): %w",
		host, port, source, carried, err)
}

// settingName is a setting's name before its "=", in carried: the
// parameters' own names and, inside options, each -c name=value's.
var settingName = regexp.MustCompile(`([A-Za-z_][A-Za-z0-9_.]*)=`)

// quotesName reports whether message quotes one of the names in carried.
func quotesName(message, carried string) bool {
	for _, m := range settingName.FindAllStringSubmatch(carried, -1) {
		if strings.Contains(message, `"`+m[1]+`"`) {
			return true
		}
	}
	return false
}

// Setting returns the value params (a parsed connection string's
// RuntimeParams) give the session setting name, and whether they set it at
// all: as a parameter of its own or inside options, in any form the server
// takes there ("-c name=value", "-cname=value" or "--name=value", a '-' in
// the name read as '_'). Names are compared as the server does, ignoring
// case. Where several set it, the value is the one the server ends with: a
// parameter of its own is applied after options, and within options the
// last one counts.
//
// A program that gives a setting a default of its own asks this first, so
// that the connection string's setting wins: a default sent as a parameter
// would silently override the operator's options.
func Setting(params map[string]string, name string) (string, bool) {
	for k, v := range params {
		if strings.EqualFold(k, name) {
			return v, true
		}
	}
	var (
		value string
		found bool
	)
	args := splitOptions(params["options"])
	for i := 0; i < len(args); i++ {
		var setting string
		switch a := args[i]; {
		case a == "-c" && i+1 < len(args):
			i++
			setting = args[i]
		case strings.HasPrefix(a, "--"), strings.HasPrefix(a, "-c"):
			setting = a[2:]
		default:
			continue
		}
		// As the server's ParseLongOption reads a name.
		if n, v, ok := strings.Cut(setting, "="); ok && strings.EqualFold(strings.ReplaceAll(n, "-", "_"), name) {
			value, found = v, true
		}
	}
	return value, found
}

// ReadCommitted returns an error, which names source (e.g.
// "DATABASE_URL"), when params (a parsed connection string's
// RuntimeParams) ask for an isolation level other than READ COMMITTED:
// the scheduler's statements and triggers read again after taking locks,
// and see what committed meanwhile only so (docs/design.md section 4).
// Where params say nothing, the server's default holds, which
// internal/pgconnect checks on a connection.
func ReadCommitted(params map[string]string, source string) error {
	const name = "default_transaction_isolation"
	v, ok := Setting(params, name)
	if !ok {
		return nil
	}
	// The server's names, compared as it does; READ UNCOMMITTED is READ
	// COMMITTED in PostgreSQL.
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "read committed", "read uncommitted":
		return nil
	}
	return fmt.Errorf("%s sets %s=%s; the scheduler needs read committed (its statements and triggers read again after taking locks, and must see what committed meanwhile): remove the setting",
		source, name, v)
}

// splitOptions splits an options parameter into arguments as the server
// does (pg_split_opts): at unescaped whitespace, a backslash taking the
// next character as it is.
func splitOptions(options string) []string {
	var (
		args    []string
		cur     strings.Builder
		inArg   bool
		escaped bool
	)
	for _, r := range options {
		switch {
		case escaped:
			cur.WriteRune(r)
			escaped = false
		case r == '\\':
			escaped, inArg = true, true
		case r == ' ' || r == '\t' || r == '\n' || r == '\r' || r == '\f' || r == '\v':
			if inArg {
				args = append(args, cur.String())
				cur.Reset()
				inArg = false
			}
		default:
			cur.WriteRune(r)
			inArg = true
		}
	}
	if inArg {
		args = append(args, cur.String())
	}
	return args
}
