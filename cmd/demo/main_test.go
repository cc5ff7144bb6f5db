package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/pgtest"
)

// `make demo` must keep working: run the scenario, once on a throwaway
// cluster as on a fresh machine, once on a given DATABASE_URL, which it must
// leave as it found it.
func TestMain(m *testing.M) { pgtest.Main(m) }

func TestDemo(t *testing.T) {
	db := pgtest.NewDB(t)
	tests := []struct {
		name string
		env  []string
	}{
		{"throwaway PostgreSQL", nil},
		{"given DATABASE_URL", []string{"DATABASE_URL=" + db.URL}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			var out, errOut bytes.Buffer
			env := append([]string{"PATH=" + os.Getenv("PATH")}, tt.env...)
			if code := run(ctx, nil, env, &out, &errOut); code != 0 {
				t.Fatalf("demo exited %d\nstdout:\n%s\nstderr:\n%s", code, out.String(), errOut.String())
			}
			for _, want := range []string{
				"demo-42 #1", "demo-42 #3", "UPDATE deferred_message SET next_run_at = now()",
				"missing_target: defer.target is absent", "scheduler stopped cleanly",
			} {
				if !strings.Contains(out.String(), want) {
					t.Fatalf("demo output lacks %q:\n%s", want, out.String())
				}
			}
		})
	}
	// The given database is as it was: no demo schema, no rows, no positions.
	var schemas, rows int
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'scheduler_demo%'").Scan(&schemas); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT (SELECT count(*) FROM deferred_message) + (SELECT count(*) FROM ingest_offset)").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if schemas != 0 || rows != 0 {
		t.Fatalf("the demo left %d schemas and %d rows in the database it was given", schemas, rows)
	}
}
