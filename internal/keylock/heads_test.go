package keylock_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/pgtest"
)

// keyRowVersions returns every deferred_key row with its physical version
// (xmin, ctid), so a test can tell whether a statement wrote to the table.
func keyRowVersions(t testing.TB, q querier) []string {
	t.Helper()
	rows, err := q.Query(t.Context(), `SELECT format('%s head=%s xmin=%s ctid=%s', coalesce(business_key, '-'), head_id, xmin, ctid)
		FROM deferred_key ORDER BY business_key, head_id`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestHeadsDerived runs statements on deferred_message, the service's and
// an operator's alike, and checks that the triggers leave deferred_key equal
// to the heads recomputed by brute force. Every message gets a distinct seq
// so that want can name heads as key@seq.
func TestHeadsDerived(t *testing.T) {
	const cols = `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES `
	tests := []struct {
		name  string
		setup []string // run before stmts
		// leaseKeys are leased to "holder" after setup; the lease must survive stmts.
		leaseKeys []string
		stmts     []string
		// untouched: stmts must not write to deferred_key at all.
		untouched bool
		want      []string // headSummary after stmts
	}{
		{
			name: "insert several keys in one statement",
			stmts: []string{cols + `('a', 20, 't', now() + interval '1 hour'), ('a', 10, 't', now() + interval '2 hours'),
				('a', 30, 't', now() - interval '1 hour'), ('b', 5, 't', now()),
				(NULL, 7, 't', now() + interval '1 minute'), (NULL, 8, 't', now())`},
			want: []string{"-@7", "-@8", "a@10", "b@5"},
		},
		{
			name: "inserts in several statements",
			stmts: []string{
				cols + `('a', 20, 't', now() + interval '1 hour')`,
				cols + `('a', 30, 't', now())`,
				cols + `('b', 40, 't', now()), ('a', 25, 't', now())`,
				cols + `(NULL, 50, 't', now())`,
			},
			want: []string{"-@50", "a@20", "b@40"},
		},
		{
			name:  "re-deferral with a lower explicit seq inserted later becomes the head",
			setup: []string{cols + `('a', 100, 't', now()), ('a', 101, 't', now())`},
			stmts: []string{cols + `('a', 7, 't', now() + interval '1 hour')`},
			want:  []string{"a@7"},
		},
		{
			name:  "equal seq: the lower id wins",
			setup: []string{`INSERT INTO deferred_message (id, business_key, seq, target_topic, next_run_at) VALUES (1002, 'a', 5, 't', now())`},
			stmts: []string{`INSERT INTO deferred_message (id, business_key, seq, target_topic, next_run_at) VALUES (1001, 'a', 5, 't', now() + interval '1 hour')`},
			want:  []string{"a@5"},
		},
		{
			name:  "expedite the head and a message behind it",
			setup: []string{cols + `('a', 1, 't', now() + interval '1 hour'), ('a', 2, 't', now() + interval '2 hours'), ('b', 3, 't', now() + interval '1 hour')`},
			stmts: []string{`UPDATE deferred_message SET next_run_at = now() WHERE business_key = 'a'`},
			want:  []string{"a@1", "b@3"},
		},
		{
			name:  "delay an unordered head",
			setup: []string{cols + `(NULL, 1, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET next_run_at = now() + interval '1 day' WHERE seq = 1`},
			want:  []string{"-@1"},
		},
		{
			name:  "cancel the head: the next message becomes the head",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now() + interval '1 hour'), ('a', 3, 't', now())`},
			stmts: []string{`DELETE FROM deferred_message WHERE seq = 1`},
			want:  []string{"a@2"},
		},
		{
			name:  "cancel a message behind the head",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now())`},
			stmts: []string{`DELETE FROM deferred_message WHERE seq = 2`},
			want:  []string{"a@1"},
		},
		{
			name:  "cancel the last message: the key row goes",
			setup: []string{cols + `('a', 1, 't', now()), ('b', 2, 't', now()), (NULL, 3, 't', now())`},
			stmts: []string{`DELETE FROM deferred_message WHERE seq IN (1, 3)`},
			want:  []string{"b@2"},
		},
		{
			name:  "cancel several keys in one statement",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now()), ('b', 3, 't', now()), ('b', 4, 't', now()), ('c', 5, 't', now())`},
			stmts: []string{`DELETE FROM deferred_message WHERE seq IN (1, 4, 5)`},
			want:  []string{"a@2", "b@3"},
		},
		{
			name:  "park the head: it holds the key (park_holds_key defaults to true)",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now() + interval '1 hour')`},
			stmts: []string{`UPDATE deferred_message SET state = 'parked', reason = 'op' WHERE seq = 1`},
			want:  []string{"a@1!"},
		},
		{
			name:  "park the head with park_holds_key false: the key goes on",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now() + interval '1 hour')`},
			stmts: []string{`UPDATE deferred_message SET state = 'parked', reason = 'op', park_holds_key = false WHERE seq = 1`},
			want:  []string{"a@2"},
		},
		{
			name:  "park a message behind the head: the head stays, not held",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET state = 'parked' WHERE seq = 2`},
			want:  []string{"a@1"},
		},
		{
			name: "publish the head in front of a parked message: the parked one holds the key",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now()), ('a', 3, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 2`,
			},
			stmts: []string{`DELETE FROM deferred_message WHERE seq = 1`},
			want:  []string{"a@2!"},
		},
		{
			name:  "park every message of a key: the lowest holds it; unordered parked rows hold nothing",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now()), (NULL, 3, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET state = 'parked'`},
			want:  []string{"a@1!"},
		},
		{
			name:  "park every message of a key without holding: no head left",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now()), (NULL, 3, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET state = 'parked', park_holds_key = false`},
			want:  nil,
		},
		{
			name: "clear park_holds_key on a held head: the key goes on",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now() + interval '1 hour')`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`,
			},
			stmts: []string{`UPDATE deferred_message SET park_holds_key = false WHERE seq = 1`},
			want:  []string{"a@2"},
		},
		{
			name: "set park_holds_key on a parked row ahead of the head: it holds the key",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now() + interval '1 hour')`,
				`UPDATE deferred_message SET state = 'parked', park_holds_key = false WHERE seq = 1`,
			},
			stmts: []string{`UPDATE deferred_message SET park_holds_key = true WHERE seq = 1`},
			want:  []string{"a@1!"},
		},
		{
			name:      "flip park_holds_key on pending rows leaves deferred_key untouched",
			setup:     []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now()), (NULL, 3, 't', now())`},
			stmts:     []string{`UPDATE deferred_message SET park_holds_key = NOT park_holds_key`},
			untouched: true,
			want:      []string{"-@3", "a@1"},
		},
		{
			name: "replay a held head: the key flows again from it",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now()), ('a', 3, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`,
			},
			stmts: []string{`UPDATE deferred_message SET state = 'pending', next_run_at = now() WHERE seq = 1`},
			want:  []string{"a@1"},
		},
		{
			name: "delete a held head: the next message becomes the head",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now() + interval '1 hour')`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`,
			},
			stmts: []string{`DELETE FROM deferred_message WHERE seq = 1`},
			want:  []string{"a@2"},
		},
		{
			name: "delete a held key's only message: the key row goes",
			setup: []string{
				cols + `('a', 1, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`,
			},
			stmts: []string{`DELETE FROM deferred_message WHERE seq = 1`},
			want:  nil,
		},
		{
			name: "insert behind a held head: the key stays held",
			setup: []string{
				cols + `('a', 5, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 5`,
			},
			stmts: []string{cols + `('a', 9, 't', now()), ('a', 7, 't', now() - interval '1 hour')`},
			want:  []string{"a@5!"},
		},
		{
			name:  "insert a parked holding row with a lower seq than the pending head: it holds the key",
			setup: []string{cols + `('a', 10, 't', now())`},
			stmts: []string{`INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason)
				VALUES ('a', 3, 't', now(), 'parked', 'exhausted: 5 retries')`},
			want: []string{"a@3!"},
		},
		{
			name:  "insert a parked row that does not hold with a lower seq: the pending head stays",
			setup: []string{cols + `('a', 10, 't', now())`},
			stmts: []string{`INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason, park_holds_key)
				VALUES ('a', 3, 't', now(), 'parked', 'exhausted: 5 retries', false)`},
			want: []string{"a@10"},
		},
		{
			name: "insert parked rows into a new key and unordered: only the ordered holding one makes a head",
			stmts: []string{`INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason, park_holds_key) VALUES
				('n', 4, 't', now(), 'parked', 'permanent: x', true), ('n', 2, 't', now(), 'parked', 'permanent: x', false),
				(NULL, 6, 't', now(), 'parked', 'permanent: x', true)`},
			want: []string{"n@4!"},
		},
		{
			name:  "park an unordered message: it holds nothing and its head goes",
			setup: []string{cols + `(NULL, 1, 't', now()), (NULL, 2, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`},
			want:  []string{"-@2"},
		},
		{
			name:  "multiple parked rows of one key: the lowest holds",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now()), ('a', 3, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET state = 'parked' WHERE seq IN (2, 1)`},
			want:  []string{"a@1!"},
		},
		{
			name: "multiple parked rows of one key: deleting the lowest leaves the next holding",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now()), ('a', 3, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq IN (1, 2)`,
			},
			stmts: []string{`DELETE FROM deferred_message WHERE seq = 1`},
			want:  []string{"a@2!"},
		},
		{
			name: "multiple parked rows of one key: replaying a later one leaves the key held",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now()), ('a', 3, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq IN (1, 2)`,
			},
			stmts: []string{`UPDATE deferred_message SET state = 'pending' WHERE seq = 2`},
			want:  []string{"a@1!"},
		},
		{
			name: "multiple parked rows of one key: replaying all releases it in seq order",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now()), ('a', 3, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq IN (1, 2)`,
			},
			stmts: []string{`UPDATE deferred_message SET state = 'pending' WHERE state = 'parked'`},
			want:  []string{"a@1"},
		},
		{
			name: "replay a parked message ahead of the head",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`,
			},
			stmts: []string{`UPDATE deferred_message SET state = 'pending', next_run_at = now() + interval '1 minute' WHERE state = 'parked'`},
			want:  []string{"a@1"},
		},
		{
			name: "replay into a key with nothing pending",
			setup: []string{
				cols + `('a', 1, 't', now()), (NULL, 2, 't', now())`,
				`UPDATE deferred_message SET state = 'parked'`,
			},
			stmts: []string{`UPDATE deferred_message SET state = 'pending', next_run_at = now() WHERE state = 'parked' AND target_topic = 't'`},
			want:  []string{"-@2", "a@1"},
		},
		{
			name: "move a held head to another key: both keys follow",
			setup: []string{
				cols + `('a', 1, 't', now()), ('a', 2, 't', now()), ('b', 3, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`,
			},
			stmts: []string{`UPDATE deferred_message SET business_key = 'b' WHERE seq = 1`},
			want:  []string{"a@2", "b@1!"},
		},
		{
			name: "change the target of a held head",
			setup: []string{
				cols + `('a', 1, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`,
			},
			stmts: []string{`UPDATE deferred_message SET target_topic = 'u' WHERE seq = 1`},
			want:  []string{"a@1!"},
		},
		{
			name: "rejected rows never make heads",
			stmts: []string{
				`INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason) VALUES
					('a', 1, NULL, now(), 'rejected', 'no target'), (NULL, 2, NULL, now(), 'rejected', 'no target'),
					('a', 3, 'x', now(), 'rejected', 'not allowed')`,
				cols + `('b', 4, 't', now())`,
				`UPDATE deferred_message SET next_run_at = now() - interval '1 hour', seq = 0 WHERE state = 'rejected'`,
				`UPDATE deferred_message SET business_key = 'b' WHERE state = 'rejected' AND business_key = 'a'`,
				`DELETE FROM deferred_message WHERE state = 'rejected' AND business_key IS NULL`,
			},
			want: []string{"b@4"},
		},
		{
			name: "an operator fixes a rejected row",
			setup: []string{
				cols + `('a', 5, 't', now())`,
				`INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason) VALUES ('a', 1, NULL, now(), 'rejected', 'no target')`,
			},
			stmts: []string{`UPDATE deferred_message SET state = 'pending', target_topic = 't', reason = NULL WHERE state = 'rejected'`},
			want:  []string{"a@1"},
		},
		{
			name:  "move a message to another key",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now()), ('b', 3, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET business_key = 'b' WHERE seq = 1`},
			want:  []string{"a@2", "b@1"},
		},
		{
			name:  "move a key's only message to a new key",
			setup: []string{cols + `('a', 1, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET business_key = 'z' WHERE seq = 1`},
			want:  []string{"z@1"},
		},
		{
			name:  "ordered message becomes unordered",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET business_key = NULL WHERE seq = 1`},
			want:  []string{"-@1", "a@2"},
		},
		{
			name:  "unordered message joins a key ahead of its head",
			setup: []string{cols + `(NULL, 1, 't', now()), ('a', 2, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET business_key = 'a' WHERE seq = 1`},
			want:  []string{"a@1"},
		},
		{
			name:  "seq rewritten by an operator",
			setup: []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now()), (NULL, 3, 't', now())`},
			stmts: []string{`UPDATE deferred_message SET seq = seq + 10 WHERE seq IN (1, 3)`},
			want:  []string{"-@13", "a@2"},
		},
		{
			name:  "several statements in one transaction",
			setup: []string{cols + `('a', 1, 't', now()), ('b', 2, 't', now())`},
			stmts: []string{`DELETE FROM deferred_message WHERE seq = 1;
				INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('a', 9, 't', now()), ('b', 1, 't', now());
				UPDATE deferred_message SET state = 'parked' WHERE seq = 2`},
			want: []string{"a@9", "b@1"},
		},
		{
			name:      "update of a column no head depends on leaves deferred_key untouched",
			setup:     []string{cols + `('a', 1, 't', now()), ('a', 2, 't', now()), (NULL, 3, 't', now())`},
			stmts:     []string{`UPDATE deferred_message SET error_message = 'still failing', attempt = attempt + 1, error_class = 'transient', reason = 'x'`},
			untouched: true,
			want:      []string{"-@3", "a@1"},
		},
		{
			name:      "update that rewrites head columns to the same values leaves deferred_key untouched",
			setup:     []string{cols + `('a', 1, 't', now()), (NULL, 3, 't', now())`},
			stmts:     []string{`UPDATE deferred_message SET next_run_at = next_run_at, state = state, seq = seq, business_key = business_key`},
			untouched: true,
			want:      []string{"-@3", "a@1"},
		},
		{
			name:      "lease survives an insert that changes the head",
			setup:     []string{cols + `('a', 10, 't', now()), (NULL, 11, 't', now())`},
			leaseKeys: []string{"a"},
			stmts:     []string{cols + `('a', 5, 't', now() + interval '1 hour')`},
			want:      []string{"-@11", "a@5"},
		},
		{
			name:      "lease survives a delete that changes the head",
			setup:     []string{cols + `('a', 10, 't', now()), ('a', 11, 't', now() + interval '1 hour')`},
			leaseKeys: []string{"a"},
			stmts:     []string{`DELETE FROM deferred_message WHERE seq = 10`},
			want:      []string{"a@11"},
		},
		{
			name:      "lease survives park, replay and expedite",
			setup:     []string{cols + `('a', 10, 't', now()), ('a', 11, 't', now() + interval '1 hour')`},
			leaseKeys: []string{"a"},
			stmts: []string{
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 10`,
				`UPDATE deferred_message SET next_run_at = now() WHERE seq = 11`,
				`UPDATE deferred_message SET state = 'pending' WHERE seq = 10`,
			},
			want: []string{"a@10"},
		},
		{
			name:      "lease survives a park that holds the key",
			setup:     []string{cols + `('a', 10, 't', now()), ('a', 11, 't', now())`},
			leaseKeys: []string{"a"},
			stmts:     []string{`UPDATE deferred_message SET state = 'parked' WHERE seq = 10`},
			want:      []string{"a@10!"},
		},
	}
	// One database; each case runs in a transaction that is rolled back, so
	// the cases cannot see each other. The triggers are statement-level, so a
	// transaction exercises them exactly as autocommit statements do.
	db := pgtest.NewDB(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tx, err := db.Pool.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.WithoutCancel(t.Context()))
			for _, s := range tt.setup {
				mustExec(t, tx, s)
			}
			assertHeadsMatch(t, tx)
			for _, k := range tt.leaseKeys {
				if tag := mustExec(t, tx, `UPDATE deferred_key SET leased_by = 'holder', leased_until = '2999-01-01'
					WHERE business_key = $1`, k); tag.RowsAffected() != 1 {
					t.Fatalf("lease key %q: no key row", k)
				}
			}
			before := keyRowVersions(t, tx)
			for _, s := range tt.stmts {
				mustExec(t, tx, s)
			}
			assertHeadsMatch(t, tx)
			if got := headSummary(t, tx); !slices.Equal(got, tt.want) {
				t.Errorf("heads = %q, want %q", got, tt.want)
			}
			if tt.untouched {
				// Within one transaction xmin stays the same, but any write
				// makes a new row version with a new ctid.
				if after := keyRowVersions(t, tx); !slices.Equal(before, after) {
					t.Errorf("deferred_key was written to:\nbefore %q\nafter  %q", before, after)
				}
			}
			for _, k := range tt.leaseKeys {
				l := leaseOf(t, tx, k)
				if !l.Found || l.By == nil || *l.By != "holder" || l.Until == nil || l.Until.Year() != 2999 {
					t.Errorf("lease of key %q lost: %v", k, l)
				}
			}
		})
	}
}

// TestHeadUntouchedAcrossTransactions checks with xmin, across committed
// transactions, that an UPDATE of columns no head depends on does not write
// deferred_key (TestHeadsDerived checks ctid within one transaction).
func TestHeadUntouchedAcrossTransactions(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES
		('a', 't', now()), ('a', 't', now()), (NULL, 't', now())`)
	before := keyRowVersions(t, db.Pool)
	mustExec(t, db.Pool, `UPDATE deferred_message SET error_message = 'x', error_class = 'transient', attempt = attempt + 1`)
	if after := keyRowVersions(t, db.Pool); !slices.Equal(before, after) {
		t.Errorf("deferred_key was written to:\nbefore %q\nafter  %q", before, after)
	}
	// The same check can fail: a head-relevant update does write.
	mustExec(t, db.Pool, `UPDATE deferred_message SET next_run_at = next_run_at + interval '1 second'`)
	if after := keyRowVersions(t, db.Pool); slices.Equal(before, after) {
		t.Errorf("an update of next_run_at did not write deferred_key: %q", after)
	}
	assertHeadsMatch(t, db.Pool)
}

