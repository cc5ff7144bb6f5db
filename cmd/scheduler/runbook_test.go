package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/sql/runbook"
)

// runbookDir is the runbook as an operator runs it, relative to this package.
const runbookDir = repoRoot + "/sql/runbook"

// seedOps fills a database with a known set of messages, one of each thing
// an operator looks for:
//
//	101 order-1  orders.retry    pending, due 2 minutes ago (the oldest due head), 5 headers
//	                             (binary, non-ASCII, and one that would clear a terminal)
//	102 order-1  orders.retry    pending, due in an hour, re-defers 101, 300-byte value
//	103 order-2  payments.retry  pending, due in an hour, binary key and value
//	104 order-3  payments.retry  parked, unknown_topic
//	105 order-4  payments.retry  parked, not_authorized
//	106 -        -               rejected now, missing_target
//	107 -        orders.retry    rejected now, invalid_delay
//	108 -        -               rejected 2 hours ago, missing_target
//	109 held-1   orders.retry    pending, due a minute ago, key backing off after 3 failures
//	110 leased-1 orders.retry    pending, due in 10 minutes, key leased by test-loop
//	111 (none)   orders.retry    pending, unordered, due in 30 minutes
func seedOps(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const seed = `
INSERT INTO deferred_message (id, business_key, seq, target_topic, next_run_at, state, reason, attempt,
                              error_class, error_message, origin_id, created_at, key, value, header_keys, header_values)
VALUES
 (101, 'order-1', 1, 'orders.retry', now() - interval '2 minutes', 'pending', NULL, 2,
  'ProviderTimeout', 'upstream 504', NULL, now(), 'order-1', '{"order":1}',
  '{defer.target,trace,bin,note,evil}',
  ARRAY['orders.retry'::bytea, 'abc'::bytea, '\x00ff'::bytea, convert_to('café', 'UTF8'), '\x1b5b324a'::bytea]),
 (102, 'order-1', 2, 'orders.retry', now() + interval '1 hour', 'pending', NULL, 3,
  NULL, NULL, 101, now(), 'order-1', convert_to(repeat('é', 150), 'UTF8'), '{}', '{}'),
 (103, 'order-2', 3, 'payments.retry', now() + interval '1 hour', 'pending', NULL, 0,
  NULL, NULL, NULL, now(), '\xff00', '\xdeadbeef', '{}', '{}'),
 (104, 'order-3', 4, 'payments.retry', now() - interval '5 minutes', 'parked', 'unknown_topic: no such topic', 1,
  NULL, NULL, NULL, now(), NULL, 'x', '{}', '{}'),
 (105, 'order-4', 5, 'payments.retry', now() - interval '5 minutes', 'parked', 'not_authorized: topic ACL', 1,
  NULL, NULL, NULL, now(), NULL, 'y', '{}', '{}'),
 (106, NULL, 6, NULL, now(), 'rejected', 'missing_target: no defer.target header', 0,
  NULL, NULL, NULL, now(), NULL, NULL, '{}', '{}'),
 (107, NULL, 7, 'orders.retry', now(), 'rejected', 'invalid_delay: "soon" is not a duration', 0,
  NULL, NULL, NULL, now(), NULL, NULL, '{}', '{}'),
 (108, NULL, 8, NULL, now(), 'rejected', 'missing_target: no defer.target header', 0,
  NULL, NULL, NULL, now() - interval '2 hours', NULL, NULL, '{}', '{}'),
 (109, 'held-1', 9, 'orders.retry', now() - interval '1 minute', 'pending', NULL, 0,
  'BrokerDown', NULL, NULL, now(), 'held-1', 'h', '{}', '{}'),
 (110, 'leased-1', 10, 'orders.retry', now() + interval '10 minutes', 'pending', NULL, 0,
  NULL, NULL, NULL, now(), 'leased-1', 'l', '{}', '{}'),
 (111, NULL, 11, 'orders.retry', now() + interval '30 minutes', 'pending', NULL, 0,
  NULL, NULL, NULL, now(), NULL, 'u', '{}', '{}')`
	for _, q := range []string{
		seed,
		// deferred_key is the triggers' to keep; a test may play dispatcher.
		`UPDATE deferred_key SET failures = 3, leased_until = now() + interval '1 hour' WHERE business_key = 'held-1'`,
		`UPDATE deferred_key SET leased_until = now() + interval '1 minute', leased_by = 'test-loop' WHERE business_key = 'leased-1'`,
		`INSERT INTO target_control (target_topic, paused, note) VALUES ('audit.retry', true, 'seeded pause')`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatalf("seed: %v\n%s", err, q)
		}
	}
}

