package keylock_test

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// reset empties deferred_message through the triggers and checks that they
// emptied deferred_key with it. A key a test left leased keeps an emptied
// row (head_id 0) until its holder lets go (deferred_key_refresh.sql); reset
// lets go for it, as the holder's finalize or the lease sweep would.
func reset(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	mustExec(t, pool, "DELETE FROM deferred_message")
	mustExec(t, pool, "DELETE FROM deferred_key WHERE head_id = 0 AND leased_by IS NOT NULL")
	var n int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM deferred_key").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("deferred_key has %d rows after every message was deleted", n)
	}
}

func TestNewValidates(t *testing.T) {
	tests := []struct {
		name string
		cfg  keylock.Config
		ok   bool
	}{
		{"valid", keylock.Config{Owner: "a", Lease: time.Second, PerKey: 1}, true},
		{"no owner", keylock.Config{Lease: time.Second, PerKey: 1}, false},
		{"zero lease", keylock.Config{Owner: "a", PerKey: 1}, false},
		{"negative lease", keylock.Config{Owner: "a", Lease: -time.Second, PerKey: 1}, false},
		{"zero per key", keylock.Config{Owner: "a", Lease: time.Second}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := keylock.New(nil, tt.cfg)
			if (err == nil) != tt.ok {
				t.Fatalf("New(%+v) error = %v, want ok=%v", tt.cfg, err, tt.ok)
			}
			if tt.ok && l.Lease() != tt.cfg.Lease {
				t.Errorf("Lease() = %v, want %v", l.Lease(), tt.cfg.Lease)
			}
		})
	}
}

