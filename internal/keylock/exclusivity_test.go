package keylock_test

import (
	"slices"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// TestOperatorRemovalKeepsTheLease: an operator who cancels, or parks with
// release, the last waiting message of a key while a dispatcher holds the
// key's lease (it is being published) must not free the key. Before
// migration 0006 the head trigger deleted the key's row, lease and all; a
// message ingested right then made a fresh, unleased row, and a second
// dispatcher claimed it while the first was still publishing: two holders
// of one key, and the later message could reach the target first.
//
// Each case takes the lease with a, removes the message as the runbook
// does, ingests the key's next message, and checks that b cannot claim it
// until a has finalized, after which b gets it; the heads stay exactly
// what the messages imply throughout.
func TestOperatorRemovalKeepsTheLease(t *testing.T) {
	tests := []struct {
		name   string
		remove string // the operator's statement; $1 is the leased message's id
	}{
		{"cancel", `DELETE FROM deferred_message WHERE id = ANY (ARRAY[$1::bigint])`},
		{"park with release", `UPDATE deferred_message SET state = 'parked', reason = 'parked by operator: test',
			park_holds_key = false WHERE id = ANY (ARRAY[$1::bigint]) AND state = 'pending'`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
				VALUES ('k', 1, 't', now())`)
			a := newLocker(t, db.Pool, "a", time.Hour, 10)
			b := newLocker(t, db.Pool, "b", time.Hour, 10)
			held, err := a.Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if got, want := claimSummary(t, held), []string{"k:1"}; !slices.Equal(got, want) {
				t.Fatalf("a claimed %q, want %q", got, want)
			}
			first := held[0].Messages[0].ID

			// a is publishing message 1 now. The operator removes it, and
			// the key's next message arrives.
			mustExec(t, db.Pool, tt.remove, first)
			assertHeadsMatch(t, db.Pool)
			if l := leaseOf(t, db.Pool, "k"); l.By == nil || *l.By != "a" {
				t.Errorf("after the operator removed the leased message, the key's lease is %v, want a's", l)
			}
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
				VALUES ('k', 2, 't', now())`)
			assertHeadsMatch(t, db.Pool)

			if got, err := b.Claim(t.Context(), 10); err != nil || len(got) > 0 {
				t.Fatalf("b claimed %q (err %v) while a still holds the key: two holders of one key", claimSummary(t, got), err)
			}

			// a's publish went out; its finalize frees the key for b.
			if err := a.Finalize(t.Context(), held, keylock.Outcome{Published: []int64{first}}); err != nil {
				t.Fatal(err)
			}
			assertHeadsMatch(t, db.Pool)
			got, err := b.Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if want := []string{"k:2"}; !slices.Equal(claimSummary(t, got), want) {
				t.Fatalf("after a finalized, b claimed %q, want %q", claimSummary(t, got), want)
			}
		})
	}
}

// TestEmptiedKeyGoesWithItsHolder: a key emptied under its lease is
// removed by its holder's finalize when nothing arrived meanwhile, and by
// the lease sweep when the holder died before finalizing; either way no
// row is left behind and the key is free for the next message.
func TestEmptiedKeyGoesWithItsHolder(t *testing.T) {
	for _, holderDies := range []bool{false, true} {
		name := "holder finalizes"
		if holderDies {
			name = "holder dies"
		}
		t.Run(name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
				VALUES ('k', 1, 't', now())`)
			lease := time.Hour
			if holderDies {
				lease = 200 * time.Millisecond
			}
			a := newLocker(t, db.Pool, "a", lease, 10)
			held, err := a.Claim(t.Context(), 10)
			if err != nil || len(held) != 1 {
				t.Fatalf("a claimed %q (err %v), want one key", claimSummary(t, held), err)
			}
			mustExec(t, db.Pool, `DELETE FROM deferred_message WHERE id = ANY (ARRAY[$1::bigint])`, held[0].Messages[0].ID)
			var rows int
			if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_key WHERE head_id = 0`).Scan(&rows); err != nil {
				t.Fatal(err)
			}
			if rows != 1 {
				t.Fatalf("%d emptied rows while a holds the key, want 1", rows)
			}
			if holderDies {
				time.Sleep(1500 * time.Millisecond) // the lease and the sweep's second of grace
				if _, err := keylock.SweepExpired(t.Context(), db.Pool); err != nil {
					t.Fatal(err)
				}
			} else if err := a.Finalize(t.Context(), held, keylock.Outcome{Published: []int64{held[0].Messages[0].ID}}); err != nil {
				t.Fatal(err)
			}
			if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_key`).Scan(&rows); err != nil {
				t.Fatal(err)
			}
			if rows != 0 {
				t.Fatalf("deferred_key has %d rows after the holder %s, want none", rows, name)
			}
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
				VALUES ('k', 2, 't', now())`)
			got, err := newLocker(t, db.Pool, "b", time.Hour, 10).Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if want := []string{"k:2"}; !slices.Equal(claimSummary(t, got), want) {
				t.Fatalf("b claimed %q, want %q", claimSummary(t, got), want)
			}
			assertHeadsMatch(t, db.Pool)
		})
	}
}

