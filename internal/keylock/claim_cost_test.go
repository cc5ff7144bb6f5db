package keylock_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/pgtest"
)

// The main claim's estimated cost does not grow with a target's backlog.
// Its read stops at a target's share times its weight, a LIMIT that names a
// column and so cannot be estimated: written as the only LIMIT, the planner
// took a tenth of the target's due heads for it, and with 200,000 due and
// analyzed costed the claim at 274,000, above jit_above_cost (100,000 by
// default). Every claim then spent about 110 ms compiling itself by JIT
// for a 15 ms read, and a drain ran at a third of its speed
// (docs/benchmarks.md, "The claim compiled by JIT"). The claim now states
// $1 as the inner LIMIT the planner estimates by. Here, with weight 1 (no
// target_control row) and weight 3, the custom plan's cost with 40,000 due
// heads must stay within twice its cost with 1,000 (with the one LIMIT it
// was 35 times), and below jit_above_cost; and where the server can
// compile by JIT, running the claim with jit on must not.
func TestClaimCostFlatInBacklog(t *testing.T) {
	const small, large = 1_000, 40_000
	for _, weight := range []int{1, 3} {
		t.Run(fmt.Sprintf("weight %d", weight), func(t *testing.T) {
			t.Parallel()
			db := pgtest.NewDB(t)
			if weight != 1 {
				mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, weight) VALUES ('orders', $1)`, weight)
			}
			insertBacklogs(t, db.Pool, []backlog{{"orders", small, -time.Hour}})
			mustExec(t, db.Pool, "ANALYZE")
			costSmall, jitSmall := claimCost(t, db.Pool)
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
				SELECT 'more-' || i, 'orders', now() - interval '1 minute' FROM generate_series(1, $1::int) AS i`, large-small)
			mustExec(t, db.Pool, "ANALYZE")
			costLarge, jitLarge := claimCost(t, db.Pool)
			t.Logf("estimated cost with %d due heads %.0f, with %d %.0f", small, costSmall, large, costLarge)
			if costLarge > 2*costSmall {
				t.Errorf("claim estimated at %.0f with %d due heads of one target, %.0f with %d: want it flat in the backlog",
					costLarge, large, costSmall, small)
			}
			if costLarge >= 100_000 {
				t.Errorf("claim estimated at %.0f with %d due heads: at or above the default jit_above_cost, 100,000", costLarge, large)
			}
			if jitSmall || jitLarge {
				t.Errorf("the claim was compiled by JIT (%d due heads: %v, %d: %v)", small, jitSmall, large, jitLarge)
			}
		})
	}
}

// claimCost returns the main claim's estimated total cost (500 keys, a
// share of 500) as its custom plan, and whether running it with jit on and
// the default thresholds compiled anything; rolled back.
func claimCost(t *testing.T, pool *pgxpool.Pool) (cost float64, jitted bool) {
	t.Helper()
	ctx := t.Context()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	mustExec(t, tx, "SET LOCAL plan_cache_mode = force_custom_plan")
	mustExec(t, tx, "SET LOCAL jit = on")
	mustExec(t, tx, "RESET jit_above_cost")
	args := []any{500, time.Minute, 10, "cost", int64(1 << 30), 500}
	var raw []byte
	if err := tx.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+statementSQL(t, "dispatch_claim.sql"), args...).Scan(&raw); err != nil {
		t.Fatal(err)
	}
	var plans []struct {
		Plan struct {
			TotalCost float64 `json:"Total Cost"`
		}
		JIT *struct {
			Functions int
		}
	}
	if err := json.Unmarshal(raw, &plans); err != nil || len(plans) != 1 {
		t.Fatalf("read the claim's plan: %v in %s", err, raw)
	}
	return plans[0].Plan.TotalCost, plans[0].JIT != nil && plans[0].JIT.Functions > 0
}