// TestClaim checks what one Claim returns: for each due key nobody holds, its
// consecutive due pending messages in (seq, id) order, at most PerKey,
// earliest heads first, and that it leases exactly those keys.
func TestClaim(t *testing.T) {
	const ins = `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state) VALUES `
	tests := []struct {
		name    string
		setup   []string
		perKey  int
		maxKeys int
		want    []string // claimSummary
	}{
		{
			name:   "run of due messages stops at the first one not due",
			setup:  []string{ins + `('a', 1, 't', now() - interval '1 minute', 'pending'), ('a', 2, 't', now(), 'pending'), ('a', 3, 't', now() + interval '1 hour', 'pending'), ('a', 4, 't', now() - interval '1 hour', 'pending')`},
			perKey: 10, maxKeys: 10,
			want: []string{"a:1,2"},
		},
		{
			name:   "run order is seq order, not due order nor insert order",
			setup:  []string{ins + `('a', 3, 't', now() - interval '3 minutes', 'pending'), ('a', 1, 't', now() - interval '1 minute', 'pending'), ('a', 2, 't', now() - interval '2 minutes', 'pending')`},
			perKey: 10, maxKeys: 10,
			want: []string{"a:1,2,3"},
		},
		{
			name:   "PerKey caps the run",
			setup:  []string{ins + `('b', 1, 't', now(), 'pending'), ('b', 2, 't', now(), 'pending'), ('b', 3, 't', now(), 'pending'), ('b', 4, 't', now(), 'pending'), ('b', 5, 't', now(), 'pending')`},
			perKey: 3, maxKeys: 10,
			want: []string{"b:1,2,3"},
		},
		{
			name: "a key whose head is not due is not claimed though later messages are",
			setup: []string{ins + `('c', 1, 't', now() + interval '1 hour', 'pending'), ('c', 2, 't', now() - interval '1 hour', 'pending'),
				('c', 3, 't', now() - interval '1 hour', 'pending'), ('d', 4, 't', now(), 'pending')`},
			perKey: 10, maxKeys: 10,
			want: []string{"d:4"},
		},
		{
			name:   "unordered messages are claimed one each",
			setup:  []string{ins + `(NULL, 1, 't', now(), 'pending'), (NULL, 2, 't', now() - interval '1 hour', 'pending'), (NULL, 3, 't', now() + interval '1 hour', 'pending')`},
			perKey: 10, maxKeys: 10,
			want: []string{"-:1", "-:2"},
		},
		{
			name: "a parked message that holds its key ends the run and blocks the key; rejected ones do neither",
			setup: []string{ins + `('a', 1, 't', now(), 'pending'), ('a', 2, 't', now(), 'parked'), ('a', 3, NULL, now(), 'rejected'),
				('a', 4, 't', now(), 'pending'), ('b', 0, 't', now(), 'parked'), ('b', 5, 't', now(), 'pending'),
				('c', 6, 't', now(), 'pending'), ('c', 7, NULL, now(), 'rejected'), ('c', 8, 't', now(), 'pending')`},
			perKey: 10, maxKeys: 10,
			want: []string{"a:1", "c:6,8"},
		},
		{
			name: "parked messages that do not hold their key neither block nor join a run",
			setup: []string{
				ins + `('a', 1, 't', now(), 'pending'), ('a', 2, 't', now(), 'parked'), ('a', 3, NULL, now(), 'rejected'),
				('a', 4, 't', now(), 'pending'), ('b', 0, 't', now(), 'parked'), ('b', 5, 't', now(), 'pending')`,
				`UPDATE deferred_message SET park_holds_key = false WHERE state = 'parked'`,
			},
			perKey: 10, maxKeys: 10,
			want: []string{"a:1,4", "b:5"},
		},
		{
			name: "a parked message ahead of a due run stops it even when the run is claimed from a head before it",
			setup: []string{ins + `('h', 1, 't', now() - interval '1 minute', 'pending'), ('h', 2, 't', now() - interval '1 minute', 'pending'),
				('h', 3, 't', now() - interval '1 minute', 'parked'), ('h', 4, 't', now() - interval '1 minute', 'pending')`},
			perKey: 10, maxKeys: 10,
			want: []string{"h:1,2"},
		},
		{
			name: "maxKeys takes the earliest heads",
			setup: []string{ins + `('e', 1, 't', now() - interval '3 minutes', 'pending'), ('f', 2, 't', now() - interval '4 minutes', 'pending'),
				('g', 3, 't', now() - interval '1 minute', 'pending'), (NULL, 4, 't', now() - interval '2 minutes', 'pending'),
				('f', 5, 't', now(), 'pending')`},
			perKey: 10, maxKeys: 2,
			want: []string{"e:1", "f:2,5"},
		},
		{
			name: "held keys are skipped; expired leases are not",
			setup: []string{
				ins + `('held', 1, 't', now(), 'pending'), ('expired', 2, 't', now(), 'pending'), ('backoff', 3, 't', now(), 'pending'), ('free', 4, 't', now(), 'pending')`,
				`UPDATE deferred_key SET leased_by = 'other', leased_until = now() + interval '1 hour' WHERE business_key = 'held'`,
				`UPDATE deferred_key SET leased_by = 'other', leased_until = now() - interval '1 millisecond' WHERE business_key = 'expired'`,
				// A key backing off after a retriable error: leased to no one until later.
				`UPDATE deferred_key SET leased_by = NULL, leased_until = now() + interval '1 hour' WHERE business_key = 'backoff'`,
			},
			perKey: 10, maxKeys: 10,
			want: []string{"expired:2", "free:4"},
		},
	}
	db := pgtest.NewDB(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reset(t, db.Pool)
			for _, s := range tt.setup {
				mustExec(t, db.Pool, s)
			}
			const lease = time.Hour
			l := newLocker(t, db.Pool, "me", lease, tt.perKey)
			before := dbNow(t, db.Pool)
			claims, err := l.Claim(t.Context(), tt.maxKeys)
			if err != nil {
				t.Fatal(err)
			}
			after := dbNow(t, db.Pool)
			if got := claimSummary(t, claims); !slices.Equal(got, tt.want) {
				t.Errorf("claims = %q, want %q", got, tt.want)
			}
			// Exactly the claimed keys are leased to us, for the lease.
			claimed := map[int64]bool{}
			for _, c := range claims {
				claimed[c.HeadID] = true
			}
			rows, err := db.Pool.Query(t.Context(), `SELECT head_id, coalesce(leased_by, ''), leased_until FROM deferred_key`)
			if err != nil {
				t.Fatal(err)
			}
			defer rows.Close()
			for rows.Next() {
				var head int64
				var by string
				var until *time.Time
				if err := rows.Scan(&head, &by, &until); err != nil {
					t.Fatal(err)
				}
				if (by == "me") != claimed[head] {
					t.Errorf("head %d: leased_by %q, claimed %v", head, by, claimed[head])
				}
				if claimed[head] && (until == nil || until.Before(before.Add(lease-time.Second)) || until.After(after.Add(lease))) {
					t.Errorf("head %d: leased_until %v, want about now + %v", head, until, lease)
				}
			}
			if err := rows.Err(); err != nil {
				t.Fatal(err)
			}
			// Nothing is left for a second holder, nor for ourselves.
			again, err := newLocker(t, db.Pool, "other-holder", lease, tt.perKey).Claim(t.Context(), 100)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range again {
				if claimed[c.HeadID] {
					t.Errorf("key %q (head %d) claimed twice", c.BusinessKey, c.HeadID)
				}
			}
		})
	}
}

