package migrations_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"path"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/migrations"
	"github.com/deferq/scheduler/sql/schema"
)

// lastOldMigration is the last migration of the releases before sql/schema:
// databases those releases migrated record versions up to it and no
// definitions checksum.
const lastOldMigration = 5

func mustDefinitions(t *testing.T) []schema.Definition {
	t.Helper()
	defs, err := schema.Definitions()
	if err != nil {
		t.Fatal(err)
	}
	return defs
}

func mustChecksum(t *testing.T) string {
	t.Helper()
	sum, err := migrations.DefinitionsChecksum()
	if err != nil {
		t.Fatal(err)
	}
	return sum
}

func exec(t *testing.T, pool *pgxpool.Pool, what, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), sql, args...); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// buildFromFiles makes, in an empty database, the schema sql/schema
// describes: tables.sql, then every definition in order.
func buildFromFiles(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	exec(t, pool, "sql/schema/tables.sql", schema.Tables())
	for _, d := range mustDefinitions(t) {
		exec(t, pool, "sql/schema/"+d.Name, d.SQL)
	}
}

// TestSchemaMatchesFiles: a database migrated by Apply holds exactly the
// scheduler objects that sql/schema's files describe: tables.sql (which
// migrate never runs) and the definitions. It is what keeps tables.sql equal
// to what the numbered migrations build. It also catches objects the
// migrations made that no file defines (a function whose file was deleted
// but never dropped, an old overload left behind by a changed argument
// list). A changed function body alone does not show here, since Apply
// applies the same file: TestDefinitionsSum and
// TestUpgradeFromOldMigrations catch that.
func TestSchemaMatchesFiles(t *testing.T) {
	migrated := pgtest.NewDB(t) // its template was migrated by Apply
	files := newPool(t, emptyDB(t))
	buildFromFiles(t, files)
	if diff := catalogDiff(catalog(t, migrated.Pool, false), catalog(t, files, false), nil); diff != "" {
		t.Errorf(`the database Apply migrates (-) differs from sql/schema (+):

%s
A table, column, constraint, index or storage parameter: a numbered migration
makes it and sql/schema/tables.sql must say the same. A function, trigger or
view on one side only: its file in sql/schema/functions, views or triggers is
missing, or a numbered migration must DROP what a deleted file defined.`, diff)
	}
}

// oldBookkeeping is scheduler_migration as the releases before sql/schema
// created it.
const oldBookkeeping = `CREATE TABLE IF NOT EXISTS scheduler_migration (
	version    int PRIMARY KEY,
	name       text NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now())`

// migrateLikeOldRelease does to an empty database what `scheduler migrate`
// of a release before sql/schema did: River's migrations, then migrations
// 0001 to upTo (at most lastOldMigration), each recorded without a
// definitions checksum.
func migrateLikeOldRelease(t *testing.T, pool *pgxpool.Pool, upTo int) {
	t.Helper()
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: discard})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrator.Migrate(t.Context(), rivermigrate.DirectionUp, nil); err != nil {
		t.Fatalf("River's migrations: %v", err)
	}
	exec(t, pool, "create the old scheduler_migration", oldBookkeeping)
	for _, m := range mustAll(t) {
		if m.Version > min(upTo, lastOldMigration) {
			break
		}
		exec(t, pool, fmt.Sprintf("migration %04d", m.Version), m.SQL)
		exec(t, pool, "record it", "INSERT INTO scheduler_migration (version, name) VALUES ($1, $2)", m.Version, m.Name)
	}
}

// definitionFile returns the file of sql/schema that defines the catalog
// object key, following the files' naming: functions/<name>.sql,
// views/<name>.sql, triggers/<table>.sql; "" for objects no definition
// makes.
func definitionFile(key string) string {
	kind, name, _ := strings.Cut(key, " ")
	switch kind {
	case "function":
		fn, _, _ := strings.Cut(name, "(")
		return path.Join("functions", fn+".sql")
	case "view":
		return path.Join("views", name+".sql")
	case "trigger":
		table, _, _ := strings.Cut(name, ".")
		return path.Join("triggers", table+".sql")
	}
	return ""
}

