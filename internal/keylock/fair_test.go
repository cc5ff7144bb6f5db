package keylock_test

import (
	"cmp"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// backlog is a number of due (or future) messages of one target, one key
// each, due at the given offset from now.
type backlog struct {
	target string
	n      int
	due    time.Duration // from now; negative: due already
}

func insertBacklogs(t *testing.T, q querier, bs []backlog) {
	t.Helper()
	for _, b := range bs {
		mustExec(t, q, `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
			SELECT $1 || '-' || $3::interval || '-' || i, $1, now() + $3::interval + i * interval '1 microsecond'
			FROM generate_series(1, $2::int) AS i`, b.target, b.n, b.due)
	}
}

func takenByTarget(claims []keylock.Claim) map[string]int {
	got := map[string]int{}
	for _, c := range claims {
		got[c.Messages[0].Target]++
	}
	return got
}

// TestClaimSharesRoundBetweenTargets: one claim takes its heads turn by turn
// from the targets with due heads (each target's earliest, then each one's
// second, ...), so that a target's backlog, however old, leaves the others
// their share; what a target does not use goes to the others.
func TestClaimSharesRoundBetweenTargets(t *testing.T) {
	tests := []struct {
		name     string
		backlogs []backlog
		paused   []string
		maxKeys  int
		want     map[string]int
	}{
		{"one target takes the whole round", []backlog{{"orders", 1000, -time.Hour}}, nil, 10,
			map[string]int{"orders": 10}},
		{"an older backlog leaves a newer target its heads", []backlog{{"orders", 1000, -time.Hour}, {"alerts", 3, -time.Second}}, nil, 10,
			map[string]int{"orders": 7, "alerts": 3}},
		{"two backlogs share, a small target first", []backlog{{"a", 1000, -time.Hour}, {"b", 1000, -time.Minute}, {"c", 2, -time.Second}}, nil, 10,
			map[string]int{"a": 4, "b": 4, "c": 2}},
		{"an odd round gives the extra turn to the earlier head", []backlog{{"a", 1000, -time.Minute}, {"b", 1000, -time.Hour}}, nil, 5,
			map[string]int{"a": 2, "b": 3}},
		{"heads not yet due take no share", []backlog{{"orders", 1000, -time.Hour}, {"later", 50, time.Hour}}, nil, 10,
			map[string]int{"orders": 10}},
		{"a paused target takes no share", []backlog{{"orders", 1000, -time.Hour}, {"alerts", 5, -time.Second}}, []string{"orders"}, 10,
			map[string]int{"alerts": 5}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			insertBacklogs(t, db.Pool, tt.backlogs)
			for _, p := range tt.paused {
				mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, paused) VALUES ($1, true)`, p)
			}
			mustExec(t, db.Pool, `ANALYZE deferred_key`)
			l := newLocker(t, db.Pool, "fair", time.Minute, 10)
			claims, err := l.Claim(t.Context(), tt.maxKeys)
			if err != nil {
				t.Fatal(err)
			}
			if got := takenByTarget(claims); !maps.Equal(got, tt.want) {
				t.Errorf("claim took %v, want %v", got, tt.want)
			}
			// Within a target, in due order: the earliest heads.
			for target, n := range tt.want {
				var earliest []string
				rows, err := db.Pool.Query(t.Context(), `SELECT business_key FROM deferred_key
					WHERE head_target = $1 ORDER BY next_run_at LIMIT $2`, target, n)
				if err != nil {
					t.Fatal(err)
				}
				for rows.Next() {
					var k string
					if err := rows.Scan(&k); err != nil {
						t.Fatal(err)
					}
					earliest = append(earliest, k)
				}
				if err := rows.Err(); err != nil {
					t.Fatal(err)
				}
				var got []string
				for _, c := range claims {
					if c.Messages[0].Target == target {
						got = append(got, c.BusinessKey)
					}
				}
				slices.Sort(got)
				slices.Sort(earliest)
				if !slices.Equal(got, earliest) {
					t.Errorf("target %s: claimed %v, want its earliest heads %v", target, got, earliest)
				}
			}
			assertHeadsMatch(t, db.Pool)
		})
	}
}

// TestClaimSharesRoundByWeight: a target's weight (target_control.weight;
// 1 without a row) is how many of its heads a turn takes, and multiplies
// what the claim reads of it: with a share of 2, a target of weight 3
// still reads the 6 heads its turns take. A weighted target alone takes
// the whole round, and a target whose heads run out leaves the rest to
// the others, as without weights.
func TestClaimSharesRoundByWeight(t *testing.T) {
	tests := []struct {
		name     string
		backlogs []backlog
		weights  map[string]int
		maxKeys  int
		share    int
		want     map[string]int
	}{
		{"weight 3 takes three heads per turn", []backlog{{"orders", 100, -time.Hour}, {"alerts", 100, -time.Second}},
			map[string]int{"orders": 3}, 8, 8, map[string]int{"orders": 6, "alerts": 2}},
		{"the share is read per unit of weight", []backlog{{"orders", 100, -time.Hour}, {"alerts", 100, -time.Second}},
			map[string]int{"orders": 3}, 8, 2, map[string]int{"orders": 6, "alerts": 2}},
		{"the weight set on the newer backlog", []backlog{{"orders", 100, -time.Hour}, {"alerts", 100, -time.Second}},
			map[string]int{"alerts": 3}, 8, 8, map[string]int{"orders": 2, "alerts": 6}},
		{"two weights and a default", []backlog{{"a", 100, -time.Hour}, {"b", 100, -time.Minute}, {"c", 100, -time.Second}},
			map[string]int{"a": 2, "b": 2}, 10, 10, map[string]int{"a": 4, "b": 4, "c": 2}},
		{"a weighted target alone takes the whole round", []backlog{{"orders", 100, -time.Hour}},
			map[string]int{"orders": 3}, 10, 10, map[string]int{"orders": 10}},
		{"a small target keeps its first turn", []backlog{{"orders", 100, -time.Hour}, {"alerts", 2, -time.Second}},
			map[string]int{"orders": 5}, 10, 10, map[string]int{"orders": 9, "alerts": 1}},
		{"what a weighted target lacks goes to the others", []backlog{{"orders", 100, -time.Hour}, {"alerts", 2, -time.Second}},
			map[string]int{"alerts": 100}, 10, 10, map[string]int{"orders": 8, "alerts": 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			insertBacklogs(t, db.Pool, tt.backlogs)
			for target, w := range tt.weights {
				mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, weight) VALUES ($1, $2)`, target, w)
			}
			mustExec(t, db.Pool, `ANALYZE deferred_key`)
			rows, err := db.Pool.Query(t.Context(), statementSQL(t, "dispatch_claim.sql"),
				tt.maxKeys, time.Minute, 1, "weighted", int64(keylock.DefaultMaxBytes), tt.share)
			if err != nil {
				t.Fatal(err)
			}
			col := slices.IndexFunc(rows.FieldDescriptions(), func(f pgconn.FieldDescription) bool { return f.Name == "target_topic" })
			got := map[string]int{}
			for rows.Next() {
				vals, err := rows.Values()
				if err != nil {
					t.Fatal(err)
				}
				target, ok := vals[col].(string)
				if !ok {
					t.Fatalf("a claimed key came back without a message: %v", vals)
				}
				got[target]++
			}
			if err := rows.Err(); err != nil {
				t.Fatal(err)
			}
			if !maps.Equal(got, tt.want) {
				t.Errorf("claim took %v, want %v", got, tt.want)
			}
		})
	}
}