// TestClaimMessageFields checks that a claimed message carries the stored
// record byte for byte.
func TestClaimMessageFields(t *testing.T) {
	db := pgtest.NewDB(t)
	var id int64
	var nextRunAt time.Time
	err := db.Pool.QueryRow(t.Context(), `INSERT INTO deferred_message
		(business_key, seq, target_topic, next_run_at, attempt, key, value, header_keys, header_values)
		VALUES ('k', 42, 'orders.retry', now() - interval '1 second', 3, '\x00ff'::bytea, NULL,
		        ARRAY['h', 'h', 'bin'], ARRAY['\x01'::bytea, '\x02'::bytea, '\x00fe'::bytea])
		RETURNING id, next_run_at`).Scan(&id, &nextRunAt)
	if err != nil {
		t.Fatal(err)
	}
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at, key, value)
		VALUES (NULL, 'u', now(), NULL, ''::bytea)`)

	claims, err := newLocker(t, db.Pool, "me", time.Minute, 10).Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(claims) != 2 {
		t.Fatalf("got %d claims, want 2: %+v", len(claims), claims)
	}
	// Ordered keys sort first.
	c := claims[0]
	if !c.Ordered || c.BusinessKey != "k" || c.HeadID != id || len(c.Messages) != 1 {
		t.Fatalf("claim = %+v", c)
	}
	m := c.Messages[0]
	wantHeaders := []keylock.Header{{"h", []byte{1}}, {"h", []byte{2}}, {"bin", []byte{0, 0xfe}}}
	if m.ID != id || m.Seq != 42 || m.Target != "orders.retry" || m.Attempt != 3 || !m.NextRunAt.Equal(nextRunAt) ||
		!bytes.Equal(m.Key, []byte{0, 0xff}) || m.Value != nil ||
		!slices.EqualFunc(m.Headers, wantHeaders, func(a, b keylock.Header) bool { return a.Key == b.Key && bytes.Equal(a.Value, b.Value) }) {
		t.Errorf("message = %+v\nwant id %d seq 42 target orders.retry attempt 3 next_run_at %v key 00ff value nil headers %v",
			m, id, nextRunAt, wantHeaders)
	}
	u := claims[1]
	if u.Ordered || u.BusinessKey != "" || len(u.Messages) != 1 {
		t.Fatalf("unordered claim = %+v", u)
	}
	if um := u.Messages[0]; um.Key != nil || um.Value == nil || len(um.Value) != 0 || len(um.Headers) != 0 {
		t.Errorf("unordered message: key %v (want nil), value %#v (want empty, not nil), headers %v", um.Key, um.Value, um.Headers)
	}
}

// TestLeaseExcludesOtherHolders: a second holder cannot claim a leased key
// until the lease expires (by the database clock), and then it can.
func TestLeaseExcludesOtherHolders(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES
		('a', 't', now()), (NULL, 't', now())`)
	const lease = 300 * time.Millisecond
	a := newLocker(t, db.Pool, "a", lease, 10)
	b := newLocker(t, db.Pool, "b", time.Minute, 10)

	first, err := a.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if got := claimSummary(t, first); len(got) != 2 {
		t.Fatalf("first claim = %q, want both keys", got)
	}
	var aUntil time.Time
	if err := db.Pool.QueryRow(t.Context(), `SELECT max(leased_until) FROM deferred_key`).Scan(&aUntil); err != nil {
		t.Fatal(err)
	}
	// claimedAt is when (by the database clock) owner's current lease on
	// the keys was taken: its leased_until less its lease.
	claimedAt := func(owner string, lease time.Duration) time.Time {
		var until time.Time
		if err := db.Pool.QueryRow(t.Context(), `SELECT min(leased_until) FROM deferred_key WHERE leased_by = $1`, owner).Scan(&until); err != nil {
			t.Fatal(err)
		}
		return until.Add(-lease)
	}

	// Neither b nor a itself can take the keys while a's lease lasts. (If
	// this runs late, past the lease, a claim is fine but must be after it.)
	again, err := a.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(again) > 0 {
		if at := claimedAt("a", lease); at.Before(aUntil) {
			t.Fatalf("a claimed %q again at %v, inside its own lease (until %v)", claimSummary(t, again), at, aUntil)
		}
		t.Skipf("test ran slower than the %v lease; nothing left to check", lease)
	}

	var second []keylock.Claim
	tries := 0
	eventually(t, 10*time.Second, "the lease to expire and b to claim", func() bool {
		tries++
		var err error
		if second, err = b.Claim(t.Context(), 10); err != nil {
			t.Fatal(err)
		}
		return len(second) > 0
	})
	if got := claimSummary(t, second); !slices.Equal(got, claimSummary(t, first)) {
		t.Errorf("b claimed %q, want %q", got, claimSummary(t, first))
	}
	if at := claimedAt("b", time.Minute); at.Before(aUntil) {
		t.Errorf("b claimed at %v, before a's lease ended at %v", at, aUntil)
	}
	t.Logf("b claimed after %d tries", tries)
}

