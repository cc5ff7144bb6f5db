package opscli

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/operate"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/sql/runbook"
)

// repoRoot is the repository's root, relative to this package.
const repoRoot = "../.."

// TestRunbook runs every file in sql/runbook with psql against a seeded
// database and checks what it prints and what it changed. A file without a
// row here fails the test, so the runbook cannot rot unseen.
func TestRunbook(t *testing.T) {
	type runbookCase struct {
		name string
		file string
		vars map[string]string
		// setup runs after the seed.
		setup string
		// lines is how many lines the output has (0: none); want are
		// substrings of it, and wantNot must not appear.
		lines         int
		want, wantNot []string
		// check is a query returning true when the file had its effect.
		check string
		// fails: the file must fail, with this in what psql prints.
		fails string
	}
	// oldestDueQuery is oldest_due.sql as a subquery, for checks of its columns.
	oldestDueQuery, err := runbook.Query("oldest_due.sql")
	if err != nil {
		t.Fatal(err)
	}
	oldestDueQuery = strings.TrimSuffix(strings.TrimSpace(oldestDueQuery), ";")
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
			// 102 is due behind 101; 113 is due in a paused target.
			name: "oldest due says why due messages wait", file: "oldest_due.sql", lines: 1,
			setup: `UPDATE deferred_message SET next_run_at = now() - interval '1 minute' WHERE id = 102;
			        INSERT INTO deferred_message (id, business_key, seq, target_topic, next_run_at)
			        VALUES (113, 'order-9', 113, 'audit.retry', now() - interval '1 minute')`,
			want:  []string{"3|101|order-1|orders.retry|"},
			check: `SELECT due_messages >= 3 AND waiting_behind = 1 AND waiting_paused = 1 FROM (` + oldestDueQuery + `) o`,
		},
		{
			name: "held keys", file: "held_keys.sql", lines: 3, vars: map[string]string{"limit": ""},
			want: []string{
				// The parked head first; its due time is empty, not infinity.
				"order-3|parked|held by parked message 104|0|||104|4|payments.retry||1||unknown_topic: no such topic|",
				"held-1|backing_off|backing off after 3 failed publish(es)|3|", "|109|9|orders.retry|",
				"leased-1|leased|leased by test-loop|0|", "|test-loop|110|10|orders.retry|",
			},
			wantNot: []string{"order-4|"}, // 105 released its key
		},
		{
			name: "held keys count what waits", file: "held_keys.sql", lines: 3, vars: map[string]string{"limit": ""},
			setup: `INSERT INTO deferred_message (id, business_key, seq, target_topic, next_run_at) VALUES
			        (120, 'order-3', 20, 'payments.retry', now()), (121, 'order-3', 21, 'payments.retry', now() + interval '1 day'),
			        (122, 'held-1', 22, 'orders.retry', now())`,
			want: []string{"|payments.retry||1||unknown_topic: no such topic|", "|2\n", "|1\n", "|0\n"},
		},
		{
			// The first of three, with the total.
			name: "held keys, the first", file: "held_keys.sql", lines: 1, vars: map[string]string{"limit": "1"},
			want: []string{"order-3|parked|held by parked message 104|", "|3|0\n"},
		},
		{
			// The row, 5 headers, 1 re-deferral, 2 history rows (101's and 102's).
			name: "show a message", file: "show_message.sql", vars: map[string]string{"id": "101"}, lines: 9,
			want: []string{
				"101|order-1|1|orders.retry|pending|", "|2||ProviderTimeout|upstream 504|",
				"|t|0|text|order-1|11|text|{\"order\":1}\n", // head, none ahead, key and value as text
				"1|defer.target|text|orders.retry\n", "2|trace|text|abc\n", "3|bin|hex|\\x00ff\n", "4|note|text|café\n",
				"re-deferral|102|order-1|2|orders.retry|pending|",
			},
		},
		{
			name: "show a re-deferral and its origin", file: "show_message.sql", vars: map[string]string{"id": "102"}, lines: 4,
			want: []string{"102|order-1|2|orders.retry|pending|", "|f|1|text|order-1|300|text|éé", "origin|101|order-1|1|orders.retry|pending|"},
		},
		{
			name: "show binary key and value", file: "show_message.sql", vars: map[string]string{"id": "103"}, lines: 2,
			want: []string{"|hex|\\xff00|4|hex|\\xdeadbeef", "103|103|"}, // the row, and its history
		},
		{
			name: "show a parked message holding its key", file: "show_message.sql", vars: map[string]string{"id": "104"}, lines: 2,
			want: []string{"|t|||0|t|0|t||", "104|104|", "|parked|1|unknown_topic: no such topic|"},
		},
		{
			name: "show a gone message: its history ends with who cancelled it", file: "show_message.sql", vars: map[string]string{"id": "112"}, lines: 2,
			want: []string{"112|112|", "|deferred|0||||orders.retry|", "|cancelled|0||||orders.retry|", "|||postgres\n"},
		},
		{
			name: "list by target, state and reason", file: "list.sql", lines: 1,
			vars: map[string]string{"target": "payments.retry", "state": "parked", "key": "", "reason": "unknown_topic", "limit": "10"},
			want: []string{"104|order-3|4|payments.retry|parked|", "|1|unknown_topic: no such topic"},
		},
		{
			name: "list by target pattern and reason code", file: "list.sql", lines: 1,
			vars: map[string]string{"target": "pay%", "state": "", "key": "", "reason": "unknown_topic", "limit": "10"},
			want: []string{"104|order-3|4|payments.retry|parked|"},
		},
		{
			name: "list: a reason code is exact, not a substring", file: "list.sql", lines: 0,
			vars: map[string]string{"target": "", "state": "", "key": "", "reason": "unknown", "limit": "10"},
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
			           AND (SELECT next_run_at > now() FROM deferred_message WHERE id = 103)
			           AND (SELECT count(*) = 1 FROM deferred_attempt WHERE message_id = 102 AND event = 'expedited' AND actor = 'postgres')`,
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
			           AND (SELECT state = 'parked' FROM deferred_message WHERE id = 104)
			           AND (SELECT array_agg(message_id) = '{102}' FROM deferred_attempt WHERE event = 'expedited')`,
		},
		{
			name: "cancel ids", file: "cancel_id.sql", vars: map[string]string{"ids": "104,106"}, lines: 2,
			want: []string{"104|order-3|4|payments.retry|parked|", "106||6||rejected|"},
			check: `SELECT NOT EXISTS (SELECT 1 FROM deferred_message WHERE id IN (104, 106)) AND (SELECT count(*) = 9 FROM deferred_message)
			           AND (SELECT array_agg(message_id ORDER BY message_id) = '{104,106}' FROM deferred_attempt
			                WHERE event = 'cancelled' AND actor = 'postgres' AND message_id <> 112)
			           AND (SELECT reason = 'unknown_topic: no such topic' FROM deferred_attempt WHERE event = 'cancelled' AND message_id = 104)`,
		},
		{
			name: "cancel a head frees its key", file: "cancel_id.sql", vars: map[string]string{"ids": "101"}, lines: 1,
			want:  []string{"101|order-1|1|orders.retry|pending|"},
			check: `SELECT head_id = 102 FROM deferred_key WHERE business_key = 'order-1'`,
		},
		{
			name: "park holding the key", file: "park_id.sql", vars: map[string]string{"ids": "101,105", "why": "it's broken, ticket OPS-7", "release": "false"}, lines: 1,
			want: []string{"101|order-1|1|orders.retry|parked|", "|operator: it's broken, ticket OPS-7"},
			check: `SELECT (SELECT head_id = 101 AND held AND next_run_at = 'infinity' FROM deferred_key WHERE business_key = 'order-1')
			           AND (SELECT reason = 'not_authorized: topic ACL' FROM deferred_message WHERE id = 105)
			           AND (SELECT parked_at IS NOT NULL FROM deferred_message WHERE id = 101)`,
		},
		{
			name: "park releasing the key", file: "park_id.sql", vars: map[string]string{"ids": "101", "why": "poison", "release": "true"}, lines: 1,
			want: []string{"101|order-1|1|orders.retry|parked|", "|operator: poison"},
			check: `SELECT (SELECT head_id = 102 AND NOT held FROM deferred_key WHERE business_key = 'order-1')
			           AND (SELECT NOT park_holds_key FROM deferred_message WHERE id = 101)`,
		},
		{
			name: "replay parked", file: "replay_parked.sql", vars: map[string]string{"target": "payments.retry"}, lines: 2,
			want: []string{"104|order-3|4|payments.retry|pending|", "105|order-4|5|payments.retry|pending|"},
			check: `SELECT (SELECT count(*) = 2 FROM deferred_message
			                WHERE id IN (104, 105) AND state = 'pending' AND reason IS NULL AND next_run_at <= now()
			                  AND redrive_count = 1 AND parked_at IS NULL)
			           AND (SELECT count(*) = 2 FROM deferred_key WHERE business_key IN ('order-3', 'order-4') AND next_run_at <= now() AND NOT held)
			           AND (SELECT count(*) = 2 FROM deferred_attempt WHERE message_id IN (104, 105) AND event = 'replayed')`,
		},
		{
			name: "replay preview", file: "replay_preview.sql", lines: 2,
			vars: fixture.ReplayVars(map[string]string{"target": "payments.%"}),
			// Oldest parked first; 104 holds its key, 105 does not.
			want:  []string{"104|order-3|4|payments.retry|parked|unknown_topic: no such topic||1|0|", "|t|t\n105|order-4|", "|f|t\n"},
			check: `SELECT count(*) = 2 FROM deferred_message WHERE state = 'parked'`,
		},
		{
			name: "replay preview by reason code and time", file: "replay_preview.sql", lines: 1,
			vars: fixture.ReplayVars(map[string]string{"reason": "not_authorized", "since": "2000-01-01T00:00:00Z"}),
			want: []string{"105|order-4|"},
		},
		{
			name: "replay preview of rejected records", file: "replay_preview.sql", lines: 2,
			vars: fixture.ReplayVars(map[string]string{"state": "rejected", "ids": "106,107,999"}),
			// 106 named no target: it cannot be replayed.
			want: []string{"106||6||rejected|missing_target: no defer.target header|", "|f|f\n107||7|orders.retry|rejected|", "|f|t\n"},
		},
		{
			name: "replay at a rate", file: "replay.sql", lines: 2,
			vars: fixture.ReplayVars(map[string]string{"target": "payments.%", "rate": "4", "reset_attempts": "true"}),
			want: []string{"104|order-3|4|payments.retry|pending|", "|0||1\n", "105|order-4|5|payments.retry|pending|"},
			check: `SELECT (SELECT (b.next_run_at - a.next_run_at) = interval '250 milliseconds'
			                FROM deferred_message a, deferred_message b WHERE a.id = 104 AND b.id = 105)
			           AND (SELECT count(*) = 2 FROM deferred_message WHERE id IN (104, 105) AND attempt = 0 AND redrive_count = 1)
			           AND (SELECT head_id = 104 AND NOT held FROM deferred_key WHERE business_key = 'order-3')`,
		},
		{
			name: "replay with no filter moves nothing", file: "replay.sql", lines: 0,
			vars:  fixture.ReplayVars(map[string]string{"rate": "", "reset_attempts": "false"}),
			check: `SELECT count(*) = 2 FROM deferred_message WHERE state = 'parked'`,
		},
		{
			name: "replay a rejected record with a target", file: "replay.sql", lines: 1,
			vars:  fixture.ReplayVars(map[string]string{"state": "rejected", "ids": "106,107", "rate": "", "reset_attempts": "false"}),
			want:  []string{"107||7|orders.retry|pending|"},
			check: `SELECT (SELECT state = 'rejected' FROM deferred_message WHERE id = 106) AND (SELECT state = 'pending' FROM deferred_message WHERE id = 107)`,
		},
		{
			name: "parked summary", file: "parked_summary.sql", lines: 2,
			want: []string{"payments.retry|not_authorized|1|0|0|", "payments.retry|unknown_topic|1|1|0|"},
		},
		{
			name: "history of a re-deferral is its lineage's", file: "history.sql", vars: map[string]string{"id": "102"}, lines: 2,
			want: []string{"101|101|", "|deferred|2||ProviderTimeout|upstream 504|orders.retry|", "101|102|", "|deferred|3|"},
		},
		{
			name: "history of a gone message", file: "history.sql", vars: map[string]string{"id": "112"}, lines: 2,
			want: []string{"112|112|", "|cancelled|"},
		},
		{
			name: "history of nothing", file: "history.sql", vars: map[string]string{"id": "999"}, lines: 0,
		},
		{
			name: "targets: only those with something set, and who changed them", file: "targets.sql", lines: 3,
			setup: `INSERT INTO target_control (target_topic) VALUES ('idle.retry');
			        INSERT INTO target_control (target_topic, weight) VALUES ('heavy.retry', 3)`,
			want: []string{"audit.retry|t||1|seeded pause|", "|postgres|", "bulk.retry|f|25|1||", "heavy.retry|f||3||"},
		},
		{
			name: "limit a new target", file: "limit_target.sql", vars: map[string]string{"target": "orders.retry", "rate": "0.5"}, lines: 1,
			want:  []string{"orders.retry|f|0.5|1||"},
			check: `SELECT rate_limit = 0.5 AND NOT paused FROM target_control WHERE target_topic = 'orders.retry'`,
		},
		{
			name: "lower a limit: saved tokens go too", file: "limit_target.sql", vars: map[string]string{"target": "bulk.retry", "rate": "5"}, lines: 1,
			want:  []string{"bulk.retry|f|5|1||"},
			check: `SELECT rate_limit = 5 AND tokens = 5 FROM target_control WHERE target_topic = 'bulk.retry'`,
		},
		{
			name: "limit a paused target keeps the pause", file: "limit_target.sql", vars: map[string]string{"target": "audit.retry", "rate": "100"}, lines: 1,
			want: []string{"audit.retry|t|100|1|seeded pause|"},
		},
		{
			name: "history of a target's controls, not of its tokens", file: "limit_target.sql", vars: map[string]string{"target": "bulk.retry", "rate": "5"}, lines: 1,
			setup: `UPDATE target_control SET tokens = 3, refilled_at = now() WHERE target_topic = 'bulk.retry';
			        UPDATE target_control SET note = note WHERE target_topic = 'bulk.retry'`,
			want: []string{"bulk.retry|f|5|1||", "|postgres|"},
			check: `SELECT array_agg(change || ':' || rate_limit ORDER BY id) = '{insert:25,update:5}'
			        FROM target_control_history WHERE target_topic = 'bulk.retry'`,
		},
		{
			name: "unlimit", file: "unlimit_target.sql", vars: map[string]string{"target": "bulk.retry"}, lines: 1,
			want:  []string{"bulk.retry|f||1||"},
			check: `SELECT rate_limit IS NULL FROM target_control WHERE target_topic = 'bulk.retry'`,
		},
		{
			name: "unlimit a target without a limit", file: "unlimit_target.sql", vars: map[string]string{"target": "audit.retry"}, lines: 0,
			check: `SELECT paused FROM target_control WHERE target_topic = 'audit.retry'`,
		},
		{
			name: "weight a new target", file: "weight_target.sql", vars: map[string]string{"target": "orders.retry", "weight": "3"}, lines: 1,
			want:  []string{"orders.retry|f||3||"},
			check: `SELECT weight = 3 AND NOT paused AND rate_limit IS NULL FROM target_control WHERE target_topic = 'orders.retry'`,
		},
		{
			name: "weight a paused, limited target keeps the rest, recorded", file: "weight_target.sql", vars: map[string]string{"target": "bulk.retry", "weight": "100"}, lines: 1,
			setup: `UPDATE target_control SET paused = true, note = 'x' WHERE target_topic = 'bulk.retry'`,
			want:  []string{"bulk.retry|t|25|100|x|", "|postgres|"},
			check: `SELECT array_agg(change || ':' || weight ORDER BY id) = '{insert:1,update:1,update:100}'
			        FROM target_control_history WHERE target_topic = 'bulk.retry'`,
		},
		{
			name: "weight 1 is the default: no row added", file: "weight_target.sql", vars: map[string]string{"target": "orders.retry", "weight": "1"}, lines: 0,
			check: `SELECT NOT EXISTS (SELECT FROM target_control WHERE target_topic = 'orders.retry')`,
		},
		{
			name: "weight 1 again", file: "weight_target.sql", vars: map[string]string{"target": "bulk.retry", "weight": "1"}, lines: 0,
			check: `SELECT weight = 1 AND rate_limit = 25 FROM target_control WHERE target_topic = 'bulk.retry'`,
		},
		{
			name: "weight out of range", file: "weight_target.sql", vars: map[string]string{"target": "bulk.retry", "weight": "101"},
			fails: "target_control_weight_range",
			check: `SELECT weight = 1 FROM target_control WHERE target_topic = 'bulk.retry'`,
		},
		{
			name: "pause a target", file: "pause_target.sql", vars: map[string]string{"target": "orders.retry", "note": "INC-42"}, lines: 1,
			want:  []string{"orders.retry|t||1|INC-42|"},
			check: `SELECT paused AND note = 'INC-42' FROM target_control WHERE target_topic = 'orders.retry'`,
		},
		{
			name: "resume a paused target", file: "resume_target.sql", vars: map[string]string{"target": "audit.retry"}, lines: 1,
			want:  []string{"audit.retry|f||1|seeded pause|"},
			check: `SELECT NOT paused FROM target_control WHERE target_topic = 'audit.retry'`,
		},
		{
			name: "resume a target that is not paused", file: "resume_target.sql", vars: map[string]string{"target": "bulk.retry"}, lines: 0,
			check: `SELECT NOT paused AND rate_limit = 25 FROM target_control WHERE target_topic = 'bulk.retry'`,
		},
		{
			name: "pause again without a note keeps the note", file: "pause_target.sql", vars: map[string]string{"target": "audit.retry", "note": ""}, lines: 1,
			want:  []string{"audit.retry|t||1|seeded pause|"},
			check: `SELECT paused AND note = 'seeded pause' FROM target_control WHERE target_topic = 'audit.retry'`,
		},
		{
			name: "pause a new target without a note", file: "pause_target.sql", vars: map[string]string{"target": "new.retry", "note": ""}, lines: 1,
			want:  []string{"new.retry|t||1||"},
			check: `SELECT paused AND note IS NULL FROM target_control WHERE target_topic = 'new.retry'`,
		},
		{
			name: "keys in flight, oldest first", file: "inflight.sql", setup: inflightSeed, lines: 4,
			vars: map[string]string{"group": "", "key": "", "limit": ""},
			want: []string{
				// The ages are truncated to the second, and a second may pass.
				"payments|order-1|orders.retry|0|41|201|1|", "|00:20:0", "audit|order-1|orders.retry|0|41|201|1|", "|00:01:0",
			},
		},
		{
			name: "keys in flight for a group and key", file: "inflight.sql", setup: inflightSeed, lines: 2,
			vars:    map[string]string{"group": "payments", "key": "order-1", "limit": "10"},
			want:    []string{"payments|order-1|orders.retry|0|41|", "payments|order-1|orders.retry|1|7|"},
			wantNot: []string{"audit|", "payments|order-2|"},
		},
		{
			name: "keys in flight, limited", file: "inflight.sql", setup: inflightSeed, lines: 1,
			vars: map[string]string{"group": "", "key": "", "limit": "1"},
			want: []string{"payments|order-1|orders.retry|0|41|"},
		},
		{
			name: "release a group's keys", file: "release_inflight.sql", setup: inflightSeed, lines: 3,
			vars:  map[string]string{"group": "payments", "key": ""},
			want:  []string{"payments|order-1|orders.retry|0|41|201|1|", "payments|order-1|orders.retry|1|7|", "payments|order-2|orders.retry|0|42|"},
			check: `SELECT count(*) = 1 AND bool_and(group_id = 'audit') FROM deferred_inflight`,
		},
		{
			name: "release one key of a group", file: "release_inflight.sql", setup: inflightSeed, lines: 2,
			vars:  map[string]string{"group": "payments", "key": "order-1"},
			want:  []string{"payments|order-1|orders.retry|0|", "payments|order-1|orders.retry|1|"},
			check: `SELECT count(*) = 2 FROM deferred_inflight WHERE business_key = 'order-2' OR group_id = 'audit'`,
		},
		{
			name: "release with no group releases nothing", file: "release_inflight.sql", setup: inflightSeed, lines: 0,
			vars:  map[string]string{"group": "", "key": ""},
			check: `SELECT count(*) = 4 FROM deferred_inflight`,
		},
		{
			name: "rejected in the last hour", file: "rejected_recent.sql", vars: map[string]string{"window": "1 hour"}, lines: 2,
			want: []string{"invalid_delay|1|", "missing_target|1|"},
		},
		{
			name: "rejected in the last day", file: "rejected_recent.sql", vars: map[string]string{"window": "1 day"}, lines: 2,
			want: []string{"missing_target|2|"},
		},
		// The console's files (internal/console).
		{
			name: "console overview", file: "console_overview.sql", vars: map[string]string{"window": "5 minutes"}, lines: 5,
			setup: `UPDATE target_control SET weight = 4 WHERE target_topic = 'bulk.retry'`,
			want: []string{"|0|0|0||0|0|2|f|||0|f|1\n", "orders.retry|5|2|2|", "payments.retry|1|0|0||0|2|0|f|||0|f|1\n",
				"audit.retry|0|0|0||0|0|0|t|seeded pause||0|f|1\n", "bulk.retry|0|0|0||0|0|0|f||25|0|f|4\n"},
		},
		{
			name: "console messages, parked, oldest first", file: "console_messages.sql", lines: 2,
			vars: map[string]string{"state": "parked", "target": "payments.%", "reason": "", "error_class": "",
				"since": "", "until": "", "sort": "oldest", "after_at": "", "after_id": "", "limit": "50"},
			want: []string{"104|order-3|4|payments.retry|parked|", "|t\n105|order-4|", "|f\n"},
		},
		{
			name: "console messages by reason code, newest first, after a cursor", file: "console_messages.sql", lines: 1,
			vars: map[string]string{"state": "", "target": "", "reason": "missing_target", "error_class": "",
				"since": "", "until": "", "sort": "newest", "after_at": "", "after_id": "108", "limit": "50"},
			want: []string{"106||6||rejected|"},
		},
		{
			name: "console messages by due time, one page", file: "console_messages.sql", lines: 2,
			vars: map[string]string{"state": "pending", "target": "", "reason": "", "error_class": "",
				"since": "", "until": "", "sort": "due", "after_at": "", "after_id": "", "limit": "2"},
			want: []string{"101|order-1|", "109|held-1|"},
		},
		{
			name: "ingest progress", file: "ingest_progress.sql", lines: 2, vars: map[string]string{"topic": "scheduler.defer"},
			setup: `INSERT INTO ingest_offset (topic, partition, next_offset) VALUES
			        ('scheduler.defer', 1, 42), ('scheduler.defer', 0, 7), ('other.topic', 0, 99)`,
			want: []string{"0|7|", "1|42|"},
		},
		{
			name: "key messages", file: "key_messages.sql", lines: 2,
			setup: `INSERT INTO deferred_message (id, business_key, seq, target_topic, next_run_at, state, reason)
			        VALUES (130, 'order-3', 30, NULL, now(), 'rejected', 'missing_target: none')`,
			vars: map[string]string{"key": "order-3", "after_seq": "", "after_id": "", "limit": "10"},
			want: []string{"104|order-3|4|payments.retry|parked|", "|t|t\n130|order-3|30||rejected|", "|f|f\n"},
		},
		{
			name: "key messages after a cursor", file: "key_messages.sql", lines: 1,
			vars: map[string]string{"key": "order-1", "after_seq": "1", "after_id": "101", "limit": "10"},
			want: []string{"102|order-1|2|orders.retry|pending|"},
		},
		{
			name: "key state of a held key", file: "key_state.sql", vars: map[string]string{"key": "order-3"}, lines: 1,
			want: []string{"order-3|104|t|0||f|||f|payments.retry|f||\n"},
		},
		{
			name: "key state of a backing-off key", file: "key_state.sql", vars: map[string]string{"key": "held-1"}, lines: 1,
			want: []string{"held-1|109|f|3|", "|t||"},
		},
		{
			name: "key state of nothing", file: "key_state.sql", vars: map[string]string{"key": "nobody"}, lines: 0,
		},
		{
			name: "fix rejected records", file: "fix_rejected.sql", lines: 1,
			vars:  map[string]string{"ids": "106,107,108,101", "target": "", "due": ""},
			want:  []string{"107||7|orders.retry|pending|", "|0||1\n"}, // 106 and 108 have no target, 101 is not rejected
			check: `SELECT (SELECT state FROM deferred_message WHERE id = 106) = 'rejected'`,
		},
		{
			name: "fix rejected records with a target and a due time", file: "fix_rejected.sql", lines: 2,
			vars:  map[string]string{"ids": "106,108", "target": "orders.retry", "due": "2030-01-01T00:00:00Z"},
			want:  []string{"106||6|orders.retry|pending|2030-01-01", "108||8|orders.retry|pending|"},
			check: `SELECT count(*) = 2 FROM deferred_message WHERE id IN (106, 108) AND state = 'pending' AND reason IS NULL AND redrive_count = 1`,
		},
	}

	files, err := filepath.Glob(filepath.Join(repoRoot, "sql", "runbook", "*.sql"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("no runbook files in %s", filepath.Join(repoRoot, "sql", "runbook"))
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
			fixture.SeedOps(t, db.Pool)
			if tt.setup != "" {
				if _, err := db.Pool.Exec(context.Background(), tt.setup); err != nil {
					t.Fatalf("setup: %v", err)
				}
			}
			out, err := fixture.Psql(t, db.URL, tt.file, tt.vars)
			switch {
			case tt.fails != "" && (err == nil || !strings.Contains(out, tt.fails)):
				t.Fatalf("psql -f %s: %v, want it to fail with %q:\n%s", tt.file, err, tt.fails, out)
			case tt.fails != "":
				out = "" // what psql printed is the error
			case err != nil:
				t.Fatalf("psql -f %s: %v\n%s", tt.file, err, out)
			}
			if got := strings.Count(out, "\n"); got != tt.lines {
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
				if _, err := operate.Bind(q, vars); err != nil {
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
	for _, cmd := range []string{"status", "ls", "show", "held", "expedite", "cancel", "park", "replay", "pause", "resume", "limit", "targets",
		"inflight", "release"} {
		if !strings.Contains(section, "\nscheduler "+cmd+" ") {
			t.Errorf("README.md, Operating it: no example of scheduler %s", cmd)
		}
	}
}
