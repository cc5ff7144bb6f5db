package migrations_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/migrations"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var discard = slog.New(slog.DiscardHandler)

// emptyDB creates a database with nothing in it (pgtest.NewDB's are already
// migrated), drops it after the test, and returns a pool config for it.
func emptyDB(t *testing.T) *pgxpool.Config {
	t.Helper()
	return emptyDBWith(t, "")
}

// emptyDBWith is emptyDB with options for CREATE DATABASE (a template, a
// collation).
func emptyDBWith(t *testing.T, options string) *pgxpool.Config {
	t.Helper()
	adminURL := pgtest.AdminURL(t)
	var b [6]byte
	rand.Read(b[:])
	name := "mig_" + hex.EncodeToString(b[:])

	admin, err := pgx.Connect(t.Context(), adminURL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(t.Context(), "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" "+options); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		c, err := pgx.Connect(ctx, adminURL)
		if err != nil {
			t.Errorf("drop database %s: %v", name, err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	cfg, err := pgxpool.ParseConfig(adminURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Database = name
	return cfg
}

func newPool(t *testing.T, cfg *pgxpool.Config) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg.Copy())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func versions(ms []migrations.Migration) []int {
	out := make([]int, len(ms))
	for i, m := range ms {
		out[i] = m.Version
	}
	return out
}

// recorded returns scheduler_migration's versions, one entry per row.
func recorded(t *testing.T, pool *pgxpool.Pool) []int {
	t.Helper()
	rows, err := pool.Query(t.Context(), "SELECT version FROM scheduler_migration ORDER BY version")
	if err != nil {
		t.Fatal(err)
	}
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		t.Fatal(err)
	}
	return vs
}

// recordedDefinitions returns the definitions checksum recorded on
// scheduler_migration's highest version.
func recordedDefinitions(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var sum *string
	if err := pool.QueryRow(t.Context(), "SELECT definitions FROM scheduler_migration ORDER BY version DESC LIMIT 1").Scan(&sum); err != nil {
		t.Fatal(err)
	}
	if sum == nil {
		return ""
	}
	return *sum
}

func mustAll(t *testing.T) []migrations.Migration {
	t.Helper()
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	if len(all) == 0 {
		t.Fatal("no migrations embedded")
	}
	return all
}

func TestAll(t *testing.T) {
	all := mustAll(t)
	for i, m := range all {
		if i > 0 && m.Version <= all[i-1].Version {
			t.Errorf("migration %d (%s) follows %d: versions must increase", m.Version, m.Name, all[i-1].Version)
		}
		if m.Name == "" || m.SQL == "" {
			t.Errorf("migration %d: empty name or SQL", m.Version)
		}
	}
	if all[0].Version != 1 || all[0].Name != "deferred_message" {
		t.Errorf("first migration = %d_%s, want 1_deferred_message", all[0].Version, all[0].Name)
	}
}

// TestApplyFreshThenAgain: on an empty database Apply applies River's and
// every one of ours; a second Apply applies nothing.
func TestApplyFreshThenAgain(t *testing.T) {
	all := mustAll(t)
	pool := newPool(t, emptyDB(t))
	ctx := t.Context()

	pending, river, err := migrations.Pending(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	if river == 0 {
		t.Error("Pending on an empty database reports no River migration pending")
	}
	if !slices.Equal(versions(pending), versions(all)) {
		t.Errorf("Pending on an empty database = %v, want every migration %v", versions(pending), versions(all))
	}

	first, err := migrations.Apply(ctx, pool, discard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(versions(first.Applied), versions(all)) || !first.Definitions || first.River == 0 {
		t.Errorf("first Apply: ours %v, definitions %v, River %d; want %v, the definitions and some River migrations",
			versions(first.Applied), first.Definitions, first.River, versions(all))
	}
	if got, want := recordedDefinitions(t, pool), mustChecksum(t); got != want {
		t.Errorf("recorded definitions %q, want %q", got, want)
	}
	for _, table := range []string{"deferred_message", "deferred_key", "river_job", "scheduler_migration"} {
		var ok bool
		if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", table).Scan(&ok); err != nil || !ok {
			t.Errorf("table %s missing after Apply (%v)", table, err)
		}
	}

	second, err := migrations.Apply(ctx, pool, discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(second.Applied) != 0 || second.Definitions || second.River != 0 {
		t.Errorf("second Apply: ours %v, definitions %v, River %d; want nothing", versions(second.Applied), second.Definitions, second.River)
	}
	if got := recorded(t, pool); !slices.Equal(got, versions(all)) {
		t.Errorf("scheduler_migration = %v, want %v", got, versions(all))
	}
	if pending, _, err := migrations.Pending(ctx, pool); err != nil || len(pending) != 0 {
		t.Errorf("Pending after Apply = %v, %v; want none", versions(pending), err)
	}
}

// TestApplyConcurrent: replicas starting at once all succeed, and each
// migration is applied and recorded exactly once, the definitions too: on an
// empty database (twice), and on one where the definitions alone are
// pending (migrated by a release before sql/schema).
func TestApplyConcurrent(t *testing.T) {
	all := mustAll(t)
	sum := mustChecksum(t)
	const replicas = 3
	rounds := []struct {
		name    string
		prepare func(*pgxpool.Pool)
		want    []int // what the one replica that applies anything applies
	}{
		{"empty", func(*pgxpool.Pool) {}, versions(all)},
		{"empty again", func(*pgxpool.Pool) {}, versions(all)},
		{"definitions pending", func(p *pgxpool.Pool) { migrateLikeOldRelease(t, p, lastOldMigration) }, func() []int {
			if len(all) > lastOldMigration {
				return versions(all[lastOldMigration:])
			}
			return []int{0}
		}()},
	}
	for _, round := range rounds {
		cfg := emptyDB(t)
		pools := make([]*pgxpool.Pool, replicas)
		for i := range pools {
			pools[i] = newPool(t, cfg) // a pool each, as separate processes would have
			if err := pools[i].Ping(t.Context()); err != nil {
				t.Fatal(err)
			}
		}
		round.prepare(pools[0])
		var riverBefore int
		if round.name == "definitions pending" {
			if err := pools[0].QueryRow(t.Context(), "SELECT count(*) FROM river_migration").Scan(&riverBefore); err != nil {
				t.Fatal(err)
			}
		}
		results := make([]migrations.Result, replicas)
		errs := make([]error, replicas)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range replicas {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				results[i], errs[i] = migrations.Apply(t.Context(), pools[i], discard)
			}()
		}
		close(start)
		wg.Wait()

		var ours, river, appliers, definers int
		for i := range replicas {
			if errs[i] != nil {
				t.Errorf("round %s: replica %d: Apply: %v", round.name, i, errs[i])
			}
			ours += len(results[i].Applied)
			river += results[i].River
			if results[i].Definitions {
				definers++
			}
			if len(results[i].Applied) > 0 {
				appliers++
				if !slices.Equal(versions(results[i].Applied), round.want) || !results[i].Definitions {
					t.Errorf("round %s: replica %d applied %v (definitions %v), want all of %v and the definitions, or nothing",
						round.name, i, versions(results[i].Applied), results[i].Definitions, round.want)
				}
			}
		}
		if ours != len(round.want) || appliers != 1 || definers != 1 {
			t.Errorf("round %s: %d of our migrations applied by %d replicas, the definitions by %d; want %d by one, and the definitions by the same",
				round.name, ours, appliers, definers, len(round.want))
		}
		var riverRecorded int
		if err := pools[0].QueryRow(t.Context(), "SELECT count(*) FROM river_migration").Scan(&riverRecorded); err != nil {
			t.Fatal(err)
		}
		if river != riverRecorded-riverBefore {
			t.Errorf("round %s: replicas report %d River migrations applied, river_migration has %d new", round.name, river, riverRecorded-riverBefore)
		}
		if got := recorded(t, pools[0]); !slices.Equal(got, versions(all)) {
			t.Errorf("round %s: scheduler_migration = %v, want each of %v once", round.name, got, versions(all))
		}
		if got := recordedDefinitions(t, pools[0]); got != sum {
			t.Errorf("round %s: recorded definitions %q, want %q", round.name, got, sum)
		}
		var triggers int
		if err := pools[0].QueryRow(t.Context(), `SELECT count(*) FROM pg_trigger
			WHERE tgrelid = 'deferred_message'::regclass AND NOT tgisinternal`).Scan(&triggers); err != nil {
			t.Fatal(err)
		}
		if triggers != 12 {
			t.Errorf("round %s: deferred_message has %d triggers, want 12 (heads and key changes on insert, update, delete, truncate; touch; history on insert, update, delete)", round.name, triggers)
		}
	}
}

// TestMigratedDB: a database pgtest migrated has nothing pending, and Apply
// finds nothing to do.
func TestMigratedDB(t *testing.T) {
	db := pgtest.NewDB(t)
	pending, _, err := migrations.Pending(t.Context(), db.Pool)
	if err != nil || len(pending) != 0 {
		t.Errorf("Pending = %v, %v; want none", versions(pending), err)
	}
	res, err := migrations.Apply(t.Context(), db.Pool, discard)
	if err != nil || len(res.Applied) != 0 || res.Definitions || res.River != 0 {
		t.Errorf("Apply = ours %v, definitions %v, River %d, %v; want nothing", versions(res.Applied), res.Definitions, res.River, err)
	}
}

// TestPendingReportsMissing: a version missing from scheduler_migration is
// pending.
func TestPendingReportsMissing(t *testing.T) {
	db := pgtest.NewDB(t)
	if _, err := db.Pool.Exec(t.Context(), "DELETE FROM scheduler_migration WHERE version = 1"); err != nil {
		t.Fatal(err)
	}
	pending, _, err := migrations.Pending(t.Context(), db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if got := versions(pending); !slices.Equal(got, []int{1}) {
		t.Errorf("Pending = %v, want [1]", got)
	}
}

// TestSchemaTooNew: a database migrated by a newer release (it records a
// version this binary lacks) is refused by Apply and Pending, Apply changes
// nothing, and it gives the migration lock back.
func TestSchemaTooNew(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, "INSERT INTO scheduler_migration (version, name) VALUES (9999, 'from_the_future')"); err != nil {
		t.Fatal(err)
	}
	before := recorded(t, db.Pool)

	for attempt := range 2 { // the second would hang if the first kept the advisory lock
		actx, cancel := context.WithTimeout(ctx, 30*time.Second)
		res, err := migrations.Apply(actx, db.Pool, discard)
		cancel()
		if !errors.Is(err, migrations.ErrSchemaTooNew) {
			t.Errorf("Apply #%d error = %v, want ErrSchemaTooNew", attempt+1, err)
		}
		if len(res.Applied) != 0 {
			t.Errorf("Apply #%d applied %v", attempt+1, versions(res.Applied))
		}
	}
	if _, _, err := migrations.Pending(ctx, db.Pool); !errors.Is(err, migrations.ErrSchemaTooNew) {
		t.Errorf("Pending error = %v, want ErrSchemaTooNew", err)
	}
	if got := recorded(t, db.Pool); !slices.Equal(got, before) {
		t.Errorf("scheduler_migration changed: %v, was %v", got, before)
	}
	var held int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
		WHERE l.locktype = 'advisory' AND d.datname = current_database()`).Scan(&held); err != nil {
		t.Fatal(err)
	}
	if held != 0 {
		t.Errorf("%d advisory locks still held after Apply failed", held)
	}
}

// TestApplySingleConnectionPool: Apply holds one pool connection for the
// advisory lock while rivermigrate asks the same pool for more, so on a pool
// of one connection (pool_max_conns=1 in DATABASE_URL) it waits forever.
func TestApplySingleConnectionPool(t *testing.T) {
	cfg := emptyDB(t)
	cfg.MaxConns = 1
	pool := newPool(t, cfg)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := migrations.Apply(ctx, pool, discard); err != nil {
		t.Errorf("Apply on a one-connection pool: %v", err)
	}
}

// TestUpgradeKeepsParkedRowsReleasing: rows parked under 0001 released their
// key; 0002 must not make them start holding it (later messages of the key
// may already have been delivered past them), while rows parked after it
// hold their key by default.
func TestUpgradeKeepsParkedRowsReleasing(t *testing.T) {
	all := mustAll(t)
	if len(all) < 2 || all[0].Version != 1 || all[1].Version != 2 {
		t.Fatalf("migrations = %v, want 1 and 2 first", versions(all))
	}
	pool := newPool(t, emptyDB(t))
	ctx := t.Context()
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(all[0].SQL)
	exec(`INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, state, reason) VALUES
		('a', 1, 't', now(), 'parked', 'old park'), ('a', 2, 't', now(), 'pending', NULL),
		('b', 3, 't', now(), 'pending', NULL), ('b', 4, 't', now(), 'pending', NULL)`)
	exec(all[1].SQL)

	heads := func() map[string]string {
		t.Helper()
		rows, err := pool.Query(ctx, `SELECT k.business_key, format('seq=%s held=%s due=%s', k.head_seq, k.held, k.next_run_at <> 'infinity')
			FROM deferred_key k ORDER BY 1`)
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]string{}
		for rows.Next() {
			var k, v string
			if err := rows.Scan(&k, &v); err != nil {
				t.Fatal(err)
			}
			got[k] = v
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return got
	}
	want := map[string]string{"a": "seq=2 held=f due=t", "b": "seq=3 held=f due=t"}
	if got := heads(); !maps.Equal(got, want) {
		t.Errorf("heads after upgrade = %v, want %v", got, want)
	}
	var holds bool
	var parkedAt *time.Time
	if err := pool.QueryRow(ctx, `SELECT park_holds_key, parked_at FROM deferred_message WHERE seq = 1`).Scan(&holds, &parkedAt); err != nil {
		t.Fatal(err)
	}
	if holds || parkedAt == nil {
		t.Errorf("row parked before the upgrade: park_holds_key = %v, parked_at = %v; want false and set", holds, parkedAt)
	}

	// Parked after the upgrade: holds its key by default.
	exec(`UPDATE deferred_message SET state = 'parked', reason = 'new park' WHERE seq = 3`)
	want["b"] = "seq=3 held=t due=f"
	if got := heads(); !maps.Equal(got, want) {
		t.Errorf("heads after parking b's head = %v, want %v", got, want)
	}
}

// applyBefore runs, with exec, the SQL of every migration in all before
// version, and returns the index of version's.
func applyBefore(t *testing.T, all []migrations.Migration, version int, exec func(string, ...any)) int {
	t.Helper()
	for i, m := range all {
		if m.Version == version {
			return i
		}
		exec(m.SQL)
	}
	t.Fatalf("no migration %04d in %v", version, versions(all))
	return 0
}

// Migration 0007 rewrites the reasons of the releases before one list of
// reason codes: dispatch's "publish_failed: <code>: ..." becomes
// "<code>: ...", an operator's "parked by operator: ..." becomes
// "operator: ...", in messages and in their history, and the rewrite is no
// change of the message (its updated_at stays).
func TestUpgradeRewritesReasonCodes(t *testing.T) {
	all := mustAll(t)
	pool := newPool(t, emptyDB(t))
	ctx := t.Context()
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%.60s: %v", sql, err)
		}
	}
	at7 := applyBefore(t, all, 7, exec)
	exec(`INSERT INTO deferred_message (id, business_key, seq, target_topic, next_run_at) VALUES
		(1, 'a', 1, 't', now()), (2, 'b', 2, 't', now()), (3, 'c', 3, 't', now()), (4, 'd', 4, 't', now())`)
	exec(`UPDATE deferred_message SET state = 'parked', reason = CASE id
		WHEN 1 THEN 'publish_failed: unknown_topic: kafka server: unknown topic'
		WHEN 2 THEN 'parked by operator: bad address'
		WHEN 3 THEN 'exhausted: after 5 retries'
		WHEN 4 THEN 'publish_failed: too_large: 2 MB' END`)
	// The touch trigger would set updated_at to now().
	exec(`ALTER TABLE deferred_message DISABLE TRIGGER deferred_message_touch`)
	exec(`UPDATE deferred_message SET updated_at = '2024-01-01T00:00:00Z'`)
	exec(`ALTER TABLE deferred_message ENABLE TRIGGER deferred_message_touch`)
	exec(all[at7].SQL)

	want := map[int64]string{
		1: "unknown_topic: kafka server: unknown topic", 2: "operator: bad address",
		3: "exhausted: after 5 retries", 4: "too_large: 2 MB",
	}
	for _, table := range []string{"deferred_message", "deferred_attempt"} {
		idCol := "id"
		if table == "deferred_attempt" {
			idCol = "message_id"
		}
		rows, err := pool.Query(ctx, fmt.Sprintf(`SELECT %s, reason FROM %s WHERE reason IS NOT NULL`, idCol, table))
		if err != nil {
			t.Fatal(err)
		}
		got := map[int64]string{}
		for rows.Next() {
			var id int64
			var reason string
			if err := rows.Scan(&id, &reason); err != nil {
				t.Fatal(err)
			}
			got[id] = reason
		}
		if !maps.Equal(got, want) {
			t.Errorf("%s reasons after 0007: %v, want %v", table, got, want)
		}
	}
	var touched int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM deferred_message WHERE updated_at <> '2024-01-01T00:00:00Z'`).Scan(&touched); err != nil {
		t.Fatal(err)
	}
	if touched != 0 {
		t.Errorf("0007 changed updated_at of %d messages", touched)
	}
}

// Migration 0011 makes business keys compare byte by byte in a database
// whose default collation is a language's (here ICU's en-US, which every
// PostgreSQL built with ICU has, whatever locales the OS holds): keys stored
// before it keep their heads, ORDER BY business_key sorts by bytes after it,
// and LIKE 'prefix%' on the key can use an index, which it cannot under a
// language collation.
func TestUpgradeKeysCompareBytewise(t *testing.T) {
	all := mustAll(t)
	cfg := emptyDBWith(t, "TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'")
	cfg.MaxConns = 1 // one connection, whose prepared statements the upgrade meets
	pool := newPool(t, cfg)
	ctx := t.Context()
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%.60s: %v", sql, err)
		}
	}
	keyOrder := func() []string {
		t.Helper()
		rows, err := pool.Query(ctx, `SELECT business_key FROM deferred_key ORDER BY business_key`)
		if err != nil {
			t.Fatal(err)
		}
		keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return keys
	}
	// The plan of a prefix search on the key, seq scans priced out: an
	// index that serves LIKE bounds its scan by the prefix (an Index Cond
	// on business_key); one that cannot is read whole.
	prefixPlan := func() string {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
			t.Fatal(err)
		}
		rows, err := tx.Query(ctx, `EXPLAIN SELECT id FROM deferred_message WHERE state = 'pending' AND business_key LIKE 'order-1%'`)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(lines, "\n")
	}

	at11 := applyBefore(t, all, 11, exec)
	exec(`INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('order-9', 1, 't', now()), ('order-10', 2, 't', now()), ('b', 3, 't', now()),
		('B', 4, 't', now()), ('order-10', 5, 't', now())`)
	// The language order, so that the test means something: en-US sorts
	// lower case before upper and skips punctuation at first.
	if got, want := keyOrder(), []string{"b", "B", "order-10", "order-9"}; !slices.Equal(got, want) {
		t.Fatalf("keys before 0011 = %q, want the language order %q", got, want)
	}
	const bounded = "Index Cond: ((business_key >= 'order-1'::text) AND (business_key < 'order-2'::text))"
	if plan := prefixPlan(); strings.Contains(plan, "business_key >=") {
		t.Fatalf("prefix search before 0011 bounded by an index:\n%s", plan)
	}
	for _, m := range all[at11:] {
		exec(m.SQL)
	}

	// A statement a connection prepared before the migration and whose
	// result holds business_key fails once (the column's collation is part
	// of the result's type), and pgx prepares it again on the next call: a
	// replica running through the upgrade sees one failed claim per
	// connection and goes on (README, "Upgrading").
	rows, err := pool.Query(ctx, `SELECT business_key FROM deferred_key ORDER BY business_key`)
	if err == nil {
		rows.Close()
		err = rows.Err()
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "0A000" {
		t.Errorf("first run of a statement prepared before 0011: %v, want SQLSTATE 0A000 (cached plan must not change result type)", err)
	}
	if got, want := keyOrder(), []string{"B", "b", "order-10", "order-9"}; !slices.Equal(got, want) {
		t.Errorf("keys after 0011 = %q, want byte order %q", got, want)
	}
	if plan := prefixPlan(); !strings.Contains(plan, bounded) || !strings.Contains(plan, "deferred_message_key_order") {
		t.Errorf("prefix search after 0011 not bounded by deferred_message_key_order (want %q):\n%s", bounded, plan)
	}
	// The heads were rebuilt with the indexes, not lost: order-10's head is
	// still its first message, and a new message of a key stored before
	// finds that key's row.
	exec(`INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('B', 6, 't', now())`)
	var heads string
	if err := pool.QueryRow(ctx, `SELECT string_agg(business_key || '=' || head_seq, ' ' ORDER BY business_key) FROM deferred_key`).Scan(&heads); err != nil {
		t.Fatal(err)
	}
	if want := "B=4 b=3 order-10=2 order-9=1"; heads != want {
		t.Errorf("heads after 0011 = %q, want %q", heads, want)
	}
}
