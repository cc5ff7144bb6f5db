package keylock_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/sql/queries"
)

// A queue table's statistics are usually stale in the worst way: autovacuum
// analyzes it while it is nearly empty (the queue has just drained), which
// records a density of about zero rows per page, and then a burst of
// deferrals grows it far past that before the next analyze. The planner then
// takes every scan of deferred_key or deferred_message to return one row,
// and prefers plans that walk a whole table, per statement or per claimed
// key: seen at 23 s for one finalize of 500 keys among 100,000.
// AnalyzeIfStale, which every process runs every second, is the fix;
// these tests build that state (rows inserted, deleted, ANALYZE, then rows
// inserted without one) and check it, and the state autovacuum leaves
// (deleted, VACUUM: no pages, and indexes that count no tuples).

// step is one hot-path step of the stale-statistics test.
type step struct {
	name string
	// perKey is how many messages each business key gets; 0 makes the
	// rows unordered.
	perKey int
	run    func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error
}

// Each hot-path step runs twice on that state, each time in a transaction
// that is rolled back, counting the rows it reads in
// pg_stat_xact_user_tables (counting rows rather than timing keeps the test
// independent of the machine). With the statistics stale, no statement may
// read a table once per message: migration 0003 bounds them by the batch's
// keys or ids, though a statement may still walk a table once. After
// AnalyzeIfStale, each step reads in proportion to its batch, not to the
// table. deferred_key_refresh, which the triggers run on every step, and the
// insert and delete triggers choose between generic and custom plans
// (migrations 0015 and 0016): each step runs with all three forced to
// either, and a generic plan is made on the stale statistics.
func TestStaleStatisticsKeepWorkProportionalToBatch(t *testing.T) {
	const (
		tableRows = 20_000
		batch     = 20
		// Rows each step may read per message of its batch: the message,
		// its key, a few index probes and the head that follows.
		perMessage = 8
	)
	steps := []step{
		{"finalize: published, own keys (head gone)", 1, func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error {
			return finalize(ctx, tx, ids, keys, nil)
		}},
		{"finalize: published, two per key (head moves)", 2, func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error {
			return finalize(ctx, tx, ids, keys, nil)
		}},
		{"finalize: parked, own keys (key held)", 1, func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error {
			return finalize(ctx, tx, nil, keys, ids)
		}},
		{"finalize: published, unordered", 0, func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error {
			return finalizeUnordered(ctx, tx, ids)
		}},
		{"operator: expedite by id, two per key", 2, func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error {
			_, err := tx.Exec(ctx, "UPDATE deferred_message SET next_run_at = now() - interval '1 minute' WHERE id = ANY ($1)", ids)
			return err
		}},
		{"operator: cancel by id, own keys", 1, func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error {
			_, err := tx.Exec(ctx, "DELETE FROM deferred_message WHERE id = ANY ($1)", ids)
			return err
		}},
		// The insert trigger's head upsert, on keys that have a head (the
		// claimed ones: ON CONFLICT, no change) and on new keys.
		{"ingest: insert, claimed keys and new ones", 1, func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error {
			_, err := tx.Exec(ctx, `INSERT INTO deferred_message (business_key, target_topic, next_run_at, key, value)
				SELECT coalesce(c.k, 'new-' || i), 't', now(), '\x01'::bytea, '\x02'::bytea
				FROM generate_series(1, 2 * cardinality($1::text[])) AS i
				LEFT JOIN unnest($1::text[]) WITH ORDINALITY AS c (k, n) ON c.n = i`, keys)
			return err
		}},
	}
	// Drained, then analyzed (the density recorded is about zero) or
	// vacuumed (autovacuum's way: the tables truncated to no pages, their
	// indexes counting no tuples).
	for _, drained := range []string{"ANALYZE", "VACUUM"} {
		for _, plans := range []string{"force_custom_plan", "force_generic_plan"} {
			for _, s := range steps {
				t.Run(drained+"/"+plans+"/"+s.name, func(t *testing.T) {
					t.Parallel()
					staleSteps(t, s, drained, plans, tableRows, batch, perMessage)
				})
			}
		}
	}
}