// TestHeadsDiffDetects checks the oracle the other tests rely on: each kind
// of damage to deferred_key is reported.
func TestHeadsDiffDetects(t *testing.T) {
	tests := []struct{ name, damage string }{
		{"head is not the lowest seq", `UPDATE deferred_key SET head_id = (SELECT id FROM deferred_message WHERE seq = 2), head_seq = 2 WHERE business_key = 'a'`},
		{"stale next_run_at", `UPDATE deferred_key SET next_run_at = next_run_at + interval '1 microsecond' WHERE business_key = 'a'`},
		{"missing key", `DELETE FROM deferred_key WHERE business_key = 'b'`},
		{"missing unordered head", `DELETE FROM deferred_key WHERE business_key IS NULL`},
		{"extra key", `INSERT INTO deferred_key (business_key, head_id, head_seq, next_run_at) VALUES ('ghost', 99, 99, now())`},
		{"duplicate unordered head", `INSERT INTO deferred_key (business_key, head_id, head_seq, next_run_at) SELECT NULL, head_id, head_seq, next_run_at FROM deferred_key WHERE business_key IS NULL`},
		{"head of a parked message", `UPDATE deferred_message SET state = 'parked' WHERE seq = 3; ALTER TABLE deferred_message DISABLE TRIGGER USER; UPDATE deferred_message SET state = 'parked' WHERE seq = 1`},
		{"head of a parked message that does not hold", `ALTER TABLE deferred_message DISABLE TRIGGER USER; UPDATE deferred_message SET state = 'parked', park_holds_key = false WHERE seq = 1`},
		{"held flag on a pending head", `UPDATE deferred_key SET held = true WHERE business_key = 'a'`},
		{"held head with a finite due time", `UPDATE deferred_message SET state = 'parked' WHERE seq = 1; UPDATE deferred_key SET next_run_at = now() WHERE business_key = 'a'`},
		{"held head that lost its flag", `UPDATE deferred_message SET state = 'parked' WHERE seq = 1; UPDATE deferred_key SET held = false WHERE business_key = 'a'`},
		{"key released although its parked head holds it", `UPDATE deferred_message SET state = 'parked' WHERE seq = 1; UPDATE deferred_key SET head_id = (SELECT id FROM deferred_message WHERE seq = 2), head_seq = 2, held = false, next_run_at = now() WHERE business_key = 'a'`},
	}
	db := pgtest.NewDB(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tx, err := db.Pool.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.WithoutCancel(t.Context()))
			mustExec(t, tx, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
				('a', 1, 't', now()), ('a', 2, 't', now()), ('b', 3, 't', now()), ('b', 4, 't', now()), (NULL, 5, 't', now())`)
			if diff, err := headsDiff(t.Context(), tx); err != nil || len(diff) != 0 {
				t.Fatalf("before damage: %q, %v", diff, err)
			}
			mustExec(t, tx, tt.damage)
			if diff, err := headsDiff(t.Context(), tx); err != nil || len(diff) == 0 {
				t.Errorf("damage not detected: %q, %v", diff, err)
			}
		})
	}
}