// TestLockerRoundsByWeight: a dispatch loop's rounds, as Claim runs them,
// keep to the weights round after round (the share each reads comes from
// the round before: nextShare), and each claim carries its target's weight.
func TestLockerRoundsByWeight(t *testing.T) {
	db := pgtest.NewDB(t)
	insertBacklogs(t, db.Pool, []backlog{{"orders", 200, -time.Hour}, {"alerts", 200, -time.Second}})
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, weight) VALUES ('orders', 3)`)
	l := newLocker(t, db.Pool, "weighted", time.Minute, 10)
	for round := 1; round <= 4; round++ {
		claims, err := l.Claim(t.Context(), 8)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := takenByTarget(claims), map[string]int{"orders": 6, "alerts": 2}; !maps.Equal(got, want) {
			t.Errorf("round %d took %v, want %v", round, got, want)
		}
		for _, c := range claims {
			if want := map[string]int{"orders": 3, "alerts": 1}[c.Messages[0].Target]; c.Weight != want {
				t.Errorf("round %d: a claim of %s has weight %d, want %d", round, c.Messages[0].Target, c.Weight, want)
			}
		}
		if err := l.Finalize(t.Context(), claims, keylock.Outcome{Published: messageIDs(claims)}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestClaimDoesNotWalkAnotherTargetsBacklog: the claim finds a target's due
// heads without reading through another target's older backlog or its own
// heads not yet due, whatever share it is given and whether or not the
// statistics know the quiet target yet: it reads the targets' first index
// entries and the heads it locks, nothing in front of them. (Written with
// a row comparison as its due-time bound, the per-target read once walked
// all 200,000 far-future heads per claim; deferred_key_due, which holds
// the same heads in due order, must not be the one it reads either.)
func TestClaimDoesNotWalkAnotherTargetsBacklog(t *testing.T) {
	const big = 50000
	tests := []struct {
		name     string
		analyzed []backlog // inserted, then ANALYZE
		later    []backlog // inserted after
		share    int
	}{
		{"older due backlog of another target", []backlog{{"orders", big, -time.Hour}, {"alerts", 5, -time.Second}}, nil, 10},
		{"older due backlog of another target, share 1", []backlog{{"orders", big, -time.Hour}, {"alerts", 5, -time.Second}}, nil, 1},
		{"statistics know only the backlog's target", []backlog{{"orders", big, -time.Hour}}, []backlog{{"alerts", 5, -time.Second}}, 10},
		{"far-future heads of the same targets", []backlog{{"orders", big, 7 * 24 * time.Hour}, {"alerts", big, 7 * 24 * time.Hour}},
			[]backlog{{"alerts", 5, -time.Second}}, 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			insertBacklogs(t, db.Pool, tt.analyzed)
			mustExec(t, db.Pool, `ANALYZE deferred_key`)
			insertBacklogs(t, db.Pool, tt.later)
			read, scans := planRows(t, db.Pool, nil, statementSQL(t, "dispatch_claim.sql"),
				10, time.Minute, 10, "me", int64(keylock.DefaultMaxBytes), tt.share)
			// Two targets' first entries and the end of the loose scan, then
			// at most share heads of each.
			if limit := int64(3 + 2*tt.share); read > limit {
				t.Errorf("read %d rows of deferred_key, want at most %d: %q", read, limit, scans)
			}
			t.Logf("%q", scans)
			// The express claim's count, light up to 32 heads: the
			// targets' first entries and at most 33 heads of each.
			read, scans = planRows(t, db.Pool, nil, statementSQL(t, "dispatch_express_targets.sql"), 32)
			if limit := int64(3 + 2*33); read > limit {
				t.Errorf("express targets read %d rows of deferred_key, want at most %d: %q", read, limit, scans)
			}
			t.Logf("express: %q", scans)
			// And they find them.
			express, err := newLocker(t, db.Pool, "express", time.Minute, 10).ClaimExpress(t.Context(), 10, 10, 32)
			if err != nil {
				t.Fatal(err)
			}
			want := map[string]int{}
			if tt.analyzed[0].due < 0 { // the other target's backlog is due
				want["alerts"] = 5
			}
			if got := takenByTarget(express); !maps.Equal(got, want) {
				t.Errorf("express claim took %v, want %v", got, want)
			}
			mustExec(t, db.Pool, `UPDATE deferred_key SET leased_until = NULL, leased_by = NULL WHERE leased_by = 'express'`)
			claims, err := newLocker(t, db.Pool, "fair", time.Minute, 10).Claim(t.Context(), 10)
			if err != nil {
				t.Fatal(err)
			}
			if got := takenByTarget(claims)["alerts"]; got != 5 {
				t.Errorf("claim took %d heads of alerts, want its 5 due ones (took %v)", got, takenByTarget(claims))
			}
		})
	}
}

// TestClaimRoundsDrainAQuietTargetFirst: rounds of one locker, as a
// dispatch loop runs them, hand a quiet target's heads out in the first
// round however long another target's backlog is, and then give the
// backlog whole rounds again. The share a round reads per target comes
// from the round before (keylock's nextShare), so the round after the
// quiet target's last heads still reads the backlog's share of the round
// before; the next one reads the whole round. A round that read the whole
// round leaves the next, larger one (dispatch's claimSize grows its rounds
// again after a hot key) the whole of it too.
func TestClaimRoundsDrainAQuietTargetFirst(t *testing.T) {
	db := pgtest.NewDB(t)
	insertBacklogs(t, db.Pool, []backlog{{"orders", 2000, -time.Hour}})
	l := newLocker(t, db.Pool, "fair", time.Minute, 10)
	rounds := []struct {
		quiet int // alerts' heads made due before the round
		want  map[string]int
		keys  int // the round's size; 0: 100
	}{
		{0, map[string]int{"orders": 100}, 0},
		{3, map[string]int{"orders": 97, "alerts": 3}, 0},
		{0, map[string]int{"orders": 97}, 0},
		{0, map[string]int{"orders": 100}, 0},
		{150, map[string]int{"orders": 50, "alerts": 50}, 0},
		{0, map[string]int{"orders": 50, "alerts": 50}, 0},
		{0, map[string]int{"orders": 50, "alerts": 50}, 0},
		{0, map[string]int{"orders": 50}, 0},
		{0, map[string]int{"orders": 100}, 0},
		{0, map[string]int{"orders": 50}, 50},
		{0, map[string]int{"orders": 100}, 0},
	}
	for i, r := range rounds {
		if r.quiet > 0 {
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
				SELECT 'alerts-' || $1::int || '-' || i, 'alerts', now() FROM generate_series(1, $2::int) AS i`, i, r.quiet)
		}
		claims, err := l.Claim(t.Context(), cmp.Or(r.keys, 100))
		if err != nil {
			t.Fatal(err)
		}
		if got := takenByTarget(claims); !maps.Equal(got, r.want) {
			t.Errorf("round %d took %v, want %v", i+1, got, r.want)
		}
		// Published: the next round finds the next heads.
		if err := l.Finalize(t.Context(), claims, keylock.Outcome{Published: messageIDs(claims)}); err != nil {
			t.Fatal(err)
		}
	}
}

