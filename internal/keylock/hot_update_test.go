package keylock_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// A claim leases every head it takes, most of a page of deferred_key at
// once. The lease columns are not indexed, so each lease is a HOT update
// (no new index entries, the old version pruned in place) when the new
// version fits on its page: migration 0004's fillfactor makes room for all
// of them. At the previous fillfactor (70) about 42% of a claim's leases
// were HOT. Releasing them is HOT too: the release writes failures back
// unchanged, and no index holds a lease column.
func TestClaimUpdatesAreHOT(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	// One connection: the claims' statistics are flushed from it below.
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	// A release is HOT only if pruning can free the claim's old versions on
	// their page, which it cannot while another backend of this database
	// holds a snapshot older than the claim; then all but one release per
	// page go to a new page. A CI run read exactly that (1,900 HOT claims,
	// 100 HOT releases), and a snapshot held by a second connection across
	// the test reproduces it. In a test database the only other backend is
	// autovacuum, whose ANALYZE of the rows inserted below holds one. The
	// test measures the schema, so autovacuum is off for its tables.
	mustExec(t, pool, `DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT c.oid::regclass AS t FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.relkind = 'r' AND n.nspname NOT IN ('pg_catalog', 'information_schema') LOOP
        EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = off)', r.t);
    END LOOP;
END $$`)

	const keys = 2000
	mustExec(t, pool, `
INSERT INTO deferred_message (source_topic, source_partition, source_offset, business_key, target_topic,
    next_run_at, key, value, header_keys, header_values)
SELECT 'hot', 0, g, 'order-' || g, 'orders.retry', now(), '\x00', '\x00', '{}', '{}'
FROM generate_series(1, $1::int) AS g`, keys)
	updates := func() (all, hot int64) {
		t.Helper()
		mustExec(t, pool, "SELECT pg_stat_force_next_flush()")
		if err := pool.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
			WHERE relname = 'deferred_key'`).Scan(&all, &hot); err != nil {
			t.Fatal(err)
		}
		return all, hot
	}
	all0, hot0 := updates()

	waitNoOtherSnapshot(t, pool)

	l := newLocker(t, pool, "hot", time.Minute, 1)
	claimed := 0
	var claims []keylock.Claim
	for claimed < keys {
		cs, err := l.Claim(ctx, 500)
		if err != nil {
			t.Fatal(err)
		}
		if len(cs) == 0 {
			t.Fatalf("claimed %d of %d due keys, then none", claimed, keys)
		}
		claimed += len(cs)
		claims = append(claims, cs...)
	}
	all1, hot1 := updates()
	all, hot := all1-all0, hot1-hot0
	t.Logf("%d claimed keys: %d updates of deferred_key, %d HOT", claimed, all, hot)
	if all < keys {
		t.Fatalf("%d updates of deferred_key for %d claimed keys: the statistics were not flushed", all, keys)
	}
	if share := float64(hot) / float64(all); share < 0.9 {
		t.Errorf("%.0f%% of the claims' updates were HOT, want at least 90%%", 100*share)
	}

	// Released unpublished, every key keeps its head and loses its lease:
	// failures is written back unchanged (0), which keeps the release HOT
	// although deferred_key_failing indexes failures (migration 0010).
	if err := l.Finalize(ctx, claims, keylock.Outcome{}); err != nil {
		t.Fatal(err)
	}
	all2, hot2 := updates()
	all, hot = all2-all1, hot2-hot1
	t.Logf("%d released keys: %d updates of deferred_key, %d HOT", len(claims), all, hot)
	if all < int64(len(claims)) {
		t.Fatalf("%d updates of deferred_key for %d released keys: the statistics were not flushed", all, len(claims))
	}
	if share := float64(hot) / float64(all); share < 0.9 {
		t.Errorf("%.0f%% of the releases' updates were HOT, want at least 90%%", 100*share)
	}
}

// waitNoOtherSnapshot waits until no other backend of the database holds a
// snapshot or a transaction id, so that pruning may remove what this test's
// own committed statements left dead: an autovacuum worker that had started
// before autovacuum was turned off finishes within seconds.
func waitNoOtherSnapshot(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var others []string
		rows, err := pool.Query(t.Context(), `SELECT backend_type || ' ' || pid || ': ' || left(query, 80)
			FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()
			  AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)`)
		if err == nil {
			others, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(others) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("other backends of the test database still hold snapshots after 30 s: %v", others)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
