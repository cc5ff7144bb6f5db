package keylock_test

import (
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// TestClaimExpressTakesLightTargetsOnly: while some target has a backlog
// (more than light due heads, leased or not), the express claim leases the
// free due heads of the targets with at most light of them, earliest due
// first over all of them, and leaves the backlog to the main claim; with no
// backlog it takes nothing. Heads not yet due and paused targets are not
// counted or taken; leased heads count but are not taken.
func TestClaimExpressTakesLightTargetsOnly(t *testing.T) {
	big := backlog{"big", 500, -time.Hour} // a backlog, without which nothing is taken
	tests := []struct {
		name     string
		backlogs []backlog
		paused   []string
		leased   int // of target "busy", its earliest due heads leased to another before the claim
		maxKeys  int
		light    int
		want     map[string]int
	}{
		{"a backlog is left, a light target taken", []backlog{{"orders", 500, -time.Hour}, {"alerts", 3, -time.Second}}, nil, 0, 100, 32,
			map[string]int{"alerts": 3}},
		{"at the bound a target is light", []backlog{big, {"orders", 32, -time.Hour}, {"alerts", 3, -time.Second}}, nil, 0, 100, 32,
			map[string]int{"orders": 32, "alerts": 3}},
		{"one over the bound it is not", []backlog{{"orders", 33, -time.Hour}, {"alerts", 3, -time.Second}}, nil, 0, 100, 32,
			map[string]int{"alerts": 3}},
		{"earliest due first within the round", []backlog{big, {"old", 5, -time.Hour}, {"new", 5, -time.Second}}, nil, 0, 7, 32,
			map[string]int{"old": 5, "new": 2}},
		{"heads not yet due neither count nor go", []backlog{big, {"alerts", 2, -time.Second}, {"alerts", 500, time.Hour}}, nil, 0, 100, 32,
			map[string]int{"alerts": 2}},
		{"a paused target is not taken", []backlog{big, {"alerts", 2, -time.Second}, {"held", 2, -time.Second}}, []string{"held"}, 0, 100, 32,
			map[string]int{"alerts": 2}},
		{"a paused backlog is no backlog", []backlog{{"held", 500, -time.Hour}, {"alerts", 2, -time.Second}}, []string{"held"}, 0, 100, 32,
			map[string]int{}},
		{"leased heads count", []backlog{big, {"busy", 40, -time.Hour}}, nil, 30, 100, 32,
			map[string]int{}},
		{"a light target's free heads go", []backlog{big, {"busy", 10, -time.Hour}}, nil, 5, 100, 32,
			map[string]int{"busy": 5}},
		{"a backlog all in flight is still one", []backlog{{"busy", 40, -time.Hour}, {"alerts", 2, -time.Second}}, nil, 40, 100, 32,
			map[string]int{"alerts": 2}},
		{"without a backlog nothing is taken", []backlog{{"alerts", 3, -time.Second}, {"orders", 32, -time.Hour}}, nil, 0, 100, 32,
			map[string]int{}},
		{"only backlogs: nothing is taken", []backlog{{"orders", 100, -time.Hour}}, nil, 0, 100, 32,
			map[string]int{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			insertBacklogs(t, db.Pool, tt.backlogs)
			for _, p := range tt.paused {
				mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, paused) VALUES ($1, true)`, p)
			}
			if tt.leased > 0 {
				mustExec(t, db.Pool, `UPDATE deferred_key SET leased_until = now() + interval '1 minute', leased_by = 'main'
					WHERE business_key IN (SELECT business_key FROM deferred_key WHERE head_target = 'busy'
					                       ORDER BY next_run_at LIMIT $1)`, tt.leased)
			}
			before := headSummary(t, db.Pool)
			l := newLocker(t, db.Pool, "express", time.Minute, 10)
			claims, err := l.ClaimExpress(t.Context(), tt.maxKeys, 10, tt.light)
			if err != nil {
				t.Fatal(err)
			}
			if got := takenByTarget(claims); !maps.Equal(got, tt.want) {
				t.Errorf("express claim took %v, want %v", got, tt.want)
			}
			// Earliest due first: no head left unleased that is due before
			// one taken, among the light targets.
			var latest time.Time
			for _, c := range claims {
				if c.Messages[0].NextRunAt.After(latest) {
					latest = c.Messages[0].NextRunAt
				}
			}
			var earlier int
			if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_key
				WHERE head_target = ANY ($1) AND leased_until IS NULL AND next_run_at < $2`,
				slices.Collect(maps.Keys(tt.want)), latest).Scan(&earlier); err != nil {
				t.Fatal(err)
			}
			mustEqual(t, "light heads left that were due before one taken", earlier, 0)
			// What it took is leased to it, and nothing else changed.
			var leased int
			if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_key WHERE leased_by = 'express'`).Scan(&leased); err != nil {
				t.Fatal(err)
			}
			mustEqual(t, "heads leased to the express claim", leased, len(claims))
			if len(claims) == 0 && !slices.Equal(before, headSummary(t, db.Pool)) {
				t.Errorf("a claim that took nothing changed the heads")
			}
			assertHeadsMatch(t, db.Pool)
		})
	}
}

// TestClaimExpressReadsRunsAsTheMainClaim: a light target's key with
// several due messages, beside another target's backlog, comes back as the
// main claim returns it, its due run
// in order, at most perKey of it, and the rest is claimed after the
// finalize; finalized, the express claim's keys are free for the next.
func TestClaimExpressReadsRunsAsTheMainClaim(t *testing.T) {
	db := pgtest.NewDB(t)
	insertBacklogs(t, db.Pool, []backlog{{"orders", 100, -time.Hour}})
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
		SELECT 'k', 'alerts', now() - interval '1 second' FROM generate_series(1, 5)`)
	l := newLocker(t, db.Pool, "express", time.Minute, 10)
	claims, err := l.ClaimExpress(t.Context(), 10, 3, 32)
	if err != nil {
		t.Fatal(err)
	}
	if len(claims) != 1 || len(claims[0].Messages) != 3 {
		t.Fatalf("express claim of one key with 5 due messages, 3 per key: %v", claimSummary(t, claims))
	}
	var ids []int64
	for i, m := range claims[0].Messages {
		if i > 0 && m.Seq <= claims[0].Messages[i-1].Seq {
			t.Fatalf("run out of order: %v", claimSummary(t, claims))
		}
		ids = append(ids, m.ID)
	}
	// While it is leased, neither claim takes the key again.
	again, err := newLocker(t, db.Pool, "main", time.Minute, 10).Claim(t.Context(), 200)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "keys of alerts the main claim took while the express claim held one", takenByTarget(again)["alerts"], 0)
	if err := newLocker(t, db.Pool, "main", time.Minute, 10).Finalize(t.Context(), again, keylock.Outcome{}); err != nil {
		t.Fatal(err)
	}
	if err := l.Finalize(t.Context(), claims, keylock.Outcome{Published: ids}); err != nil {
		t.Fatal(err)
	}
	rest, err := l.ClaimExpress(t.Context(), 10, 10, 32)
	if err != nil {
		t.Fatal(err)
	}
	if len(rest) != 1 || len(rest[0].Messages) != 2 || rest[0].Messages[0].Seq <= claims[0].Messages[2].Seq {
		t.Fatalf("after the finalize, the key's last two messages in order: %v", claimSummary(t, rest))
	}
	assertHeadsMatch(t, db.Pool)
}