// A claim aborted by a deadlock (PostgreSQL can make the claim wait for an
// operator's statement and abort it, see Locker.claim) is run once more;
// a second deadlock in a row is returned, with nothing leased. The
// deadlocks come from a statement trigger on deferred_key, which the
// claim's lease update fires: a real PostgreSQL error with the deadlock's
// SQLSTATE, raised by the first deadlocks calls (a sequence counts them
// outside the aborted transactions).
func TestClaimRetriesADeadlock(t *testing.T) {
	for _, tc := range []struct {
		deadlocks int
		wantErr   bool
	}{{0, false}, {1, false}, {2, true}} {
		t.Run(fmt.Sprintf("%d deadlocks", tc.deadlocks), func(t *testing.T) {
			db := pgtest.NewDB(t)
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES ('a', 't', now())`)
			mustExec(t, db.Pool, `CREATE SEQUENCE claim_deadlocks`)
			mustExec(t, db.Pool, fmt.Sprintf(`CREATE FUNCTION claim_deadlock() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN
					IF nextval('claim_deadlocks') <= %d THEN
						RAISE EXCEPTION 'deadlock detected (raised by the test)' USING ERRCODE = 'deadlock_detected';
					END IF;
					RETURN NULL;
				END $$`, tc.deadlocks))
			mustExec(t, db.Pool, `CREATE TRIGGER claim_deadlock AFTER UPDATE ON deferred_key
				FOR EACH STATEMENT EXECUTE FUNCTION claim_deadlock()`)

			claims, err := newLocker(t, db.Pool, "me", time.Minute, 10).Claim(t.Context(), 10)
			var calls int64
			if err := db.Pool.QueryRow(t.Context(), `SELECT last_value FROM claim_deadlocks`).Scan(&calls); err != nil {
				t.Fatal(err)
			}
			if want := int64(min(tc.deadlocks+1, 2)); calls != want {
				t.Errorf("the claim statement ran %d times, want %d", calls, want)
			}
			var leased int
			if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_key WHERE leased_by = 'me'`).Scan(&leased); err != nil {
				t.Fatal(err)
			}
			if tc.wantErr {
				if !keylock.IsDeadlock(err) || !strings.Contains(err.Error(), "claim due keys") {
					t.Fatalf("Claim error = %v, want the deadlock, saying what failed", err)
				}
				if len(claims) != 0 || leased != 0 {
					t.Fatalf("%d claims returned, %d keys leased after the failed claim; want none", len(claims), leased)
				}
				return
			}
			if err != nil {
				t.Fatalf("Claim: %v, want the claim run again after %d deadlock", err, tc.deadlocks)
			}
			if got := claimSummary(t, claims); len(got) != 1 || leased != 1 {
				t.Fatalf("claimed %q with %d keys leased, want key a", got, leased)
			}
		})
	}
}

