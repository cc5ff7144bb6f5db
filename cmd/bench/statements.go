package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/sql/queries"
	"github.com/deferq/scheduler/sql/schema"
)

// Where Postgres's time goes, statement by statement: pg_stat_statements,
// read before and after a phase in the phase's database. The CPU figures
// say how much Postgres spent per message; these say on what, so that the
// gap to the bare queue can be read off a run instead of reconstructed by
// hand (docs/benchmarks.md, "Where Postgres's time goes").
//
// The figure is pg_stat_statements' total_exec_time: the executor's wall
// time, lock waits and time off the CPU included, so on a busy machine the
// statements' sum exceeds the CPU Postgres used. Statements run inside
// triggers and functions are counted both on their own (nested) and within
// the statement that fired them (track = all); the report keeps the two
// apart so that nothing is added twice.

// enableStatements loads pg_stat_statements into a throwaway cluster, which
// needs a restart: the cluster has just started and holds no data yet. It
// tracks nested statements too (track = all), a setting PostgreSQL knows
// only once the library is loaded.
func enableStatements(ctx context.Context, p *postgres) error {
	exec := func(stmts ...string) error {
		conn, err := pgx.Connect(ctx, p.adminURL)
		if err != nil {
			return err
		}
		defer conn.Close(context.WithoutCancel(ctx))
		for _, stmt := range stmts {
			if _, err := conn.Exec(ctx, stmt); err != nil {
				return fmt.Errorf("%s: %w", stmt, err)
			}
		}
		return nil
	}
	if err := exec("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"); err != nil {
		return err
	}
	if err := p.cluster.Restart(ctx); err != nil {
		return err
	}
	return exec("ALTER SYSTEM SET pg_stat_statements.track = 'all'",
		"ALTER SYSTEM SET pg_stat_statements.track_planning = on", "SELECT pg_reload_conf()")
}

// probeStatements reports whether pg_stat_statements can be read on the
// admin database, creating the extension there if the server loaded it.
func (p *postgres) probeStatements(ctx context.Context) error {
	var loaded bool
	if err := p.admin.QueryRow(ctx,
		`SELECT 'pg_stat_statements' = ANY (regexp_split_to_array(current_setting('shared_preload_libraries'), '\s*,\s*'))`).Scan(&loaded); err != nil {
		return err
	}
	if !loaded {
		return fmt.Errorf("the server does not load pg_stat_statements (shared_preload_libraries)")
	}
	if _, err := p.admin.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"); err != nil {
		return err
	}
	_, err := p.admin.Exec(ctx, "SELECT FROM pg_stat_statements LIMIT 0")
	return err
}

// stmtKey names one entry of pg_stat_statements within a database: the same
// statement run at top level and inside a function, or by two roles, are
// two entries.
type stmtKey struct {
	user   uint32
	id     int64
	nested bool
}

// stmtTotal is an entry's running totals.
type stmtTotal struct {
	query      string
	calls      int64
	exec, plan time.Duration
	jit        time.Duration
}

// stmtSample is a database's entries at one moment.
type stmtSample map[stmtKey]stmtTotal

// statements samples the entries of database name; nil when the server
// does not track statements (p.stmts is false).
func (p *postgres) statements(ctx context.Context, name string) (stmtSample, error) {
	if !p.stmts {
		return nil, nil
	}
	rows, err := p.admin.Query(ctx, `SELECT s.userid, coalesce(s.queryid, 0), NOT s.toplevel, s.calls, s.total_exec_time, s.total_plan_time,
			s.jit_generation_time + s.jit_inlining_time + s.jit_optimization_time + s.jit_emission_time, coalesce(s.query, '')
		FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
		WHERE d.datname = $1`, name)
	if err != nil {
		return nil, fmt.Errorf("read pg_stat_statements of %s: %w", name, err)
	}
	defer rows.Close()
	s := stmtSample{}
	for rows.Next() {
		var k stmtKey
		var t stmtTotal
		var ms, planMS, jitMS float64
		if err := rows.Scan(&k.user, &k.id, &k.nested, &t.calls, &ms, &planMS, &jitMS, &t.query); err != nil {
			return nil, fmt.Errorf("read pg_stat_statements of %s: %w", name, err)
		}
		t.exec = time.Duration(ms * float64(time.Millisecond))
		t.plan = time.Duration(planMS * float64(time.Millisecond))
		t.jit = time.Duration(jitMS * float64(time.Millisecond))
		s[k] = t
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read pg_stat_statements of %s: %w", name, err)
	}
	return s, nil
}

// stmtCost is what one statement cost during a phase.
type stmtCost struct {
	label  string
	nested bool // run inside a trigger or function; its time is also in the statement that ran it
	calls  int64
	exec   time.Duration
	// plan is the time spent planning it (pg_stat_statements.track_planning).
	// A top-level statement is planned before it runs; a nested one while
	// the statement that fired it runs, so that one's exec holds it.
	plan time.Duration
	// jit is the part of exec spent compiling it by JIT: a statement
	// costed above jit_above_cost compiles itself on every run, and at
	// about 100 ms that can be most of a short statement's time
	// (docs/benchmarks.md, "The claim compiled by JIT").
	jit time.Duration
}

