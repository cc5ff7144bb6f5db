// Package migrations brings a database's schema up to date: River's
// migrations, then the scheduler's numbered migrations, then the scheduler's
// definitions (functions, triggers and views, from sql/schema).
//
// # Numbered migrations
//
// Each file NNNN_name.sql is one migration, applied once, in version order,
// after River's own migrations (run through rivermigrate). Migrations are
// history: once released, a migration is never edited. They build the
// tables and move data; sql/schema/tables.sql shows what the tables look
// like after the last one.
//
// # Definitions
//
// The current text of every function, trigger and view lives in sql/schema
// (package schema: functions/, views/, triggers/), written so that it can
// be applied again (CREATE OR REPLACE). Migrations 0001 to 0005 still
// create them as they did, and Apply then applies the files over them; from
// 0006 on, migrations leave the definitions to those files. Apply applies
// all of them, in schema.Definitions' order, after the numbered migrations
// and in the same transaction, when either
//
//   - a numbered migration ran in this call (it may have dropped something a
//     definition creates, say a view over a column it retyped), or
//   - the database last received other definitions: a checksum of the files
//     is recorded in scheduler_migration.definitions, on the row of the
//     highest version, and it differs from this binary's (or is missing: a
//     database migrated before the definitions were kept in sql/schema).
//
// Pending reports definitions to apply as a Migration of their own (see
// Migration.IsDefinitions) when no numbered migration is pending, so that
// `scheduler run` refuses to start and /readyz fails until they are applied.
//
// # Changing the schema
//
// To add a column (or a table, index, constraint, storage parameter): write
// a new numbered migration that makes the change, and make the same change
// in sql/schema/tables.sql. TestSchemaMatchesFiles builds one database with
// Apply and another from tables.sql and the definitions, compares their
// catalogs, and prints the difference.
//
// To change a function, trigger or view: edit its file in sql/schema, add a
// numbered migration that names the file, for example a file
// 0006_refresh_faster.sql that holds
//
//	-- Changes sql/schema/functions/deferred_key_refresh.sql: ...why.
//
// (a migration that is only a comment is fine: the change itself is the
// file's, and reviewing it is reading that file's diff), and record the
// file's new checksum with
//
//	go test ./migrations -run TestDefinitionsSum -update
//
// which writes definitions.sum. TestDefinitionsSum fails while a definition
// differs from definitions.sum, and -update refuses unless the highest
// migration names each changed file. The migration is what keeps versions
// meaningful: a database is newer than a binary exactly when it records a
// migration the binary lacks (ErrSchemaTooNew), and since every change of
// definitions comes with a new migration, a binary that knows the
// database's highest version has that version's definitions. Without the
// migration, an older replica would see the new definitions as merely
// different, report them pending, and with --migrate put its own back. A
// recorded checksum that differs at the same version therefore means a
// database that has not received this binary's definitions (one migrated
// before they were tracked, or by a development build), and counts as
// pending, not as newer.
//
// Definitions are applied after the call's last numbered migration, so a
// migration's own statements run against the definitions the database
// already has. A migration that needs a changed function while it runs (its
// UPDATE fires a trigger that must already behave the new way) creates it
// itself too; the file then applies the same text again. Re-applying never
// drops anything: to remove a function, trigger or view, delete its file
// and DROP it in the numbered migration.
//
// # Guarantees
//
// An advisory lock serialises concurrent runners, so two replicas starting
// at once apply each migration, and the definitions, exactly once: the
// second waits for the first to finish and then finds nothing left to do.
// The numbered migrations of a call and the definitions commit together,
// in one transaction, so a database never shows a version without the
// definitions that go with it. Apply is idempotent.
//
// # Roles (sql/roles)
//
// CREATE OR REPLACE FUNCTION sets every attribute it names and resets the
// others, so applying a definition would undo what sql/roles/grants.sql set
// with ALTER FUNCTION: SECURITY DEFINER on the AFTER trigger functions, so
// that the operator role's plain UPDATEs of deferred_message and
// target_control may write the derived tables, and the search_path pinned
// on those and on the SECURITY DEFINER functions. Apply therefore puts
// SECURITY DEFINER and search_path back, as they were before the call, on
// every function whose file has not changed since the database's version
// (definitions.sum says which migration last changed each file): applying
// an unchanged definition again changes nothing, and upgrading a database
// of the releases before sql/schema needs no grants.sql. A function whose
// file did change takes what its file says, as a function a migration
// replaced always did; Apply then logs a warning naming it, and grants.sql
// must run again (after every `scheduler migrate` that applied a migration,
// as before). Other settings made with ALTER FUNCTION are not kept: put
// them in the function's file.
package migrations

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/deferq/scheduler/sql/schema"
)