// TestFinalize: published messages go, parked ones are parked with their
// reason, and the keys are free at once for any holder.
func TestFinalize(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('a', 1, 't', now()), ('a', 2, 't', now()), ('a', 3, 't', now()), ('a', 4, 't', now()),
		('b', 5, 't', now()), (NULL, 6, 't', now()), (NULL, 7, 't', now())`)
	a := newLocker(t, db.Pool, "a", time.Hour, 3)
	claims, err := a.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimSummary(t, claims), []string{"-:6", "-:7", "a:1,2,3", "b:5"}; !slices.Equal(got, want) {
		t.Fatalf("claims = %q, want %q", got, want)
	}
	ids := map[int64]int64{} // seq -> id
	for _, c := range claims {
		for _, m := range c.Messages {
			ids[m.Seq] = m.ID
		}
	}
	// a: 1 published, 2 parked, 3 not sent (stays pending); b: parked;
	// unordered 6 published, 7 parked.
	out := keylock.Outcome{
		Published: []int64{ids[1], ids[6]},
		Parked:    []keylock.Park{{ID: ids[2], Reason: "record too large"}, {ID: ids[5], Reason: "unknown topic"}, {ID: ids[7], Reason: "not authorized"}},
	}
	if err := a.Finalize(t.Context(), claims, out); err != nil {
		t.Fatal(err)
	}

	rows, err := db.Pool.Query(t.Context(), `SELECT seq, state, coalesce(reason, '') FROM deferred_message ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		Seq    int64
		State  string
		Reason string
	}
	var got []row
	for rows.Next() {
		var r row
		if err := rows.Scan(&r.Seq, &r.State, &r.Reason); err != nil {
			t.Fatal(err)
		}
		got = append(got, r)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := []row{{2, "parked", "record too large"}, {3, "pending", ""}, {4, "pending", ""}, {5, "parked", "unknown topic"}, {7, "parked", "not authorized"}}
	if !slices.Equal(got, want) {
		t.Errorf("messages after finalize = %+v, want %+v", got, want)
	}
	assertHeadsMatch(t, db.Pool)
	if l := leaseOf(t, db.Pool, "a"); !l.Found || l.By != nil || l.Until != nil {
		t.Errorf("key a after finalize: %v, want released", l)
	}
	// The parked messages hold their keys (park_holds_key defaults to true):
	// a waits behind 2, b behind 5.
	if got, want := headSummary(t, db.Pool), []string{"a@2!", "b@5!"}; !slices.Equal(got, want) {
		t.Errorf("heads after finalize = %q, want %q", got, want)
	}
	other := newLocker(t, db.Pool, "b", time.Hour, 3)
	if next, err := other.Claim(t.Context(), 10); err != nil || len(next) > 0 {
		t.Errorf("claims behind held keys = %q, %v; want none", claimSummary(t, next), err)
	}

	// Released at once when the parked message does not hold its key:
	// another holder claims the rest without waiting.
	mustExec(t, db.Pool, `UPDATE deferred_message SET park_holds_key = false WHERE state = 'parked'`)
	next, err := other.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimSummary(t, next), []string{"a:3,4"}; !slices.Equal(got, want) {
		t.Errorf("claims after finalize = %q, want %q", got, want)
	}
}