// staleSteps is one step of TestStaleStatisticsKeepWorkProportionalToBatch
// on tables drained and then analyzed or vacuumed (drained), with
// deferred_key_refresh and the insert and delete triggers planning by plans
// (a plan_cache_mode).
func staleSteps(t *testing.T, s step, drained, plans string, tableRows, batch, perMessage int) {
	ctx := t.Context()
	db := pgtest.NewDB(t)
	for _, fn := range []string{"deferred_key_refresh(text[], bigint[])", "deferred_key_after_insert()", "deferred_key_after_delete()"} {
		mustExec(t, db.Pool, "ALTER FUNCTION "+fn+" SET plan_cache_mode = "+plans)
	}
	// A paused target with no messages: with a throttled target the
	// refresh also reads the targets of the heads it writes, to lock only
	// those (migration 0017), and that read must be bounded too. Without
	// one it skips the read.
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, paused) VALUES ('paused.t', true)`)
	staleStateAfter(t, db.Pool, tableRows, s.perKey, drained+" deferred_message, deferred_key")

	// Before the analyze, with the statistics stale: each statement
	// may walk a table once, but none may walk it per message.
	claimRead, stepRead := runStep(t, db.Pool, s, batch, false)
	walks := int64(3*tableRows + perMessage*batch)
	for table, n := range claimRead {
		if n > walks {
			t.Errorf("stale statistics: claim read %d rows of %s for %d heads among %d rows (limit %d): a plan walks the table per head",
				n, table, batch, tableRows, walks)
		}
	}
	for table, n := range stepRead {
		if n > walks {
			t.Errorf("stale statistics: %s read %d rows of %s for %d messages among %d rows (limit %d): a plan walks the table per message",
				s.name, n, table, batch, tableRows, walks)
		}
	}

	analyzed, err := keylock.AnalyzeIfStale(ctx, db.Pool, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if len(analyzed) != 2 {
		t.Fatalf("AnalyzeIfStale analyzed %v in the stale state, want deferred_key and deferred_message", analyzed)
	}

	// After it: in proportion to the batch.
	claimRead, stepRead = runStep(t, db.Pool, s, batch, true)
	limit := int64(perMessage * batch)
	for table, n := range claimRead {
		if n > limit {
			t.Errorf("claim read %d rows of %s for %d heads among %d rows (limit %d): a plan walks the table", n, table, batch, tableRows, limit)
		}
	}
	for table, n := range stepRead {
		if n > limit {
			t.Errorf("%s read %d rows of %s for %d messages among %d rows (limit %d): a plan walks the table",
				s.name, n, table, batch, tableRows, limit)
		}
	}
}

// runStep claims batch heads and runs step s on them in one transaction,
// rolled back, and returns the rows of each table the claim read and the
// rows the step read after it. With checkHeads, the heads must match the
// brute-force recomputation after the step.
func runStep(t *testing.T, pool *pgxpool.Pool, s step, batch int, checkHeads bool) (claimRead, stepRead map[string]int64) {
	t.Helper()
	ctx := t.Context()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	// The counts may include earlier transactions of this connection that
	// were not flushed yet (PostgreSQL 15): count from here.
	before := readRows(t, tx)

	// The claim itself, then the step on what it claimed: the first
	// message of each claimed key, or each unordered head.
	rows, err := queries.DispatchClaim(ctx, tx, queries.DispatchClaimParams{ClaimParams: queries.ClaimParams{
		MaxKeys: batch, Lease: time.Minute, PerKey: 1, Owner: "stale-stats", MaxBytes: int64(keylock.DefaultMaxBytes)},
		Share: batch})
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	var ids []int64
	var keys []string
	for _, r := range rows {
		if r.ID == nil {
			t.Fatalf("claimed head %d came back without its message", r.HeadID)
		}
		ids = append(ids, *r.ID)
		if r.BusinessKey != nil {
			keys = append(keys, *r.BusinessKey)
		}
	}
	if len(ids) != batch {
		t.Fatalf("claimed %d heads, want %d", len(ids), batch)
	}
	claimRead = readRows(t, tx)
	if err := s.run(ctx, tx, ids, keys); err != nil {
		t.Fatalf("%s: %v", s.name, err)
	}
	stepRead = readRows(t, tx)
	for table := range stepRead {
		stepRead[table] -= claimRead[table]
	}
	for table := range claimRead {
		claimRead[table] -= before[table]
	}
	if checkHeads {
		assertHeadsMatch(t, tx)
	}
	return claimRead, stepRead
}

// staleState leaves deferred_message and deferred_key as a drained and then
// flooded queue leaves them: analyzed while empty over pages that held rows,
// then n rows due now inserted (perKey messages per business key, or
// unordered ones when perKey is 0) without an analyze since. Autovacuum is
// off for both, so that it cannot analyze them behind the test's back, and
// the inserting connection flushes its statistics before it returns, so
// that pg_stat_user_tables counts the rows at once.
func staleState(t *testing.T, pool *pgxpool.Pool, n, perKey int) {
	t.Helper()
	staleStateAfter(t, pool, n, perKey, "ANALYZE deferred_message, deferred_key")
}

// staleStateAfter is staleState with another statement run on the drained
// tables: "VACUUM deferred_message, deferred_key" is autovacuum after a
// drain, which truncates both to 0 pages and records 0 tuples for every
// index, whose pages stay.
func staleStateAfter(t *testing.T, pool *pgxpool.Pool, n, perKey int, drained string) {
	t.Helper()
	conn, err := pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	insert := func(from, to int) {
		key := fmt.Sprintf("'k-' || ((g - 1) / %d)", max(perKey, 1))
		if perKey == 0 {
			key = "NULL"
		}
		mustExec(t, conn, `
