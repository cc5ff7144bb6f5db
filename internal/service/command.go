package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/cmdflag"
	"github.com/deferq/scheduler/internal/config"
	"github.com/deferq/scheduler/internal/pgconnect"
	"github.com/deferq/scheduler/migrations"
)

// RunCommand is `scheduler run`: it parses the command's flags, reads the
// configuration from environ, and runs the service until ctx is done.
// version is the binary's. It returns the exit code: 0 after a clean stop, 1
// when the service failed, 2 for a usage or configuration error.
func RunCommand(ctx context.Context, version string, args, environ []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	migrate := fs.Bool("migrate", false, "apply pending migrations before starting (otherwise a database with pending migrations stops start-up)")
	if done, code := cmdflag.Parse(fs, args, stdout, stderr, func(w io.Writer) {
		fmt.Fprint(w, `Usage: scheduler run [flags]

Consumes the defer topic into Postgres, republishes due messages in per-key
order, releases keys once their consumer group committed past them, and
serves /healthz, /readyz, /metrics and the key-state query (POST
/v1/key-state) on HTTP_ADDR. SIGINT or SIGTERM stops consuming, finishes
in-flight batches, commits and exits 0; during start-up (waiting for the
brokers, say) it stops at once and exits 0 too.

Environment:
`)
		config.PrintEnvHelp(w)
		fmt.Fprint(w, "\nFlags:\n")
	}); done {
		return code
	}
	cfg, err := config.Load(environ)
	if err = errors.Join(err, cfg.RequireRun()); err != nil {
		fmt.Fprintf(stderr, "scheduler run: configuration:\n%v\n", cmdflag.Indent(err))
		return 2
	}
	logger := cfg.Logger(stderr)
	svc, err := New(ctx, cfg, logger, Options{Migrate: *migrate, Version: version})
	if err != nil && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		// SIGINT or SIGTERM during start-up (often while waiting for the
		// brokers): a requested stop like any other, not a failure.
		logger.Info("stopped during start-up", "reason", err)
		return 0
	}
	if err != nil {
		logger.Error("start-up failed", "error", err)
		return 1
	}
	if err := svc.Run(ctx); err != nil {
		logger.Error("stopped with an error", "error", err)
		return 1
	}
	return 0
}

// MigrateCommand is `scheduler migrate`: it applies River's migrations and
// the scheduler's to DATABASE_URL and says what it applied. Exit codes as
// RunCommand's.
func MigrateCommand(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	if done, code := cmdflag.Parse(fs, args, stdout, stderr, func(w io.Writer) {
		fmt.Fprint(w, `Usage: scheduler migrate

Applies River's migrations (through rivermigrate) and the service's own
(embedded from migrations/) to DIRECT_DATABASE_URL, else DATABASE_URL.
Idempotent, and safe when several replicas run it at once: they wait on a
session-level advisory lock, so it refuses a URL that leads through a pooler
in transaction mode. Refuses a database whose schema is newer than this
binary.
`)
	}); done {
		return code
	}
	cfg, err := config.Load(environ)
	if url, _ := cfg.DirectDB(); url == "" {
		err = errors.Join(err, errors.New("DATABASE_URL is not set: want a PostgreSQL URL, e.g. postgres://user:pass@host:5432/db"))
	}
	if err != nil {
		fmt.Fprintf(stderr, "scheduler migrate: configuration:\n%v\n", cmdflag.Indent(err))
		return 2
	}
	logger := cfg.Logger(stderr)
	res, err := migrate(ctx, cfg, nil, logger)
	if err != nil {
		fmt.Fprintf(stderr, "scheduler migrate: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "migrations applied: %d of the scheduler's, %d of River's\n", len(res.Applied), res.River)
	for _, m := range res.Applied {
		fmt.Fprintf(stdout, "  %04d_%s\n", m.Version, m.Name)
	}
	return 0
}

// pingTimeout bounds connecting to the database and the start-up checks.
const pingTimeout = 10 * time.Second

// openPool connects to DATABASE_URL and checks its sessions
// (internal/pgconnect): READ COMMITTED, triggers firing, writes taken.
//
// Parameters of the URL's query string that pgx does not know itself (jit,
// work_mem, options, application_name, ...) are session settings of every
// connection (see internal/pgsession); a refused one is reported at once.
// application_name is "defer-scheduler" unless the URL names one, so that
// replicas can be told apart in pg_stat_activity.
func openPool(ctx context.Context, cfg config.Config) (*pgconnect.Pool, error) {
	return pgconnect.Open(ctx, cfg.DatabaseURL, pgconnect.Options{
		Source: "DATABASE_URL", AppName: "defer-scheduler", MaxConns: int32(cfg.DBMaxConns), Timeout: pingTimeout})
}

// sessionPool returns a pool whose connections are sessions of their own,
// for what needs one (need: migrate's session lock, LISTEN): on
// DIRECT_DATABASE_URL when it is set, else main, the pool on DATABASE_URL
// (opened here when nil). A pool through a pooler in transaction mode is
// refused; fix says what else the operator may do. release closes the
// pool unless it is main's.
func sessionPool(ctx context.Context, cfg config.Config, main *pgconnect.Pool, need, fix string) (pool *pgxpool.Pool, release func(), err error) {
	url, source := cfg.DirectDB()
	p := main
	if p == nil || source != "DATABASE_URL" {
		if p, err = pgconnect.Open(ctx, url, pgconnect.Options{
			Source: source, AppName: "defer-scheduler", MaxConns: 2, Timeout: pingTimeout}); err != nil {
			return nil, nil, err
		}
	}
	release = func() {
		if p != main {
			p.Close()
		}
	}
	if p.TransactionPooled {
		release()
		return nil, nil, fmt.Errorf("%s reaches PostgreSQL through a pooler in transaction mode (two transactions of one connection ran on "+
			"different server sessions), and %s needs a session of its own: set DIRECT_DATABASE_URL to a URL that reaches "+
			"PostgreSQL directly or through a pooler in session mode%s (README, \"Connection poolers\")", source, need, fix)
	}
	return p.Pool, release, nil
}

// migrate applies pending migrations on a session of its own (main, the
// service's pool, may be nil): they wait on each other with a
// session-level advisory lock.
func migrate(ctx context.Context, cfg config.Config, main *pgconnect.Pool, logger *slog.Logger) (migrations.Result, error) {
	pool, release, err := sessionPool(ctx, cfg, main, "migrate (it holds a session-level advisory lock)", "")
	if err != nil {
		return migrations.Result{}, err
	}
	defer release()
	return migrations.Apply(ctx, pool, logger)
}