// TestHeldKeyReplayFlowsInOrder: a key held by a parked head publishes
// nothing, whatever is due behind it; replaying the parked message lets the
// whole key out again in seq order, the replayed message first.
func TestHeldKeyReplayFlowsInOrder(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('k', 1, 't', now() - interval '1 minute'), ('k', 2, 't', now() - interval '2 minutes'),
		('k', 3, 't', now() - interval '3 minutes'), ('other', 4, 't', now())`)
	l := newLocker(t, db.Pool, "me", time.Hour, 10)
	claims, err := l.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimSummary(t, claims), []string{"k:1,2,3", "other:4"}; !slices.Equal(got, want) {
		t.Fatalf("claims = %q, want %q", got, want)
	}
	var ids []int64
	for _, c := range claims {
		for _, m := range c.Messages {
			ids = append(ids, m.ID)
		}
	}
	// The broker refuses k's first message for good; the rest is not sent.
	if err := l.Finalize(t.Context(), claims, keylock.Outcome{
		Published: ids[3:], Parked: []keylock.Park{{ID: ids[0], Reason: "publish_failed: too_large: x"}},
	}); err != nil {
		t.Fatal(err)
	}
	assertHeadsMatch(t, db.Pool)
	for range 3 {
		if got, err := l.Claim(t.Context(), 10); err != nil || len(got) > 0 {
			t.Fatalf("claims while k is held = %q, %v; want none", claimSummary(t, got), err)
		}
	}
	if due, ok, err := l.NextDue(t.Context()); err != nil || ok {
		t.Fatalf("NextDue while the only key is held = %v, %v, %v; want none", due, ok, err)
	}
	mustExec(t, db.Pool, `UPDATE deferred_message SET state = 'pending', next_run_at = now() WHERE id = $1`, ids[0])
	claims, err = l.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimSummary(t, claims), []string{"k:1,2,3"}; !slices.Equal(got, want) {
		t.Errorf("claims after replay = %q, want %q", got, want)
	}
}

// TestFinalizeRetryBacksOff: keys that failed retriably stay blocked for the
// back-off, for every holder, then become claimable again with their
// messages still pending.
func TestFinalizeRetryBacksOff(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('a', 1, 't', now()), ('a', 2, 't', now()), (NULL, 3, 't', now()), ('ok', 4, 't', now())`)
	const backoff = 400 * time.Millisecond
	a := newLockerBackoff(t, db.Pool, "a", time.Hour, 10, backoff)
	b := newLocker(t, db.Pool, "b", time.Hour, 10)
	claims, err := a.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimSummary(t, claims), []string{"-:3", "a:1,2", "ok:4"}; !slices.Equal(got, want) {
		t.Fatalf("claims = %q, want %q", got, want)
	}
	var retry []keylock.Claim
	for _, c := range claims {
		if c.BusinessKey != "ok" {
			retry = append(retry, c)
		}
	}
	if err := a.Finalize(t.Context(), claims, keylock.Outcome{Retry: retry}); err != nil {
		t.Fatal(err)
	}
	releasedAt := dbNow(t, db.Pool)
	assertHeadsMatch(t, db.Pool)

	// "ok" was released without back-off; the others wait.
	got, err := b.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if s := claimSummary(t, got); !slices.Equal(s, []string{"ok:4"}) {
		t.Fatalf("claim right after finalize = %q, want only ok:4", s)
	}
	if err := b.Finalize(t.Context(), got, keylock.Outcome{}); err != nil {
		t.Fatal(err)
	}
	var later []keylock.Claim
	eventually(t, 10*time.Second, "the back-off to pass", func() bool {
		all, err := b.Claim(t.Context(), 10)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range all {
			if c.BusinessKey == "ok" {
				// Released without back-off: finalize it away, it is not what we wait for.
				if err := b.Finalize(t.Context(), []keylock.Claim{c}, keylock.Outcome{}); err != nil {
					t.Fatal(err)
				}
				continue
			}
			later = append(later, c)
		}
		return len(later) > 0
	})
	claimedAt := dbNow(t, db.Pool)
	if claimedAt.Sub(releasedAt) < backoff-50*time.Millisecond {
		t.Errorf("claimed %v after the retry release, want at least the back-off %v", claimedAt.Sub(releasedAt), backoff)
	}
	if s, want := claimSummary(t, later), []string{"-:3", "a:1,2"}; !slices.Equal(s, want) {
		// Both back-offs end together; if the poll caught only one, take the rest.
		rest, err := b.Claim(t.Context(), 10)
		if err != nil {
			t.Fatal(err)
		}
		if s = claimSummary(t, append(later, rest...)); !slices.Equal(s, want) {
			t.Errorf("claims after back-off = %q, want %q", s, want)
		}
	}
}

