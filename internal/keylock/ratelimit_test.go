package keylock_test

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

func TestLimitedTargets(t *testing.T) {
	db := pgtest.NewDB(t)
	l := newLocker(t, db.Pool, "me", time.Minute, 10)
	got, err := l.LimitedTargets(t.Context())
	if err != nil || len(got) != 0 {
		t.Fatalf("LimitedTargets with no target_control rows = %q, %v; want none", got, err)
	}
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, paused, rate_limit) VALUES
		('b.limited', false, 5), ('a.limited', false, 0.5), ('paused.limited', true, 5), ('paused', true, NULL), ('free', false, NULL)`)
	got, err = l.LimitedTargets(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"a.limited", "b.limited"}; !slices.Equal(got, want) {
		t.Errorf("LimitedTargets = %q, want %q", got, want)
	}
}

// bucket is a target_control row's token bucket.
type bucket struct {
	Tokens   float64
	Refilled *time.Time
}

func (b bucket) equal(o bucket) bool {
	if b.Tokens != o.Tokens || (b.Refilled == nil) != (o.Refilled == nil) {
		return false
	}
	return b.Refilled == nil || b.Refilled.Equal(*o.Refilled)
}

func bucketOf(t testing.TB, q querier, target string) bucket {
	t.Helper()
	var b bucket
	if err := q.QueryRow(t.Context(), `SELECT tokens, refilled_at FROM target_control WHERE target_topic = $1`, target).
		Scan(&b.Tokens, &b.Refilled); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestTakeTokens checks one take at a time: what is granted, what is left in
// the bucket, and when the next token comes.
func TestTakeTokens(t *testing.T) {
	const ins = `INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES `
	tests := []struct {
		name  string
		setup []string
		want  int
		// grant is the expected Grant for target "lim" (nil: no row).
		grant *keylock.Grant
		// left is the bucket's tokens after the take, give or take what
		// 20ms refill (0.2 at 10/s).
		left float64
	}{
		{
			name:  "no due work: nothing taken, bucket untouched",
			setup: []string{ins + `('k', 'lim', now() + interval '1 hour')`},
			want:  5,
		},
		{
			name:  "a fresh bucket starts full (one second's worth)",
			setup: []string{ins + `('k', 'lim', now())`},
			want:  3,
			grant: &keylock.Grant{Target: "lim", Taken: 3},
			left:  7,
		},
		{
			name:  "a take never exceeds the bucket, and says when the next token comes",
			setup: []string{ins + `('k', 'lim', now())`, `UPDATE target_control SET tokens = 2.5, refilled_at = clock_timestamp()`},
			want:  100,
			// 0.5 left; one token needs 0.5 more at 10/s: 50ms.
			grant: &keylock.Grant{Target: "lim", Taken: 2, NextToken: 50 * time.Millisecond},
			left:  0.5,
		},
		{
			name:  "refill since refilled_at, capped at one second's worth",
			setup: []string{ins + `('k', 'lim', now())`, `UPDATE target_control SET tokens = 0, refilled_at = clock_timestamp() - interval '1 hour'`},
			want:  100,
			grant: &keylock.Grant{Target: "lim", Taken: 10, NextToken: 100 * time.Millisecond},
			left:  0,
		},
		{
			name: "less than a token: nothing taken, bucket not written",
			setup: []string{ins + `('k', 'lim', now())`,
				`UPDATE target_control SET tokens = 0.2, refilled_at = clock_timestamp()`},
			want:  5,
			grant: &keylock.Grant{Target: "lim", Taken: 0, NextToken: 80 * time.Millisecond},
			left:  0.2,
		},
		{
			// 1e12 seconds: beyond a Duration. The longest Duration, not an
			// overflow into a negative wait that would spin the loop.
			name: "a bucket refilling at 1e-12/s, empty",
			setup: []string{ins + `('k', 'lim', now())`,
				`UPDATE target_control SET rate_limit = 1e-12, tokens = 0, refilled_at = clock_timestamp()`},
			want:  5,
			grant: &keylock.Grant{Target: "lim", Taken: 0, NextToken: time.Duration(math.MaxInt64)},
			left:  0,
		},
		{
			name:  "a bucket refilling at 1e-12/s, fresh: its one token taken, the next one far away",
			setup: []string{ins + `('k', 'lim', now())`, `UPDATE target_control SET rate_limit = 1e-12`},
			want:  5,
			grant: &keylock.Grant{Target: "lim", Taken: 1, NextToken: time.Duration(math.MaxInt64)},
			left:  0,
		},
		{
			name:  "paused: no row",
			setup: []string{ins + `('k', 'lim', now())`, `UPDATE target_control SET paused = true`},
			want:  5,
		},
		{
			name:  "a leased head is not due work",
			setup: []string{ins + `('k', 'lim', now())`, `UPDATE deferred_key SET leased_by = 'x', leased_until = now() + interval '1 hour'`},
			want:  5,
		},
		{
			name:  "a key held by a parked message is not due work",
			setup: []string{ins + `('k', 'lim', now())`, `UPDATE deferred_message SET state = 'parked'`},
			want:  5,
		},
	}
	db := pgtest.NewDB(t)
	l := newLocker(t, db.Pool, "me", time.Minute, 10)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reset(t, db.Pool)
			mustExec(t, db.Pool, "DELETE FROM target_control")
			mustExec(t, db.Pool, "INSERT INTO target_control (target_topic, rate_limit) VALUES ('lim', 10), ('other', 10)")
			// The bucket refills at 10/s from the setup on: what it holds at
			// the take depends on the time that passed since, bounded by
			// this (under -race on two cores it was once 30 ms).
			start := time.Now()
			for _, s := range tt.setup {
				mustExec(t, db.Pool, s)
			}
			before := bucketOf(t, db.Pool, "lim")
			grants, err := l.TakeTokens(t.Context(), []string{"lim", "other", "absent"}, tt.want)
			if err != nil {
				t.Fatal(err)
			}
			passed := time.Since(start)
			after := bucketOf(t, db.Pool, "lim")
			if tt.grant == nil {
				if len(grants) != 0 {
					t.Fatalf("grants = %+v, want none", grants)
				}
				if !after.equal(before) {
					t.Errorf("bucket changed from %+v to %+v", before, after)
				}
				return
			}
			if len(grants) != 1 {
				t.Fatalf("grants = %+v, want one for lim", grants)
			}
			g := grants[0]
			if g.Target != tt.grant.Target || g.Taken != tt.grant.Taken ||
				g.NextToken > tt.grant.NextToken || g.NextToken < tt.grant.NextToken-passed {
				t.Errorf("grant = %+v, want %+v (next token sooner by at most the %v that passed)", g, *tt.grant, passed)
			}
			if after.Tokens < tt.left || after.Tokens > tt.left+10*passed.Seconds() {
				t.Errorf("tokens left = %v, want %v (plus at most 10/s for the %v that passed)", after.Tokens, tt.left, passed)
			}
			if g.Taken == 0 && !after.equal(before) {
				t.Errorf("a take of nothing wrote the bucket: %+v -> %+v", before, after)
			}
			if g.Taken > 0 && (after.Refilled == nil || (before.Refilled != nil && !after.Refilled.After(*before.Refilled))) {
				t.Errorf("refilled_at %v not moved forward from %v", after.Refilled, before.Refilled)
			}
		})
	}
}

func TestReturnTokens(t *testing.T) {
	db := pgtest.NewDB(t)
	l := newLocker(t, db.Pool, "me", time.Minute, 10)
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, rate_limit, tokens, refilled_at) VALUES
		('a', 10, 2, now()), ('b', 0.5, 0, now()), ('c', NULL, 0, NULL)`)
	if err := l.ReturnTokens(t.Context(), map[string]int{"a": 3, "b": 5, "c": 4, "absent": 1, "zero": 0}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		target string
		want   float64
	}{
		{"a", 5}, // 2 + 3
		{"b", 1}, // capped at one token: a rate below 1/s still bursts one
		{"c", 0}, // not limited: left alone
	} {
		if got := bucketOf(t, db.Pool, c.target).Tokens; got != c.want {
			t.Errorf("tokens of %s = %v, want %v", c.target, got, c.want)
		}
	}
	if err := l.ReturnTokens(t.Context(), nil); err != nil {
		t.Errorf("ReturnTokens(nil) = %v", err)
	}
}