// TestPublishedKeyWaitsForItsGroup: once a message that names a consumer
// group is published, its key stays leased 'in-flight' until its
// deferred_inflight rows go (the group committed past it, or an operator
// released it): no dispatcher claims the key's next message meanwhile,
// since a record the consumer has not handled may still come back ahead
// of it. A key whose last message went keeps an emptied row under that
// lease, which goes with the release. Messages without a group do not
// wait.
func TestPublishedKeyWaitsForItsGroup(t *testing.T) {
	tests := []struct {
		name     string
		group    string // of the first message; "" for none
		second   bool   // a second message waits behind the first
		inFlight bool
	}{
		{name: "a group, a message behind", group: "g", second: true, inFlight: true},
		{name: "a group, nothing behind", group: "g", inFlight: true},
		{name: "no group", second: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			var group *string
			if tt.group != "" {
				group = &tt.group
			}
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, group_id)
				VALUES ('k', 1, 't', now(), $1)`, group)
			a := newLocker(t, db.Pool, "a", time.Hour, 1)
			held, err := a.Claim(t.Context(), 10)
			if err != nil || len(held) != 1 {
				t.Fatalf("a claimed %q (err %v), want k:1", claimSummary(t, held), err)
			}
			if tt.second {
				mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
					VALUES ('k', 2, 't', now())`)
			}
			id := held[0].Messages[0].ID
			if err := a.Finalize(t.Context(), held, keylock.Outcome{Published: []int64{id},
				Placements: []keylock.Placement{{Partition: 3, Offset: 41}}}); err != nil {
				t.Fatal(err)
			}
			assertHeadsMatch(t, db.Pool)
			var rows int
			if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_inflight
				WHERE group_id = 'g' AND business_key = 'k' AND target_topic = 't' AND partition = 3 AND record_offset = 41
				  AND message_id = $1 AND seq = 1`, id).Scan(&rows); err != nil {
				t.Fatal(err)
			}
			if want := map[bool]int{true: 1, false: 0}[tt.inFlight]; rows != want {
				t.Fatalf("%d in-flight rows for k, want %d", rows, want)
			}
			var published int
			if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_attempt
				WHERE message_id = $1 AND event = 'published' AND partition = 3 AND record_offset = 41`, id).Scan(&published); err != nil {
				t.Fatal(err)
			}
			if published != 1 {
				t.Errorf("%d 'published' events with the partition and offset, want 1", published)
			}

			b := newLocker(t, db.Pool, "b", time.Hour, 10)
			got, err := b.Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if !tt.inFlight {
				if want := []string{"k:2"}; !slices.Equal(claimSummary(t, got), want) {
					t.Fatalf("without a group b claimed %q, want %q at once", claimSummary(t, got), want)
				}
				return
			}
			if len(got) > 0 {
				t.Fatalf("b claimed %q while k is in flight for g", claimSummary(t, got))
			}
			if l := leaseOf(t, db.Pool, "k"); !l.Found || l.By == nil || *l.By != "in-flight" || !l.Forever {
				t.Fatalf("k's lease is %v, want 'in-flight' until infinity", l)
			}

			// The group commits past it: the releaser deletes the row.
			mustExec(t, db.Pool, `DELETE FROM deferred_inflight WHERE business_key = 'k'`)
			assertHeadsMatch(t, db.Pool)
			l := leaseOf(t, db.Pool, "k")
			if !tt.second {
				if l.Found {
					t.Fatalf("k's emptied row stayed after the release: %v", l)
				}
				return
			}
			if l.By != nil {
				t.Fatalf("k's lease is %v after the release, want none", l)
			}
			if got, err = b.Claim(t.Context(), 10); err != nil {
				t.Fatal(err)
			}
			if want := []string{"k:2"}; !slices.Equal(claimSummary(t, got), want) {
				t.Fatalf("after the release b claimed %q, want %q", claimSummary(t, got), want)
			}
		})
	}
}

// TestTruncateInflightReleasesEveryKey: TRUNCATE deferred_inflight lets
// every key in flight go, as deleting every row does.
func TestTruncateInflightReleasesEveryKey(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, group_id)
		VALUES ('k', 1, 't', now(), 'g'), ('j', 2, 't', now(), 'g')`)
	a := newLocker(t, db.Pool, "a", time.Hour, 1)
	held, err := a.Claim(t.Context(), 10)
	if err != nil || len(held) != 2 {
		t.Fatalf("a claimed %q (err %v), want both keys", claimSummary(t, held), err)
	}
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('k', 3, 't', now())`)
	out := keylock.Outcome{}
	for i, c := range held {
		out.Published = append(out.Published, c.Messages[0].ID)
		out.Placements = append(out.Placements, keylock.Placement{Partition: 0, Offset: int64(i)})
	}
	if err := a.Finalize(t.Context(), held, out); err != nil {
		t.Fatal(err)
	}
	mustExec(t, db.Pool, `TRUNCATE deferred_inflight`)
	assertHeadsMatch(t, db.Pool)
	got, err := newLocker(t, db.Pool, "b", time.Hour, 10).Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"k:3"}; !slices.Equal(claimSummary(t, got), want) {
		t.Fatalf("after the truncate b claimed %q, want %q", claimSummary(t, got), want)
	}
	var left int
	if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_key WHERE business_key = 'j'`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("j's emptied row stayed after the truncate")
	}
}
