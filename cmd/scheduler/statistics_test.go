package main

import (
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/pgtest"
)

// The running service analyzes the queue tables when their statistics have
// fallen far behind (see internal/keylock's stale-statistics tests for why
// and for what the plans do otherwise): here, tables analyzed while empty
// and then filled with 5,000 far-future messages.
func TestServiceAnalyzesStaleQueueTables(t *testing.T) {
	ctx := t.Context()
	db := pgtest.NewDB(t)
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fill := func(from, to int) {
		t.Helper()
		if _, err := conn.Exec(ctx, `
INSERT INTO deferred_message (source_topic, source_partition, source_offset, business_key, target_topic,
    next_run_at, attempt, key, value, header_keys, header_values)
SELECT 'stale', 0, g, 'k-' || g, 'orders.retry', now() + interval '1 day', 0, '\x00', '\x00', '{}', '{}'
FROM generate_series($1::bigint, $2::bigint) AS g`, from, to); err != nil {
			t.Fatal(err)
		}
	}
	for _, q := range []string{
		"ALTER TABLE deferred_message SET (autovacuum_enabled = false)",
		"ALTER TABLE deferred_key SET (autovacuum_enabled = false)",
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	fill(1, 2000)
	for _, q := range []string{"DELETE FROM deferred_message", "ANALYZE deferred_message, deferred_key"} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	fill(100_001, 105_000)
	// So that pg_stat_user_tables counts the rows at once.
	if _, err := conn.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
		t.Fatal(err)
	}
	conn.Release()

	p := start(t, serviceEnv(db.URL, broker(t), "statistics"))
	const want = "analyzed queue tables whose statistics had fallen behind"
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(p.Logs(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q in the service's log after 20s", want)
		}
		time.Sleep(100 * time.Millisecond)
	}
	var est float64
	if err := db.Pool.QueryRow(ctx, "SELECT reltuples FROM pg_class WHERE relname = 'deferred_key'").Scan(&est); err != nil {
		t.Fatal(err)
	}
	if est < 4_000 {
		t.Errorf("deferred_key estimated at %v rows after the service's analyze, holds 5,000", est)
	}
}