// TestTakeTokensConcurrent: many dispatchers taking from one bucket at once
// never get more than the bucket held plus what it refilled meanwhile.
func TestTakeTokensConcurrent(t *testing.T) {
	db := pgtest.NewDB(t)
	pool := bigPool(t, db.URL, 10)
	const rate = 40
	mustExec(t, pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES ('k', 'lim', now())`)
	mustExec(t, pool, `INSERT INTO target_control (target_topic, rate_limit) VALUES ('lim', $1)`, rate)
	start := dbNow(t, pool)
	var taken atomic.Int64
	var wg sync.WaitGroup
	for w := range 8 {
		l := newLocker(t, pool, fmt.Sprintf("w%d", w), time.Minute, 1)
		wg.Go(func() {
			for range 25 {
				grants, err := l.TakeTokens(t.Context(), []string{"lim"}, 3)
				if err != nil {
					t.Error(err)
					return
				}
				for _, g := range grants {
					taken.Add(int64(g.Taken))
				}
			}
		})
	}
	wg.Wait()
	elapsed := dbNow(t, pool).Sub(start).Seconds()
	// The bucket starts full (rate tokens) and refills at rate per second.
	if limit := rate + rate*elapsed; float64(taken.Load()) > limit {
		t.Errorf("took %d tokens in %.2fs, at most %.1f allowed", taken.Load(), elapsed, limit)
	}
	if taken.Load() < rate {
		t.Errorf("took %d tokens, want at least the full bucket (%d)", taken.Load(), rate)
	}
	t.Logf("took %d tokens in %.2fs", taken.Load(), elapsed)
}

// TestClaimTarget: the main claim leaves rate-limited targets alone;
// ClaimTarget claims only that target's heads, one message each, earliest
// first, and nothing of a paused target.
func TestClaimTarget(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('a', 1, 'lim', now() - interval '3 minutes'), ('a', 2, 'lim', now() - interval '3 minutes'),
		('b', 3, 'lim', now() - interval '2 minutes'), ('c', 4, 'lim', now() - interval '1 minute'),
		(NULL, 5, 'lim', now() - interval '4 minutes'), ('d', 6, 'free', now())`)
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, rate_limit) VALUES ('lim', 100)`)
	l := newLocker(t, db.Pool, "me", time.Hour, 10)

	main, err := l.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimSummary(t, main), []string{"d:6"}; !slices.Equal(got, want) {
		t.Errorf("main claim = %q, want %q (the limited target skipped)", got, want)
	}
	limited, err := l.ClaimTarget(t.Context(), 3, "lim", keylock.DefaultMaxBytes)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimSummary(t, limited), []string{"-:5", "a:1", "b:3"}; !slices.Equal(got, want) {
		t.Errorf("ClaimTarget(3) = %q, want %q (earliest heads, one message each)", got, want)
	}

	mustExec(t, db.Pool, `UPDATE target_control SET paused = true`)
	if got, err := l.ClaimTarget(t.Context(), 10, "lim", keylock.DefaultMaxBytes); err != nil || len(got) > 0 {
		t.Errorf("ClaimTarget of a paused target = %q, %v; want none", claimSummary(t, got), err)
	}
	mustExec(t, db.Pool, `UPDATE target_control SET paused = false, rate_limit = NULL`)
	rest, err := l.Claim(t.Context(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimSummary(t, rest), []string{"c:4"}; !slices.Equal(got, want) {
		t.Errorf("main claim once the limit is removed = %q, want %q", got, want)
	}
}

// TestTakeTokensQuietWhenEmpty: a round that finds less than a token writes
// nothing, so it does not fire target_control's notification, which would
// wake every dispatcher for nothing (and they, in turn, each other).
func TestTakeTokensQuietWhenEmpty(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES ('k', 'lim', now())`)
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, rate_limit, tokens, refilled_at) VALUES ('lim', 1, 0, clock_timestamp())`)
	conn, err := db.Pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	mustExec(t, conn, "LISTEN deferred_key_due")
	l := newLocker(t, db.Pool, "me", time.Minute, 10)
	for range 3 {
		grants, err := l.TakeTokens(t.Context(), []string{"lim"}, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(grants) != 1 || grants[0].Taken != 0 || grants[0].NextToken <= 0 || grants[0].NextToken > time.Second {
			t.Fatalf("grants = %+v, want nothing taken and the next token within 1s", grants)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if n, err := conn.Conn().WaitForNotification(ctx); err == nil {
		t.Errorf("taking from an empty bucket notified %q", n.Channel)
	}
}
