package keylock_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/migrations"
	"github.com/deferq/scheduler/sql/queries"
)

// throttledSummary lists the throttled heads as headSummary does.
func throttledSummary(t testing.TB, q querier) []string {
	t.Helper()
	rows, err := q.Query(t.Context(), `SELECT coalesce(business_key, '-') || '@' || head_seq FROM deferred_key WHERE throttled`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// TestThrottledFlag follows deferred_key.throttled through the head triggers
// (heads written while a target is paused or limited) and target_control's
// (a target paused, limited, resumed, renamed, deleted, truncated): after
// every step it equals the brute-force recomputation, and the throttled
// heads are the ones listed.
func TestThrottledFlag(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason) VALUES
		('a', 1, 'p', now(), 'pending', NULL), ('a', 2, 'q', now(), 'pending', NULL), ('b', 3, 'q', now(), 'pending', NULL),
		(NULL, 4, 'p', now(), 'pending', NULL), ('h', 5, 'p', now(), 'parked', 'permanent: x'), ('h', 6, 'p', now(), 'pending', NULL)`)
	steps := []struct {
		name string
		sql  string
		want []string
	}{
		{"no target_control", `SELECT`, nil},
		{"pause p: its heads, not the held key's", `INSERT INTO target_control (target_topic, paused) VALUES ('p', true)`,
			[]string{"-@4", "a@1"}},
		{"a new head of paused p", `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('c', 7, 'p', now())`,
			[]string{"-@4", "a@1", "c@7"}},
		{"a key's head moves to a free target", `DELETE FROM deferred_message WHERE seq = 1`, []string{"-@4", "c@7"}},
		{"limit q", `INSERT INTO target_control (target_topic, rate_limit) VALUES ('q', 5)`,
			[]string{"-@4", "a@2", "b@3", "c@7"}},
		{"replay the held key of paused p", `UPDATE deferred_message SET state = 'pending' WHERE seq = 5`,
			[]string{"-@4", "a@2", "b@3", "c@7", "h@5"}},
		{"park a throttled head that holds its key", `UPDATE deferred_message SET state = 'parked' WHERE seq = 7`,
			[]string{"-@4", "a@2", "b@3", "h@5"}},
		{"resume p", `UPDATE target_control SET paused = false WHERE target_topic = 'p'`, []string{"a@2", "b@3"}},
		{"pause limited q", `UPDATE target_control SET paused = true WHERE target_topic = 'q'`, []string{"a@2", "b@3"}},
		{"remove paused q's limit", `UPDATE target_control SET rate_limit = NULL WHERE target_topic = 'q'`, []string{"a@2", "b@3"}},
		{"delete p's row", `DELETE FROM target_control WHERE target_topic = 'p'`, []string{"a@2", "b@3"}},
		{"rename q's row to p", `UPDATE target_control SET target_topic = 'p' WHERE target_topic = 'q'`, []string{"-@4", "h@5"}},
		{"move a head to p", `UPDATE deferred_message SET target_topic = 'p' WHERE seq = 2`, []string{"-@4", "a@2", "h@5"}},
		{"an update that changes nothing", `UPDATE target_control SET paused = true, note = 'again'`, []string{"-@4", "a@2", "h@5"}},
		{"truncate target_control", `TRUNCATE target_control`, nil},
	}
	for _, st := range steps {
		mustExec(t, db.Pool, st.sql)
		assertHeadsMatch(t, db.Pool)
		if got := throttledSummary(t, db.Pool); !slices.Equal(got, st.want) {
			t.Errorf("after %s: throttled heads %q, want %q", st.name, got, st.want)
		}
	}
}

// planRows runs EXPLAIN (ANALYZE, BUFFERS) of query in a transaction that
// is rolled back, and returns how many deferred_key rows its plan read: for
// every scan of the table or of one of the given indexes (all scans of it
// if none are given), the rows it returned plus those its filters removed,
// over all its loops. It also returns the scans, for messages.
func planRows(t testing.TB, q querier, indexes []string, query string, args ...any) (int64, []string) {
	t.Helper()
	var out int64
	var scans []string
	err := pgx.BeginFunc(t.Context(), q.(interface {
		Begin(context.Context) (pgx.Tx, error)
	}), func(tx pgx.Tx) error {
		var raw []byte
		if err := tx.QueryRow(t.Context(), "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+query, args...).Scan(&raw); err != nil {
			return err
		}
		var plans []struct{ Plan map[string]any }
		if err := json.Unmarshal(raw, &plans); err != nil {
			return err
		}
		num := func(n map[string]any, k string) float64 {
			f, _ := n[k].(float64)
			return f
		}
		var walk func(n map[string]any)
		walk = func(n map[string]any) {
			index, _ := n["Index Name"].(string)
			rel, _ := n["Relation Name"].(string)
			// ModifyTable and Tid Scan touch the claimed rows themselves.
			typ, _ := n["Node Type"].(string)
			counted := rel == "deferred_key" && len(indexes) == 0 && typ != "ModifyTable" && typ != "Tid Scan" ||
				slices.Contains(indexes, index)
			if counted {
				loops := num(n, "Actual Loops")
				read := (num(n, "Actual Rows") + num(n, "Rows Removed by Filter") + num(n, "Rows Removed by Index Recheck")) * loops
				out += int64(read + 0.5)
				scans = append(scans, fmt.Sprintf("%s %s %s: %.0f rows", n["Node Type"], rel, index, read))
			}
			children, _ := n["Plans"].([]any)
			for _, c := range children {
				if m, ok := c.(map[string]any); ok {
					walk(m)
				}
			}
		}
		walk(plans[0].Plan)
		return errRollback
	})
	if err != nil && !errors.Is(err, errRollback) {
		t.Fatalf("explain %s: %v", oneLine(query)[:80], err)
	}
	return out, scans
}

var errRollback = errors.New("roll back")

func mustEqual[T comparable](t testing.TB, what string, got, want T) {
	t.Helper()
	if got != want {
		t.Fatalf("%s = %v, want %v", what, got, want)
	}
}

// TestThrottledBacklogNotRead: a paused target with a large due backlog, and
// a rate-limited one, cost nothing to the statements every dispatch round
// runs (docs/design.md section 4.3: blocked backlog is never rescanned). The main
// claim and the next-due read walk only heads that can go; a limited
// target's claim and token checks read only that target's heads; the
// backlog gauge finds the oldest due head in a few index entries. Measured
// by the rows each plan read, which does not depend on timing.
func TestThrottledBacklogNotRead(t *testing.T) {
	const paused, limited = 50000, 20000
	db := pgtest.NewDB(t)
	// The paused target's heads exist before the pause (target_control's
	// trigger flags them); the limited target's come after its limit (the
	// insert trigger flags them). All are older than the free target's.
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
		SELECT 'p' || i, 'paused.t', now() - interval '1 hour' FROM generate_series(1, $1::int) AS i`, paused)
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, paused) VALUES ('paused.t', true)`)
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, rate_limit) VALUES ('limited.t', 100)`)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
		SELECT 'l' || i, 'limited.t', now() - interval '30 minutes' FROM generate_series(1, $1::int) AS i`, limited)
	// A free target's backlog too: the main claim must take the first of
	// them in order, not sort them all.
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
		SELECT 'f' || i, 'free.t', now() - interval '1 minute' FROM generate_series(1, 5000) AS i`)
	// A few keys back off after publish failures, for the gauge's count.
	const failing = 3
	mustExec(t, db.Pool, `UPDATE deferred_key SET failures = 2, leased_until = now() + interval '1 minute'
		WHERE business_key IN ('p1', 'p2', 'p3')`)
	mustExec(t, db.Pool, `ANALYZE deferred_key`)
	var throttled int
	if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_key WHERE throttled`).Scan(&throttled); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "throttled heads", throttled, paused+limited)

	lease := time.Minute
	tests := []struct {
		name    string
		indexes []string // the scans to count; nil: every scan of deferred_key
		sql     string
		args    []any
		max     int64
	}{
		{"main claim", nil, statementSQL(t, "dispatch_claim.sql"), []any{10, lease, 10, "me", int64(keylock.DefaultMaxBytes), 10}, 12},
		{"limited target's claim", nil, statementSQL(t, "dispatch_claim_target.sql"), []any{5, lease, 1, "me", int64(keylock.DefaultMaxBytes), "limited.t"}, 5},
		// The free target has a backlog: 11 entries counted.
		{"express targets", nil, statementSQL(t, "dispatch_express_targets.sql"), []any{10}, 13},
		{"express claim", nil, statementSQL(t, "dispatch_claim_express.sql"),
			[]any{10, lease, 10, "me", int64(keylock.DefaultMaxBytes), []string{"free.t", "paused.t", "limited.t"}, 10}, 10},
		{"next due", nil, statementSQL(t, "dispatch_next_due.sql"), nil, 20},
		{"token peek", nil, statementSQL(t, "target_peek_tokens.sql"), []any{[]string{"limited.t", "paused.t"}}, 5},
		{"token take", nil, statementSQL(t, "target_take_tokens.sql"), []any{[]string{"limited.t"}, 5}, 5},
		// The gauge also counts all of deferred_message, on an interval by
		// design; what must not grow is what it reads of deferred_key:
		// finding the oldest due head, counting the keys held by a parked
		// message, and counting the keys backing off (deferred_key_failing,
		// migration 0010; it was a scan of every key).
		{"backlog gauge", nil, statementSQL(t, "metrics_backlog.sql"), nil, 20 + failing},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			read, scans := planRows(t, db.Pool, tt.indexes, tt.sql, tt.args...)
			if len(scans) == 0 {
				t.Fatalf("no scan of deferred_key in the plan")
			}
			for _, s := range scans {
				if strings.HasPrefix(s, "Seq Scan") && tt.indexes == nil {
					t.Errorf("plan reads all of deferred_key: %s", s)
				}
			}
			if read > tt.max {
				t.Errorf("read %d rows of deferred_key, want at most %d with %d paused and %d limited due heads: %q",
					read, tt.max, paused, limited, scans)
			}
			t.Logf("%q", scans)
		})
	}

	// What those statements return is still right.
	l := newLocker(t, db.Pool, "me", time.Minute, 10)
	claims, err := l.Claim(t.Context(), 100)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "main claim", len(claims), 100)
	for _, c := range claims {
		if !strings.HasPrefix(c.BusinessKey, "f") {
			t.Fatalf("main claim took %q", c.BusinessKey)
		}
	}
	limitedClaims, err := l.ClaimTarget(t.Context(), 5, "limited.t", keylock.DefaultMaxBytes)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "limited claim", len(limitedClaims), 5)
	rows, err := queries.MetricsBacklog(t.Context(), db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "gauge's keys backing off", rows[0].HeldKeys, int64(failing))
}

// TestBacklogGaugeOldestDue: the oldest due head of the backlog gauge counts
// a rate-limited target's heads (a limit that cannot keep up is lateness)
// but not a paused target's (an operator's pause is not).
func TestBacklogGaugeOldestDue(t *testing.T) {
	tests := []struct {
		name  string
		setup []string
		want  time.Duration // about
	}{
		{"nothing due", nil, 0},
		{"a free target", []string{`INSERT INTO deferred_message (business_key, target_topic, next_run_at)
			VALUES ('f', 'free.t', now() - interval '60 seconds')`}, time.Minute},
		{"a limited target's head is older", []string{
			`INSERT INTO target_control (target_topic, rate_limit) VALUES ('limited.t', 1)`,
			`INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES
				('f', 'free.t', now() - interval '60 seconds'), ('l', 'limited.t', now() - interval '600 seconds')`,
		}, 10 * time.Minute},
		{"a paused target's head does not count", []string{
			`INSERT INTO target_control (target_topic, paused, rate_limit) VALUES ('paused.t', true, 1)`,
			`INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES
				('f', 'free.t', now() - interval '60 seconds'), ('p', 'paused.t', now() - interval '600 seconds')`,
		}, time.Minute},
		{"nor one left unflagged by a race with its pause", []string{
			`INSERT INTO target_control (target_topic, paused) VALUES ('paused.t', true)`,
			`INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES
				('f', 'free.t', now() - interval '60 seconds'), ('p', 'paused.t', now() - interval '600 seconds')`,
			`UPDATE deferred_key SET throttled = false`,
		}, time.Minute},
		{"a limited target's head left unflagged counts", []string{
			`INSERT INTO target_control (target_topic, rate_limit) VALUES ('limited.t', 1)`,
			`INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES
				('f', 'free.t', now() - interval '60 seconds'), ('l', 'limited.t', now() - interval '600 seconds')`,
			`UPDATE deferred_key SET throttled = false`,
		}, 10 * time.Minute},
	}
	db := pgtest.NewDB(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reset(t, db.Pool)
			mustExec(t, db.Pool, "DELETE FROM target_control")
			for _, s := range tt.setup {
				mustExec(t, db.Pool, s)
			}
			rows, err := queries.MetricsBacklog(t.Context(), db.Pool)
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) == 0 {
				t.Fatal("no row")
			}
			got := time.Duration(rows[0].OldestDueSeconds * float64(time.Second))
			if got < tt.want || got > tt.want+5*time.Second {
				t.Errorf("oldest due = %v, want about %v", got, tt.want)
			}
		})
	}
}

// TestThrottleSweep: maintenance's sweep flags heads a race left unflagged
// and unflags what must not be flagged, and reports how many.
func TestThrottleSweep(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, paused) VALUES ('paused.t', true)`)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason) VALUES
		('a', 1, 'paused.t', now(), 'pending', NULL), ('b', 2, 'paused.t', now(), 'pending', NULL),
		('c', 3, 'free.t', now(), 'pending', NULL), ('h', 4, 'paused.t', now(), 'parked', 'permanent: x')`)
	n, err := keylock.SweepThrottled(t.Context(), db.Pool)
	if err != nil || n != 0 {
		t.Fatalf("sweep of right flags = %d, %v; want 0", n, err)
	}
	// As races could leave them, and worse.
	mustExec(t, db.Pool, `UPDATE deferred_key SET throttled = NOT throttled WHERE business_key IN ('a', 'c', 'h')`)
	if diff, err := headsDiff(t.Context(), db.Pool); err != nil || len(diff) == 0 {
		t.Fatalf("heads diff after spoiling the flags = %q, %v; want differences", diff, err)
	}
	n, err = keylock.SweepThrottled(t.Context(), db.Pool)
	if err != nil || n != 3 {
		t.Errorf("sweep = %d, %v; want 3 flags changed", n, err)
	}
	assertHeadsMatch(t, db.Pool)
}

// TestClaimStatementsShareTheirMessageRead: the main claim, a limited
// target's claim and the express claim differ only in which heads they
// lease.
func TestClaimStatementsShareTheirMessageRead(t *testing.T) {
	const from = "), claimed AS ("
	tail := func(name, s string) string {
		i := strings.Index(s, from)
		if i < 0 {
			t.Fatalf("%s has no %q", name, from)
		}
		return s[i:]
	}
	main := tail("dispatch_claim.sql", statementSQL(t, "dispatch_claim.sql"))
	for _, other := range []string{"dispatch_claim_target.sql", "dispatch_claim_express.sql"} {
		if tail(other, statementSQL(t, other)) != main {
			t.Errorf("dispatch_claim.sql and %s differ after the heads they lease", other)
		}
	}
}

// TestThrottleRaces runs head writers (ingest-style inserts, claims and
// finalizes moving heads, operators' updates) against an operator who keeps
// pausing, resuming, limiting and un-limiting the targets, sometimes in a
// transaction that is held a while and rolled back. In every committed
// snapshot no head is flagged throttled while its target is not paused or
// limited: such a head would never be claimed. Heads left unflagged while
// their target is throttled are allowed (the claims check target_control
// anyway); after maintenance's sweep the flags are exact.
func TestThrottleRaces(t *testing.T) {
	db := pgtest.NewDB(t)
	_, _ = db.Pool.Exec(t.Context(), "ALTER DATABASE "+pgx.Identifier{db.Name}.Sanitize()+" SET deadlock_timeout = '50ms'")
	pool := bigPool(t, db.URL, 16)
	targets := []string{"x", "y"}
	mustExec(t, pool, `INSERT INTO target_control (target_topic, paused) VALUES ('x', true), ('y', false)`)
	tctx := t.Context()
	run, stop := context.WithTimeout(tctx, 3*time.Second)
	defer stop()
	var wg sync.WaitGroup
	var inserted, toggles, checks, deadlocks atomic.Int64
	failed := func(format string, args ...any) {
		t.Errorf(format, args...)
		stop()
	}

	for w := range 2 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for run.Err() == nil {
				n := 1 + rng.IntN(20)
				keys := make([]*string, n)
				tgts := make([]string, n)
				for i := range n {
					if rng.IntN(5) > 0 {
						k := fmt.Sprintf("k%d", rng.IntN(40))
						keys[i] = &k
					}
					tgts[i] = targets[rng.IntN(len(targets))]
				}
				err := retryDeadlock(&deadlocks, func() error {
					_, err := pool.Exec(tctx, `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
						SELECT k, tg, now() - interval '1 second' FROM unnest($1::text[], $2::text[]) AS r (k, tg)
						WHERE (SELECT count(*) FROM deferred_message) < 400`, keys, tgts)
					return err
				})
				if err != nil {
					failed("insert: %v", err)
					return
				}
				inserted.Add(int64(n))
			}
		})
	}
	// Dispatch of whatever is free: heads move to the keys' next messages.
	for w := range 2 {
		l := newLocker(t, pool, fmt.Sprintf("d%d", w), time.Minute, 3)
		wg.Go(func() {
			for run.Err() == nil {
				claims, err := l.Claim(tctx, 10)
				if err != nil {
					failed("claim: %v", err)
					return
				}
				var out keylock.Outcome
				for _, c := range claims {
					for _, m := range c.Messages {
						out.Published = append(out.Published, m.ID)
					}
				}
				if err := retryDeadlock(&deadlocks, func() error { return l.Finalize(tctx, claims, out) }); err != nil {
					failed("finalize: %v", err)
					return
				}
				if len(claims) == 0 {
					time.Sleep(2 * time.Millisecond)
				}
			}
		})
	}
	// An operator moving messages between targets: heads of a key change
	// target.
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(9, 9))
		for run.Err() == nil {
			err := retryDeadlock(&deadlocks, func() error {
				_, err := pool.Exec(tctx, `UPDATE deferred_message SET target_topic = $1
					WHERE id IN (SELECT id FROM deferred_message ORDER BY random() LIMIT 3)`, targets[rng.IntN(len(targets))])
				return err
			})
			if err != nil {
				failed("retarget: %v", err)
				return
			}
			time.Sleep(time.Millisecond)
		}
	})
	// The operator of target_control.
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(3, 3))
		for run.Err() == nil {
			target := targets[rng.IntN(len(targets))]
			var sql string
			switch rng.IntN(4) {
			case 0:
				sql = `UPDATE target_control SET paused = NOT paused WHERE target_topic = $1`
			case 1:
				sql = `UPDATE target_control SET rate_limit = CASE WHEN rate_limit IS NULL THEN 50 END WHERE target_topic = $1`
			case 2:
				sql = `WITH d AS (DELETE FROM target_control WHERE target_topic = $1 RETURNING 1)
					INSERT INTO target_control (target_topic, paused) SELECT $1, true WHERE NOT EXISTS (SELECT FROM d)`
			default:
				sql = `INSERT INTO target_control (target_topic, paused) VALUES ($1, false)
					ON CONFLICT (target_topic) DO UPDATE SET paused = NOT target_control.paused`
			}
			rollback := rng.IntN(4) == 0
			err := retryDeadlock(&deadlocks, func() error {
				return pgx.BeginFunc(tctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(tctx, sql, target); err != nil {
						return err
					}
					// Held open a while: head writers meet the change under way.
					time.Sleep(time.Duration(rng.IntN(5)) * time.Millisecond)
					if rollback {
						return errRollback
					}
					return nil
				})
			})
			if err != nil && !errors.Is(err, errRollback) {
				failed("target_control: %v", err)
				return
			}
			toggles.Add(1)
		}
	})
	// Every committed snapshot: no head flagged whose target is free, nor a
	// held one.
	wg.Go(func() {
		for run.Err() == nil {
			var bad []string
			err := pgx.BeginTxFunc(tctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly},
				func(tx pgx.Tx) error {
					rows, err := tx.Query(tctx, `SELECT format('key=%s head_seq=%s target=%s held=%s', business_key, head_seq, head_target, held)
						FROM deferred_key k
						WHERE k.throttled AND (k.held OR NOT EXISTS (SELECT 1 FROM target_control c
							WHERE c.target_topic = k.head_target AND (c.paused OR c.rate_limit IS NOT NULL)))`)
					if err != nil {
						return err
					}
					bad, err = pgx.CollectRows(rows, pgx.RowTo[string])
					return err
				})
			if err != nil {
				failed("snapshot check: %v", err)
				return
			}
			checks.Add(1)
			if len(bad) > 0 {
				failed("snapshot %d: heads flagged throttled whose target is not: %q", checks.Load(), bad)
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	})
	wg.Wait()
	t.Logf("inserted %d, %d target_control changes, %d snapshot checks, %d deadlocks retried",
		inserted.Load(), toggles.Load(), checks.Load(), deadlocks.Load())
	if inserted.Load() == 0 || toggles.Load() == 0 || checks.Load() == 0 {
		t.Fatal("the run did no work")
	}
	n, err := keylock.SweepThrottled(tctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the sweep repaired %d flags left unflagged", n)
	assertHeadsMatch(t, pool)
}

// TestUpgradeFlagsPausedTargets: heads of targets paused before migration
// 0002 (which brought the throttled flag) are flagged by it, so that the
// main claim does not walk their backlog after the upgrade either.
func TestUpgradeFlagsPausedTargets(t *testing.T) {
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	if len(all) < 2 || all[0].Version != 1 || all[1].Version != 2 {
		t.Fatalf("migrations %v..., want 1 and 2 first", all[0].Version)
	}
	adminURL := pgtest.AdminURL(t)
	admin, err := pgx.Connect(t.Context(), adminURL)
	if err != nil {
		t.Fatal(err)
	}
	// Cleanups run last in, first out: the drop below, then this.
	t.Cleanup(func() { admin.Close(context.Background()) })
	name := fmt.Sprintf("keylock_upgrade_%d", time.Now().UnixNano())
	mustExec(t, admin, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	cfg, err := pgx.ParseConfig(adminURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Database = name
	conn, err := pgx.ConnectConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	mustExec(t, conn, all[0].SQL)
	mustExec(t, conn, `INSERT INTO target_control (target_topic, paused) VALUES ('paused.t', true), ('resumed.t', false)`)
	mustExec(t, conn, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('a', 1, 'paused.t', now()), ('b', 2, 'resumed.t', now()), (NULL, 3, 'paused.t', now()), ('c', 4, 'free.t', now())`)
	mustExec(t, conn, all[1].SQL)
	if got, want := throttledSummary(t, conn), []string{"-@3", "a@1"}; !slices.Equal(got, want) {
		t.Errorf("throttled heads after the upgrade = %q, want %q", got, want)
	}
	assertHeadsMatch(t, conn)
}

