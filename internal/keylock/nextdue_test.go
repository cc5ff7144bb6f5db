package keylock_test

import (
	"context"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

func TestNextDue(t *testing.T) {
	const ins = `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES `
	tests := []struct {
		name   string
		setup  []string
		wantOK bool
		want   time.Duration // with tolerance
	}{
		{name: "nothing pending", wantOK: false},
		{
			name: "only parked and rejected messages",
			setup: []string{`INSERT INTO deferred_message (business_key, target_topic, next_run_at, state) VALUES
				('a', 't', now(), 'parked'), (NULL, 't', now(), 'parked'), (NULL, NULL, now(), 'rejected')`},
		},
		{name: "a future head", setup: []string{ins + `('a', 1, 't', now() + interval '10 seconds')`}, wantOK: true, want: 10 * time.Second},
		{name: "a due head is 0", setup: []string{ins + `('a', 1, 't', now() + interval '10 seconds'), ('b', 2, 't', now() - interval '1 hour')`}, wantOK: true, want: 0},
		{
			name:   "the head counts, not a due message behind it",
			setup:  []string{ins + `('a', 1, 't', now() + interval '30 seconds'), ('a', 2, 't', now() - interval '1 hour')`},
			wantOK: true, want: 30 * time.Second,
		},
		{
			name:   "earliest of ordered and unordered heads",
			setup:  []string{ins + `('a', 1, 't', now() + interval '7 seconds'), (NULL, 2, 't', now() + interval '5 seconds'), (NULL, 3, 't', now() + interval '9 seconds')`},
			wantOK: true, want: 5 * time.Second,
		},
		{
			name: "a leased head is skipped",
			setup: []string{
				ins + `('a', 1, 't', now() - interval '1 second'), ('b', 2, 't', now() + interval '20 seconds')`,
				`UPDATE deferred_key SET leased_by = 'x', leased_until = now() + interval '1 hour' WHERE business_key = 'a'`,
			},
			wantOK: true, want: 20 * time.Second,
		},
		{
			name: "a head whose lease expired counts",
			setup: []string{
				ins + `('a', 1, 't', now() + interval '3 seconds'), ('b', 2, 't', now() + interval '20 seconds')`,
				`UPDATE deferred_key SET leased_by = 'x', leased_until = now() - interval '1 second' WHERE business_key = 'a'`,
			},
			wantOK: true, want: 3 * time.Second,
		},
		{
			name: "a key held by a parked message is never due",
			setup: []string{
				ins + `('held', 1, 't', now() - interval '1 hour'), ('held', 2, 't', now() - interval '1 hour'), ('b', 3, 't', now() + interval '8 seconds')`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`,
			},
			wantOK: true, want: 8 * time.Second,
		},
		{
			name: "only held keys",
			setup: []string{
				ins + `('held', 1, 't', now()), ('held', 2, 't', now())`,
				`UPDATE deferred_message SET state = 'parked' WHERE seq = 1`,
			},
			wantOK: false,
		},
		{
			name: "heads of a paused target are skipped",
			setup: []string{
				ins + `('p', 1, 'paused.t', now() - interval '1 hour'), ('b', 2, 't', now() + interval '6 seconds')`,
				`INSERT INTO target_control (target_topic, paused) VALUES ('paused.t', true)`,
			},
			wantOK: true, want: 6 * time.Second,
		},
		{
			name: "due heads of a rate-limited target are skipped",
			setup: []string{
				ins + `('r', 1, 'limited.t', now() - interval '1 hour'), ('b', 2, 't', now() + interval '4 seconds')`,
				`INSERT INTO target_control (target_topic, rate_limit) VALUES ('limited.t', 10)`,
			},
			wantOK: true, want: 4 * time.Second,
		},
		{
			name: "a future head of a rate-limited target counts",
			setup: []string{
				ins + `('r', 1, 'limited.t', now() + interval '3 seconds'), ('b', 2, 't', now() + interval '9 seconds')`,
				`INSERT INTO target_control (target_topic, rate_limit) VALUES ('limited.t', 10)`,
			},
			wantOK: true, want: 3 * time.Second,
		},
		{
			name: "only leased heads",
			setup: []string{
				ins + `('a', 1, 't', now()), (NULL, 2, 't', now())`,
				`UPDATE deferred_key SET leased_by = 'x', leased_until = now() + interval '1 hour'`,
			},
			wantOK: false,
		},
		{
			// Further away than a Duration can say: the longest Duration,
			// not an overflow into a negative wait that would spin the loop.
			name:   "a head due in the year 9999",
			setup:  []string{ins + `('a', 1, 't', '9999-12-31 00:00:00+00')`},
			wantOK: true, want: time.Duration(math.MaxInt64),
		},
		{
			name: "a rate-limited target's future head among other limited targets' due backlogs",
			setup: []string{
				ins + `('r1', 1, 'limited.a', now() - interval '1 hour'), ('r2', 2, 'limited.b', now() - interval '1 hour'),
					('r3', 3, 'limited.b', now() + interval '7 seconds'), ('p', 4, 'paused.t', now() + interval '2 seconds')`,
				`INSERT INTO target_control (target_topic, rate_limit, paused) VALUES
					('limited.a', 10, false), ('limited.b', 10, false), ('paused.t', 10, true)`,
			},
			wantOK: true, want: 7 * time.Second,
		},
		{
			// A race with the pause left the head unflagged (see migration
			// 0002): the claim's safety net also keeps it out of NextDue.
			name: "an unflagged head of a paused target is skipped",
			setup: []string{
				ins + `('p', 1, 'paused.t', now() - interval '1 hour'), ('b', 2, 't', now() + interval '5 seconds')`,
				`INSERT INTO target_control (target_topic, paused) VALUES ('paused.t', true)`,
				`UPDATE deferred_key SET throttled = false`,
			},
			wantOK: true, want: 5 * time.Second,
		},
	}
	db := pgtest.NewDB(t)
	l := newLocker(t, db.Pool, "me", time.Minute, 10)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reset(t, db.Pool)
			mustExec(t, db.Pool, "DELETE FROM target_control")
			for _, s := range tt.setup {
				mustExec(t, db.Pool, s)
			}
			got, ok, err := l.NextDue(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if ok != tt.wantOK {
				t.Fatalf("NextDue = %v, %v; want ok=%v", got, ok, tt.wantOK)
			}
			if !ok {
				if got != 0 {
					t.Errorf("NextDue = %v with ok=false, want 0", got)
				}
				return
			}
			// The setup ran a moment ago; the time left can only have shrunk.
			if got > tt.want || got < tt.want-time.Second || got < 0 {
				t.Errorf("NextDue = %v, want about %v (at most, within 1s)", got, tt.want)
			}
		})
	}
}

// TestSweepExpired clears expired leases and only those.
func TestSweepExpired(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('expired', 1, 't', now() - interval '1 minute'), ('live', 2, 't', now() - interval '1 minute'),
		('free', 3, 't', now() - interval '1 minute'), ('backoff', 4, 't', now() - interval '1 minute'),
		('future', 5, 't', now() + interval '1 hour'),
		(NULL, 6, 't', now() - interval '1 minute'), (NULL, 7, 't', now() - interval '1 minute')`)
	mustExec(t, db.Pool, `UPDATE deferred_key SET leased_by = 'dead', leased_until = now() - interval '5 seconds'
		WHERE business_key = 'expired' OR head_seq = 6`)
	mustExec(t, db.Pool, `UPDATE deferred_key SET leased_by = 'alive', leased_until = now() + interval '1 hour'
		WHERE business_key = 'live' OR head_seq = 7`)
	mustExec(t, db.Pool, `UPDATE deferred_key SET leased_by = NULL, leased_until = now() + interval '1 hour'
		WHERE business_key = 'backoff'`)
	leases := func() []string {
		rows, err := db.Pool.Query(t.Context(), `SELECT format('%s@%s by=%s until=%s', coalesce(business_key, '-'), head_seq,
			coalesce(leased_by, 'NULL'), coalesce(leased_until::text, 'NULL')) FROM deferred_key ORDER BY head_seq`)
		if err != nil {
			t.Fatal(err)
		}
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	before := leases()

	n, err := keylock.SweepExpired(t.Context(), db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Errorf("SweepExpired = %d, want 2", n)
	}
	// In head_seq order: expired@1 and the unordered -@6 lose their
	// leases; every other row is as it was.
	want := slices.Clone(before)
	want[0] = "expired@1 by=NULL until=NULL"
	want[5] = "-@6 by=NULL until=NULL"
	if after := leases(); !slices.Equal(after, want) {
		t.Errorf("after sweep:\n  %q\nwant\n  %q", after, want)
	}
	// Sweeping again finds nothing.
	if n, err := keylock.SweepExpired(t.Context(), db.Pool); err != nil || n != 0 {
		t.Errorf("second SweepExpired = %d, %v; want 0", n, err)
	}
	assertHeadsMatch(t, db.Pool)
}

// TestSweepExpiredHeadNotDue: a lease that expired on a key whose head moved
// to a message not due yet (an insert with a lower seq, or an expedite in
// reverse, while the key was held) is an expired lease like any other.
func TestSweepExpiredHeadNotDue(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('a', 10, 't', now())`)
	claims, err := newLocker(t, db.Pool, "dead", 100*time.Millisecond, 10).Claim(t.Context(), 10)
	if err != nil || len(claims) != 1 {
		t.Fatalf("claim: %v %v", claims, err)
	}
	// While held, a re-deferral with a lower seq and a future time becomes the head.
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('a', 1, 't', now() + interval '1 hour')`)
	mustExec(t, db.Pool, `UPDATE deferred_key SET leased_until = now() - interval '1 minute'`) // the holder died long ago
	if _, err := keylock.SweepExpired(t.Context(), db.Pool); err != nil {
		t.Fatal(err)
	}
	if l := leaseOf(t, db.Pool, "a"); l.By != nil {
		t.Errorf("expired lease not swept: %v", l)
	}
}

// TestClaimReleasesEmptyClaims: a key claimed but whose head has no due
// pending message to return is released at once, not left leased and not
// returned. Such a head cannot arise while the triggers run (a claimed due
// head always has its message in the claim's snapshot), so the test makes
// one by bypassing them, as a restore with session_replication_role =
// replica or a manual edit of deferred_key would.
func TestClaimReleasesEmptyClaims(t *testing.T) {
	const ins = `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES `
	tests := []struct {
		name  string
		setup func(t *testing.T, q querier)
		want  []string // claims that must still come back
	}{
		{
			name: "head message deleted without triggers",
			setup: func(t *testing.T, q querier) {
				mustExec(t, q, ins+`('gone', 1, 't', now()), (NULL, 2, 't', now()), ('ok', 3, 't', now())`)
				mustExec(t, q, `SET session_replication_role = replica;
					DELETE FROM deferred_message WHERE seq IN (1, 2);
					SET session_replication_role = DEFAULT`)
			},
			want: []string{"ok:3"},
		},
		{
			// Only for an ordered key: an unordered claim returns its message
			// on deferred_key's word that it is due.
			name: "deferred_key says due, the head message is not",
			setup: func(t *testing.T, q querier) {
				mustExec(t, q, ins+`('late', 1, 't', now() + interval '1 hour'), ('ok', 3, 't', now())`)
				mustExec(t, q, `UPDATE deferred_key SET next_run_at = now() - interval '1 second' WHERE head_seq = 1`)
			},
			want: []string{"ok:3"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			conn, err := db.Pool.Acquire(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			tt.setup(t, conn)
			conn.Release()
			l := newLocker(t, db.Pool, "me", time.Hour, 10)
			claims, err := l.Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if got := claimSummary(t, claims); !slices.Equal(got, tt.want) {
				t.Errorf("claims = %q, want %q", got, tt.want)
			}
			var leased []string
			rows, err := db.Pool.Query(context.Background(), `SELECT coalesce(business_key, '-') || '@' || head_seq FROM deferred_key
				WHERE leased_by IS NOT NULL OR leased_until IS NOT NULL ORDER BY 1`)
			if err != nil {
				t.Fatal(err)
			}
			if leased, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
				t.Fatal(err)
			}
			if want := []string{"ok@3"}; !slices.Equal(leased, want) {
				t.Errorf("leased keys after claim = %q, want %q (empty claims released)", leased, want)
			}
		})
	}
}
