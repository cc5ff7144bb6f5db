package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/sql/queries"
)

// A throwaway cluster loads pg_stat_statements, and a phase's statements
// come back named where they are written: the service's files by file, a
// trigger's statements by function, with their calls and time. The rows
// come from the schema's own triggers, fired by an insert the way the
// backlog scenario makes them.
func TestStatementsNameWhereTimeGoes(t *testing.T) {
	ctx := t.Context()
	var said []string
	say := func(format string, args ...any) { said = append(said, fmt.Sprintf(format, args...)) }
	p, err := startPostgres(ctx, "", "", false, say)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.close(context.Background(), "") })
	if !p.stmts {
		t.Fatalf("a throwaway cluster does not track statements; the bench said %q", said)
	}
	db, err := p.fresh(ctx, "stmts")
	if err != nil {
		t.Fatal(err)
	}
	lb, err := newStmtLabeler()
	if err != nil {
		t.Fatal(err)
	}

	before, err := p.statements(ctx, db.name)
	if err != nil {
		t.Fatal(err)
	}
	const rows, nextDue = 50, 3
	if err := fillBacklog(ctx, db, rows); err != nil {
		t.Fatal(err)
	}
	for range nextDue {
		if _, _, err := queries.DispatchNextDue(ctx, db.pool); err != nil {
			t.Fatal(err)
		}
	}
	after, err := p.statements(ctx, db.name)
	if err != nil {
		t.Fatal(err)
	}
	costs := after.since(before, lb)

	find := func(nested bool, prefix string) (stmtCost, bool) {
		for _, c := range costs {
			if c.nested == nested && strings.HasPrefix(c.label, prefix) {
				return c, true
			}
		}
		return stmtCost{}, false
	}
	if c, ok := find(false, "dispatch_next_due.sql"); !ok || c.calls != nextDue || c.exec <= 0 {
		t.Errorf("dispatch_next_due.sql: %+v (found %v), want %d calls with a time", c, ok, nextDue)
	}
	if c, ok := find(true, "deferred_key_after_insert: WITH heads AS"); !ok || c.calls < 1 || c.exec <= 0 {
		t.Errorf("the insert trigger's head upsert: %+v (found %v), want it named by its function", c, ok)
	}
	if _, ok := find(false, "deferred_key_after_insert"); ok {
		t.Errorf("a trigger's statement is counted as sent by a client: %+v", costs)
	}
	if top := topLevel(costs); top <= 0 {
		t.Errorf("top-level time %v, want > 0", top)
	}
	// Planning is tracked too: the trigger's statements are planned at
	// their first calls on a connection (plan_cache_mode = auto keeps
	// custom plans for the first five, and this fills the backlog in
	// fewer statements).
	if c, _ := find(true, "deferred_key_after_insert: WITH heads AS"); c.plan <= 0 {
		t.Errorf("the insert trigger's head upsert was planned in %v, want > 0 (track_planning)", c.plan)
	}
	for i := 1; i < len(costs); i++ {
		if costs[i].exec+costs[i].plan > costs[i-1].exec+costs[i-1].plan {
			t.Fatalf("costs not most expensive first: %+v", costs)
		}
	}

	var out bytes.Buffer
	writeStatements(&out, "WHERE", []stmtPhase{{"scheduler", rows, costs}})
	for _, want := range []string{"of it planning", "of it JIT", "dispatch_next_due.sql", "all statements sent", "inside: deferred_key_after_insert: WITH heads AS"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}

	// The same phase on a server that does not track statements: no
	// figures, no section, no error.
	p.stmts = false
	none, err := p.statements(ctx, db.name)
	if err != nil || none != nil {
		t.Errorf("statements without tracking = %v, %v; want nil, nil", none, err)
	}
	out.Reset()
	writeStatements(&out, "WHERE", []stmtPhase{{"scheduler", rows, none.since(before, lb)}})
	if out.Len() != 0 {
		t.Errorf("report without tracking:\n%s\nwant nothing", out.String())
	}
}

// A server that does not load pg_stat_statements (the tests' shared one,
// unless it was set up to) makes the bench say so and go on.
func TestStatementsUnavailableIsSaid(t *testing.T) {
	ctx := t.Context()
	var said []string
	say := func(format string, args ...any) { said = append(said, fmt.Sprintf(format, args...)) }
	p, err := startPostgres(ctx, pgtest.AdminURL(t), "", false, say)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.close(context.Background(), "") })
	if p.stmts {
		t.Skip("the tests' server loads pg_stat_statements")
	}
	if !strings.Contains(strings.Join(said, "\n"), "no per-statement times") {
		t.Errorf("the bench said %q, want it to say the report has no per-statement times", said)
	}
}

func TestStatementLabel(t *testing.T) {
	lb, err := newStmtLabeler()
	if err != nil {
		t.Fatal(err)
	}
	// Every statement file is named by its own first line: a file added
	// with the same first comment line as another would be counted as it.
	var claim string
	for _, st := range queries.Statements() {
		if got := lb.label(st.SQL); got != st.File {
			t.Errorf("%s is labelled %q: its first line is not its own", st.File, got)
		}
		if st.File == "dispatch_claim.sql" {
			claim = st.SQL
		}
	}
	long := "SELECT " + strings.Repeat("x, ", 40) + "y FROM nowhere"
	for _, tc := range []struct {
		name, query, want string
	}{
		{"a service file", claim, "dispatch_claim.sql"},
		{"River's", "-- name: JobInsertFastMany :many\nWITH raw_job_data AS (SELECT 1)", "River JobInsertFastMany"},
		{"PERFORM in a trigger function", "SELECT deferred_key_refresh(coalesce(keys, $16), coalesce(ids, $17))",
			"deferred_key_after_delete: SELECT deferred_key_refresh(coalesce(keys, $…"},
		{"a function's statement", "SELECT array_agg(DISTINCT business_key ORDER BY business_key)\n   FILTER (WHERE business_key IS NOT NULL), array_agg(id) FILTER (WHERE business_key IS NULL AND state = $1)",
			"deferred_key_after_delete: SELECT array_agg(DISTINCT business_key ORDER…"},
		{"ingest's COPY, as pgx sends it", `copy "deferred_message" ( "id", "source_topic" ) from stdin binary;`,
			"COPY deferred_message (queries.IngestCopy)"},
		{"anything else, short", "SELECT   1", "SELECT 1"},
		{"anything else, long", long, clip(long, 48)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := lb.label(tc.query); got != tc.want {
				t.Errorf("label = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestTopLevelLeavesNestedOut(t *testing.T) {
	costs := []stmtCost{
		{label: "a", exec: 3 * time.Millisecond},
		{label: "b", nested: true, exec: 2 * time.Millisecond},
		{label: "c", exec: time.Millisecond},
	}
	if got := topLevel(costs); got != 4*time.Millisecond {
		t.Errorf("topLevel = %v, want 4ms", got)
	}
}