// since returns what each statement cost between before and s, most
// expensive first; nil when either sample is missing.
func (s stmtSample) since(before stmtSample, lb *stmtLabeler) []stmtCost {
	if s == nil || before == nil {
		return nil
	}
	var out []stmtCost
	for k, t := range s {
		b := before[k]
		if t.calls <= b.calls {
			continue
		}
		out = append(out, stmtCost{label: lb.label(t.query), nested: k.nested, calls: t.calls - b.calls,
			exec: t.exec - b.exec, plan: t.plan - b.plan, jit: t.jit - b.jit})
	}
	slices.SortFunc(out, func(a, b stmtCost) int {
		return cmp.Or(cmp.Compare(b.exec+b.plan, a.exec+a.plan), strings.Compare(a.label, b.label))
	})
	return out
}

// topLevel sums the statements the clients sent, planning and execution
// (each including what its triggers ran).
func topLevel(costs []stmtCost) time.Duration {
	var d time.Duration
	for _, c := range costs {
		if !c.nested {
			d += c.exec + c.plan
		}
	}
	return d
}

// stmtLabeler names a statement by where it is written: the service's
// statement files (sql/queries) by their first line, which is a comment
// unique to each; the functions (sql/schema) by the text of the statement
// up to its first parameter, which pg_stat_statements writes for constants
// and PL/pgSQL variables alike. Anything else (River's, the bench's own)
// is its first words.
type stmtLabeler struct {
	byFirstLine map[string]string // first line of a statement file -> file
	functions   []schema.Definition
	codes       []string // each function's code, whitespace collapsed
}

func newStmtLabeler() (*stmtLabeler, error) {
	lb := &stmtLabeler{byFirstLine: map[string]string{}}
	for _, st := range queries.Statements() {
		lb.byFirstLine[firstLine(st.SQL)] = st.File
	}
	defs, err := schema.Definitions()
	if err != nil {
		return nil, err
	}
	for _, d := range defs {
		if strings.HasPrefix(d.Name, "functions/") {
			lb.functions = append(lb.functions, d)
			lb.codes = append(lb.codes, collapse(d.Code()))
		}
	}
	return lb, nil
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(line)
}

func collapse(s string) string { return strings.Join(strings.Fields(s), " ") }

// label names query; at most 72 characters.
func (lb *stmtLabeler) label(query string) string {
	if f, ok := lb.byFirstLine[firstLine(query)]; ok {
		return f
	}
	text := collapse(query)
	if name, ok := strings.CutPrefix(text, "-- name: "); ok { // River's statements (sqlc)
		name, _, _ = strings.Cut(name, " ")
		return "River " + name
	}
	if table, ok := strings.CutPrefix(text, "copy "); ok { // pgx's CopyFrom: ingest's queries.IngestCopy
		table, _, _ = strings.Cut(table, " ")
		return "COPY " + strings.Trim(table, `"`) + " (queries.IngestCopy)"
	}
	words := clip(text, 48)
	// The text up to the first parameter, long enough to be telling.
	probe, _, _ := strings.Cut(text, "$")
	probe = strings.TrimSpace(probe)
	if len(probe) >= 16 {
		for i, code := range lb.codes {
			// PL/pgSQL runs PERFORM f(...) as SELECT f(...).
			if strings.Contains(code, probe) || strings.Contains(code, "PERFORM"+strings.TrimPrefix(probe, "SELECT")) {
				name := strings.TrimSuffix(strings.TrimPrefix(lb.functions[i].Name, "functions/"), ".sql")
				return clip(name+": "+words, 72)
			}
		}
	}
	return words
}

// clip cuts s to n characters, marking the cut.
func clip(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}

// writeStatements writes where Postgres's time went in one phase of each
// contender: per message, the statements the clients sent, then those run
// inside them.
func writeStatements(w io.Writer, title string, contenders []stmtPhase) {
	found := false
	for _, c := range contenders {
		if len(c.costs) > 0 {
			found = true
		}
	}
	if !found {
		return
	}
	fmt.Fprintf(w, "\n%s\n", title)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "contender\tµs per msg\tof it planning\tof it JIT\tshare\tcalls\t  statement")
	for _, c := range contenders {
		if len(c.costs) == 0 || c.n <= 0 {
			continue
		}
		total := topLevel(c.costs)
		perMsg := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / float64(c.n) }
		row := func(label string, sc stmtCost) {
			share := "-"
			if total > 0 {
				share = fmt.Sprintf("%.0f%%", 100*float64(sc.exec+sc.plan)/float64(total))
			}
			fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.1f\t%s\t%d\t  %s\n", c.name, perMsg(sc.exec+sc.plan), perMsg(sc.plan), perMsg(sc.jit), share, sc.calls, label)
		}
		for _, sc := range c.costs {
			if !sc.nested && perMsg(sc.exec+sc.plan) >= 0.05 {
				row(sc.label, sc)
			}
		}
		var planned, jitted time.Duration
		for _, sc := range c.costs {
			planned += sc.plan // nested planning included: it is time too, inside a statement sent
			jitted += sc.jit   // likewise
		}
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.1f\t100%%\t\t  all statements sent\n", c.name, perMsg(total), perMsg(planned), perMsg(jitted))
		for _, sc := range c.costs {
			if sc.nested && perMsg(sc.exec+sc.plan) >= 0.5 {
				row("  inside: "+sc.label, sc)
			}
		}
	}
	tw.Flush()
}

// stmtPhase is one contender's statements during a phase of n messages.
type stmtPhase struct {
	name  string
	n     int64
	costs []stmtCost
}