// psqlRun runs a runbook file with the real psql, unaligned and tuples only
// (fields separated by |), stopping at the first error.
func psqlRun(t *testing.T, dbURL, file string, vars map[string]string) (string, error) {
	t.Helper()
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Fatal("psql is not installed (Debian package postgresql-client); the runbook is meant for it")
	}
	args := []string{"-X", "-q", "-v", "ON_ERROR_STOP=1", "-At", "-d", dbURL}
	for _, name := range slices.Sorted(func(yield func(string) bool) {
		for k := range vars {
			if !yield(k) {
				return
			}
		}
	}) {
		args = append(args, "-v", name+"="+vars[name])
	}
	args = append(args, "-f", filepath.Join(runbookDir, file))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, psql, args...)
	cmd.Env = append(os.Environ(), "PGCONNECT_TIMEOUT=5", "PGTZ=UTC")
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestRunbook runs every file in sql/runbook with psql against a seeded
// database and checks what it prints and what it changed. A file without a
// row here fails the test, so the runbook cannot rot unseen.
func TestRunbook(t *testing.T) {
	type runbookCase struct {
		name string
		file string
		vars map[string]string
		// lines is how many lines the output has; want are substrings of
		// it, and wantNot must not appear.
		lines         int
		want, wantNot []string
		// check is a query returning true when the file had its effect.
		check string
	}
	tests := []runbookCase{
		{
			name: "backlog", file: "backlog.sql", lines: 5,
			want: []string{
				"\n|rejected|2|0||\n", "orders.retry|pending|5|2|", "orders.retry|rejected|1|0||",
				"payments.retry|parked|2|0||", "payments.retry|pending|1|0|",
			},
		},
		{
			name: "next due", file: "next_due.sql", vars: map[string]string{"limit": "3"}, lines: 3,
			want:    []string{"101|order-1|1|orders.retry|", "|t|2\n", "109|held-1|9|orders.retry|", "110|leased-1|10|orders.retry|"},
			wantNot: []string{"111|"},
		},
		{
			name: "next due shows heads", file: "next_due.sql", vars: map[string]string{"limit": "100"}, lines: 6,
			want: []string{"|f|3\n"}, // 102, behind 101, is not its key's head
		},
		{
			name: "oldest due", file: "oldest_due.sql", lines: 1,
			want: []string{"2|101|order-1|orders.retry|"},
		},
		{
			name: "held keys", file: "held_keys.sql", lines: 2,
			want: []string{
				"held-1|backing off after 3 failed publish(es)|3|", "|109|9|orders.retry|",
				"leased-1|leased by test-loop|0|", "|test-loop|110|10|orders.retry|",
			},
		},
		{
			name: "show a message", file: "show_message.sql", vars: map[string]string{"id": "101"},
			want: []string{
				"101|order-1|1|orders.retry|pending|", "|2||ProviderTimeout|upstream 504|",
				"|t|0|text|order-1|11|text|{\"order\":1}\n", // head, none ahead, key and value as text
				"1|defer.target|text|orders.retry\n", "2|trace|text|abc\n", "3|bin|hex|\\x00ff\n", "4|note|text|café\n",
				"re-deferral|102|order-1|2|orders.retry|pending|",
			},
		},
		{
			name: "show a re-deferral and its origin", file: "show_message.sql", vars: map[string]string{"id": "102"},
			want: []string{"102|order-1|2|orders.retry|pending|", "|f|1|text|order-1|300|text|éé", "origin|101|order-1|1|orders.retry|pending|"},
		},
		{
			name: "show binary key and value", file: "show_message.sql", vars: map[string]string{"id": "103"}, lines: 1,
			want: []string{"|hex|\\xff00|4|hex|\\xdeadbeef"},
		},
		{
			name: "list by target, state and reason", file: "list.sql", lines: 1,
			vars: map[string]string{"target": "payments.retry", "state": "parked", "key": "", "reason": "UNKNOWN", "limit": "10"},
			want: []string{"104|order-3|4|payments.retry|parked|", "|1|unknown_topic: no such topic"},
		},
		{
			name: "list by key", file: "list.sql", lines: 2,
			vars: map[string]string{"target": "", "state": "", "key": "order-1", "reason": "", "limit": "10"},
			want: []string{"101|order-1|", "102|order-1|"},
		},
		{
			name: "list everything", file: "list.sql", lines: 11,
			vars: map[string]string{"target": "", "state": "", "key": "", "reason": "", "limit": "100"},
		},
		{
			name: "expedite a key", file: "expedite_key.sql", vars: map[string]string{"key": "order-1"}, lines: 1,
			want: []string{"102|order-1|2|orders.retry|pending|"}, // 101 is due already
			check: `SELECT (SELECT next_run_at <= now() FROM deferred_message WHERE id = 102)
			           AND (SELECT next_run_at > now() FROM deferred_message WHERE id = 103)`,
		},
		{
			name: "expedite a target", file: "expedite_target.sql", vars: map[string]string{"target": "payments.retry"}, lines: 1,
			want: []string{"103|order-2|3|payments.retry|pending|"},
			check: `SELECT (SELECT next_run_at <= now() FROM deferred_message WHERE id = 103)
			           AND (SELECT next_run_at <= now() FROM deferred_key WHERE business_key = 'order-2')
			           AND (SELECT count(*) = 2 FROM deferred_message WHERE state = 'parked')`,
		},
		{
			name: "expedite ids", file: "expedite_id.sql", vars: map[string]string{"ids": "102,104,999"}, lines: 1,
			want: []string{"102|order-1|2|orders.retry|pending|"}, // 104 is parked, 999 does not exist
			check: `SELECT (SELECT next_run_at <= now() FROM deferred_message WHERE id = 102)
			           AND (SELECT state = 'parked' FROM deferred_message WHERE id = 104)`,
		},
		{
			name: "cancel ids", file: "cancel_id.sql", vars: map[string]string{"ids": "104,106"}, lines: 2,
			want:  []string{"104|order-3|4|payments.retry|parked|", "106||6||rejected|"},
			check: `SELECT NOT EXISTS (SELECT 1 FROM deferred_message WHERE id IN (104, 106)) AND (SELECT count(*) = 9 FROM deferred_message)`,
		},
		{
			name: "cancel a head frees its key", file: "cancel_id.sql", vars: map[string]string{"ids": "101"}, lines: 1,
			want:  []string{"101|order-1|1|orders.retry|pending|"},
			check: `SELECT head_id = 102 FROM deferred_key WHERE business_key = 'order-1'`,
		},
		{
			name: "park", file: "park_id.sql", vars: map[string]string{"ids": "101,105", "why": "it's broken, ticket OPS-7"}, lines: 1,
			want: []string{"101|order-1|1|orders.retry|parked|", "|parked by operator: it's broken, ticket OPS-7"},
			check: `SELECT (SELECT head_id = 102 FROM deferred_key WHERE business_key = 'order-1')
			           AND (SELECT reason = 'not_authorized: topic ACL' FROM deferred_message WHERE id = 105)`,
		},
		{
			name: "replay parked", file: "replay_parked.sql", vars: map[string]string{"target": "payments.retry"}, lines: 2,
			want: []string{"104|order-3|4|payments.retry|pending|", "105|order-4|5|payments.retry|pending|"},
			check: `SELECT (SELECT count(*) = 2 FROM deferred_message
			                WHERE id IN (104, 105) AND state = 'pending' AND reason IS NULL AND next_run_at <= now())
			           AND (SELECT count(*) = 2 FROM deferred_key WHERE business_key IN ('order-3', 'order-4') AND next_run_at <= now())`,
		},
		{
			name: "pause a target", file: "pause_target.sql", vars: map[string]string{"target": "orders.retry", "note": "INC-42"}, lines: 1,
			want:  []string{"orders.retry|t|INC-42|"},
			check: `SELECT paused AND note = 'INC-42' FROM target_control WHERE target_topic = 'orders.retry'`,
		},
		{
			name: "resume a paused target", file: "resume_target.sql", vars: map[string]string{"target": "audit.retry"}, lines: 1,
			want:  []string{"audit.retry|f|seeded pause|"},
			check: `SELECT NOT paused FROM target_control WHERE target_topic = 'audit.retry'`,
		},
		{
			name: "rejected in the last hour", file: "rejected_recent.sql", vars: map[string]string{"window": "1 hour"}, lines: 2,
			want: []string{"invalid_delay|1|", "missing_target|1|"},
		},
		{
			name: "rejected in the last day", file: "rejected_recent.sql", vars: map[string]string{"window": "1 day"}, lines: 2,
			want: []string{"missing_target|2|"},
		},
	}

	files, err := filepath.Glob(filepath.Join(runbookDir, "*.sql"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("no runbook files in %s", runbookDir)
	}
	var onDisk []string
	for _, f := range files {
		name := filepath.Base(f)
		onDisk = append(onDisk, name)
		if !slices.ContainsFunc(tests, func(tt runbookCase) bool { return tt.file == name }) {
			t.Errorf("%s has no test: add a row to TestRunbook that runs it and checks its effect", name)
		}
	}
	if embedded := runbook.Names(); !slices.Equal(embedded, onDisk) {
		t.Errorf("runbook.Names() = %v, files on disk %v", embedded, onDisk)
	}

	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			seedOps(t, db.Pool)
			out, err := psqlRun(t, db.URL, tt.file, tt.vars)
			if err != nil {
				t.Fatalf("psql -f %s: %v\n%s", tt.file, err, out)
			}
			if got := strings.Count(out, "\n"); tt.lines > 0 && got != tt.lines {
				t.Errorf("%d lines, want %d:\n%s", got, tt.lines, out)
			}
			for _, w := range tt.want {
				if !strings.Contains("\n"+out, w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			for _, w := range tt.wantNot {
				if strings.Contains("\n"+out, "\n"+w) {
					t.Errorf("output has a line starting %q:\n%s", w, out)
				}
			}
			if tt.check != "" {
				var ok bool
				if err := db.Pool.QueryRow(context.Background(), tt.check).Scan(&ok); err != nil {
					t.Fatalf("check: %v", err)
				}
				if !ok {
					t.Errorf("effect not as expected: %s\noutput:\n%s", tt.check, out)
				}
			}
		})
	}
}

