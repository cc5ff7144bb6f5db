package opscli

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/pgtest"
)

// TestOpsDeadlockSaysRunAgain checks what an operator sees when a write
// command deadlocks with another transaction: PostgreSQL aborts the
// command's statement with 40P01, and the command must change nothing and
// say so, and that it can be run again. In production the other is a
// finalize, and the cycle comes from a statement that locks many messages
// in another order than the finalize's (docs/design.md 4.6, 19), which no
// test can time. Here the other transaction takes two locks in the opposite
// order to the command's statement, which locks a message and then, through
// the head trigger, its key's head: it holds the head of order-2, the
// command changes message 103 (order-2's only message) and waits for the
// head, then the other asks for 103. Its deadlock_timeout is set far above
// the server's (1 s by default), so the command's backend is the one that
// finds the cycle and is aborted.
func TestOpsDeadlockSaysRunAgain(t *testing.T) {
	tests := []struct {
		name string
		args []string
	}{
		{"cancel", []string{"cancel", "103"}},
		{"park", []string{"park", "--why", "deadlock test", "103"}},
		{"expedite", []string{"expedite", "--id", "103"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			db := pgtest.NewDB(t)
			fixture.SeedOps(t, db.Pool)
			var before string
			const snapshot = `SELECT string_agg(format('%s %s %s', id, state, next_run_at), ', ' ORDER BY id)
				FROM deferred_message WHERE id = 103`
			if err := db.Pool.QueryRow(ctx, snapshot).Scan(&before); err != nil {
				t.Fatal(err)
			}

			other, err := pgx.Connect(ctx, db.URL)
			if err != nil {
				t.Fatal(err)
			}
			defer other.Close(context.Background())
			tx, err := other.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			for _, q := range []string{
				`SET LOCAL deadlock_timeout = '5min'`,
				`SELECT 1 FROM deferred_key WHERE business_key = 'order-2' FOR UPDATE`,
			} {
				if _, err := tx.Exec(ctx, q); err != nil {
					t.Fatalf("%s: %v", q, err)
				}
			}

			type result struct {
				code           int
				stdout, stderr string
			}
			done := make(chan result, 1)
			go func() {
				var stdout, stderr bytes.Buffer
				code := run(ctx, tt.args, []string{"DATABASE_URL=" + db.URL, "USER=alice"}, &stdout, &stderr)
				done <- result{code, stdout.String(), stderr.String()}
			}()
			// The command's statement waits for the head once it holds 103.
			// (Not found by its text: pg_stat_activity keeps the first
			// track_activity_query_size bytes, the runbook file's comments.)
			waitFor(ctx, t, db.Pool.QueryRow, `SELECT count(*) > 0 FROM pg_stat_activity
				WHERE datname = current_database() AND wait_event_type = 'Lock'
				  AND pid NOT IN (pg_backend_pid(), $1)`, other.PgConn().PID())
			// Closing the cycle: this waits until PostgreSQL aborts the command.
			if _, err := tx.Exec(ctx, `SELECT id FROM deferred_message WHERE id = 103 FOR UPDATE`); err != nil {
				t.Fatalf("the other transaction was aborted, not the command: %v", err)
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}

			var r result
			select {
			case r = <-done:
			case <-ctx.Done():
				t.Fatal("the command did not return")
			}
			if r.code != 1 {
				t.Errorf("exit code %d, want 1\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
			}
			if r.stdout != "" {
				t.Errorf("stdout after an error:\n%s", r.stdout)
			}
			for _, want := range []string{"deadlock detected", "(SQLSTATE 40P01)", "nothing changed, run it again\n"} {
				if !strings.Contains(r.stderr, want) {
					t.Errorf("stderr lacks %q:\n%s", want, r.stderr)
				}
			}
			if strings.Count(r.stderr, "\n") != 1 {
				t.Errorf("error is not one line:\n%s", r.stderr)
			}

			var after string
			if err := db.Pool.QueryRow(ctx, snapshot).Scan(&after); err != nil {
				t.Fatal(err)
			}
			if after != before {
				t.Errorf("messages changed: %s, were %s", after, before)
			}
			var history int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM deferred_attempt WHERE message_id = 103`).Scan(&history); err != nil {
				t.Fatal(err)
			}
			if history != 0 {
				t.Errorf("%d history rows for a command that changed nothing", history)
			}

			// Run again, it does what it was asked.
			var stdout, stderr bytes.Buffer
			if code := run(ctx, tt.args, []string{"DATABASE_URL=" + db.URL, "USER=alice"}, &stdout, &stderr); code != 0 {
				t.Errorf("run again: exit code %d\n%s", code, stderr.String())
			}
		})
	}
}

// waitFor polls query (with args) until it returns true.
func waitFor(ctx context.Context, t *testing.T, queryRow func(context.Context, string, ...any) pgx.Row, query string, args ...any) {
	t.Helper()
	for {
		var ok bool
		if err := queryRow(ctx, query, args...).Scan(&ok); err != nil {
			t.Fatalf("%s: %v", query, err)
		}
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for: %s", query)
		case <-time.After(10 * time.Millisecond):
		}
	}
}
