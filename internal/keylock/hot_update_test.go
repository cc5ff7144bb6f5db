package keylock_test

import (
	"fmt"
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
//
// A release is HOT only if pruning can free the claim's old versions on
// their page, which it cannot while a snapshot older than the claim is
// held where it counts; then all but one release per page go to a new
// page. CI read exactly that twice (1,900 HOT claims, 100 HOT releases),
// and a snapshot held by a second connection to the test's database across
// the test reproduces it. So autovacuum is off for the test's tables (an
// ANALYZE holds one), the release waits until every transaction of the
// server older than it has ended, and a measurement spoiled anyway is
// repeated in a fresh database, up to three times, with what held the
// horizon logged. A schema whose releases cannot be HOT fails all three.
func TestClaimUpdatesAreHOT(t *testing.T) {
	const attempts = 3
	for i := 1; ; i++ {
		problem, holders := measureHOT(t)
		if problem == "" {
			return
		}
		if i == attempts {
			t.Fatalf("%s (attempt %d of %d; other transactions of the server then: %s)", problem, i, attempts, holders)
		}
		t.Logf("%s (attempt %d of %d; other transactions of the server then: %s); measuring again", problem, i, attempts, holders)
	}
}

// measureHOT claims and releases 2,000 keys in a fresh database and
// returns what fell short of the HOT shares wanted ("" when none), with the
// server's other transactions at the time.
func measureHOT(t *testing.T) (problem, holders string) {
	t.Helper()
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

	waitOlderTransactions(t, pool)
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
		problem = fmt.Sprintf("%.0f%% of the claims' updates were HOT, want at least 90%%", 100*share)
	}

	// Released unpublished, every key keeps its head and loses its lease:
	// failures is written back unchanged (0), which keeps the release HOT
	// although deferred_key_failing indexes failures (migration 0010).
	waitOlderTransactions(t, pool)
	holders = otherTransactions(t, pool)
	if err := l.Finalize(ctx, claims, keylock.Outcome{}); err != nil {
		t.Fatal(err)
	}
	all2, hot2 := updates()
	all, hot = all2-all1, hot2-hot1
	t.Logf("%d released keys: %d updates of deferred_key, %d HOT", len(claims), all, hot)
	if all < int64(len(claims)) {
		t.Fatalf("%d updates of deferred_key for %d released keys: the statistics were not flushed", all, len(claims))
	}
	if share := float64(hot) / float64(all); share < 0.9 && problem == "" {
		problem = fmt.Sprintf("%.0f%% of the releases' updates were HOT, want at least 90%%", 100*share)
	}
	return problem, holders
}

// waitOlderTransactions waits until no other backend of the server holds a
// transaction id or a snapshot from before this call (in any database: a
// snapshot in the test's own database keeps the claim's old versions from
// being pruned, and what else may is not known), up to 30 s; a holder that
// outlasts that is left to spoil the measurement, which then says so.
func waitOlderTransactions(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	var now string
	if err := pool.QueryRow(t.Context(), "SELECT pg_current_xact_id()::text").Scan(&now); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var older int
		if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE pid <> pg_backend_pid()
			  AND (age(backend_xmin) >= age($1::xid) OR age(backend_xid) >= age($1::xid))`, now).Scan(&older); err != nil {
			t.Fatal(err)
		}
		if older == 0 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// otherTransactions describes the server's other backends that hold a
// transaction id or a snapshot, and its replication slots' horizons.
func otherTransactions(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	rows, err := pool.Query(t.Context(), `
SELECT format('%s %s in %s: xid %s, xmin %s, state %s, %s', backend_type, pid, coalesce(datname, '-'),
              coalesce(backend_xid::text, '-'), coalesce(backend_xmin::text, '-'), coalesce(state, '-'), left(query, 60))
FROM pg_stat_activity
WHERE pid <> pg_backend_pid() AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
UNION ALL
SELECT format('slot %s: xmin %s, catalog_xmin %s', slot_name, coalesce(xmin::text, '-'), coalesce(catalog_xmin::text, '-'))
FROM pg_replication_slots`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(got) == 0 {
		return "none"
	}
	return fmt.Sprint(got)
}