func messageIDs(claims []keylock.Claim) []int64 {
	var ids []int64
	for _, c := range claims {
		for _, m := range c.Messages {
			ids = append(ids, m.ID)
		}
	}
	return ids
}

// TestNextShare: the share of the next claim is what the targets that still
// had heads can use.
func TestNextShare(t *testing.T) {
	claimsOf := func(byTarget, weights map[string]int) []keylock.Claim {
		var cs []keylock.Claim
		for _, target := range slices.Sorted(maps.Keys(byTarget)) {
			for range byTarget[target] {
				cs = append(cs, keylock.Claim{Messages: []keylock.Message{{Target: target}}, Weight: weights[target]})
			}
		}
		return cs
	}
	tests := []struct {
		name    string
		taken   map[string]int
		weights map[string]int // none: 1
		empty   int
		maxKeys int
		share   int
		want    int
	}{
		{"nothing due: the whole round", nil, nil, 0, 500, 500, 500},
		{"one target, full round", map[string]int{"a": 500}, nil, 0, 500, 500, 500},
		{"one target, few heads: no one held back", map[string]int{"a": 20}, nil, 0, 500, 500, 500},
		{"a backlog beside a quiet target", map[string]int{"a": 499, "b": 1}, nil, 0, 500, 500, 499},
		{"two backlogs and a quiet target", map[string]int{"a": 250, "b": 249, "c": 1}, nil, 0, 500, 500, 250},
		{"a backlog at its share in a round that was not full", map[string]int{"a": 250, "c": 3}, nil, 0, 500, 250, 497},
		{"keys that came back empty count against the round", map[string]int{"a": 400}, nil, 100, 500, 500, 400},
		{"never below one", map[string]int{"a": 1, "b": 1, "c": 1}, nil, 0, 2, 1, 1},
		// A turn takes a target's weight in heads: the share is per unit of
		// weight, so the claim reads 375 and 125, what the turns take.
		{"backlogs of weights 3 and 1", map[string]int{"a": 375, "b": 125}, map[string]int{"a": 3}, 0, 500, 500, 125},
		{"a weighted backlog beside a quiet target", map[string]int{"a": 497, "c": 3}, map[string]int{"a": 3}, 0, 500, 500, 166},
		{"a weighted backlog at its share in a round that was not full", map[string]int{"a": 200, "c": 3}, map[string]int{"a": 2}, 0, 500, 100, 249},
		{"a weighted quiet target", map[string]int{"a": 498, "c": 2}, map[string]int{"c": 5}, 0, 500, 500, 498},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := keylock.NextShare(claimsOf(tt.taken, tt.weights), tt.empty, tt.maxKeys, tt.share); got != tt.want {
				t.Errorf("NextShare(%v, %d, %d, %d) = %d, want %d", tt.taken, tt.empty, tt.maxKeys, tt.share, got, tt.want)
			}
		})
	}
}