// TestRunbookHeaders checks that every file says what it does and how to call
// it, and that the call it shows sets exactly the variables the file uses.
func TestRunbookHeaders(t *testing.T) {
	// The psql invocations a header shows, and the variables they set.
	callLine := regexp.MustCompile(`(?m)^--\s+psql "\$DATABASE_URL" (.*?)-f sql/runbook/(\S+)\s*$`)
	setVar := regexp.MustCompile(`-v (\w+)=`)
	for _, name := range runbook.Names() {
		t.Run(name, func(t *testing.T) {
			q, err := runbook.Query(name)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(q, "-- "+name+": ") {
				t.Errorf("does not start with %q", "-- "+name+": ")
			}
			for _, w := range []string{"\n-- What: ", "\n-- When: ", "\n-- Call:\n"} {
				if !strings.Contains(q, w) {
					t.Errorf("header lacks %q", strings.TrimSpace(w))
				}
			}
			// Join continued lines, so that a call split with \ reads as one.
			joined := strings.ReplaceAll(q, "\\\n--", "")
			calls := callLine.FindAllStringSubmatch(joined, -1)
			if len(calls) == 0 {
				t.Fatalf("header shows no call of the form psql \"$DATABASE_URL\" ... -f sql/runbook/%s", name)
			}
			for _, c := range calls {
				if c[2] != name {
					continue // a pointer to another file
				}
				vars := map[string]string{}
				for _, m := range setVar.FindAllStringSubmatch(c[1], -1) {
					vars[m[1]] = "1"
				}
				if _, err := bindPsqlVars(q, vars); err != nil {
					t.Errorf("the call %q does not set exactly the file's variables: %v", strings.TrimSpace(c[0]), err)
				}
			}
		})
	}
}

// TestRunbookREADME checks that the README's "Operating it" section lists
// every runbook file and every operator command.
func TestRunbookREADME(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(data)
	start := strings.Index(doc, "\n## Operating it\n")
	if start < 0 {
		t.Fatal(`README.md has no section "## Operating it"`)
	}
	section := doc[start+1:]
	if end := strings.Index(section, "\n## "); end >= 0 {
		section = section[:end]
	}
	for _, name := range runbook.Names() {
		if !strings.Contains(section, "`"+name+"`") || !strings.Contains(section, "-f sql/runbook/"+name) {
			t.Errorf("README.md, Operating it: no row with an example for %s", name)
		}
	}
	for _, cmd := range []string{"status", "ls", "show", "expedite", "cancel", "park"} {
		if !strings.Contains(section, "\nscheduler "+cmd+" ") {
			t.Errorf("README.md, Operating it: no example of scheduler %s", cmd)
		}
	}
}