// statementSQL returns the text of one of sql/queries' statements, for a
// test that reads its plan.
func statementSQL(t *testing.T, file string) string {
	t.Helper()
	s, ok := queries.Lookup(file)
	if !ok {
		t.Fatalf("no statement %s", file)
	}
	return s.SQL
}

// TestThrottleShareLocksOnlyItsTargets: a head writer takes the shared
// advisory lock of the throttled targets it writes heads of, and of no
// other (a lock on another target would make an operator's un-throttling of
// that target wait for the writer). The function runs on generic plans
// (migration 0016), which do not know how many targets they are asked
// about; with the target test outside the CASE, a sequential scan of a
// small target_control ran the CASE first and locked every throttled
// target.
func TestThrottleShareLocksOnlyItsTargets(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, paused)
		SELECT 'p' || i, i % 2 = 0 FROM generate_series(0, 49) AS i`)
	mustExec(t, db.Pool, `ANALYZE target_control`)
	for _, tc := range []struct {
		name string
		sql  string
		want []string // throttled targets whose lock the transaction holds
	}{
		{"asked about one paused target", `SELECT deferred_key_throttle_share(ARRAY['p2'])`, []string{"p2"}},
		{"asked about a paused and a free one", `SELECT deferred_key_throttle_share(ARRAY['p4', 'p5'])`, []string{"p4"}},
		{"asked about all", `SELECT deferred_key_throttle_share(NULL)`, nil}, // every even one: checked by count below
		{"an insert of a paused target's message", `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
			VALUES ('k', 'p6', now())`, []string{"p6"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			// Beyond the plan cache's first five custom plans, so that
			// the plan is the one it keeps.
			for range 7 {
				mustExec(t, tx, tc.sql)
			}
			held := heldThrottleLocks(t, tx)
			if tc.want == nil {
				if len(held) != 25 {
					t.Errorf("holds the locks of %d targets, want the 25 paused ones: %q", len(held), held)
				}
				return
			}
			if !slices.Equal(held, tc.want) {
				t.Errorf("holds the locks of %q, want %q", held, tc.want)
			}
		})
	}
}

// TestHeadWritersLockOnlyTheirTargets: a refresh of heads (an operator's
// delete or update of messages, every finalize) and the throttle sweep take
// the shared lock of the throttled targets they write heads of, not of
// every throttled target (migration 0017): each lock is an entry of the
// shared lock table until the transaction ends.
func TestHeadWritersLockOnlyTheirTargets(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, paused)
		SELECT 'p' || i, i % 2 = 0 FROM generate_series(0, 49) AS i`)
	// Key d: a free target's message ahead of a paused one's. Key u: a
	// paused target's. Key s: a paused target's head whose flag a race
	// left unset. Key f: a free target's.
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('d', 1, 'p1', now()), ('d', 2, 'p8', now()), ('u', 3, 'p10', now()), ('s', 4, 'p12', now()),
		('f', 5, 'p3', now())`)
	mustExec(t, db.Pool, `ANALYZE target_control`)
	for _, tc := range []struct {
		name  string
		setup string // run once in the transaction first
		sql   string
		want  []string // throttled targets whose lock the transaction holds
	}{
		{"a delete that moves a head to a paused target", "", `DELETE FROM deferred_message WHERE business_key = 'd' AND seq = 1`, []string{"p8"}},
		{"an update of a paused target's message", "", `UPDATE deferred_message SET next_run_at = now() WHERE business_key = 'u'`, []string{"p10"}},
		{"an update of a free target's message", "", `UPDATE deferred_message SET next_run_at = now() WHERE business_key = 'f'`, []string{}},
		{"a sweep with nothing to flag", "", `SELECT deferred_key_throttle_sweep()`, []string{}},
		{"a sweep that flags one target's head", `UPDATE deferred_key SET throttled = false WHERE business_key = 's'`,
			`SELECT deferred_key_throttle_sweep()`, []string{"p12"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			if tc.setup != "" {
				mustExec(t, tx, tc.setup)
			}
			// Beyond the plan cache's first five custom plans, so that
			// the plans are the ones it keeps.
			for range 7 {
				mustExec(t, tx, tc.sql)
			}
			held := heldThrottleLocks(t, tx)
			if !slices.Equal(held, tc.want) {
				t.Errorf("holds the locks of %q, want %q", held, tc.want)
			}
			if diff, err := headsDiff(ctx, tx); err != nil || len(diff) > 0 {
				t.Errorf("heads differ from their recomputation: %q, %v", diff, err)
			}
		})
	}
}

// heldThrottleLocks lists the targets whose shared throttle lock (see
// deferred_key_throttle_share.sql) this transaction holds.
func heldThrottleLocks(t testing.TB, tx pgx.Tx) []string {
	t.Helper()
	var held []string
	if err := tx.QueryRow(t.Context(), `SELECT coalesce(array_agg(c.target_topic ORDER BY c.target_topic), '{}')
		FROM target_control c JOIN pg_locks l
		  ON l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.mode = 'ShareLock'
		 AND l.classid::bigint = (hashtext('deferred_key.throttled')::bigint & 4294967295)
		 AND l.objid::bigint = (hashtext(c.target_topic)::bigint & 4294967295)`).Scan(&held); err != nil {
		t.Fatal(err)
	}
	return held
}

// TestManyThrottledTargets: with more paused targets than PostgreSQL's
// default lock table holds (max_locks_per_transaction 64 x 100
// connections), a free target's messages are still claimed and finalized,
// and the maintenance sweep still runs. Before migration 0017 every
// finalize took a lock per paused target and failed with "out of shared
// memory" (on a server whose lock table is larger it passed then too;
// TestHeadWritersLockOnlyTheirTargets checks the locks themselves).
func TestManyThrottledTargets(t *testing.T) {
	const paused = 20000
	db := pgtest.NewDB(t)
	ctx := t.Context()
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, paused)
		SELECT 'svc' || i || '.retry', true FROM generate_series(1, $1::int) AS i`, paused)
	// One paused target has a head, so that the refresh has a throttled
	// target to ask about too.
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('a', 1, 'free.t', now()), ('a', 2, 'svc7.retry', now()), ('b', 3, 'free.t', now())`)
	l := newLocker(t, db.Pool, "me", time.Minute, 10)
	claims, err := l.Claim(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	// What a round publishes: each key's run up to a change of target
	// (dispatch's run), so a@2 stays, for its paused target.
	var ids []int64
	for _, c := range claims {
		for _, m := range c.Messages {
			if m.Target != "free.t" {
				break
			}
			ids = append(ids, m.ID)
		}
	}
	mustEqual(t, "messages published", len(ids), 2)
	if err := l.Finalize(ctx, claims, keylock.Outcome{Published: ids}); err != nil {
		t.Fatalf("finalize beside %d paused targets: %v", paused, err)
	}
	assertHeadsMatch(t, db.Pool)
	if got := throttledSummary(t, db.Pool); !slices.Equal(got, []string{"a@2"}) {
		t.Errorf("throttled heads = %q, want a@2 (its paused target's message)", got)
	}
	if _, err := keylock.SweepThrottled(ctx, db.Pool); err != nil {
		t.Fatalf("sweep beside %d paused targets: %v", paused, err)
	}
}
