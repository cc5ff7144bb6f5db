package opscli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/opscli/opsjson"
	"github.com/deferq/scheduler/internal/pgtest"
)

// TestOpsCommands runs every operator command in process against a seeded
// database (see seedOps), with human and JSON output, and the bad input each
// must refuse with one line and a non-zero exit.
func TestOpsCommands(t *testing.T) {
	down := "DATABASE_URL=postgres://postgres@" + freeAddr(t) + "/scheduler?sslmode=disable"
	// A server that is up, asked for a session setting it refuses.
	refused := "DATABASE_URL=" + pgtest.WithQuery(t, pgtest.AdminURL(t), "options=-c%20jit%3Dsometimes")
	tests := []struct {
		name string
		args []string
		// env replaces the environment; nil means DATABASE_URL of a fresh
		// seeded database.
		env            []string
		code           int
		stdout, stderr []string // substrings
		notStdout      []string
		// json, when set, checks the parsed stdout.
		json func(t *testing.T, out string)
		// check is a query returning true when the command had its effect
		// (or, for a refusal, none).
		check string
		// setup runs after the seed.
		setup string
		// addEnv is added to the environment of a fresh seeded database.
		addEnv []string
	}{
		// status
		{
			name: "status", args: []string{"status"},
			stdout: []string{
				"Backlog by target and state:\n", "  TARGET          STATE     MESSAGES  DUE  FIRST RUN AT",
				"  -               rejected  2         0    -", "  orders.retry    pending   5         2    ",
				"  payments.retry  parked    2         0    -",
				"Lateness: 2m", "message 101 (key order-1, target orders.retry)", "; 2 key heads due\n",
				"Held keys: 3, 1 by a parked message, 1 backing off after failed publishes, 0 in flight (scheduler held lists them)\n",
				"Rejected in the last hour: 2 (invalid_delay 1, missing_target 1)\n",
			},
		},
		{
			name: "status --json", args: []string{"status", "--json"},
			json: func(t *testing.T, out string) {
				s := opsjson.Decode[opsjson.Status](t, out)
				if len(s.Backlog) != 5 || s.DueHeads != 2 || s.LatenessSeconds < 119 || s.OldestDue == nil ||
					s.OldestDue.ID != 101 || s.OldestDue.BusinessKey != "order-1" || s.HeldKeys != 3 || s.ParkedKeys != 1 || s.BackingOffKeys != 1 ||
					s.RejectedLastHour != 2 || len(s.RejectedReasons) != 2 {
					t.Errorf("status: %+v", s)
				}
			},
		},
		{name: "status with an argument", args: []string{"status", "now"}, code: 2, stderr: []string{`unexpected argument "now"`}},

		// ls
		{
			name: "ls", args: []string{"ls", "--target", "payments.retry"},
			stdout: []string{
				"ID   KEY      SEQ  TARGET          STATE    DUE ", "ATTEMPT  REASON\n",
				"\n104  order-3  4    payments.retry  parked   ", "  1        unknown_topic: no such topic\n",
				"\n105  order-4  5 ", "\n103  order-2  3    payments.retry  pending  ",
			},
			notStdout: []string{"orders.retry"},
		},
		{
			name: "ls --json", args: []string{"ls", "--state", "parked", "--json"},
			json: func(t *testing.T, out string) {
				ms := opsjson.Decode[[]opsjson.Message](t, out)
				opsjson.SameIDs(t, "ls", opsjson.IDs(ms), 104, 105)
				if ms[0].State != "parked" || *ms[0].TargetTopic != "payments.retry" || *ms[0].Reason != "unknown_topic: no such topic" || ms[0].Attempt != 1 {
					t.Errorf("ls: %+v", ms[0])
				}
			},
		},
		{
			name: "ls by reason code", args: []string{"ls", "--reason", "missing_target", "--json"},
			json: func(t *testing.T, out string) {
				opsjson.SameIDs(t, "ls", opsjson.IDs(opsjson.Decode[[]opsjson.Message](t, out)), 106, 108)
			},
		},
		{
			name: "ls --limit", args: []string{"ls", "--key", "order-1", "--limit", "1"},
			stdout: []string{"\n101  order-1  1 ", "(the first 1; --limit shows more)\n"},
		},
		{name: "ls no match", args: []string{"ls", "--key", "nope"}, stdout: []string{"no messages match\n"}},
		{
			name: "ls --target is a glob", args: []string{"ls", "--state", "parked", "--target", "pay*", "--json"},
			json: func(t *testing.T, out string) {
				opsjson.SameIDs(t, "ls", opsjson.IDs(opsjson.Decode[[]opsjson.Message](t, out)), 104, 105)
			},
		},
		{name: "ls --target a plain name is exact", args: []string{"ls", "--target", "payments.retr"}, stdout: []string{"no messages match\n"}},
		{name: "ls --reason is a code, not a substring", args: []string{"ls", "--reason", "missing"}, stdout: []string{"no messages match\n"}},
		{name: "ls --reason refuses a whole reason", args: []string{"ls", "--reason", "missing_target: no header"}, code: 2,
			stderr: []string{`want a reason code, the part of the reason before the colon, e.g. missing_target`}},
		{name: "ls shows no due time for a rejected message", args: []string{"ls", "--state", "rejected"},
			stdout: []string{"\n106  -    6    -             rejected  -    0 "}},
		{
			name: "ls no match --json", args: []string{"ls", "--key", "nope", "--json"},
			json: func(t *testing.T, out string) {
				if strings.TrimSpace(out) != "[]" {
					t.Errorf("want [], got %s", out)
				}
			},
		},
		{name: "ls bad state", args: []string{"ls", "--state", "bogus"}, code: 2,
			stderr: []string{`--state "bogus" is not a state: want one of pending, parked, rejected`}},
		{name: "ls bad state --json", args: []string{"ls", "--json", "--state", "bogus"}, code: 2,
			stderr: []string{`{"error":"--state \"bogus\" is not a state: want one of pending, parked, rejected`}},
		{name: "ls bad limit", args: []string{"ls", "--limit", "0"}, code: 2, stderr: []string{"--limit 0 is out of range"}},
		{name: "ls limit not a number", args: []string{"ls", "--limit", "ten"}, code: 2, stderr: []string{`invalid value "ten" for flag -limit`}},
		{name: "ls unknown flag", args: []string{"ls", "--bogus"}, code: 2, stderr: []string{"flag provided but not defined: -bogus", "scheduler ls --help"}},
		{name: "ls unknown flag --json", args: []string{"ls", "--bogus", "--json"}, code: 2, stderr: []string{`{"error":"flag provided but not defined: -bogus`}},

		// show
		{
			name: "show", args: []string{"show", "101"},
			stdout: []string{
				"Message 101: pending, head of its key\n", "  business key  order-1\n", "  target topic  orders.retry\n",
				"  attempt       2\n", "  error         ProviderTimeout: upstream 504\n",
				"Key (text): order-1\n", "Headers:\n", "  #  KEY           ENCODING  VALUE\n",
				"  1  defer.target  text      orders.retry\n", "  3  bin           hex       \\x00ff\n",
				"  4  note          text      café\n", "  5  evil          text      \\x1b[2J\n",
				"Value (text, 11 bytes):\n{\"order\":1}\n", "Lineage:\n", "  re-deferral  102  order-1  2 ",
			},
			notStdout: []string{"\x1b"},
		},
		{
			name: "show behind its head, value cut", args: []string{"show", "102"},
			stdout: []string{
				"Message 102: pending, behind 1 pending message of its key\n", "  origin id     101\n",
				"Value (text, 300 bytes, first 256 bytes; --full for all):\n" + strings.Repeat("é", 128) + "\n",
				"Headers: none\n", "  origin    101  order-1  1 ",
			},
		},
		{
			name: "show --full", args: []string{"show", "--full", "102"},
			stdout: []string{"Value (text, 300 bytes):\n" + strings.Repeat("é", 150) + "\n"},
		},
		{
			name: "show --json", args: []string{"show", "102", "--json"},
			json: func(t *testing.T, out string) {
				s := opsjson.Decode[opsjson.Story](t, out)
				m := s.Message
				if m.ID != 102 || m.IsHead || *m.PendingAhead != 1 || *m.ValueBytes != 300 || !m.ValueTruncated ||
					*m.Value != strings.Repeat("é", 128) || len(s.Headers) != 0 || len(s.Lineage) != 1 ||
					s.Lineage[0].Relation != "origin" || s.Lineage[0].ID != 101 {
					t.Errorf("show: %+v", s)
				}
			},
		},
		{
			name: "show binary --json", args: []string{"show", "--json", "103"},
			json: func(t *testing.T, out string) {
				m := opsjson.Decode[opsjson.Story](t, out).Message
				if *m.KeyEncoding != "hex" || *m.Key != `\xff00` || *m.ValueEncoding != "hex" || *m.Value != `\xdeadbeef` || !m.IsHead {
					t.Errorf("show: %+v", m)
				}
			},
		},
		{
			name: "show headers --json", args: []string{"show", "--json", "101"},
			json: func(t *testing.T, out string) {
				s := opsjson.Decode[opsjson.Story](t, out)
				if len(s.Headers) != 5 || s.Headers[2].Key != "bin" || s.Headers[2].Encoding != "hex" || s.Headers[2].Value != `\x00ff` ||
					s.Headers[4].Value != "\x1b[2J" || *s.Message.ErrorClass != "ProviderTimeout" {
					t.Errorf("show: %+v", s)
				}
			},
		},
		{
			name: "show rejected", args: []string{"show", "106"},
			stdout: []string{"Message 106: rejected\n", "  reason        missing_target: no defer.target header\n", "Key: none\n", "Value: none (null)\n", "Lineage: none\n"},
		},
		{
			name: "show a parked message holding its key", args: []string{"show", "104"},
			stdout: []string{
				"Message 104: parked, holding its key: 0 pending messages of the key wait behind it\n", "  parked at     ",
				"  replayed      0 times\n", "History of lineage 104:\n",
				"  RECORDED AT", "MESSAGE  EVENT   ATTEMPT  TARGET          DUE", "  104      parked  1        payments.retry  ",
				"  unknown_topic: no such topic  -      -\n",
			},
		},
		{
			name: "show a parked message that released its key", args: []string{"show", "105", "--json"},
			json: func(t *testing.T, out string) {
				s := opsjson.Decode[opsjson.Story](t, out)
				m := s.Message
				if m.State != "parked" || m.HoldsKey || m.ParkHoldsKey || m.ParkedAt == nil || m.IsHead || len(s.History) != 1 ||
					s.History[0].Event != "parked" || *s.History[0].Reason != "not_authorized: topic ACL" {
					t.Errorf("show: %+v", s)
				}
			},
		},
		{
			name: "show the history of a lineage", args: []string{"show", "102", "--json"},
			json: func(t *testing.T, out string) {
				h := opsjson.Decode[opsjson.Story](t, out).History
				if len(h) != 2 || h[0].LineageID != 101 || h[0].MessageID != 101 || h[0].Event != "deferred" || h[0].Attempt != 2 ||
					*h[0].ErrorClass != "ProviderTimeout" || *h[0].ErrorMessage != "upstream 504" || h[1].MessageID != 102 || h[1].LineageID != 101 {
					t.Errorf("history: %+v", h)
				}
			},
		},
		{
			name: "show a gone message", args: []string{"show", "112"},
			stdout: []string{"Message 112: cancelled by postgres at ", ", while pending\n", "History of lineage 112:\n", "  112      deferred   0 ",
				"  112      cancelled  0 ", "  postgres\n"},
		},
		{
			name: "show a gone message --json", args: []string{"show", "112", "--json"},
			json: func(t *testing.T, out string) {
				if !strings.Contains(out, `"message": null`) {
					t.Errorf("want message null:\n%s", out)
				}
				if h := opsjson.Decode[opsjson.Story](t, out).History; len(h) != 2 || h[0].MessageID != 112 || h[1].Event != "cancelled" {
					t.Errorf("history: %+v", h)
				}
				if !strings.Contains(out, `"end": "cancelled by postgres at `) {
					t.Errorf("want the end of the story:\n%s", out)
				}
			},
		},
		{name: "show unknown id", args: []string{"show", "999"}, code: 1, stderr: []string{"scheduler show: no message with id 999, and no history of one\n"}},
		{name: "show unknown id --json", args: []string{"show", "999", "--json"}, code: 1, stderr: []string{`{"error":"no message with id 999, and no history of one"}`}},

		// held
		{
			name: "held", args: []string{"held"},
			stdout: []string{
				"Held by a parked message (replay or cancel it to release the key):\n",
				"  KEY      HEAD  TARGET          WAITING  PARKED AT", "REASON\n", "  order-3  104   payments.retry  0        ",
				"  unknown_topic: no such topic\n",
				"\n\nBacking off after failed publishes (they retry by themselves):\n",
				"  KEY     HEAD  TARGET        WAITING  FAILURES  RETRY      ERROR CLASS\n",
				"  held-1  109   orders.retry  0        3         in ", "  BrokerDown\n",
				"\n\nLeased by a dispatcher (publishing now):\n", "  leased-1  110   orders.retry  0        test-loop  ",
			},
			notStdout: []string{"order-4"},
		},
		{
			name: "held --json", args: []string{"held", "--json"},
			json: func(t *testing.T, out string) {
				h := opsjson.Decode[[]opsjson.Held](t, out)
				if len(h) != 3 || h[0].Kind != "parked" || *h[0].BusinessKey != "order-3" || h[0].HeadID != 104 || h[0].NextRunAt != nil ||
					h[0].ParkedAt == nil || *h[0].Reason != "unknown_topic: no such topic" ||
					h[1].Kind != "backing_off" || h[1].NextRunAt == nil || h[2].Kind != "leased" || *h[2].BusinessKey != "leased-1" {
					t.Errorf("held: %+v", h)
				}
			},
		},
		{name: "held with an argument", args: []string{"held", "order-3"}, code: 2, stderr: []string{`unexpected argument "order-3"`}},
		{name: "show malformed id", args: []string{"show", "abc"}, code: 2, stderr: []string{`"abc" is not a message id`}},
		{name: "show no id", args: []string{"show"}, code: 2, stderr: []string{"want one message id, got 0"}},
		{name: "show two ids", args: []string{"show", "101", "102"}, code: 2, stderr: []string{"want one message id, got 2"}},
		{name: "show a list", args: []string{"show", "101,102"}, code: 2, stderr: []string{`want one message id, got 2`}},
		{name: "show an id and --id", args: []string{"show", "101", "--id", "102"}, code: 2, stderr: []string{`want one message id, got 2`}},

		// expedite
		{
			name: "expedite --key", args: []string{"expedite", "--key", "order-1"},
			stdout: []string{"\n102  order-1  2    orders.retry  pending  ", "expedited 1 message\n"},
			check:  `SELECT next_run_at <= now() FROM deferred_message WHERE id = 102`,
		},
		{
			name: "expedite --target --json", args: []string{"expedite", "--target", "orders.retry", "--json"},
			json: func(t *testing.T, out string) {
				c := opsjson.Decode[opsjson.Change](t, out)
				if c.Expedited == nil || *c.Expedited != 3 {
					t.Errorf("expedite: %+v", c)
				}
				opsjson.SameIDs(t, "expedite", opsjson.IDs(c.Messages), 102, 110, 111)
			},
			check: `SELECT count(*) = 0 FROM deferred_message WHERE target_topic = 'orders.retry' AND state = 'pending' AND next_run_at > now()`,
		},
		{
			name: "expedite --id", args: []string{"expedite", "--id", "103,110", "--json"},
			json: func(t *testing.T, out string) {
				opsjson.SameIDs(t, "expedite", opsjson.IDs(opsjson.Decode[opsjson.Change](t, out).Messages), 103, 110)
			},
			check: `SELECT bool_and(next_run_at <= now()) FROM deferred_message WHERE id IN (103, 110)`,
		},
		{
			name: "expedite a key already due", args: []string{"expedite", "--key", "held-1"},
			stdout: []string{`nothing to expedite: the pending messages with business key "held-1" are all due already`},
		},
		{name: "expedite an unknown key", args: []string{"expedite", "--key", "nope"}, code: 1,
			stderr: []string{`scheduler expedite: no pending message with business key "nope"`}},
		{name: "expedite an unknown target --json", args: []string{"expedite", "--target", "nope", "--json"}, code: 1,
			stderr: []string{`{"error":"no pending message with target topic \"nope\""}`}},
		{
			name: "expedite an unknown and a parked id", args: []string{"expedite", "--id", "103,104,999"}, code: 1,
			stderr: []string{"message 104 is parked, no message with id 999: only pending messages can be expedited", "nothing changed"},
			check:  `SELECT next_run_at > now() FROM deferred_message WHERE id = 103`,
		},
		{
			name: "expedite --target is a glob", args: []string{"expedite", "--target", "orders.*", "--json"},
			json: func(t *testing.T, out string) {
				opsjson.SameIDs(t, "expedite", opsjson.IDs(opsjson.Decode[opsjson.Change](t, out).Messages), 102, 110, 111)
			},
			check:  `SELECT count(*) = 3 FROM deferred_attempt WHERE event = 'expedited' AND actor = 'cli:alice'`,
			addEnv: []string{"USER=alice"},
		},
		{
			name: "expedite ids as arguments", args: []string{"expedite", "103", "110"},
			stdout: []string{"expedited 2 messages\n"},
		},
		{name: "expedite nothing", args: []string{"expedite"}, code: 2, stderr: []string{"give exactly one of ids (arguments or --id), --key and --target (got 0)"}},
		{name: "expedite two ways", args: []string{"expedite", "--key", "a", "--target", "b"}, code: 2, stderr: []string{"(got 2)"}},
		{name: "expedite an empty key", args: []string{"expedite", "--key", ""}, code: 2, stderr: []string{"--key is empty"}},
		{name: "expedite a malformed id", args: []string{"expedite", "--id", "12a"}, code: 2, stderr: []string{`"12a" is not a message id`}},
		{name: "expedite an argument that is no id", args: []string{"expedite", "--key", "a", "b"}, code: 2, stderr: []string{`"b" is not a message id`}},
		{name: "expedite a key and ids", args: []string{"expedite", "--key", "a", "5"}, code: 2, stderr: []string{`give exactly one of ids (arguments or --id), --key and --target (got 2)`}},

		// cancel
		{
			name: "cancel", args: []string{"cancel", "104", "106"},
			stdout: []string{"\n104  order-3  4    payments.retry  parked ", "\n106  -        6    -   ", "cancelled 2 messages\n"},
			check:  `SELECT NOT EXISTS (SELECT 1 FROM deferred_message WHERE id IN (104, 106))`,
		},
		{
			name: "cancel --json, flags among ids", args: []string{"cancel", "101", "--json", "109"},
			json: func(t *testing.T, out string) {
				c := opsjson.Decode[opsjson.Change](t, out)
				if c.Cancelled == nil || *c.Cancelled != 2 {
					t.Errorf("cancel: %+v", c)
				}
				opsjson.SameIDs(t, "cancel", opsjson.IDs(c.Messages), 101, 109)
			},
			check: `SELECT (SELECT head_id = 102 FROM deferred_key WHERE business_key = 'order-1')
			           AND NOT EXISTS (SELECT 1 FROM deferred_key WHERE business_key = 'held-1')`,
		},
		{
			name: "cancel an unknown id", args: []string{"cancel", "104", "999"}, code: 1,
			stderr: []string{"scheduler cancel: no message with id 999; nothing changed\n"},
			check:  `SELECT EXISTS (SELECT 1 FROM deferred_message WHERE id = 104)`,
		},
		{
			name: "cancel an unknown id --json", args: []string{"cancel", "--json", "998,999"}, code: 1,
			stderr: []string{`{"error":"no message with id 998, no message with id 999; nothing changed"}`},
		},
		{name: "cancel nothing", args: []string{"cancel"}, code: 2, stderr: []string{"want at least one message id"}},
		{name: "cancel a malformed id", args: []string{"cancel", "104", "x1"}, code: 2, stderr: []string{`"x1" is not a message id`},
			check: `SELECT EXISTS (SELECT 1 FROM deferred_message WHERE id = 104)`},
		{name: "cancel an id after --", args: []string{"cancel", "--", "-5"}, code: 2, stderr: []string{`"-5" is not a message id`}},

		// park
		{
			name: "park", args: []string{"park", "101", "--why", "bad address, OPS-7"},
			stdout: []string{"\n101  order-1  1    orders.retry  parked ", "operator: bad address, OPS-7\n", "parked 1 message\n"},
			// It holds its key, as its policy says (park_holds_key).
			check: `SELECT (SELECT state = 'parked' AND reason = 'operator: bad address, OPS-7' FROM deferred_message WHERE id = 101)
			           AND (SELECT head_id = 101 AND held FROM deferred_key WHERE business_key = 'order-1')`,
		},
		{
			name: "park --release-key", args: []string{"park", "101", "--why", "poison", "--release-key"},
			stdout: []string{"parked 1 message\n"},
			check: `SELECT (SELECT state = 'parked' AND NOT park_holds_key FROM deferred_message WHERE id = 101)
			           AND (SELECT head_id = 102 AND NOT held FROM deferred_key WHERE business_key = 'order-1')`,
		},
		{
			name: "park --json", args: []string{"park", "--json", "--why", "x", "--id", "103,110"},
			json: func(t *testing.T, out string) {
				c := opsjson.Decode[opsjson.Change](t, out)
				if c.Parked == nil || *c.Parked != 2 || c.Messages[0].State != "parked" || *c.Messages[0].Reason != "operator: x" {
					t.Errorf("park: %+v", c)
				}
			},
			check: `SELECT count(*) = 4 FROM deferred_message WHERE state = 'parked'`,
		},
		{
			name: "park a parked and a rejected id", args: []string{"park", "101", "104", "106", "--why", "x"}, code: 1,
			stderr: []string{"message 104 is parked, message 106 is rejected: only pending messages can be parked; nothing changed"},
			check:  `SELECT state = 'pending' FROM deferred_message WHERE id = 101`,
		},
		{name: "park with --reason, a reason code elsewhere", args: []string{"park", "101", "--reason", "bad"}, code: 2,
			stderr: []string{"--reason is a reason code (ls, replay); say why with --why bad"},
			check:  `SELECT state = 'pending' FROM deferred_message WHERE id = 101`},
		{name: "park without a reason", args: []string{"park", "101"}, code: 2, stderr: []string{"--why is required"},
			check: `SELECT state = 'pending' FROM deferred_message WHERE id = 101`},
		{name: "park without ids", args: []string{"park", "--why", "x"}, code: 2, stderr: []string{"want at least one message id"}},

		// inflight, release
		{
			name: "inflight", args: []string{"inflight"}, setup: inflightSeed,
			stdout: []string{
				"GROUP     KEY      TARGET        PARTITION  OFFSET  MESSAGE  PUBLISHED AT", "AGE\n",
				// Oldest first: each row follows the age that ends the one before.
				"AGE\npayments  order-1  orders.retry  0          41      201      ", "  20m", "s\npayments  order-1  orders.retry  1          7 ",
				"s\npayments  order-2  orders.retry  0          42      203 ", "s\naudit     order-1  orders.retry  0          41      201 ", "  1m",
			},
		},
		{
			name: "inflight --group --json", args: []string{"inflight", "--group", "audit", "--json"}, setup: inflightSeed,
			json: func(t *testing.T, out string) {
				rs := opsjson.Decode[[]opsjson.Inflight](t, out)
				if len(rs) != 1 || rs[0].GroupID != "audit" || rs[0].BusinessKey != "order-1" || rs[0].TargetTopic != "orders.retry" ||
					rs[0].Partition != 0 || rs[0].RecordOffset != 41 || rs[0].MessageID != 201 || rs[0].Seq != 1 ||
					rs[0].AgeSeconds < 59 || rs[0].AgeSeconds > 120 || rs[0].PublishedAt == "" {
					t.Errorf("inflight: %+v", rs)
				}
			},
		},
		{
			name: "inflight --key --limit", args: []string{"inflight", "--key", "order-1", "--limit", "2"}, setup: inflightSeed,
			stdout:    []string{"\npayments  order-1  orders.retry  0 ", "\npayments  order-1  orders.retry  1 ", "(the oldest 2; --limit shows more)\n"},
			notStdout: []string{"audit", "order-2"},
		},
		{name: "inflight none", args: []string{"inflight"}, stdout: []string{"no key is in flight\n"}},
		{name: "inflight none for a group", args: []string{"inflight", "--group", "nope"}, setup: inflightSeed,
			stdout: []string{"no key is in flight for group nope\n"}},
		{
			name: "inflight none --json", args: []string{"inflight", "--json"},
			json: func(t *testing.T, out string) {
				if strings.TrimSpace(out) != "[]" {
					t.Errorf("want [], got %s", out)
				}
			},
		},
		{name: "inflight bad limit", args: []string{"inflight", "--limit", "0"}, code: 2, stderr: []string{"--limit 0 is out of range"}},
		{name: "inflight unknown flag", args: []string{"inflight", "--bogus"}, code: 2,
			stderr: []string{"flag provided but not defined: -bogus", "scheduler inflight --help"}},
		{name: "inflight with an argument", args: []string{"inflight", "payments"}, code: 2, stderr: []string{`unexpected argument "payments"`}},
		{
			name: "release --dry-run", args: []string{"release", "--group", "payments", "--key", "order-1", "--dry-run"}, setup: inflightSeed,
			stdout: []string{
				"\npayments  order-1  orders.retry  0 ", "\npayments  order-1  orders.retry  1 ",
				"dry run: would release 1 key (2 target partitions) of group payments, key order-1; nothing changed\n",
			},
			notStdout: []string{"audit", "order-2"},
			check:     `SELECT count(*) = 4 FROM deferred_inflight`,
		},
		{
			name: "release --dry-run --json", args: []string{"release", "--dry-run", "--group", "payments", "--json"}, setup: inflightSeed,
			json: func(t *testing.T, out string) {
				r := opsjson.Decode[opsjson.Release](t, out)
				if !r.DryRun || r.Group != "payments" || r.Key != nil || r.Matched != 3 || r.Released != 0 || len(r.Keys) != 3 {
					t.Errorf("release: %+v", r)
				}
			},
			check: `SELECT count(*) = 4 FROM deferred_inflight`,
		},
		{
			name: "release", args: []string{"release", "--group", "payments"}, setup: inflightSeed,
			stdout: []string{"\npayments  order-2  orders.retry  0          42 ", "released 2 keys (3 target partitions) of group payments\n"},
			check:  `SELECT count(*) = 1 AND bool_and(group_id = 'audit') FROM deferred_inflight`,
		},
		{
			name: "release one key --json", args: []string{"release", "--group", "payments", "--key", "order-2", "--json"}, setup: inflightSeed,
			json: func(t *testing.T, out string) {
				r := opsjson.Decode[opsjson.Release](t, out)
				if r.DryRun || r.Key == nil || *r.Key != "order-2" || r.Matched != 1 || r.Released != 1 || len(r.Keys) != 1 ||
					r.Keys[0].RecordOffset != 42 || r.Keys[0].GroupID != "payments" {
					t.Errorf("release: %+v", r)
				}
			},
			check: `SELECT count(*) = 3 AND NOT bool_or(business_key = 'order-2') FROM deferred_inflight`,
		},
		{
			name: "release a group with nothing in flight", args: []string{"release", "--group", "nope"}, setup: inflightSeed,
			stdout: []string{"no key is in flight for group nope; nothing released\n"},
			check:  `SELECT count(*) = 4 FROM deferred_inflight`,
		},
		{name: "release without --group", args: []string{"release", "--key", "order-1"}, code: 2, setup: inflightSeed,
			stderr: []string{"scheduler release: --group is required", "(see scheduler release --help)"}, check: `SELECT count(*) = 4 FROM deferred_inflight`},
		{name: "release without --group --json", args: []string{"release", "--json"}, code: 2,
			stderr: []string{`{"error":"--group is required`}},
		{name: "release an empty group", args: []string{"release", "--group", " "}, code: 2, stderr: []string{"--group is required"}},
		{name: "release with an argument", args: []string{"release", "--group", "payments", "order-1"}, code: 2, setup: inflightSeed,
			stderr: []string{`unexpected argument "order-1"`}, check: `SELECT count(*) = 4 FROM deferred_inflight`},
		{name: "release unknown flag", args: []string{"release", "--group", "payments", "--force"}, code: 2, setup: inflightSeed,
			stderr: []string{"flag provided but not defined: -force", "scheduler release --help"}, check: `SELECT count(*) = 4 FROM deferred_inflight`},

		// help
		{name: "status --help", args: []string{"status", "--help"}, stdout: []string{"Usage: scheduler status", "-json"}},
		{name: "ls --help", args: []string{"ls", "--help"}, stdout: []string{"Usage: scheduler ls", "-target", "-state", "-key", "-reason", "-limit", "(default 50)", "-json"}},
		{name: "show -h", args: []string{"show", "-h"}, stdout: []string{"Usage: scheduler show", "-full", "-json"}},
		{name: "expedite --help", args: []string{"expedite", "--help"}, stdout: []string{"Usage: scheduler expedite", "-id", "-key", "-target"}},
		{name: "cancel --help", args: []string{"cancel", "--help"}, stdout: []string{"Usage: scheduler cancel"}},
		{name: "park --help", args: []string{"park", "--help"}, stdout: []string{"Usage: scheduler park", "-reason", "-release-key"}},
		{name: "held --help", args: []string{"held", "--help"}, stdout: []string{"Usage: scheduler held", "held_keys.sql"}},
		{name: "replay --help", args: []string{"replay", "--help"}, stdout: []string{"Usage: scheduler replay", "-target", "-key", "-error-class",
			"-reason", "-since", "-until", "-id", "-dry-run", "-rate", "-reset-attempts", "-yes", "-confirm-above", "(default 100)", "(default \"parked\")"}},
		{name: "pause --help", args: []string{"pause", "--help"}, stdout: []string{"Usage: scheduler pause TARGET", "-note"}},
		{name: "resume --help", args: []string{"resume", "--help"}, stdout: []string{"Usage: scheduler resume TARGET"}},
		{name: "limit --help", args: []string{"limit", "--help"}, stdout: []string{"Usage: scheduler limit TARGET RATE", "scheduler limit TARGET off"}},
		{name: "weight --help", args: []string{"weight", "--help"}, stdout: []string{"Usage: scheduler weight TARGET WEIGHT", "weight_target.sql"}},
		{name: "targets --help", args: []string{"targets", "--help"}, stdout: []string{"Usage: scheduler targets", "targets.sql"}},
		{name: "inflight --help", args: []string{"inflight", "--help"}, stdout: []string{"Usage: scheduler inflight", "-group", "-key", "-limit", "(default 100)", "inflight.sql"}},
		{name: "release --help", args: []string{"release", "--help"}, stdout: []string{"Usage: scheduler release --group GROUP", "-group", "-key", "-dry-run", "release_inflight.sql"}},

		// pause, resume, limit, targets
		{
			name: "targets", args: []string{"targets"},
			setup:     `INSERT INTO target_control (target_topic) VALUES ('idle.retry')`,
			stdout:    []string{"TARGET       PAUSED  RATE LIMIT  WEIGHT  UPDATED AT", "CHANGED BY  NOTE\n", "audit.retry  yes     -           1       ", "  postgres    seeded pause\n", "bulk.retry   no      25/s        1       "},
			notStdout: []string{"idle.retry"},
		},
		{
			name: "targets --json", args: []string{"targets", "--json"},
			json: func(t *testing.T, out string) {
				ts := opsjson.Decode[[]opsjson.Target](t, out)
				if len(ts) != 2 || ts[0].TargetTopic != "audit.retry" || !ts[0].Paused || *ts[0].Note != "seeded pause" || ts[0].RateLimit != nil ||
					ts[0].Weight != 1 || ts[1].TargetTopic != "bulk.retry" || ts[1].Paused || *ts[1].RateLimit != 25 || ts[1].Weight != 1 {
					t.Errorf("targets: %+v", ts)
				}
			},
		},
		{name: "targets with an argument", args: []string{"targets", "x"}, code: 2, stderr: []string{`unexpected argument "x"`}},
		{
			name: "pause", args: []string{"pause", "orders.retry", "--note", "INC-42: provider down"},
			stdout: []string{"orders.retry  yes     -   ", "INC-42: provider down\n", "paused orders.retry\n"},
			check:  `SELECT paused AND note = 'INC-42: provider down' AND rate_limit IS NULL FROM target_control WHERE target_topic = 'orders.retry'`,
		},
		{
			name: "pause again replaces the note, keeps the limit", args: []string{"pause", "--json", "bulk.retry"},
			json: func(t *testing.T, out string) {
				c := opsjson.Decode[opsjson.TargetChange](t, out)
				if !c.Changed || !c.Target.Paused || c.Target.Note != nil || *c.Target.RateLimit != 25 || c.Note != "" {
					t.Errorf("pause: %+v", c)
				}
			},
			check: `SELECT paused AND rate_limit = 25 FROM target_control WHERE target_topic = 'bulk.retry'`,
		},
		{
			name: "pause a target outside TARGET_TOPICS warns", args: []string{"pause", "audit.retry"},
			addEnv: []string{"TARGET_TOPICS=orders.*,payments.retry"},
			stdout: []string{"paused audit.retry\n", "seeded pause"},
			stderr: []string{"scheduler pause: warning: TARGET_TOPICS (orders.*,payments.retry) does not allow audit.retry"},
		},
		{name: "pause without a target", args: []string{"pause", "--note", "x"}, code: 2, stderr: []string{"want a target topic"}},
		{name: "pause an illegal topic", args: []string{"pause", "orders/retry"}, code: 2,
			stderr: []string{`"orders/retry" is not a Kafka topic name`}, check: `SELECT count(*) = 2 FROM target_control`},
		{name: "pause two targets", args: []string{"pause", "a", "b"}, code: 2, stderr: []string{`unexpected argument "b"`}},
		{
			name: "resume", args: []string{"resume", "audit.retry"},
			stdout: []string{"audit.retry  no      -  ", "seeded pause\n", "resumed audit.retry\n"},
			check:  `SELECT NOT paused FROM target_control WHERE target_topic = 'audit.retry'`,
		},
		{
			name: "resume a target that is not paused", args: []string{"resume", "bulk.retry", "--json"},
			json: func(t *testing.T, out string) {
				c := opsjson.Decode[opsjson.TargetChange](t, out)
				if c.Changed || c.Target.TargetTopic != "bulk.retry" || c.Note != "target bulk.retry is not paused; nothing changed" {
					t.Errorf("resume: %+v", c)
				}
			},
		},
		{name: "resume an unknown target", args: []string{"resume", "orders.retyr"}, code: 1,
			stderr: []string{"target orders.retyr has no controls (it was never paused, limited or weighted); nothing changed"},
			check:  `SELECT count(*) = 2 FROM target_control`},
		{name: "resume without a target", args: []string{"resume"}, code: 2, stderr: []string{"want a target topic"}},
		{
			name: "limit", args: []string{"limit", "orders.retry", "12.5"},
			stdout: []string{"orders.retry  no      12.5/s", "limited orders.retry\n"},
			check:  `SELECT rate_limit = 12.5 AND NOT paused FROM target_control WHERE target_topic = 'orders.retry'`,
		},
		{
			name: "limit --json", args: []string{"limit", "--json", "audit.retry", "1e2"},
			json: func(t *testing.T, out string) {
				c := opsjson.Decode[opsjson.TargetChange](t, out)
				if !c.Changed || *c.Target.RateLimit != 100 || !c.Target.Paused {
					t.Errorf("limit: %+v", c)
				}
			},
		},
		{
			name: "limit off", args: []string{"limit", "bulk.retry", "off"},
			stdout: []string{"bulk.retry  no      -  ", "unlimited bulk.retry\n"},
			check:  `SELECT rate_limit IS NULL FROM target_control WHERE target_topic = 'bulk.retry'`,
		},
		{
			name: "limit --rate", args: []string{"limit", "orders.retry", "--rate", "12.5"}, addEnv: []string{"USER=bob"},
			stdout: []string{"orders.retry  no      12.5/s", "cli:bob", "limited orders.retry\n"},
			check:  `SELECT count(*) = 1 FROM target_control_history WHERE target_topic = 'orders.retry' AND actor = 'cli:bob' AND rate_limit = 12.5`,
		},
		{name: "limit a rate twice", args: []string{"limit", "orders.retry", "5", "--rate", "6"}, code: 2, stderr: []string{"give the rate once"}},
		{name: "limit off without a limit", args: []string{"limit", "audit.retry", "OFF"}, stdout: []string{"target audit.retry is not rate limited; nothing changed\n"}},
		{name: "limit off an unknown target", args: []string{"limit", "nope.retry", "off"}, code: 1, stderr: []string{"target nope.retry has no controls"}},
		{name: "limit zero", args: []string{"limit", "bulk.retry", "0"}, code: 2, stderr: []string{"rate 0: want messages per second > 0"},
			check: `SELECT rate_limit = 25 FROM target_control WHERE target_topic = 'bulk.retry'`},
		{name: "limit negative", args: []string{"limit", "bulk.retry", "-5"}, code: 2, stderr: []string{"rate -5: want messages per second > 0"},
			check: `SELECT rate_limit = 25 FROM target_control WHERE target_topic = 'bulk.retry'`},
		{name: "limit not a number", args: []string{"limit", "bulk.retry", "fast"}, code: 2, stderr: []string{`rate "fast" is not a number`}},
		{name: "limit infinite", args: []string{"limit", "bulk.retry", "Inf"}, code: 2, stderr: []string{`rate "Inf" is not a number`}},
		{name: "limit without a rate", args: []string{"limit", "bulk.retry"}, code: 2, stderr: []string{`want a target topic and a rate (messages per second, or off), got only "bulk.retry"`}},
		{name: "limit without anything", args: []string{"limit"}, code: 2, stderr: []string{"want a target topic and a rate"}},
		{name: "limit an illegal topic", args: []string{"limit", "a b", "5"}, code: 2, stderr: []string{`"a b" is not a Kafka topic name`},
			check: `SELECT count(*) = 2 FROM target_control`},
		{
			name: "weight", args: []string{"weight", "orders.retry", "3"}, addEnv: []string{"USER=bob"},
			stdout: []string{"orders.retry  no      -           3       ", "cli:bob", "weighted orders.retry\n"},
			check: `SELECT weight = 3 AND NOT paused AND rate_limit IS NULL FROM target_control WHERE target_topic = 'orders.retry'
			        AND EXISTS (SELECT FROM target_control_history WHERE target_topic = 'orders.retry' AND actor = 'cli:bob' AND weight = 3)`,
		},
		{
			name: "weight --json keeps the limit", args: []string{"weight", "--json", "bulk.retry", "100"},
			json: func(t *testing.T, out string) {
				c := opsjson.Decode[opsjson.TargetChange](t, out)
				if !c.Changed || c.Target.Weight != 100 || *c.Target.RateLimit != 25 || c.Note != "" {
					t.Errorf("weight: %+v", c)
				}
			},
		},
		{
			name: "weight as it is", args: []string{"weight", "bulk.retry", "1", "--json"},
			json: func(t *testing.T, out string) {
				c := opsjson.Decode[opsjson.TargetChange](t, out)
				if c.Changed || c.Target.Weight != 1 || c.Note != "target bulk.retry is of weight 1 already; nothing changed" {
					t.Errorf("weight: %+v", c)
				}
			},
		},
		{name: "weight 1 of a target without controls", args: []string{"weight", "new.retry", "1"},
			stdout: []string{"target new.retry has no controls, so weight 1 already (the default); nothing changed\n"},
			check:  `SELECT count(*) = 2 FROM target_control`},
		{name: "weight zero", args: []string{"weight", "bulk.retry", "0"}, code: 2, stderr: []string{`weight "0": want a whole number from 1 to 100`},
			check: `SELECT weight = 1 FROM target_control WHERE target_topic = 'bulk.retry'`},
		{name: "weight negative", args: []string{"weight", "bulk.retry", "-2"}, code: 2, stderr: []string{"weight -2: want a whole number from 1 to 100"}},
		{name: "weight too large", args: []string{"weight", "bulk.retry", "101"}, code: 2, stderr: []string{`weight "101": want a whole number from 1 to 100`}},
		{name: "weight not whole", args: []string{"weight", "bulk.retry", "2.5"}, code: 2, stderr: []string{`weight "2.5": want a whole number`}},
		{name: "weight without a weight", args: []string{"weight", "bulk.retry"}, code: 2, stderr: []string{`want a target topic and a weight (1 to 100), got only "bulk.retry"`}},
		{name: "weight an illegal topic", args: []string{"weight", "a b", "2"}, code: 2, stderr: []string{`"a b" is not a Kafka topic name`},
			check: `SELECT count(*) = 2 FROM target_control`},

		// configuration and a database that is down
		{name: "no DATABASE_URL", args: []string{"status"}, env: []string{}, code: 2, stderr: []string{"DATABASE_URL is not set"}},
		{name: "bad DATABASE_URL", args: []string{"ls"}, env: []string{"DATABASE_URL=postgres://a:b@host:notaport/db"}, code: 2,
			stderr: []string{"DATABASE_URL is not a valid PostgreSQL URL"}},
		{name: "malformed DATABASE_URL", args: []string{"ls", "--json"}, env: []string{"DATABASE_URL=postgres://h:notaport/db"}, code: 2,
			stderr: []string{`{"error":"DATABASE_URL is not a valid PostgreSQL URL`}},
		// Operator commands read DATABASE_URL only: a service setting they do
		// not use cannot stop them.
		{name: "service settings do not matter", args: []string{"ls"}, env: []string{down, "LOG_LEVEL=loud", "KAFKA_SASL_MECHANISM=PLAIN"}, code: 1,
			stderr: []string{"connect to the database"}},
		{name: "a session setting refused", args: []string{"status"}, env: []string{refused}, code: 1,
			stderr: []string{"scheduler status: the database at", "refused a session setting in DATABASE_URL (options=-c jit=sometimes)", `parameter "jit" requires a Boolean value`}},
		{name: "database down: status", args: []string{"status"}, env: []string{down}, code: 1, stderr: []string{"scheduler status: connect to the database at 127.0.0.1:"}},
		{name: "database down: ls --json", args: []string{"ls", "--json"}, env: []string{down}, code: 1, stderr: []string{`{"error":"connect to the database at 127.0.0.1:`}},
		{name: "database down: show", args: []string{"show", "1"}, env: []string{down}, code: 1, stderr: []string{"connection refused"}},
		{name: "database down: expedite", args: []string{"expedite", "--key", "k"}, env: []string{down}, code: 1, stderr: []string{"connect to the database"}},
		{name: "database down: cancel --json", args: []string{"cancel", "1", "--json"}, env: []string{down}, code: 1, stderr: []string{`{"error":"connect to the database`}},
		{name: "database down: park", args: []string{"park", "1", "--why", "x"}, env: []string{down}, code: 1, stderr: []string{"connect to the database"}},
		{name: "database down: held", args: []string{"held"}, env: []string{down}, code: 1, stderr: []string{"connect to the database"}},
		{name: "database down: replay", args: []string{"replay", "--id", "1"}, env: []string{down}, code: 1, stderr: []string{"connect to the database"}},
		{name: "database down: pause", args: []string{"pause", "t"}, env: []string{down}, code: 1, stderr: []string{"connect to the database"}},
		{name: "database down: targets --json", args: []string{"targets", "--json"}, env: []string{down}, code: 1, stderr: []string{`{"error":"connect to the database`}},
		{name: "database down: inflight", args: []string{"inflight"}, env: []string{down}, code: 1, stderr: []string{"connect to the database"}},
		{name: "database down: release", args: []string{"release", "--group", "g"}, env: []string{down}, code: 1, stderr: []string{"connect to the database"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := tt.args
			env := tt.env
			var db pgtest.DB
			if env == nil {
				db = pgtest.NewDB(t)
				fixture.SeedOps(t, db.Pool)
				env = append([]string{"DATABASE_URL=" + db.URL}, tt.addEnv...)
				if tt.setup != "" {
					if _, err := db.Pool.Exec(context.Background(), tt.setup); err != nil {
						t.Fatalf("setup: %v", err)
					}
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var stdout, stderr bytes.Buffer
			start := time.Now()
			code := run(ctx, args, env, &stdout, &stderr)
			took := time.Since(start)
			out, errOut := stdout.String(), stderr.String()
			if code != tt.code {
				t.Fatalf("exit code %d, want %d\nstdout:\n%s\nstderr:\n%s", code, tt.code, out, errOut)
			}
			if code == 0 && errOut != "" && len(tt.stderr) == 0 {
				t.Errorf("stderr is not empty:\n%s", errOut)
			}
			if code != 0 {
				if strings.Count(errOut, "\n") != 1 || !strings.HasSuffix(errOut, "\n") {
					t.Errorf("error is not one line:\n%s", errOut)
				}
				if out != "" {
					t.Errorf("stdout is not empty after an error:\n%s", out)
				}
				if jsonRequested(args) {
					var e struct{ Error string }
					if err := json.Unmarshal([]byte(errOut), &e); err != nil || e.Error == "" {
						t.Errorf("error is not JSON {\"error\": ...}: %v\n%s", err, errOut)
					}
				}
				if took > opsConnectTimeout+2*time.Second {
					t.Errorf("failing took %v", took)
				}
			}
			for _, w := range tt.stdout {
				if !strings.Contains(out, w) {
					t.Errorf("stdout lacks %q:\n%s", w, out)
				}
			}
			for _, w := range tt.notStdout {
				if strings.Contains(out, w) {
					t.Errorf("stdout has %q:\n%s", w, out)
				}
			}
			for _, w := range tt.stderr {
				if !strings.Contains(errOut, w) {
					t.Errorf("stderr lacks %q:\n%s", w, errOut)
				}
			}
			if tt.json != nil {
				tt.json(t, out)
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

// inflightSeed holds keys in flight for two consumer groups: payments has
// order-1 in two partitions of orders.retry and order-2 in one, audit
// order-1 in one.
const inflightSeed = `INSERT INTO deferred_inflight
	(group_id, business_key, target_topic, partition, record_offset, message_id, seq, published_at) VALUES
	('payments', 'order-1', 'orders.retry', 0, 41, 201, 1, now() - interval '20 minutes'),
	('payments', 'order-1', 'orders.retry', 1, 7, 202, 2, now() - interval '10 minutes'),
	('payments', 'order-2', 'orders.retry', 0, 42, 203, 3, now() - interval '5 minutes'),
	('audit', 'order-1', 'orders.retry', 0, 41, 201, 1, now() - interval '1 minute')`

// TestOpsTablesAlign checks that ls prints an aligned table: every cell of a
// column starts where its heading does.
func TestOpsTablesAlign(t *testing.T) {
	db := pgtest.NewDB(t)
	fixture.SeedOps(t, db.Pool)
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"ls", "--limit", "100"}, []string{"DATABASE_URL=" + db.URL}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	lines := strings.Split(strings.TrimSuffix(stdout.String(), "\n"), "\n")
	if len(lines) != 12 {
		t.Fatalf("%d lines, want a heading and 11 messages:\n%s", len(lines), stdout.String())
	}
	var starts []int
	for _, h := range messageColumns() {
		starts = append(starts, strings.Index(lines[0], h))
	}
	for _, l := range lines[1:] {
		r := []rune(l)
		for i, s := range starts[1:] {
			// Runes: a column start counts characters (é is one), and the
			// cell before must end with spaces.
			if s >= len(r) || r[s-1] != ' ' || r[s] == ' ' {
				t.Errorf("column %s does not start at %d in %q", messageColumns()[i+1], s, l)
			}
		}
	}
}