// TestFinalizeAfterTakeover: a holder whose lease expired and was taken by
// another must not release the new holder's lease when it finalizes late.
func TestFinalizeAfterTakeover(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('a', 1, 't', now()), ('a', 2, 't', now()), (NULL, 3, 't', now())`)
	slow := newLocker(t, db.Pool, "slow", 200*time.Millisecond, 1)
	fast := newLocker(t, db.Pool, "fast", time.Hour, 1)
	mine, err := slow.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimSummary(t, mine), []string{"-:3", "a:1"}; !slices.Equal(got, want) {
		t.Fatalf("slow claimed %q, want %q", got, want)
	}
	var theirs []keylock.Claim
	eventually(t, 10*time.Second, "slow's lease to expire", func() bool {
		got, err := fast.Claim(t.Context(), 10)
		if err != nil {
			t.Fatal(err)
		}
		theirs = append(theirs, got...)
		return len(theirs) == 2
	})
	type lease struct {
		by    *string
		until *time.Time
	}
	leases := func() map[int64]lease {
		out := map[int64]lease{}
		rows, err := db.Pool.Query(t.Context(), `SELECT head_id, leased_by, leased_until FROM deferred_key`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var h int64
			var l lease
			if err := rows.Scan(&h, &l.by, &l.until); err != nil {
				t.Fatal(err)
			}
			out[h] = l
		}
		return out
	}
	before := leases()
	for h, l := range before {
		if l.by == nil || *l.by != "fast" {
			t.Fatalf("head %d not leased by fast before slow finalizes: %v", h, l.by)
		}
	}
	// Slow finalizes both ways: as published (its publish went out) and as
	// a retriable failure. Neither may touch fast's leases.
	if err := slow.Finalize(t.Context(), mine, keylock.Outcome{Retry: mine}); err != nil {
		t.Fatal(err)
	}
	if err := slow.Finalize(t.Context(), mine, keylock.Outcome{}); err != nil {
		t.Fatal(err)
	}
	after := leases()
	for h, l := range before {
		a, ok := after[h]
		if !ok || a.by == nil || *a.by != "fast" || a.until == nil || !a.until.Equal(*l.until) {
			t.Errorf("head %d: fast's lease changed by slow's finalize: before %v %v, after %v %v", h, *l.by, *l.until, a.by, a.until)
		}
	}
	// And nobody else can claim while fast holds them.
	if got, err := newLocker(t, db.Pool, "third", time.Hour, 1).Claim(t.Context(), 10); err != nil || len(got) > 0 {
		t.Errorf("third holder claimed %q (err %v) while fast holds the keys", claimSummary(t, got), err)
	}
}