//go:embed *.sql definitions.sum
var files embed.FS

// sumFile lists each definition with the migration that last changed it
// (see the package doc); TestDefinitionsSum keeps it true.
const sumFile = "definitions.sum"

// lockKey is the advisory lock all migration runners take. It is an arbitrary
// constant ("defer-sc" in ASCII) that no other user of the database shares.
const lockKey int64 = 0x64656665722d7363

// Migration is one versioned schema change, or, when IsDefinitions, the
// definitions of sql/schema as a whole.
type Migration struct {
	Version int    // from the file name's NNNN; 0 for the definitions
	Name    string // from the file name, after the version
	SQL     string // the file's statements, run in one transaction
}

// definitionsName is the Name of the Migration that stands for the
// definitions.
const definitionsName = "schema_definitions"

// IsDefinitions reports whether m stands for sql/schema's definitions
// rather than a numbered migration. Pending returns one when the
// definitions are the only thing to apply, and Apply reports one in
// Result.Applied when they were the only thing it applied.
func (m Migration) IsDefinitions() bool {
	return m.Version == 0 && m.Name == definitionsName
}

var fileName = regexp.MustCompile(`^(\d{4})_([a-z0-9_]+)\.sql$`)

// All returns the embedded numbered migrations in version order.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		return nil, fmt.Errorf("read embedded migrations: %w", err)
	}
	var out []Migration
	for _, e := range entries {
		if e.Name() == sumFile {
			continue
		}
		m := fileName.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("migration file %q: name must be NNNN_name.sql", e.Name())
		}
		v, _ := strconv.Atoi(m[1])
		if v == 0 {
			return nil, fmt.Errorf("migration file %q: versions start at 0001", e.Name())
		}
		body, err := fs.ReadFile(files, e.Name())
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", e.Name(), err)
		}
		if len(out) > 0 && out[len(out)-1].Version == v {
			return nil, fmt.Errorf("migration version %d appears twice", v)
		}
		out = append(out, Migration{Version: v, Name: m[2], SQL: string(body)})
	}
	slices.SortFunc(out, func(a, b Migration) int { return a.Version - b.Version })
	return out, nil
}

// definitions returns sql/schema's definitions, their checksum, and the
// Migration that stands for them.
func definitions() ([]schema.Definition, string, Migration, error) {
	defs, err := schema.Definitions()
	if err != nil {
		return nil, "", Migration{}, err
	}
	if len(defs) == 0 {
		return nil, "", Migration{}, errors.New("no definitions embedded from sql/schema")
	}
	h := sha256.New()
	var all strings.Builder
	for _, d := range defs {
		// Name and code, each ended by a NUL, which neither contains: moving
		// code from one file to another changes the checksum too. Comments
		// around the statements do not count (Definition.Code).
		h.Write([]byte(d.Name + "\x00" + d.Code() + "\x00"))
		fmt.Fprintf(&all, "-- sql/schema/%s\n%s\n", d.Name, d.SQL)
	}
	sum := hex.EncodeToString(h.Sum(nil))
	return defs, sum, Migration{Version: 0, Name: definitionsName, SQL: all.String()}, nil
}

// DefinitionsChecksum returns the checksum of sql/schema's definitions that
// Apply records in scheduler_migration.definitions: hex SHA-256 over each
// definition's name and code (schema.Definition.Code: its text without the
// comment lines around its statements), in the order they are applied.
func DefinitionsChecksum() (string, error) {
	_, sum, _, err := definitions()
	return sum, err
}

// ErrSchemaTooNew is returned when the database holds a migration this binary
// does not know: a newer release migrated it, and running older code against
// it could corrupt data.
var ErrSchemaTooNew = errors.New("database schema is newer than this binary")