INSERT INTO deferred_message (source_topic, source_partition, source_offset, business_key, target_topic,
    next_run_at, attempt, error_class, key, value, header_keys, header_values)
SELECT 'stale', 0, g, `+key+`, 'stale.retry', now() - interval '1 second', 0, 'Timeout',
    convert_to('k-' || g, 'UTF8'), convert_to(repeat('x', 100), 'UTF8'), '{}', '{}'
FROM generate_series($1::bigint, $2::bigint) AS g
ORDER BY g`, from, to)
	}
	mustExec(t, conn, "ALTER TABLE deferred_message SET (autovacuum_enabled = false)")
	mustExec(t, conn, "ALTER TABLE deferred_key SET (autovacuum_enabled = false)")
	insert(1, 2_000)
	mustExec(t, conn, "DELETE FROM deferred_message")
	mustExec(t, conn, drained)
	insert(1_000_001, 1_000_000+n)
	// Flushed when this statement's result is sent.
	mustExec(t, conn, "SELECT pg_stat_force_next_flush()")
}

// readRows returns the rows this transaction has read so far from
// deferred_message and deferred_key, by sequential and index scans.
func readRows(t *testing.T, tx pgx.Tx) map[string]int64 {
	t.Helper()
	return countsByName(t, tx, `SELECT relname, coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
		FROM pg_stat_xact_user_tables WHERE relname IN ('deferred_message', 'deferred_key')`)
}

// countsByName runs a query returning (name, count) rows and maps them.
func countsByName(t *testing.T, q querier, sql string, args ...any) map[string]int64 {
	t.Helper()
	rows, err := q.Query(t.Context(), sql, args...)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	var name string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&name, &n}, func() error { out[name] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// finalize runs Locker.Finalize's statements for ordered keys: published
// rows deleted, parked rows parked, the keys released. A copy of Finalize's
// batch rather than a call to it: the rows read are counted per transaction,
// and Finalize runs its own.
func finalize(ctx context.Context, tx pgx.Tx, published []int64, keys []string, parked []int64) error {
	changed := append(append([]int64(nil), published...), parked...)
	if err := queries.DispatchLockMessages(ctx, tx, queries.DispatchLockMessagesParams{IDs: changed}); err != nil {
		return fmt.Errorf("lock messages: %w", err)
	}
	if err := queries.DispatchLockKeys(ctx, tx, queries.DispatchLockKeysParams{Keys: keys}); err != nil {
		return fmt.Errorf("lock keys: %w", err)
	}
	if err := queries.DispatchFinalizing(ctx, tx, queries.DispatchFinalizingParams{Owner: "stale-stats"}); err != nil {
		return fmt.Errorf("finalizing: %w", err)
	}
	if len(published) > 0 {
		if err := queries.DispatchDelete(ctx, tx, queries.DispatchDeleteParams{IDs: published}); err != nil {
			return fmt.Errorf("delete: %w", err)
		}
	}
	if len(parked) > 0 {
		reasons := make([]string, len(parked))
		for i := range reasons {
			reasons[i] = "exhausted"
		}
		if err := queries.DispatchPark(ctx, tx, queries.DispatchParkParams{IDs: parked, Reasons: reasons}); err != nil {
			return fmt.Errorf("park: %w", err)
		}
	}
	if err := queries.DispatchReleaseEmpty(ctx, tx, queries.DispatchReleaseEmptyParams{Keys: keys, Owner: "stale-stats"}); err != nil {
		return fmt.Errorf("delete emptied keys: %w", err)
	}
	if err := queries.DispatchRelease(ctx, tx, queries.DispatchReleaseParams{Keys: keys, Owner: "stale-stats",
		BackoffBase: time.Second, BackoffMax: time.Minute}); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	return nil
}

// finalizeUnordered is finalize for unordered heads, all published.
func finalizeUnordered(ctx context.Context, tx pgx.Tx, ids []int64) error {
	if err := queries.DispatchLockMessages(ctx, tx, queries.DispatchLockMessagesParams{IDs: ids}); err != nil {
		return fmt.Errorf("lock messages: %w", err)
	}
	if err := queries.DispatchDelete(ctx, tx, queries.DispatchDeleteParams{IDs: ids}); err != nil {
		return fmt.Errorf("delete: %w", err)
	}
	if err := queries.DispatchReleaseUnordered(ctx, tx, queries.DispatchReleaseUnorderedParams{Heads: ids, Owner: "stale-stats",
		BackoffBase: time.Second, BackoffMax: time.Minute}); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	return nil
}

// AnalyzeIfStale analyzes only when the estimate is far behind and the
// tables are worth it, and once it has, not again until they outgrow it.
func TestAnalyzeIfStale(t *testing.T) {
	cases := []struct {
		name    string
		setup   func(t *testing.T, pool *pgxpool.Pool)
		minRows int64
		want    int // tables analyzed by the first call
	}{
		{"drained, analyzed, then flooded", func(t *testing.T, pool *pgxpool.Pool) { staleState(t, pool, 5_000, 1) }, 1000, 2},
		{"flooded, but below the minimum", func(t *testing.T, pool *pgxpool.Pool) { staleState(t, pool, 5_000, 1) }, 10_000, 0},
		{"drained, vacuumed to nothing, then flooded", func(t *testing.T, pool *pgxpool.Pool) {
			staleStateAfter(t, pool, 5_000, 1, "VACUUM deferred_message, deferred_key")
			// The state autovacuum leaves: no pages, and indexes that keep
			// theirs but count no tuples.
			var pages, pkeyPages int32
			var pkeyTuples float32
			if err := pool.QueryRow(t.Context(), `SELECT t.relpages, i.relpages, i.reltuples FROM pg_class t, pg_class i
				WHERE t.relname = 'deferred_message' AND i.relname = 'deferred_message_pkey'`).Scan(&pages, &pkeyPages, &pkeyTuples); err != nil {
				t.Fatal(err)
			}
			if pages != 0 || pkeyPages == 0 || pkeyTuples != 0 {
				t.Fatalf("after the VACUUM: deferred_message relpages %d, its primary key relpages %d reltuples %v; want 0, > 0, 0",
					pages, pkeyPages, pkeyTuples)
			}
		}, 1000, 2},
		{"never analyzed: the planner follows the size", func(t *testing.T, pool *pgxpool.Pool) {
			conn, err := pool.Acquire(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Release()
			mustExec(t, conn, `
