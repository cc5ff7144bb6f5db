// Package migrations holds the service's versioned schema and applies it.
//
// Each file NNNN_name.sql is one migration, applied once, in version order,
// all in one transaction, after River's own migrations (run through
// rivermigrate). An advisory lock serialises concurrent runners, so two
// replicas starting at once apply each migration exactly once: the second
// waits for the first to finish and then finds nothing left to do.
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"regexp"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

//go:embed *.sql
var files embed.FS

// lockKey is the advisory lock all migration runners take. It is an arbitrary
// constant ("defer-sc" in ASCII) that no other user of the database shares.
const lockKey int64 = 0x64656665722d7363

// Migration is one versioned schema change.
type Migration struct {
	Version int    // from the file name's NNNN
	Name    string // from the file name, after the version
	SQL     string // the file's statements, run in one transaction
}

var fileName = regexp.MustCompile(`^(\d{4})_([a-z0-9_]+)\.sql$`)

// All returns the embedded migrations in version order.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		return nil, fmt.Errorf("read embedded migrations: %w", err)
	}
	var out []Migration
	for _, e := range entries {
		m := fileName.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("migration file %q: name must be NNNN_name.sql", e.Name())
		}
		v, _ := strconv.Atoi(m[1])
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

// ErrSchemaTooNew is returned when the database holds a migration this binary
// does not know: a newer release migrated it, and running older code against
// it could corrupt data.
var ErrSchemaTooNew = errors.New("database schema is newer than this binary")

// Result says what Apply did.
type Result struct {
	Applied []Migration // ours, applied by this call
	River   int         // River migrations applied by this call
}

// Apply brings the database up to date: River's migrations first (through
// rivermigrate), then the service's. It is idempotent and safe to run from
// several processes at once.
func Apply(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) (Result, error) {
	all, err := All()
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
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: logger})
	if err != nil {
		return Result{}, fmt.Errorf("river migrator: %w", err)
	}
	rr, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil)
	if err != nil {
		return Result{}, fmt.Errorf("river migrations: %w", err)
	}
	res.River = len(rr.Versions)

	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		// IF NOT EXISTS still needs CREATE on the schema, which the
		// least-privilege service role (sql/roles) lacks: check first, so
		// that `run --migrate` with nothing to do works under it.
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass('scheduler_migration') IS NOT NULL`).Scan(&exists); err != nil {
			return fmt.Errorf("look for scheduler_migration: %w", err)
		}
		if !exists {
			if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS scheduler_migration (
				version    int PRIMARY KEY,
				name       text NOT NULL,
				applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
				return fmt.Errorf("create scheduler_migration: %w", err)
			}
		}
		applied, err := appliedVersions(ctx, tx)
		if err != nil {
			return err
		}
		if err := checkKnown(all, applied); err != nil {
			return err
		}
		for _, m := range all {
			if slices.Contains(applied, m.Version) {
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
		return nil
	})
	return res, err
}

// Pending returns the migrations this binary has that the database lacks,
// and how many of River's it lacks. A service refuses to run while any are
// pending, and also when the database is newer than the binary
// (ErrSchemaTooNew).
func Pending(ctx context.Context, pool *pgxpool.Pool) (ours []Migration, river int, err error) {
	all, err := All()
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

	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass('scheduler_migration') IS NOT NULL").Scan(&exists); err != nil {
		return nil, 0, fmt.Errorf("look for scheduler_migration: %w", err)
	}
	if !exists {
		return all, river, nil
	}
	applied, err := appliedVersions(ctx, pool)
	if err != nil {
		return nil, 0, err
	}
	if err := checkKnown(all, applied); err != nil {
		return nil, 0, err
	}
	for _, m := range all {
		if !slices.Contains(applied, m.Version) {
			ours = append(ours, m)
		}
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

func appliedVersions(ctx context.Context, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}) ([]int, error) {
	rows, err := db.Query(ctx, "SELECT version FROM scheduler_migration ORDER BY version")
	if err != nil {
		return nil, fmt.Errorf("read applied migrations: %w", err)
	}
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("read applied migrations: %w", err)
	}
	return vs, nil
}