// Result says what Apply did.
type Result struct {
	// Applied are the numbered migrations applied by this call. When the
	// definitions were the only thing applied, it holds the one Migration
	// that stands for them (IsDefinitions).
	Applied []Migration
	// Definitions is true when this call applied sql/schema's definitions:
	// always after a numbered migration, and whenever the database had
	// received other definitions.
	Definitions bool
	// River is the number of River migrations applied by this call.
	River int
}

// Apply brings the database up to date: River's migrations first (through
// rivermigrate), then the service's numbered migrations and definitions. It
// is idempotent and safe to run from several processes at once.
func Apply(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) (Result, error) {
	all, err := All()
	if err != nil {
		return Result{}, err
	}
	defs, sum, defsMigration, err := definitions()
	if err != nil {
		return Result{}, err
	}
	// A session-level lock, because River's migrations cannot all run in
	// one transaction (one adds an enum value and then uses it), so the lock
	// must outlive several transactions. It is taken on a connection of its
	// own, outside the pool, so that River can still use the pool even when
	// the pool has a single connection; closing the connection releases it.
	conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		return Result{}, fmt.Errorf("connect for migrations: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", lockKey); err != nil {
		return Result{}, fmt.Errorf("take migration lock: %w", err)
	}
	// Closing the connection releases the lock too, but only once the server
	// has processed the disconnect, after Apply returned: a caller checking
	// pg_locks, or the next runner, could still find it held. Unlock first.
	defer conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", lockKey)

	var res Result
	// River logs each of its migrations at info in its own words
	// ("rivermigrate.Migrator[v5.Tx]: Applied migration"); the caller
	// reports what was applied (Result.River), so only River's warnings and
	// errors are worth a line, marked as River's.
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{
		Logger: slog.New(warnOnly{logger.Handler()}).With("component", "river")})
	if err != nil {
		return Result{}, fmt.Errorf("river migrator: %w", err)
	}
	rr, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil)
	if err != nil {
		return Result{}, fmt.Errorf("river migrations: %w", err)
	}
	res.River = len(rr.Versions)

	changedSince, err := definitionsChangedSince()
	if err != nil {
		return Result{}, err
	}
	var kept, reset []string // functions whose ALTER FUNCTION settings were kept, or reset
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		// IF NOT EXISTS still needs CREATE on the schema, and ADD COLUMN
		// ownership of the table, which the least-privilege service role
		// (sql/roles) lacks: look first, so that `run --migrate` with nothing
		// to do works under it.
		st, err := readState(ctx, tx)
		if err != nil {
			return err
		}
		if !st.table {
			if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS scheduler_migration (
				version     int PRIMARY KEY,
				name        text NOT NULL,
				applied_at  timestamptz NOT NULL DEFAULT now(),
				definitions text)`); err != nil {
				return fmt.Errorf("create scheduler_migration: %w", err)
			}
		} else if !st.column {
			// A database migrated before the definitions were kept in
			// sql/schema.
			if _, err := tx.Exec(ctx, `ALTER TABLE scheduler_migration ADD COLUMN IF NOT EXISTS definitions text`); err != nil {
				return fmt.Errorf("add scheduler_migration.definitions: %w", err)
			}
		}
		if err := checkKnown(all, st.applied); err != nil {
			return err
		}
		if st.definitions == sum && !slices.ContainsFunc(all, func(m Migration) bool { return !slices.Contains(st.applied, m.Version) }) {
			return nil // up to date
		}
		// Before the migrations, which may replace functions too.
		before, err := functionSecurity(ctx, tx)
		if err != nil {
			return err
		}
		for _, m := range all {
			if slices.Contains(st.applied, m.Version) {
				continue
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("migration %04d_%s: %w", m.Version, m.Name, err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO scheduler_migration (version, name) VALUES ($1, $2)", m.Version, m.Name); err != nil {
				return fmt.Errorf("record migration %04d: %w", m.Version, err)
			}
			res.Applied = append(res.Applied, m)
		}
		// Whether or not their checksum changed: a migration may have
		// dropped what a definition makes.
		for _, d := range defs {
			if _, err := tx.Exec(ctx, d.SQL); err != nil {
				return fmt.Errorf("definition sql/schema/%s: %w", d.Name, err)
			}
		}
		if _, err := tx.Exec(ctx, `UPDATE scheduler_migration SET definitions = $1
			WHERE version = (SELECT max(version) FROM scheduler_migration)`, sum); err != nil {
			return fmt.Errorf("record definitions: %w", err)
		}
		after, err := functionSecurity(ctx, tx)
		if err != nil {
			return err
		}
		var since int // the database's version before this call
		if len(st.applied) > 0 {
			since = st.applied[len(st.applied)-1]
		}
		for fn, was := range before {
			now, ok := after[fn]
			lostDefiner := was.definer && !now.definer
			lostPath := was.searchPath != "" && was.searchPath != now.searchPath
			if !ok || (!lostDefiner && !lostPath) {
				continue
			}
			if changedSince(path.Join("functions", was.name+".sql"), since) {
				reset = append(reset, fn)
				continue
			}
			// The file is the one the database had: applying it again must
			// change nothing, so what ALTER FUNCTION set goes back.
			if lostDefiner {
				if _, err := tx.Exec(ctx, "ALTER FUNCTION "+fn+" SECURITY DEFINER"); err != nil {
					return fmt.Errorf("keep %s SECURITY DEFINER: %w", fn, err)
				}
			}
			if lostPath {
				// As the catalog prints it: a list whose elements are quoted
				// where they need to be, which SET takes as it is; "" is the
				// empty list.
				value := strings.TrimPrefix(was.searchPath, "search_path=")
				if value == `""` {
					value = "''"
				}
				if _, err := tx.Exec(ctx, "ALTER FUNCTION "+fn+" SET search_path = "+value); err != nil {
					return fmt.Errorf("keep the search_path of %s: %w", fn, err)
				}
			}
			kept = append(kept, fn)
		}
		slices.Sort(kept)
		slices.Sort(reset)
		res.Definitions = true
		if len(res.Applied) == 0 {
			res.Applied = []Migration{defsMigration}
		}
		return nil
	})
	if err != nil {
		return Result{}, err
	}
	if res.Definitions && logger != nil {
		logger.Info("applied the definitions of sql/schema", "files", len(defs), "checksum", sum)
		if len(kept) > 0 {
			logger.Info("kept SECURITY DEFINER and search_path set by ALTER FUNCTION on functions whose definitions did not change",
				"functions", strings.Join(kept, ", "))
		}
		if len(reset) > 0 {
			logger.Warn("changed functions lost SECURITY DEFINER or search_path set by ALTER FUNCTION (sql/roles/grants.sql sets them): run grants.sql again",
				"functions", strings.Join(reset, ", "))
		}
	}
	return res, nil
}

// Pending returns what this binary would apply to the database: the
// numbered migrations the database lacks, or, when it lacks none but has
// not received this binary's definitions, the one Migration that stands for
// them (IsDefinitions); and how many of River's migrations it lacks. A
// service refuses to run while any are pending, and also when the database
// is newer than the binary (ErrSchemaTooNew).
func Pending(ctx context.Context, pool *pgxpool.Pool) (ours []Migration, river int, err error) {
	all, err := All()
	if err != nil {
		return nil, 0, err
	}
	_, sum, defsMigration, err := definitions()
	if err != nil {
		return nil, 0, err
	}
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return nil, 0, fmt.Errorf("river migrator: %w", err)
	}
	existing, err := migrator.ExistingVersions(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("read River's applied migrations: %w", err)
	}
	river = max(len(migrator.AllVersions())-len(existing), 0)

	st, err := readState(ctx, pool)
	if err != nil {
		return nil, 0, err
	}
	if !st.table {
		return all, river, nil
	}
	if err := checkKnown(all, st.applied); err != nil {
		return nil, 0, err
	}
	for _, m := range all {
		if !slices.Contains(st.applied, m.Version) {
			ours = append(ours, m)
		}
	}
	if len(ours) == 0 && st.definitions != sum {
		ours = []Migration{defsMigration}
	}
	return ours, river, nil
}

// checkKnown fails with ErrSchemaTooNew when the database has a migration
// this binary does not know.
func checkKnown(all []Migration, applied []int) error {
	for _, v := range applied {
		if !slices.ContainsFunc(all, func(m Migration) bool { return m.Version == v }) {
			return fmt.Errorf("%w: it has migration %d, this binary knows up to %d; run a newer release",
				ErrSchemaTooNew, v, all[len(all)-1].Version)
		}
	}
	return nil
}

type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// state is what scheduler_migration says.
type state struct {
	table       bool   // scheduler_migration exists
	column      bool   // and has its definitions column
	applied     []int  // the versions it records, in order
	definitions string // the checksum recorded on the highest version; "" if none
}

// readState reads scheduler_migration, which may not exist yet, or lack the
// definitions column.
func readState(ctx context.Context, db querier) (state, error) {
	var st state
	if err := db.QueryRow(ctx, `SELECT to_regclass('scheduler_migration') IS NOT NULL,
		EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('scheduler_migration')
		        AND attname = 'definitions' AND NOT attisdropped)`).Scan(&st.table, &st.column); err != nil {
		return state{}, fmt.Errorf("look for scheduler_migration: %w", err)
	}
	if !st.table {
		return st, nil
	}
	q := "SELECT version, NULL::text FROM scheduler_migration ORDER BY version"
	if st.column {
		q = "SELECT version, definitions FROM scheduler_migration ORDER BY version"
	}
	rows, err := db.Query(ctx, q)
	if err != nil {
		return state{}, fmt.Errorf("read applied migrations: %w", err)
	}
	var sums []*string
	st.applied, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (int, error) {
		var v int
		var sum *string
		err := row.Scan(&v, &sum)
		sums = append(sums, sum)
		return v, err
	})
	if err != nil {
		return state{}, fmt.Errorf("read applied migrations: %w", err)
	}
	if n := len(sums); n > 0 && sums[n-1] != nil {
		st.definitions = *sums[n-1]
	}
	return st, nil
}

// security is what grants.sql sets on a function with ALTER FUNCTION, and
// CREATE OR REPLACE FUNCTION resets unless it says the same.
type security struct {
	name       string // the function's name, which names its file
	definer    bool   // SECURITY DEFINER
	searchPath string // its search_path setting, "search_path=..."; "" if none
}

// functionSecurity returns the SECURITY DEFINER flag and search_path setting
// of every function in the schema the definitions are created in, by
// signature.
func functionSecurity(ctx context.Context, tx pgx.Tx) (map[string]security, error) {
	rows, err := tx.Query(ctx, `SELECT p.oid::regprocedure::text, p.proname, p.prosecdef,
			coalesce((SELECT c FROM unnest(p.proconfig) AS c WHERE c LIKE 'search\_path=%'), '')
		FROM pg_proc p
		WHERE p.pronamespace = current_schema()::regnamespace`)
	if err != nil {
		return nil, fmt.Errorf("read functions' settings: %w", err)
	}
	out := map[string]security{}
	var sig string
	var s security
	_, err = pgx.ForEachRow(rows, []any{&sig, &s.name, &s.definer, &s.searchPath}, func() error {
		out[sig] = s
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read functions' settings: %w", err)
	}
	return out, nil
}

// definitionsChangedSince returns a function that reports whether the
// definition file (say "functions/deferred_key_refresh.sql") changed after
// migration version: definitions.sum names the migration that last changed
// each file, and a database at that version or later has its current text.
// A file it does not list counts as changed.
func definitionsChangedSince() (func(file string, version int) bool, error) {
	b, err := fs.ReadFile(files, sumFile)
	if err != nil {
		return nil, fmt.Errorf("read embedded %s: %w", sumFile, err)
	}
	last := map[string]int{}
	for i, line := range strings.Split(string(b), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.Atoi(f[0])
		if len(f) != 3 || err != nil {
			return nil, fmt.Errorf("%s:%d: %q, want VERSION SHA256 FILE", sumFile, i+1, line)
		}
		last[f[2]] = v
	}
	return func(file string, version int) bool {
		v, ok := last[file]
		return !ok || v > version
	}, nil
}

// warnOnly passes on the records of its handler at warn and above.
type warnOnly struct{ slog.Handler }

func (h warnOnly) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelWarn && h.Handler.Enabled(ctx, l)
}

func (h warnOnly) WithAttrs(attrs []slog.Attr) slog.Handler {
	return warnOnly{h.Handler.WithAttrs(attrs)}
}

func (h warnOnly) WithGroup(name string) slog.Handler { return warnOnly{h.Handler.WithGroup(name)} }