INSERT INTO deferred_message (source_topic, source_partition, source_offset, business_key, target_topic,
    next_run_at, attempt, key, value, header_keys, header_values)
SELECT 'fresh', 0, g, 'k-' || g, 'stale.retry', now(), 0, '\x00', '\x00', '{}', '{}'
FROM generate_series(1, 5000) AS g`)
			mustExec(t, conn, "SELECT pg_stat_force_next_flush()")
		}, 1000, 0},
		{"empty", func(t *testing.T, pool *pgxpool.Pool) {}, 0, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.NewDB(t)
			c.setup(t, db.Pool)
			got, err := keylock.AnalyzeIfStale(t.Context(), db.Pool, c.minRows)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != c.want {
				t.Fatalf("analyzed %v, want %d tables", got, c.want)
			}
			if c.want == 0 {
				return
			}
			// The tables and their indexes: an index counted empty makes a
			// whole scan of it look free.
			for _, rel := range []string{"deferred_key", "deferred_key_business_key", "deferred_message", "deferred_message_pkey"} {
				var est float64
				if err := db.Pool.QueryRow(t.Context(), "SELECT reltuples FROM pg_class WHERE relname = $1", rel).Scan(&est); err != nil {
					t.Fatal(err)
				}
				if est < 4_000 {
					t.Errorf("%s estimated at %v rows after the analyze, holds 5,000", rel, est)
				}
			}
			again, err := keylock.AnalyzeIfStale(t.Context(), db.Pool, c.minRows)
			if err != nil {
				t.Fatal(err)
			}
			if len(again) != 0 {
				t.Errorf("analyzed %v again with fresh statistics", again)
			}
		})
	}
}

// Finalize finds its messages by the primary key whatever the statistics
// say. Its state test (pending) implies the predicate of the partial index
// deferred_message_key_order; with statistics taken while the queue was
// nearly empty, the planner once costed a scan of that whole index at next
// to nothing and ANDed it with the primary key's probes, reading every
// pending message's entry and page per finalize (dispatch_delete.sql). The
// plans of both finalize statements that find messages by id, custom and
// generic, on the stale state before AnalyzeIfStale runs, must not name it.
func TestFinalizeFindsMessagesByPrimaryKey(t *testing.T) {
	const rows, batch = 20_000, 500
	ctx := t.Context()
	db := pgtest.NewDB(t)
	staleState(t, db.Pool, rows, 1)
	var ids []int64
	if err := db.Pool.QueryRow(ctx, "SELECT array_agg(id ORDER BY id) FROM (SELECT id FROM deferred_message ORDER BY id LIMIT $1) s",
		batch).Scan(&ids); err != nil {
		t.Fatal(err)
	}
	partitions, offsets := make([]int32, batch), make([]int64, batch)
	claimed := make([]time.Time, batch)
	reasons := make([]string, batch)
	for i := range offsets {
		offsets[i] = int64(i)
		claimed[i] = time.Now()
		reasons[i] = "test"
	}
	for _, c := range []struct {
		file string
		args []any
	}{
		{"dispatch_delete.sql", []any{ids, partitions, offsets, claimed}},
		{"dispatch_park.sql", []any{ids, reasons}},
	} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			t.Run(c.file+"/"+mode, func(t *testing.T) {
				tx, err := db.Pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(context.WithoutCancel(ctx))
				mustExec(t, tx, "SET LOCAL plan_cache_mode = "+mode)
				rows, err := tx.Query(ctx, "EXPLAIN "+statementSQL(t, c.file), c.args...)
				if err != nil {
					t.Fatal(err)
				}
				plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
				if err != nil {
					t.Fatal(err)
				}
				text := strings.Join(plan, "\n")
				if strings.Contains(text, "deferred_message_key_order") || !strings.Contains(text, "deferred_message_pkey") {
					t.Errorf("%s finds its %d ids among %d rows with stale statistics by:\n%s\nwant deferred_message_pkey alone",
						c.file, batch, rows, text)
				}
			})
		}
	}
}

// Unordered messages (no business key) and their heads are found by id
// whatever the statistics say, like finalize's messages (above). Written
// plainly, the state test of deferred_key_refresh's unordered branch implies
// the predicate of deferred_message_key_order, whose first column is the
// business key, and "business_key IS NULL" on deferred_key is a condition on
// deferred_key_business_key: with stale statistics the planner ANDed in a
// scan of every unordered entry of either index. Each statement below, run
// for a batch of unordered ids on the stale state, may read only the batch's
// entries of those indexes, counted in pg_stat_user_indexes. Before
// migration 0014 the refresh read 40,000 entries of the first (20,000 per
// statement) and the release 20,000 of the second.
func TestUnorderedHeadsAreFoundById(t *testing.T) {
	for _, drained := range []string{"ANALYZE", "VACUUM"} {
		t.Run(drained, func(t *testing.T) {
			t.Parallel()
			unorderedByIdAfter(t, drained+" deferred_message, deferred_key")
		})
	}
}

// unorderedByIdAfter is TestUnorderedHeadsAreFoundById on tables drained
// and then analyzed or vacuumed (drained).
func unorderedByIdAfter(t *testing.T, drained string) {
	const rows, batch = 20_000, 500
	ctx := t.Context()
	db := pgtest.NewDB(t)
	staleStateAfter(t, db.Pool, rows, 0, drained)
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	mustExec(t, conn, "SET stats_fetch_consistency = none")
	indexes := []string{"deferred_message_key_order", "deferred_key_business_key"}
	// The entries read so far, once this backend's counts are sent (at the
	// end of the statement after the forced flush is asked for).
	entriesRead := func() map[string]int64 {
		t.Helper()
		mustExec(t, conn, "SELECT pg_stat_force_next_flush()")
		return countsByName(t, conn, `SELECT indexrelname::text, idx_tup_read FROM pg_stat_user_indexes
			WHERE indexrelname = ANY ($1)`, indexes)
	}
	var ids []int64
	if err := conn.QueryRow(ctx, "SELECT array_agg(id ORDER BY id) FROM (SELECT id FROM deferred_message ORDER BY id LIMIT $1) s",
		batch).Scan(&ids); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		run  func(tx pgx.Tx) error
	}{
		// The messages still pending: their heads are read and kept.
		{"refresh", func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT deferred_key_refresh('{}', $1)", ids)
			return err
		}},
		// Finalize's way: the messages deleted, the trigger refreshes
		// (and removes) their heads, the heads are released.
		{"delete", func(tx pgx.Tx) error {
			return queries.DispatchDelete(ctx, tx, queries.DispatchDeleteParams{IDs: ids})
		}},
		{"release", func(tx pgx.Tx) error {
			return queries.DispatchReleaseUnordered(ctx, tx, queries.DispatchReleaseUnorderedParams{Heads: ids,
				Owner: "stale-stats", BackoffBase: time.Second, BackoffMax: time.Minute})
		}},
	} {
		before := entriesRead()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.run(tx); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		after := entriesRead()
		for _, index := range indexes {
			if read := after[index] - before[index]; read > 2*batch {
				t.Errorf("%s: %d unordered messages among %d with stale statistics read %d entries of %s, want at most %d",
					c.name, batch, rows, read, index, 2*batch)
			}
		}
	}
}

// A queue refilling after a VACUUM truncated it is analyzed before the
// statistics count its rows: a backend sends its counts at most once a
// second, and until the analyze every plan made meanwhile treats the table
// as empty. Its pages, all new since the VACUUM, count it at once.
func TestAnalyzeIfStaleCountsATruncatedTableByItsPages(t *testing.T) {
	ctx := t.Context()
	db := pgtest.NewDB(t)
	staleStateAfter(t, db.Pool, 0, 1, "VACUUM deferred_message, deferred_key")
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// A backend's first transaction sends its counts; the next ones within
	// a second keep theirs.
	mustExec(t, conn, "SELECT pg_stat_force_next_flush()")
	mustExec(t, conn, "SELECT 1")
	mustExec(t, conn, `