// TestUpgradeFromOldMigrations: a database a release before sql/schema
// migrated (versions 0001 to 0005, no definitions checksum) reports the
// definitions pending, and Apply upgrades it to exactly the catalog a fresh
// database gets, River's objects and the bookkeeping included. Applying the
// definitions there changes no object whose file has not changed since
// those migrations (definitions.sum): the files say exactly what migrations
// 0001 to 0005 made, so the upgrade replaces functions, triggers and views
// by identical ones.
func TestUpgradeFromOldMigrations(t *testing.T) {
	ctx := t.Context()
	old := newPool(t, emptyDB(t))
	migrateLikeOldRelease(t, old, lastOldMigration)
	before := catalog(t, old, true)

	pending, river, err := migrations.Pending(ctx, old)
	if err != nil {
		t.Fatal(err)
	}
	wantPending := versions(mustAll(t)[lastOldMigration:])
	if len(wantPending) == 0 {
		wantPending = []int{0} // only the definitions
	}
	if !slices.Equal(versions(pending), wantPending) || river != 0 {
		t.Errorf("Pending on a database of the old release = %v and %d of River's, want %v and none", versions(pending), river, wantPending)
	}
	if len(mustAll(t)) == lastOldMigration && (len(pending) != 1 || !pending[0].IsDefinitions()) {
		t.Errorf("Pending = %+v, want the definitions", pending[0])
	}

	res, err := migrations.Apply(ctx, old, discard)
	if err != nil {
		t.Fatalf("Apply on a database of the old release: %v", err)
	}
	if !slices.Equal(versions(res.Applied), wantPending) || !res.Definitions || res.River != 0 {
		t.Errorf("Apply = ours %v, definitions %v, River %d; want %v, true, 0", versions(res.Applied), res.Definitions, res.River, wantPending)
	}
	var recorded string
	if err := old.QueryRow(ctx, "SELECT definitions FROM scheduler_migration ORDER BY version DESC LIMIT 1").Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if sum := mustChecksum(t); recorded != sum {
		t.Errorf("recorded definitions %q, want %q", recorded, sum)
	}
	if p, _, err := migrations.Pending(ctx, old); err != nil || len(p) != 0 {
		t.Errorf("Pending after the upgrade = %v, %v; want none", versions(p), err)
	}
	after := catalog(t, old, true)

	fresh := newPool(t, emptyDB(t))
	if _, err := migrations.Apply(ctx, fresh, discard); err != nil {
		t.Fatal(err)
	}
	if diff := catalogDiff(catalog(t, fresh, true), after, nil); diff != "" {
		t.Errorf("a database upgraded from the old release (+) differs from a fresh one (-):\n%s", diff)
	}

	// The objects the definitions make, as 0001..0005 left them against
	// what the files made of them.
	sums := readSum(t)
	unchanged := func(key string) bool {
		file := definitionFile(key)
		if file == "" && strings.HasPrefix(key, "column ") {
			// A view's columns are its file's.
			table, _, _ := strings.Cut(strings.TrimPrefix(key, "column "), ".")
			if strings.HasPrefix(before["relation "+table], "kind v") {
				file = path.Join("views", table+".sql")
			}
		}
		l, ok := sums[file]
		return ok && l.version <= lastOldMigration
	}
	if diff := catalogDiff(before, after, unchanged); diff != "" {
		t.Errorf(`applying sql/schema's definitions to a database migrations 0001..%04d made (-) changed objects (+)
that definitions.sum says have not changed since those migrations:

%s
The files must define exactly what the migrations did, so that the upgrade is
harmless. If the change is meant, it needs a new numbered migration that names
the file (see TestDefinitionsSum).`, lastOldMigration, diff)
	}
}

