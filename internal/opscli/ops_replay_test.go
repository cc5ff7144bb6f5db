package opscli

import (
	"bytes"
	"context"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/operate"
	"github.com/deferq/scheduler/internal/opscli/opsjson"
	"github.com/deferq/scheduler/internal/pgtest"
)

// seedReplay fills a database with a parking lot to replay from:
//
//	201 a-1      payments.retry   parked 3h ago, exhausted, java.net.SocketTimeoutException, attempt 5, holds its key
//	202 a-1      payments.retry   pending behind 201
//	203 a-2      payments.retry   parked 30m ago, unknown_topic, replayed twice already, holds its key
//	204 b-1      pay_ments.retry  parked 10m ago, exhausted
//	205 b-2      payXments.retry  parked 10m ago, exhausted (a _ in a pattern must not match it)
//	206 (none)   orders.retry     parked 1h ago, permanent, ValidationError, unordered
//	207 c-1      orders.retry     pending
//	208 (none)   -                rejected, missing_target (cannot be replayed)
//	209 c-2      orders.retry     rejected, target_not_allowed
//	211 d-1      orders.retry     parked 5m ago, permanent, released its key, seq before 212
//	212 d-1      orders.retry     parked 20m ago, permanent, released its key
func seedReplay(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const seed = `
INSERT INTO deferred_message (id, business_key, seq, target_topic, next_run_at, state, reason, attempt,
                              error_class, redrive_count, park_holds_key, parked_at)
VALUES
 (201, 'a-1', 1, 'payments.retry', now() - interval '4 hours', 'parked', 'exhausted: after 5 retries', 5,
  'java.net.SocketTimeoutException', 0, true, now() - interval '3 hours'),
 (202, 'a-1', 2, 'payments.retry', now() - interval '1 hour', 'pending', NULL, 0, NULL, 0, true, NULL),
 (203, 'a-2', 3, 'payments.retry', now() - interval '1 hour', 'parked', 'unknown_topic: no such topic', 1,
  NULL, 2, true, now() - interval '30 minutes'),
 (204, 'b-1', 4, 'pay_ments.retry', now(), 'parked', 'exhausted: after 3 retries', 3, NULL, 0, true, now() - interval '10 minutes'),
 (205, 'b-2', 5, 'payXments.retry', now(), 'parked', 'exhausted: after 3 retries', 3, NULL, 0, true, now() - interval '10 minutes'),
 (206, NULL, 6, 'orders.retry', now(), 'parked', 'permanent: consumer said so', 0, 'ValidationError', 0, true, now() - interval '1 hour'),
 (207, 'c-1', 7, 'orders.retry', now() + interval '1 hour', 'pending', NULL, 0, NULL, 0, true, NULL),
 (208, NULL, 8, NULL, now(), 'rejected', 'missing_target: no defer.target header', 0, NULL, 0, true, NULL),
 (209, 'c-2', 9, 'orders.retry', now(), 'rejected', 'target_not_allowed: orders.retry', 0, NULL, 0, true, NULL),
 (211, 'd-1', 11, 'orders.retry', now(), 'parked', 'permanent: bad', 0, NULL, 0, false, now() - interval '5 minutes'),
 (212, 'd-1', 12, 'orders.retry', now(), 'parked', 'permanent: bad', 0, NULL, 0, false, now() - interval '20 minutes')`
	if _, err := pool.Exec(ctx, seed); err != nil {
		t.Fatalf("seed: %v", err)
	}
}