INSERT INTO deferred_message (source_topic, source_partition, source_offset, business_key, target_topic,
    next_run_at, attempt, key, value, header_keys, header_values)
SELECT 'refill', 0, g, 'r-' || g, 'stale.retry', now(), 0, '\x00', convert_to(repeat('x', 100), 'UTF8'), '{}', '{}'
FROM generate_series(1, 5000) AS g`)
	var live int64
	if err := db.Pool.QueryRow(ctx, "SELECT n_live_tup FROM pg_stat_user_tables WHERE relname = 'deferred_message'").Scan(&live); err != nil {
		t.Fatal(err)
	}
	if live >= 1000 {
		t.Skipf("the statistics counted the refill already (%d rows): the insert took over a second", live)
	}
	analyzed, err := keylock.AnalyzeIfStale(ctx, db.Pool, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(analyzed, "deferred_message") {
		t.Errorf("analyzed %v with 5,000 rows in a truncated deferred_message the statistics counted at %d, want it analyzed", analyzed, live)
	}
}

// A table someone else is analyzing or vacuuming (here: holding the lock
// they take) is skipped after lock_timeout rather than waited for, and the
// other table is still analyzed; the next call picks the skipped one up.
func TestAnalyzeIfStaleSkipsALockedTable(t *testing.T) {
	ctx := t.Context()
	db := pgtest.NewDB(t)
	staleState(t, db.Pool, 5_000, 1)

	holder, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(context.WithoutCancel(ctx))
	mustExec(t, holder, "LOCK TABLE deferred_key IN SHARE UPDATE EXCLUSIVE MODE")

	start := time.Now()
	got, err := keylock.AnalyzeIfStale(ctx, db.Pool, 1000)
	if err != nil {
		t.Fatalf("with deferred_key locked: %v", err)
	}
	if !slices.Equal(got, []string{"deferred_message"}) {
		t.Fatalf("analyzed %v with deferred_key locked, want [deferred_message]", got)
	}
	// lock_timeout is 200ms; a generous bound, only to catch waiting for
	// the lock's holder.
	if waited := time.Since(start); waited > 10*time.Second {
		t.Errorf("AnalyzeIfStale took %v with deferred_key locked: it waited for the lock", waited)
	}

	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got, err = keylock.AnalyzeIfStale(ctx, db.Pool, 1000); err != nil || !slices.Equal(got, []string{"deferred_key"}) {
		t.Fatalf("after the lock went: analyzed %v (%v), want [deferred_key]", got, err)
	}
}

// TestRoundReadsOnlyItsHeads: a whole round (a claim of 500 heads among
// 20,000 keys, and its finalize), with fresh statistics, reads its heads and
// their messages, not the tables. Two plans read every head below about
// 65,000 keys, which the smaller batch of
// TestStaleStatisticsKeepWorkProportionalToBatch does not show: the claim
// leasing its heads through a join on ctid (a hash join over a sequential
// scan; dispatch_claim.sql now leases them by a TID scan), and the release
// naming keys and unordered heads in one WHERE (a sequential scan;
// dispatch_release.sql and dispatch_release_unordered.sql are apart).
func TestRoundReadsOnlyItsHeads(t *testing.T) {
	const (
		keys       = 20_000
		batch      = 500
		perMessage = 8
	)
	for _, s := range []step{
		{"own keys (head gone)", 1, func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error {
			return finalize(ctx, tx, ids, keys, nil)
		}},
		{"two per key (head moves, key released)", 2, func(ctx context.Context, tx pgx.Tx, ids []int64, keys []string) error {
			return finalize(ctx, tx, ids, keys, nil)
		}},
	} {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.NewDB(t)
			staleState(t, db.Pool, keys*s.perKey, s.perKey)
			if _, err := keylock.AnalyzeIfStale(t.Context(), db.Pool, 1000); err != nil {
				t.Fatal(err)
			}
			claimRead, stepRead := runStep(t, db.Pool, s, batch, true)
			for table, n := range claimRead {
				if n > perMessage*batch {
					t.Errorf("claim read %d rows of %s for %d heads among %d keys (limit %d): a plan walks the table",
						n, table, batch, keys, perMessage*batch)
				}
			}
			for table, n := range stepRead {
				if n > perMessage*batch {
					t.Errorf("finalize read %d rows of %s for %d messages among %d keys (limit %d): a plan walks the table",
						n, table, batch, keys, perMessage*batch)
				}
			}
		})
	}
}
