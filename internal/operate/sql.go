package operate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/deferq/scheduler/sql/runbook"
)

// Statement is one statement of a runbook file with its psql variables
// turned into pgx placeholders.
type Statement struct {
	SQL  string
	Args []any
}

// Bind prepares a psql script for pgx, so that the operator commands
// run the runbook files exactly as an operator does with psql -f. It splits
// query into statements at top-level semicolons and replaces each psql
// variable reference, :'name' (a text literal) or :name (a number), with a
// placeholder $n whose argument is vars[name]; every use of one name within a
// statement shares one placeholder. Arguments are strings, which pgx sends in
// text format, so the server parses each one as the type the statement gives
// its placeholder, the way it would parse the value psql pastes in.
//
// Like psql, it leaves alone what is inside string literals (standard, escape,
// dollar-quoted), quoted identifiers and comments, and the :: of casts.
// A reference to a variable missing from vars, a variable in vars that the
// script never uses (a typo in the caller), psql meta-commands and the
// :"name" and :{?name} forms are errors: the runbook files use none of them.
func Bind(query string, vars map[string]string) ([]Statement, error) {
	var (
		out     []Statement
		b       strings.Builder
		args    []any
		slot    = map[string]int{} // name -> placeholder number in this statement
		used    = map[string]bool{}
		content bool // the statement has more than blanks and comments
		depth   int  // parentheses: a ; inside them does not end a statement
		line    = 1
	)
	finish := func() {
		if content {
			out = append(out, Statement{SQL: strings.TrimSpace(b.String()), Args: args})
		}
		b.Reset()
		args, slot, content = nil, map[string]int{}, false
	}
	// copyThrough copies query[i:end] and counts its lines.
	copyThrough := func(i, end int) int {
		line += strings.Count(query[i:end], "\n")
		b.WriteString(query[i:end])
		return end
	}
	for i := 0; i < len(query); {
		c := query[i]
		next := byte(0)
		if i+1 < len(query) {
			next = query[i+1]
		}
		switch {
		case c == '-' && next == '-':
			end := strings.IndexByte(query[i:], '\n')
			if end < 0 {
				end = len(query) - i
			}
			i = copyThrough(i, i+end)

		case c == '/' && next == '*':
			// Block comments nest in PostgreSQL.
			end, nest := i+2, 1
			for nest > 0 && end < len(query) {
				switch {
				case strings.HasPrefix(query[end:], "/*"):
					nest, end = nest+1, end+2
				case strings.HasPrefix(query[end:], "*/"):
					nest, end = nest-1, end+2
				default:
					end++
				}
			}
			if nest > 0 {
				return nil, fmt.Errorf("line %d: unterminated /* comment", line)
			}
			i = copyThrough(i, end)

		case c == '\'':
			// In an E'' string a backslash escapes the next character;
			// elsewhere (standard_conforming_strings) it is a character.
			escapes := i > 0 && (query[i-1] == 'E' || query[i-1] == 'e') && (i < 2 || !identChar(query[i-2]))
			end, ok := i+1, false
			for end < len(query) {
				if escapes && query[end] == '\\' {
					end += 2
					continue
				}
				if query[end] == '\'' {
					ok = true
					end++
					break
				}
				end++
			}
			if !ok || end > len(query) {
				return nil, fmt.Errorf("line %d: unterminated string literal", line)
			}
			content = true
			i = copyThrough(i, end) // '' inside a literal reads as two literals: same result

		case c == '"':
			end := strings.IndexByte(query[i+1:], '"')
			if end < 0 {
				return nil, fmt.Errorf("line %d: unterminated quoted identifier", line)
			}
			content = true
			i = copyThrough(i, i+1+end+1)

		case c == '$' && (i == 0 || !identChar(query[i-1])) && (next == '$' || identStart(next)):
			// A dollar quote $tag$...$tag$; $1 is a placeholder, and a $
			// inside an identifier is part of it.
			tagEnd := i + 1
			for tagEnd < len(query) && identChar(query[tagEnd]) {
				tagEnd++
			}
			if tagEnd >= len(query) || query[tagEnd] != '$' {
				content = true
				i = copyThrough(i, tagEnd)
				break
			}
			tag := query[i : tagEnd+1]
			end := strings.Index(query[tagEnd+1:], tag)
			if end < 0 {
				return nil, fmt.Errorf("line %d: unterminated dollar-quoted string %s", line, tag)
			}
			content = true
			i = copyThrough(i, tagEnd+1+end+len(tag))

		case c == ':' && next == ':':
			content = true
			i = copyThrough(i, i+2)

		case c == ':' && (next == '\'' || identStart(next)):
			var name string
			if next == '\'' {
				end := strings.IndexByte(query[i+2:], '\'')
				if end < 0 {
					return nil, fmt.Errorf("line %d: unterminated variable reference :'", line)
				}
				name = query[i+2 : i+2+end]
				if !validVarName(name) {
					return nil, fmt.Errorf("line %d: :'%s' is not a psql variable reference", line, name)
				}
				i += 2 + end + 1
			} else {
				end := i + 1
				for end < len(query) && identChar(query[end]) {
					end++
				}
				name = query[i+1 : end]
				i = end
			}
			value, ok := vars[name]
			if !ok {
				return nil, fmt.Errorf("line %d: variable %q is not set", line, name)
			}
			n, ok := slot[name]
			if !ok {
				args = append(args, value)
				n = len(args)
				slot[name] = n
			}
			used[name] = true
			content = true
			fmt.Fprintf(&b, "$%d", n)

		case c == ':' && (next == '"' || next == '{'):
			return nil, fmt.Errorf("line %d: psql variable form :%c is not supported", line, next)

		case c == '\\':
			end := strings.IndexAny(query[i:], " \t\n")
			if end < 0 {
				end = len(query) - i
			}
			return nil, fmt.Errorf("line %d: psql meta-command %s is not supported", line, query[i:i+end])

		case c == ';' && depth == 0:
			i++
			finish()

		default:
			switch c {
			case '(':
				depth++
			case ')':
				depth--
			}
			if c != ' ' && c != '\t' && c != '\n' && c != '\r' {
				content = true
			}
			i = copyThrough(i, i+1)
		}
	}
	finish()
	var unused []string
	for name := range vars {
		if !used[name] {
			unused = append(unused, name)
		}
	}
	if len(unused) > 0 {
		slices.Sort(unused)
		return nil, fmt.Errorf("variable %s not used by the script", strings.Join(unused, ", "))
	}
	return out, nil
}