// snapshot returns every row of table as JSON, by id (deferred_key rows by
// business key and head), so that a test can tell exactly what changed.
func snapshot(t *testing.T, pool *pgxpool.Pool, table string) map[string]string {
	t.Helper()
	queries := map[string]string{
		"deferred_message": `SELECT id::text, to_jsonb(m)::text FROM deferred_message m`,
		"deferred_key":     `SELECT coalesce(business_key, 'unordered ' || head_id), to_jsonb(k)::text FROM deferred_key k`,
		"deferred_attempt": `SELECT id::text, to_jsonb(a)::text FROM deferred_attempt a`,
	}
	rows, err := pool.Query(context.Background(), queries[table])
	if err != nil {
		t.Fatalf("snapshot %s: %v", table, err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var id, row string
		if err := rows.Scan(&id, &row); err != nil {
			t.Fatalf("snapshot %s: %v", table, err)
		}
		out[id] = row
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("snapshot %s: %v", table, err)
	}
	return out
}

type jsonReplay struct {
	State   string `json:"state"`
	DryRun  bool   `json:"dry_run"`
	Matched int    `json:"matched"`
	Groups  []struct {
		TargetTopic *string `json:"target_topic"`
		Reason      string  `json:"reason"`
		Messages    int     `json:"messages"`
	} `json:"groups"`
	Candidates []struct {
		ID         int64     `json:"id"`
		Since      time.Time `json:"since"`
		HoldsKey   bool      `json:"holds_key"`
		Replayable bool      `json:"replayable"`
	} `json:"candidates"`
	NotReplayable []int64  `json:"not_replayable"`
	Replayed      int      `json:"replayed"`
	LeftAlone     int      `json:"left_alone"`
	Rate          *float64 `json:"rate"`
	Messages      []struct {
		opsjson.Message
		RedriveCount int `json:"redrive_count"`
	} `json:"messages"`
}

// TestReplay runs scheduler replay with each filter alone and combined, and
// checks that exactly the matching messages moved and that every other row
// is as it was, byte for byte.
func TestReplay(t *testing.T) {
	tests := []struct {
		name string
		args []string // after "replay"; --yes --json are added
		// replayed are the ids that must move, in id order (they are all
		// due now); every other row of deferred_message must not change.
		replayed []int64
		// notReplayable are matching ids that cannot move.
		notReplayable []int64
		// check is a query returning true when the replay had its effect.
		check string
	}{
		{name: "target glob", args: []string{"--target", "payments.*"}, replayed: []int64{201, 203}},
		{name: "target glob: _ is a character, not a wildcard", args: []string{"--target", "pay_ments.*"}, replayed: []int64{204}},
		{name: "target glob: ?", args: []string{"--target", "pay?ments.retry"}, replayed: []int64{204, 205}},
		{name: "target: every target, on purpose", args: []string{"--target", "*"}, replayed: []int64{201, 203, 204, 205, 206, 211, 212}},
		{name: "key", args: []string{"--key", "a-2"}, replayed: []int64{203}},
		{name: "error class glob", args: []string{"--error-class", "java.net.*"}, replayed: []int64{201}},
		{name: "error class exact", args: []string{"--error-class", "ValidationError"}, replayed: []int64{206}},
		{name: "reason code", args: []string{"--reason", "exhausted"}, replayed: []int64{201, 204, 205}},
		{name: "ids as arguments and --id", args: []string{"201", "204", "--id", "205"}, replayed: []int64{201, 204, 205}},
		{name: "since a duration ago", args: []string{"--since", "45m"}, replayed: []int64{203, 204, 205, 211, 212}},
		{name: "until a duration ago", args: []string{"--until", "45m"}, replayed: []int64{201, 206}},
		{
			name: "since and until as RFC 3339", replayed: []int64{203, 206},
			args: []string{"--since", time.Now().Add(-90 * time.Minute).Format(time.RFC3339), "--until", time.Now().Add(-25 * time.Minute).Format(time.RFC3339)},
		},
		{name: "ids, repeated and listed", args: []string{"--id", "206", "--id", "201,203"}, replayed: []int64{201, 203, 206}},
		{name: "an id of another state is not replayed", args: []string{"--id", "203,207"}, replayed: []int64{203}},
		{
			name: "combined", args: []string{"--target", "pay*", "--reason", "exhausted", "--since", "1h"},
			replayed: []int64{204, 205},
		},
		{
			name: "combined with a key", args: []string{"--target", "payments.retry", "--reason", "exhausted", "--key", "a-2"},
		},
		{
			name: "rejected with a target", args: []string{"--state", "rejected", "--reason", "target_not_allowed"},
			replayed: []int64{209},
			check:    `SELECT state = 'pending' AND reason IS NULL AND redrive_count = 1 FROM deferred_message WHERE id = 209`,
		},
		{
			name: "rejected with and without a target", args: []string{"--state", "rejected", "--since", "1h"},
			replayed: []int64{209}, notReplayable: []int64{208},
			check: `SELECT state = 'rejected' FROM deferred_message WHERE id = 208`,
		},
		{
			name: "attempts kept", args: []string{"--id", "201"}, replayed: []int64{201},
			check: `SELECT attempt = 5 FROM deferred_message WHERE id = 201`,
		},
		{
			name: "attempts reset", args: []string{"--id", "201", "--reset-attempts"}, replayed: []int64{201},
			check: `SELECT attempt = 0 FROM deferred_message WHERE id = 201`,
		},
		{
			name: "redrive count goes up", args: []string{"--key", "a-2"}, replayed: []int64{203},
			check: `SELECT redrive_count = 3 FROM deferred_message WHERE id = 203`,
		},
		{
			// 201 held a-1, with 202 waiting behind it: the key is no longer
			// held, 201 heads it and is due, and history records the replay.
			name: "a held key is released in order", args: []string{"--key", "a-1"}, replayed: []int64{201},
			check: `SELECT (SELECT head_id = 201 AND NOT held AND next_run_at <= now() FROM deferred_key WHERE business_key = 'a-1')
			           AND (SELECT state = 'pending' AND parked_at IS NULL FROM deferred_message WHERE id = 201)
			           AND (SELECT count(*) = 1 FROM deferred_attempt WHERE message_id = 201 AND event = 'replayed' AND lineage_id = 201)`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			seedReplay(t, db.Pool)
			before := snapshot(t, db.Pool, "deferred_message")
			args := append([]string{"replay", "--yes", "--json"}, tt.args...)
			var stdout, stderr bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			code := run(ctx, args, []string{"DATABASE_URL=" + db.URL}, &stdout, &stderr)
			after := snapshot(t, db.Pool, "deferred_message")
			if len(tt.replayed) == 0 {
				// Nothing matches: an error, and nothing changed.
				if code != 1 || !strings.Contains(stderr.String(), "no message matches --state parked") {
					t.Errorf("exit %d, want 1 and no match:\n%s%s", code, stdout.String(), stderr.String())
				}
				if !maps.Equal(before, after) {
					t.Error("deferred_message changed")
				}
				return
			}
			if code != 0 {
				t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout.String(), stderr.String())
			}
			r := opsjson.Decode[jsonReplay](t, stdout.String())
			var got []int64
			for _, m := range r.Messages {
				got = append(got, m.ID)
				if m.State != "pending" || m.Reason != nil || m.NextRunAt.After(time.Now().Add(time.Second)) {
					t.Errorf("replayed message %+v", m)
				}
			}
			opsjson.SameIDs(t, "replayed", got, tt.replayed...)
			if r.Replayed != len(tt.replayed) || r.LeftAlone != 0 || r.DryRun || r.Matched != len(tt.replayed)+len(tt.notReplayable) {
				t.Errorf("report: %+v", r)
			}
			opsjson.SameIDs(t, "not replayable", r.NotReplayable, tt.notReplayable...)
			for id, row := range before {
				moved := slices.ContainsFunc(tt.replayed, func(r int64) bool { return id == strconv.FormatInt(r, 10) })
				if !moved && after[id] != row {
					t.Errorf("message %s changed, but is not replayed:\nbefore %s\nafter  %s", id, row, after[id])
				}
				if moved && after[id] == row {
					t.Errorf("message %s did not change", id)
				}
			}
			if len(after) != len(before) {
				t.Errorf("%d messages after, %d before", len(after), len(before))
			}
			if tt.check != "" {
				var ok bool
				if err := db.Pool.QueryRow(ctx, tt.check).Scan(&ok); err != nil {
					t.Fatalf("check: %v", err)
				}
				if !ok {
					t.Errorf("effect not as expected: %s", tt.check)
				}
			}
		})
	}
}