// TestPendingReportsDefinitions: a database that received other definitions
// than this binary's (its recorded checksum differs) has them pending, even
// with every numbered migration applied; Apply applies them, alone, puts back
// a function that differed, and records the checksum.
func TestPendingReportsDefinitions(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	want := functionDef(t, db.Pool, "deferred_key_notify(timestamp with time zone)")

	// As a binary with another deferred_key_notify would have left it.
	exec(t, db.Pool, "change deferred_key_notify", `CREATE OR REPLACE FUNCTION deferred_key_notify(earliest timestamptz) RETURNS void
		LANGUAGE plpgsql AS $$ BEGIN END $$`)
	exec(t, db.Pool, "record other definitions", `UPDATE scheduler_migration SET definitions = 'other'
		WHERE version = (SELECT max(version) FROM scheduler_migration)`)

	pending, _, err := migrations.Pending(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if len(pending) != 1 || !pending[0].IsDefinitions() || !strings.Contains(pending[0].SQL, "sql/schema/functions/deferred_key_notify.sql") {
		t.Fatalf("Pending = %v, want the definitions alone", versions(pending))
	}

	res, err := migrations.Apply(ctx, db.Pool, discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Applied) != 1 || !res.Applied[0].IsDefinitions() || !res.Definitions || res.River != 0 {
		t.Errorf("Apply = ours %v, definitions %v, River %d; want the definitions alone", versions(res.Applied), res.Definitions, res.River)
	}
	if got := functionDef(t, db.Pool, "deferred_key_notify(timestamp with time zone)"); got != want {
		t.Errorf("deferred_key_notify after Apply:\n%s", lineDiff(want, got))
	}
	if got := recordedDefinitions(t, db.Pool); got != mustChecksum(t) {
		t.Errorf("recorded definitions %q, want %q", got, mustChecksum(t))
	}
	if p, _, err := migrations.Pending(ctx, db.Pool); err != nil || len(p) != 0 {
		t.Errorf("Pending after Apply = %v, %v; want none", versions(p), err)
	}
	again, err := migrations.Apply(ctx, db.Pool, discard)
	if err != nil || len(again.Applied) != 0 || again.Definitions {
		t.Errorf("second Apply = ours %v, definitions %v, %v; want nothing", versions(again.Applied), again.Definitions, err)
	}
}

// pinLikeGrants does to the functions what sql/roles/grants.sql does (for
// schema public), with its queries: the AFTER trigger functions of
// deferred_message and target_control run as the owner with search_path
// pinned, and deferred_queue_analyze and deferred_sequences_advance, where
// they exist, have it pinned too.
func pinLikeGrants(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	rows, err := pool.Query(t.Context(), `
		SELECT DISTINCT format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %I, pg_temp', t.tgfoid::regprocedure, 'public')
		FROM pg_trigger t
		WHERE t.tgrelid IN ('deferred_message'::regclass, 'target_control'::regclass)
		  AND NOT t.tgisinternal
		  AND t.tgtype & 2 = 0
		UNION ALL
		SELECT format('ALTER FUNCTION %s SET search_path = %I, pg_temp', p.oid::regprocedure, 'public')
		FROM pg_proc p
		WHERE p.proname IN ('deferred_queue_analyze', 'deferred_sequences_advance')
		  AND p.pronamespace = 'public'::regnamespace`)
	if err != nil {
		t.Fatal(err)
	}
	stmts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(stmts) < 5 {
		t.Fatalf("grants.sql's queries found %d functions to pin", len(stmts))
	}
	for _, s := range stmts {
		exec(t, pool, "pin like grants.sql", s)
	}
}

// TestUpgradeKeepsGrants: upgrading a database of the release before
// sql/schema, on which grants.sql ran, changes none of the scheduler's
// objects, so grants.sql need not run again: the functions Apply replaced
// by identical ones keep the SECURITY DEFINER and search_path grants.sql
// set, and Apply warns about none.
func TestUpgradeKeepsGrants(t *testing.T) {
	if len(mustAll(t)) > lastOldMigration {
		t.Skip("the binary has migrations after the old release's: TestApplyKeepsGrantsOfUnchangedFunctions covers what an upgrade then keeps")
	}
	pool := newPool(t, emptyDB(t))
	migrateLikeOldRelease(t, pool, lastOldMigration)
	pinLikeGrants(t, pool)
	before := catalog(t, pool, false)

	var logs bytes.Buffer
	res, err := migrations.Apply(t.Context(), pool, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if !res.Definitions {
		t.Error("Apply did not apply the definitions")
	}
	if diff := catalogDiff(before, catalog(t, pool, false), nil); diff != "" {
		t.Errorf("upgrading a database that grants.sql set up changed it (- before, + after):\n%s", diff)
	}
	if out := logs.String(); strings.Contains(out, "level=WARN") || !strings.Contains(out, "deferred_key_after_update()") {
		t.Errorf("want an info line naming the functions whose settings were kept, and no warning; logged:\n%s", out)
	}
}

// TestApplyKeepsGrantsOfUnchangedFunctions: on a database at migration 0002
// set up by grants.sql, Apply keeps SECURITY DEFINER and the search_path on
// the functions whose definitions have not changed since 0002
// (deferred_key_after_update), and warns, naming grants.sql, about those
// that changed and so lost them (deferred_key_refresh, changed by 0003, and
// deferred_key_after_insert, changed by 0016).
func TestApplyKeepsGrantsOfUnchangedFunctions(t *testing.T) {
	pool := newPool(t, emptyDB(t))
	migrateLikeOldRelease(t, pool, 2)
	pinLikeGrants(t, pool)
	sums := readSum(t)
	if sums["functions/deferred_key_after_update.sql"].version > 2 || sums["functions/deferred_key_refresh.sql"].version <= 2 ||
		sums["functions/deferred_key_after_insert.sql"].version <= 2 {
		t.Skip("deferred_key_after_update changed after 0002, or deferred_key_refresh or deferred_key_after_insert did not: pick other functions")
	}
	exec(t, pool, "pin deferred_key_refresh too", `ALTER FUNCTION deferred_key_refresh(text[], bigint[]) SECURITY DEFINER SET search_path = public, pg_temp`)

	var logs bytes.Buffer
	res, err := migrations.Apply(t.Context(), pool, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if !res.Definitions {
		t.Error("Apply did not apply the definitions")
	}
	settings := func(fn string) string {
		t.Helper()
		var s string
		if err := pool.QueryRow(t.Context(), `SELECT format('definer=%s config=%s', prosecdef, coalesce(proconfig, '{}'))
			FROM pg_proc WHERE oid = $1::regprocedure`, fn).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	if got, want := settings("deferred_key_after_update()"), `definer=t config={plan_cache_mode=force_custom_plan,"search_path=public, pg_temp"}`; got != want {
		t.Errorf("deferred_key_after_update, whose file did not change since 0002: %s, want %s", got, want)
	}
	if got, want := settings("deferred_key_after_insert()"), `definer=f config={plan_cache_mode=auto}`; got != want {
		t.Errorf("deferred_key_after_insert, changed by 0016: %s, want %s (what its file says)", got, want)
	}
	if got, want := settings("deferred_key_refresh(text[],bigint[])"), `definer=f config={plan_cache_mode=auto}`; got != want {
		t.Errorf("deferred_key_refresh, changed by 0003: %s, want %s (what its file says)", got, want)
	}
	out := logs.String()
	warn := ""
	for line := range strings.Lines(out) {
		if strings.Contains(line, "level=WARN") {
			warn += line
		}
	}
	if !strings.Contains(warn, "grants.sql") || !strings.Contains(warn, "deferred_key_refresh(text[],bigint[])") ||
		!strings.Contains(warn, "deferred_key_after_insert()") || strings.Contains(warn, "deferred_key_after_update") {
		t.Errorf("want a warning naming grants.sql, deferred_key_refresh and deferred_key_after_insert, not deferred_key_after_update; logged:\n%s", out)
	}
}

func functionDef(t *testing.T, pool *pgxpool.Pool, signature string) string {
	t.Helper()
	var def string
	if err := pool.QueryRow(context.WithoutCancel(t.Context()), "SELECT pg_get_functiondef($1::regprocedure)", signature).Scan(&def); err != nil {
		t.Fatalf("pg_get_functiondef(%s): %v", signature, err)
	}
	return def
}
