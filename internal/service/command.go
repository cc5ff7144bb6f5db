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
	"github.com/deferq/scheduler/internal/pgsession"
	"github.com/deferq/scheduler/migrations"
	"github.com/deferq/scheduler/sql/queries"
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
(embedded from migrations/) to DATABASE_URL. Idempotent, and safe when several
replicas run it at once: they wait on an advisory lock. Refuses a database
whose schema is newer than this binary.
`)
	}); done {
		return code
	}
	cfg, err := config.Load(environ)
	if cfg.DatabaseURL == "" {
		err = errors.Join(err, errors.New("DATABASE_URL is not set: want a PostgreSQL URL, e.g. postgres://user:pass@host:5432/db"))
	}
	if err != nil {
		fmt.Fprintf(stderr, "scheduler migrate: configuration:\n%v\n", cmdflag.Indent(err))
		return 2
	}
	logger := cfg.Logger(stderr)
	pool, err := openPool(ctx, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "scheduler migrate: %v\n", err)
		return 1
	}
	defer pool.Close()
	res, err := migrations.Apply(ctx, pool, logger)
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

// pingTimeout bounds openPool's first exchange with the database.
const pingTimeout = 10 * time.Second

// openPool connects to DATABASE_URL, failing fast with a clear message when
// the database does not answer.
//
// Parameters of the URL's query string that pgx does not know itself (jit,
// work_mem, options, application_name, ...) are session settings of every
// connection (see internal/pgsession); a refused one is reported by the
// first ping. application_name is "defer-scheduler" unless the URL names one,
// so that replicas can be told apart in pg_stat_activity.
func openPool(ctx context.Context, cfg config.Config) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL is not a valid PostgreSQL URL: %w", err)
	}
	pc.MaxConns = cfg.DBMaxConns
	carried := pgsession.Carried(pc.ConnConfig.RuntimeParams)
	if err := pgsession.ReadCommitted(pc.ConnConfig.RuntimeParams, "DATABASE_URL"); err != nil {
		return nil, err
	}
	if pc.ConnConfig.RuntimeParams["application_name"] == "" {
		pc.ConnConfig.RuntimeParams["application_name"] = "defer-scheduler"
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect to the database: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			// Something accepted the connection (or swallowed it) and never
			// answered: a hung server, a wrong port, a firewall. The bare
			// "context deadline exceeded" names neither server nor wait.
			return nil, fmt.Errorf("the database at %s:%d did not answer within %v (is DATABASE_URL's host and port a PostgreSQL server that is up?): %w",
				pc.ConnConfig.Host, pc.ConnConfig.Port, pingTimeout, err)
		}
		if rerr := pgsession.Refused(err, "DATABASE_URL", pc.ConnConfig.Host, pc.ConnConfig.Port, carried); rerr != nil {
			return nil, rerr
		}
		return nil, fmt.Errorf("connect to the database at %s:%d: %w", pc.ConnConfig.Host, pc.ConnConfig.Port, err)
	}
	if err := takesWrites(pctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// takesWrites returns an error when the pool's server takes no writes: a
// hot standby (DATABASE_URL naming a replica, or a list of servers without
// target_session_attrs=read-write), or a read-only default. The service
// would otherwise start, serve /readyz and fail every batch it stores.
func takesWrites(ctx context.Context, pool *pgxpool.Pool) error {
	server, ok, err := writable(ctx, pool)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("the database at %s takes no writes (transaction_read_only is on: a hot standby, or "+
			"default_transaction_read_only set for the role, the database or in DATABASE_URL), and the scheduler writes: "+
			"point DATABASE_URL at the primary, or list every server and add target_session_attrs=read-write "+
			"(README, \"High availability\")", server)
	}
	return nil
}

// writable reports whether a connection of pool takes writes, and the
// address of the server it reached, which need not be the URL's first when
// it lists several.
func writable(ctx context.Context, pool *pgxpool.Pool) (server string, ok bool, err error) {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return "", false, fmt.Errorf("connect to the database: %w", err)
	}
	defer c.Release()
	server = c.Conn().PgConn().Conn().RemoteAddr().String()
	st, err := queries.SessionState(ctx, c)
	if err != nil {
		return server, false, fmt.Errorf("read the session's state at %s: %w", server, err)
	}
	return server, !st.ReadOnly, nil
}

// reconnectIfReadOnly closes every connection of pool when the server they
// reach takes no writes any more, and says so: a primary demoted in place
// (a switchover without a restart) keeps its sessions open and refuses
// every write on them, and pgx would replace them only at the end of their
// lifetime (an hour by default). New connections go where DATABASE_URL
// leads now: the new primary, with a list of servers and
// target_session_attrs=read-write, or a name the failover moved. Readiness
// runs it, every METRICS_INTERVAL.
func reconnectIfReadOnly(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) error {
	server, ok, err := writable(ctx, pool)
	if err != nil || ok {
		return err
	}
	pool.Reset()
	logger.Warn("the database takes no writes any more (a primary demoted in place?): closed every connection, to reconnect through DATABASE_URL",
		"server", server)
	return fmt.Errorf("the database at %s takes no writes; reconnecting through DATABASE_URL", server)
}
