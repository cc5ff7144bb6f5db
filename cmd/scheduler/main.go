// Command scheduler is a database-backed delay scheduler for Kafka.
//
// Consumers that fail on a message for a reason that will heal produce it,
// unchanged plus a few headers, to the defer topic. The scheduler stores it
// in Postgres and republishes it to the topic the headers name when it is
// due, keeping per-key order. See README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/migrations"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(runWithInput(ctx, os.Args[1:], os.Environ(), os.Stdin, os.Stdout, os.Stderr))
}

const usage = `scheduler: a database-backed delay scheduler for Kafka.

Usage:
  scheduler <command> [flags]

Commands:
  run       ingest the defer topic, dispatch due messages, serve health checks
  migrate   apply the database migrations (the service's and River's)
  demo      run the whole pipeline on a throwaway Postgres and an in-process
            Kafka broker, with a short scripted scenario (needs nothing set up)
  version   print the version

Operator commands (DATABASE_URL; --json for scripts; see "Operating it" in
the README and the SQL runbook in sql/runbook):
  status    backlog by target and state, lateness, held keys, recent rejections
  ls        list messages, filtered by target, state, key or reason
  show      one message: its row, key, headers, value, lineage and history
  held      business keys that cannot move: held by a parked message,
            backing off after failed publishes, or leased
  expedite  make pending messages due now, by id, business key or target
  cancel    delete messages by id
  park      park pending messages by id, with a reason
  replay    send parked or rejected messages again, by filter, at a rate
  pause     stop republishing to a target topic; resume undoes it
  resume    republish to a paused target topic again
  limit     cap a target topic's rate in messages per second, or lift it (off)
  targets   list the per-target controls: paused, rate limit, note

Configuration comes from environment variables; "scheduler run --help" lists
them with their defaults. "scheduler <command> --help" describes a command.
`

// run is main without the process and without input: a command that asks a
// question (replay, above --confirm-above) reads end of input and gets no
// for an answer.
func run(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	return runWithInput(ctx, args, environ, strings.NewReader(""), stdout, stderr)
}

// runWithInput is main without the process: it returns the exit code. 0 is
// success, 1 a failure while running, 2 a usage or configuration error.
// stdin answers the questions a command asks.
func runWithInput(ctx context.Context, args, environ []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	case "version", "--version":
		fmt.Fprintln(stdout, "scheduler", version)
		return 0
	case "run":
		return cmdRun(ctx, rest, environ, stdout, stderr)
	case "migrate":
		return cmdMigrate(ctx, rest, environ, stdout, stderr)
	case "demo":
		return cmdDemo(ctx, rest, environ, stdout, stderr)
	case "status":
		return cmdStatus(ctx, rest, environ, stdout, stderr)
	case "ls":
		return cmdLs(ctx, rest, environ, stdout, stderr)
	case "show":
		return cmdShow(ctx, rest, environ, stdout, stderr)
	case "expedite":
		return cmdExpedite(ctx, rest, environ, stdout, stderr)
	case "cancel":
		return cmdCancel(ctx, rest, environ, stdout, stderr)
	case "park":
		return cmdPark(ctx, rest, environ, stdout, stderr)
	case "held":
		return cmdHeld(ctx, rest, environ, stdout, stderr)
	case "replay":
		return cmdReplay(ctx, rest, environ, stdin, stdout, stderr)
	case "pause":
		return cmdPause(ctx, rest, environ, stdout, stderr)
	case "resume":
		return cmdResume(ctx, rest, environ, stdout, stderr)
	case "limit":
		return cmdLimit(ctx, rest, environ, stdout, stderr)
	case "targets":
		return cmdTargets(ctx, rest, environ, stdout, stderr)
	default:
		fmt.Fprintf(stderr, "scheduler: unknown command %q; commands are run, migrate, demo, version, status, ls, show, held, "+
			"expedite, cancel, park, replay, pause, resume, limit, targets (see scheduler --help)\n", cmd)
		return 2
	}
}

// parseFlags parses a subcommand's flags. It returns done=true with the exit
// code when the caller should stop (help asked for, or a bad flag).
func parseFlags(fs *flag.FlagSet, args []string, stdout, stderr io.Writer, describe func(io.Writer)) (done bool, code int) {
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	err := fs.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		describe(stdout)
		fs.SetOutput(stdout)
		fs.PrintDefaults()
		return true, 0
	case err != nil:
		fmt.Fprintf(stderr, "scheduler %s: %v (see scheduler %s --help)\n", fs.Name(), err, fs.Name())
		return true, 2
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "scheduler %s: unexpected argument %q (see scheduler %s --help)\n", fs.Name(), fs.Arg(0), fs.Name())
		return true, 2
	}
	return false, 0
}

func cmdRun(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	migrate := fs.Bool("migrate", false, "apply pending migrations before starting (otherwise a database with pending migrations stops start-up)")
	if done, code := parseFlags(fs, args, stdout, stderr, func(w io.Writer) {
		fmt.Fprint(w, `Usage: scheduler run [flags]

Consumes the defer topic into Postgres, republishes due messages in per-key
order, and serves /healthz, /readyz and /metrics on HTTP_ADDR. SIGINT or
SIGTERM stops consuming, finishes in-flight batches, commits and exits 0.

Environment:
`)
		printEnvHelp(w)
		fmt.Fprint(w, "\nFlags:\n")
	}); done {
		return code
	}
	cfg, err := loadConfig(environ)
	if err = errors.Join(err, cfg.requireRun()); err != nil {
		fmt.Fprintf(stderr, "scheduler run: configuration:\n%v\n", indent(err))
		return 2
	}
	logger := cfg.logger(stderr)
	svc, err := newService(ctx, cfg, logger, *migrate)
	if err != nil {
		logger.Error("start-up failed", "error", err)
		return 1
	}
	if err := svc.run(ctx); err != nil {
		logger.Error("stopped with an error", "error", err)
		return 1
	}
	return 0
}

func cmdMigrate(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	if done, code := parseFlags(fs, args, stdout, stderr, func(w io.Writer) {
		fmt.Fprint(w, `Usage: scheduler migrate

Applies River's migrations (through rivermigrate) and the service's own
(embedded from migrations/) to DATABASE_URL. Idempotent, and safe when several
replicas run it at once: they wait on an advisory lock. Refuses a database
whose schema is newer than this binary.
`)
	}); done {
		return code
	}
	cfg, err := loadConfig(environ)
	if cfg.DatabaseURL == "" {
		err = errors.Join(err, errors.New("DATABASE_URL is not set: want a PostgreSQL URL, e.g. postgres://user:pass@host:5432/db"))
	}
	if err != nil {
		fmt.Fprintf(stderr, "scheduler migrate: configuration:\n%v\n", indent(err))
		return 2
	}
	logger := cfg.logger(stderr)
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

// openPool connects to DATABASE_URL, failing fast with a clear message when
// the database does not answer.
func openPool(ctx context.Context, cfg config) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL is not a valid PostgreSQL URL: %w", err)
	}
	pc.MaxConns = cfg.DBMaxConns
	pc.ConnConfig.RuntimeParams["application_name"] = "defer-scheduler"
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect to the database: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to the database at %s:%d: %w", pc.ConnConfig.Host, pc.ConnConfig.Port, err)
	}
	return pool, nil
}

func indent(err error) string {
	var b []byte
	b = append(b, "  "...)
	for _, c := range []byte(err.Error()) {
		b = append(b, c)
		if c == '\n' {
			b = append(b, "  "...)
		}
	}
	return string(b)
}

// discardLogger is for components whose logs a command does not want.
func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