// TestReplayStaggered checks the schedule --rate writes: consecutive
// replayed messages 1/rate seconds apart, oldest parked first, except that
// the messages of one business key keep their seq order among their key's
// times.
func TestReplayStaggered(t *testing.T) {
	db := pgtest.NewDB(t)
	seedReplay(t, db.Pool)
	var stdout, stderr bytes.Buffer
	start := time.Now()
	code := run(context.Background(), []string{"replay", "--reason", "permanent", "--rate", "10", "--json"}, []string{"DATABASE_URL=" + db.URL}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	r := opsjson.Decode[jsonReplay](t, stdout.String())
	if r.Rate == nil || *r.Rate != 10 || r.Replayed != 3 {
		t.Fatalf("report: %+v", r)
	}
	// By parked time: 206 (1h ago), 212 (20m), 211 (5m). 211 and 212 share
	// key d-1, and 211 comes first in it, so it takes the earlier of their
	// two times.
	rows, err := db.Pool.Query(context.Background(),
		`SELECT id, extract(epoch FROM next_run_at - (SELECT min(next_run_at) FROM deferred_message WHERE id IN (206, 211, 212)))::float8
		 FROM deferred_message WHERE id IN (206, 211, 212) ORDER BY next_run_at`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var order []int64
	var offsets []float64
	for rows.Next() {
		var id int64
		var off float64
		if err := rows.Scan(&id, &off); err != nil {
			t.Fatal(err)
		}
		order, offsets = append(order, id), append(offsets, off)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	opsjson.SameIDs(t, "due order", order, 206, 211, 212)
	if !slices.Equal(offsets, []float64{0, 0.1, 0.2}) {
		t.Errorf("due times %v seconds after the first, want [0 0.1 0.2]", offsets)
	}
	first := r.Messages[0].NextRunAt
	if first.Before(start.Add(-time.Second)) || first.After(time.Now().Add(time.Second)) {
		t.Errorf("the first replayed message is due at %v, want now (%v)", first, start)
	}
}

// TestReplayCommand covers what replay prints, asks and refuses.
func TestReplayCommand(t *testing.T) {
	tests := []struct {
		name           string
		args           []string // after "replay"
		stdin          string
		code           int
		stdout, stderr []string
		// changed: whether deferred_message may differ afterwards. When
		// false, deferred_message, deferred_key and deferred_attempt must be
		// identical before and after.
		changed bool
		check   string
	}{
		{
			name: "dry run", args: []string{"--reason", "exhausted", "--dry-run"},
			stdout: []string{
				"3 parked messages match --state parked --reason exhausted:\n",
				"  TARGET           REASON     MESSAGES\n", "  payments.retry   exhausted  1\n", "  pay_ments.retry  exhausted  1\n",
				"  ID   KEY         TARGET           PARKED AT", "REDRIVES  REASON\n",
				"  201  a-1 (held)  payments.retry   ", "  0         exhausted: after 5 retries\n",
				"dry run: would replay 3 messages; nothing changed\n",
			},
		},
		{
			name: "dry run --json", args: []string{"--target", "*", "--dry-run", "--json"},
			stdout: []string{`"dry_run": true`, `"matched": 7`, `"replayed": 0`, `"messages": []`},
		},
		{
			name: "dry run of rejected records", args: []string{"--state", "rejected", "--since", "1h", "--dry-run"},
			stdout: []string{
				"2 rejected messages match --state rejected --since 1h (", "ID   KEY  TARGET        REJECTED AT",
				"1 cannot be replayed and stay as they are: a rejected record that named no target topic has nowhere to go (set its target_topic first) (208)\n",
				"dry run: would replay 1 message; nothing changed\n",
			},
		},
		{
			name: "replay", args: []string{"--key", "a-2"}, changed: true,
			stdout: []string{"1 parked message matches --state parked --key a-2:\n", "replayed 1 message, due now\n"},
		},
		{
			name: "replay at a rate", args: []string{"--target", "*", "--rate", "2"}, changed: true,
			stdout: []string{"7 parked messages match --state parked --target *:\n", "replayed 7 messages at 2/s: due from ", " (over 3s)\n"},
		},
		{
			name: "confirmed", args: []string{"--target", "payments.retry", "--confirm-above", "1"}, stdin: "2\n", changed: true,
			stdout: []string{"replayed 2 messages, due now\n"},
			stderr: []string{"This replays 2 parked messages. Type 2 to go on: "},
			check:  `SELECT count(*) = 2 FROM deferred_message WHERE id IN (201, 203) AND state = 'pending'`,
		},
		{
			name: "confirmed without a newline", args: []string{"--target", "payments.retry", "--confirm-above", "1"}, stdin: " 2", changed: true,
			stdout: []string{"replayed 2 messages, due now\n"},
		},
		{
			name: "wrong answer", args: []string{"--target", "payments.retry", "--confirm-above", "1"}, stdin: "y\n", code: 1,
			stdout: []string{"2 parked messages match"},
			stderr: []string{"Type 2 to go on: ", `scheduler replay: not confirmed: typed "y", not 2; nothing changed`},
		},
		{
			name: "no answer", args: []string{"--target", "payments.retry", "--confirm-above", "1"}, code: 1,
			stderr: []string{"no answer (end of input); nothing changed: --yes replays without asking"},
		},
		{
			name: "--yes does not ask", args: []string{"--target", "payments.retry", "--confirm-above", "1", "--yes"}, changed: true,
			stdout: []string{"replayed 2 messages"},
		},
		{
			name: "below the threshold it does not ask", args: []string{"--target", "payments.retry"}, changed: true,
			stdout: []string{"replayed 2 messages"},
		},
		{
			name: "nothing matches", args: []string{"--target", "payments.*", "--key", "nope"}, code: 1,
			stderr: []string{"scheduler replay: no message matches --state parked --target payments.* --key nope; nothing changed\n"},
		},
		{
			name: "nothing matches --json", args: []string{"--reason", "nope", "--json"}, code: 1,
			stderr: []string{`{"error":"no message matches --state parked --reason nope; nothing changed"}`},
		},
		{
			// A dry run is a question: "nothing" is an answer, not a failure.
			name: "dry run, nothing matches", args: []string{"--target", "payments.*", "--key", "nope", "--dry-run"},
			stdout: []string{"dry run: no message matches --state parked --target payments.* --key nope; nothing would be replayed\n"},
		},
		{
			name: "dry run, nothing matches --json", args: []string{"--reason", "nope", "--dry-run", "--json"},
			stdout: []string{`"dry_run": true`, `"matched": 0`, `"replayed": 0`, `"candidates": []`},
		},
		{
			name: "dry run, nothing replayable", args: []string{"--state", "rejected", "--reason", "missing_target", "--dry-run"},
			stdout: []string{"1 rejected message matches", "dry run: would replay 0 messages: a rejected record that named no target topic"},
		},
		{
			name: "nothing replayable", args: []string{"--state", "rejected", "--reason", "missing_target"}, code: 1,
			stderr: []string{"none of the 1 matching rejected message can be replayed: a rejected record that named no target topic"},
		},
		{name: "no filter", args: []string{"--rate", "5"}, code: 2, stderr: []string{"give at least one filter", "never an accident", "--target '*' means all targets"}},
		{name: "only a state", args: []string{"--state", "rejected", "--yes"}, code: 2, stderr: []string{"give at least one filter"}},
		{name: "an empty filter", args: []string{"--target", ""}, code: 2, stderr: []string{"--target is empty"}},
		{name: "pending", args: []string{"--state", "pending", "--key", "a-1"}, code: 2, stderr: []string{`--state "pending": replay takes parked or rejected messages`}},
		{name: "rate 0", args: []string{"--key", "a-1", "--rate", "0"}, code: 2, stderr: []string{"--rate 0: want messages per second > 0"}},
		{name: "rate negative", args: []string{"--key", "a-1", "--rate", "-3"}, code: 2, stderr: []string{"--rate -3: want messages per second > 0"}},
		{name: "rate not a number", args: []string{"--key", "a-1", "--rate", "fast"}, code: 2, stderr: []string{`--rate "fast" is not a number`}},
		{name: "rate empty", args: []string{"--key", "a-1", "--rate", ""}, code: 2, stderr: []string{`--rate "" is not a number`}},
		{name: "unknown flag", args: []string{"--key", "a-1", "--force"}, code: 2, stderr: []string{"flag provided but not defined: -force", "scheduler replay --help"}},
		{name: "an argument that is no id", args: []string{"abc"}, code: 2, stderr: []string{`"abc" is not a message id`}},
		{name: "bad id", args: []string{"--id", "20x"}, code: 2, stderr: []string{`invalid value "20x" for flag -id: "20x" is not a message id`}},
		{name: "bad since", args: []string{"--since", "yesterday"}, code: 2, stderr: []string{`--since "yesterday" is neither an RFC 3339 time`}},
		{name: "negative since", args: []string{"--since", "-5m"}, code: 2, stderr: []string{`--since "-5m" is neither`}},
		{name: "bad until", args: []string{"--until", "2024-13-01T00:00:00Z"}, code: 2, stderr: []string{`--until "2024-13-01T00:00:00Z"`}},
		{name: "since after until", args: []string{"--since", "1h", "--until", "2h"}, code: 2, stderr: []string{"is not before --until", "nothing can match"}},
		{name: "character class", args: []string{"--target", "pay[xy]"}, code: 2, stderr: []string{`--target "pay[xy]": character classes [...] are not supported`}},
		{name: "bad glob", args: []string{"--error-class", `java\`}, code: 2, stderr: []string{`--error-class "java\\"`}},
		{name: "a whole reason", args: []string{"--reason", "exhausted: after 5 retries"}, code: 2, stderr: []string{"want a reason code, the part of the reason before the colon, e.g. exhausted"}},
		{name: "negative threshold", args: []string{"--key", "a-1", "--confirm-above", "-1"}, code: 2, stderr: []string{"--confirm-above -1: want 0 or more"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			seedReplay(t, db.Pool)
			tables := []string{"deferred_message", "deferred_key", "deferred_attempt"}
			var before []map[string]string
			for _, table := range tables {
				before = append(before, snapshot(t, db.Pool, table))
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var stdout, stderr bytes.Buffer
			code := runWithInput(ctx, append([]string{"replay"}, tt.args...), []string{"DATABASE_URL=" + db.URL},
				strings.NewReader(tt.stdin), &stdout, &stderr)
			out, errOut := stdout.String(), stderr.String()
			if code != tt.code {
				t.Fatalf("exit code %d, want %d\nstdout:\n%s\nstderr:\n%s", code, tt.code, out, errOut)
			}
			if code == 0 && tt.stdin == "" && errOut != "" {
				t.Errorf("stderr is not empty:\n%s", errOut)
			}
			if code == 2 && out != "" {
				t.Errorf("stdout is not empty after a usage error:\n%s", out)
			}
			for _, w := range tt.stdout {
				if !strings.Contains(out, w) {
					t.Errorf("stdout lacks %q:\n%s", w, out)
				}
			}
			for _, w := range tt.stderr {
				if !strings.Contains(errOut, w) {
					t.Errorf("stderr lacks %q:\n%s", w, errOut)
				}
			}
			for i, table := range tables {
				same := maps.Equal(before[i], snapshot(t, db.Pool, table))
				if !tt.changed && !same {
					t.Errorf("%s changed", table)
				}
				if tt.changed && same && i == 0 {
					t.Errorf("%s did not change", table)
				}
			}
			if tt.check != "" {
				var ok bool
				if err := db.Pool.QueryRow(ctx, tt.check).Scan(&ok); err != nil {
					t.Fatalf("check: %v", err)
				}
				if !ok {
					t.Errorf("effect not as expected: %s", tt.check)
				}
			}
		})
	}
}

// TestReplayLeavesChangedRowsAlone checks that replay.sql checks its filters
// again as it moves rows: a message that changed after the preview (here,
// replayed and parked again for another reason) is not touched.
func TestReplayLeavesChangedRowsAlone(t *testing.T) {
	db := pgtest.NewDB(t)
	seedReplay(t, db.Pool)
	ctx := context.Background()
	// The preview found 201 and 204 parked as exhausted; meanwhile 204 was
	// parked again for another reason.
	if _, err := db.Pool.Exec(ctx, `UPDATE deferred_message SET reason = 'permanent: now' WHERE id = 204`); err != nil {
		t.Fatal(err)
	}
	vars := fixture.ReplayVars(map[string]string{"ids": "201,204", "reason": "exhausted", "rate": "", "reset_attempts": "false"})
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	moved, err := operate.Rows[operate.ReplayedMessage](ctx, conn.Conn(), "replay.sql", vars)
	if err != nil {
		t.Fatal(err)
	}
	if len(moved) != 1 || moved[0].ID != 201 || moved[0].RedriveCount != 1 {
		t.Errorf("moved %+v, want 201 alone", moved)
	}
	var state string
	if err := db.Pool.QueryRow(ctx, `SELECT state FROM deferred_message WHERE id = 204`).Scan(&state); err != nil || state != "parked" {
		t.Errorf("204: %q, %v; want parked", state, err)
	}
}
