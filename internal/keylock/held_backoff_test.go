package keylock_test

import (
	"slices"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// keyState is the lease and failure count of one business key's row.
type keyState struct {
	Held       bool
	Failures   int
	LeasedBy   *string
	LeaseAhead bool // leased_until is in the future
}

func keyStateOf(t testing.TB, q querier, key string) keyState {
	t.Helper()
	var s keyState
	if err := q.QueryRow(t.Context(), `SELECT held, failures, leased_by, coalesce(leased_until > now(), false)
		FROM deferred_key WHERE business_key = $1`, key).Scan(&s.Held, &s.Failures, &s.LeasedBy, &s.LeaseAhead); err != nil {
		t.Fatalf("key %s: %v", key, err)
	}
	return s
}

// TestHeldKeyStartsWithoutBackoff: a finalize that parks a message holding
// its key and records a retriable failure of a later message of the key
// leaves the key held with a failure and a back-off. Once the key stops
// being held (the parked head replayed or deleted, or a re-deferral landing
// ahead of it) its head is claimable at once: the back-off belonged to the
// key's past. A lease a dispatcher holds is not the past: it stays.
func TestHeldKeyStartsWithoutBackoff(t *testing.T) {
	tests := []struct {
		name string
		// release makes k stop being held; $1 is the parked head's id.
		release string
		// leasedBy, if set, makes a dispatcher hold k's lease when it is
		// released.
		leasedBy string
		// want is the next claim (claimSummary), right after release.
		want []string
	}{
		{name: "replayed", release: `UPDATE deferred_message SET state = 'pending', next_run_at = now() WHERE id = $1`,
			want: []string{"k:1,2"}},
		{name: "deleted", release: `DELETE FROM deferred_message WHERE id = $1`, want: []string{"k:2"}},
		{name: "a re-deferral lands ahead", release: `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
			SELECT 'k', 0, 't', now() WHERE $1::bigint IS NOT NULL`, want: []string{"k:0"}},
		{name: "a lease a dispatcher holds is kept", leasedBy: "other",
			release: `UPDATE deferred_message SET state = 'pending', next_run_at = now() WHERE id = $1`},
	}
	db := pgtest.NewDB(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reset(t, db.Pool)
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
				('k', 1, 't', now() - interval '1 minute'), ('k', 2, 't', now() - interval '1 minute')`)
			// A back-off far longer than the test: a key that waits for it
			// is not claimed below.
			l := newLockerBackoff(t, db.Pool, "me", time.Hour, 10, time.Hour)
			claims, err := l.Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if got := claimSummary(t, claims); !slices.Equal(got, []string{"k:1,2"}) {
				t.Fatalf("claims = %q, want k:1,2", got)
			}
			head := claims[0].Messages[0].ID
			// The broker refused the first message for good and the second
			// retriably, in one round.
			if err := l.Finalize(t.Context(), claims, keylock.Outcome{
				Parked: []keylock.Park{{ID: head, Reason: "publish_failed: too_large: x"}},
				Retry:  claims,
			}); err != nil {
				t.Fatal(err)
			}
			if s := keyStateOf(t, db.Pool, "k"); !s.Held || s.Failures != 1 || s.LeasedBy != nil || !s.LeaseAhead {
				t.Fatalf("after the finalize: %+v, want held, one failure and a back-off owned by no one", s)
			}
			if tt.leasedBy != "" {
				mustExec(t, db.Pool, `UPDATE deferred_key SET leased_by = $1 WHERE business_key = 'k'`, tt.leasedBy)
			}

			mustExec(t, db.Pool, tt.release, head)
			assertHeadsMatch(t, db.Pool)
			s := keyStateOf(t, db.Pool, "k")
			if s.Held || s.Failures != 0 {
				t.Errorf("after the release: %+v, want not held, no failures", s)
			}
			if tt.leasedBy != "" {
				if s.LeasedBy == nil || *s.LeasedBy != tt.leasedBy || !s.LeaseAhead {
					t.Errorf("after the release: %+v, want the lease of %s kept", s, tt.leasedBy)
				}
			} else if s.LeasedBy != nil || s.LeaseAhead {
				t.Errorf("after the release: %+v, want no lease", s)
			}
			got, err := l.Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if s := claimSummary(t, got); !slices.Equal(s, tt.want) {
				t.Errorf("claim right after the release = %q, want %q", s, tt.want)
			}
		})
	}
}

// TestHeldKeyKeepsBackoffWhileHeld: only leaving the held state resets the
// key; a held key whose head changes (an earlier parked message) keeps its
// failure count.
func TestHeldKeyKeepsBackoffWhileHeld(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason) VALUES
		('k', 2, 't', now(), 'parked', 'permanent: x'), ('k', 3, 't', now(), 'pending', NULL)`)
	mustExec(t, db.Pool, `UPDATE deferred_key SET failures = 2, leased_until = now() + interval '1 hour'`)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason)
		VALUES ('k', 1, 't', now(), 'parked', 'exhausted: x')`)
	assertHeadsMatch(t, db.Pool)
	if s := keyStateOf(t, db.Pool, "k"); !s.Held || s.Failures != 2 || !s.LeaseAhead {
		t.Errorf("held key after a new parked head: %+v, want still held with its failures and back-off", s)
	}
}