// identStart and identChar follow psql's variable names: ASCII letters,
// digits and underscores (and bytes >= 0x80, part of UTF-8 names).
func identStart(c byte) bool {
	return c == '_' || c >= 0x80 || (c|0x20 >= 'a' && c|0x20 <= 'z')
}

func identChar(c byte) bool { return identStart(c) || (c >= '0' && c <= '9') }

func validVarName(s string) bool {
	if s == "" || !identStart(s[0]) {
		return false
	}
	for i := 1; i < len(s); i++ {
		if !identChar(s[i]) {
			return false
		}
	}
	return true
}

// Statements returns the statements of the runbook file name with
// vars bound.
func Statements(name string, vars map[string]string) ([]Statement, error) {
	q, err := runbook.Query(name)
	if err != nil {
		return nil, err
	}
	sts, err := Bind(q, vars)
	if err != nil {
		return nil, fmt.Errorf("runbook %s: %w", name, err)
	}
	return sts, nil
}

// Queryer runs a statement: a connection or a transaction.
type Queryer interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Collect runs st and scans its rows into T by column name. Every
// column must have a field: a runbook file and the command that reads it
// change together.
func Collect[T any](ctx context.Context, q Queryer, st Statement) ([]T, error) {
	rows, err := q.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return nil, err
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByName[T])
	if out == nil {
		out = []T{} // JSON [] rather than null
	}
	return out, err
}

// Rows runs the runbook file name, which must be one statement, and
// scans its rows into T.
func Rows[T any](ctx context.Context, q Queryer, name string, vars map[string]string) ([]T, error) {
	sts, err := Statements(name, vars)
	if err != nil {
		return nil, err
	}
	if len(sts) != 1 {
		return nil, fmt.Errorf("runbook %s: %d statements, want 1", name, len(sts))
	}
	rows, err := Collect[T](ctx, q, sts[0])
	if err != nil {
		return nil, ExplainDBError(name, err)
	}
	return rows, nil
}

// ExplainDBError names the runbook file that failed and adds what an
// operator should do about the errors the README documents.
func ExplainDBError(name string, err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == pgerrcode.DeadlockDetected {
		return fmt.Errorf("runbook %s: %w: a dispatcher was finalizing some of the same messages; nothing changed, run it again", name, err)
	}
	return fmt.Errorf("runbook %s: %w", name, err)
}

// ExplainNoSchema turns the error of a statement that ran into a missing
// table (undefined_table) into what is wrong and what to do: the database
// was never migrated (or not fully), not a bug in the command. Every
// operator command's statements run under withConn, which calls it with
// the connection they ran on.
func ExplainNoSchema(ctx context.Context, conn *pgx.Conn, err error) error {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != pgerrcode.UndefinedTable {
		return err
	}
	what := "lacks part of the scheduler schema"
	// A failed statement outside a transaction, or a rolled back one,
	// leaves the connection usable for this question.
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	var exists bool
	if conn.QueryRow(qctx, "SELECT to_regclass('deferred_message') IS NOT NULL").Scan(&exists) == nil && !exists {
		what = "has no scheduler schema"
	}
	cc := conn.Config()
	return fmt.Errorf("the database %s at %s:%d %s (%s): run `scheduler migrate` with this DATABASE_URL",
		cc.Database, cc.Host, cc.Port, what, pe.Message)
}

// Execer runs a statement that returns no rows: a connection or a
// transaction.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// SetActor names who makes the changes of the rest of the transaction
// (for example "console:alice" or "cli:bob"): the history triggers record it
// in deferred_attempt.actor, and where it is not set they record the
// database's session_user, which is who an operator with psql is. It lasts
// until the transaction ends, so it must run inside one.
func SetActor(ctx context.Context, q Execer, actor string) error {
	if _, err := q.Exec(ctx, "SELECT set_config('scheduler.actor', $1, true)", actor); err != nil {
		return fmt.Errorf("set the actor of this change: %w", err)
	}
	return nil
}
