// Command scheduler is a database-backed delay scheduler for Kafka.
//
// Consumers that fail on a message for a reason that will heal produce it,
// unchanged plus a few headers, to the defer topic. The scheduler stores it
// in Postgres and republishes it to the topic the headers name when it is
// due, keeping per-key order. See README.md and docs/design.md.
//
// This command only parses which command to run and calls the package that
// runs it: internal/service (run, migrate), internal/console (console) and
// internal/opscli (the operator commands).
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/deferq/scheduler/internal/console"
	"github.com/deferq/scheduler/internal/opscli"
	"github.com/deferq/scheduler/internal/service"
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
  version   print the version
  console   serve the operator console (a web page) alone, against
            DATABASE_URL; "console hash-password" makes a user's hash

Operator commands (DATABASE_URL; --json for scripts; see "Operating it" in
the README and the SQL runbook in sql/runbook):
  status    backlog by target and state, lateness, held keys, recent rejections
  ls        list messages, filtered by target, state, key or reason
  show      one message: its row, key, headers, value, lineage and history
  held      business keys that cannot move: held by a parked message,
            backing off after failed publishes, in flight, or leased
  inflight  keys republished and waiting for their consumer group's commit
  release   let a consumer group's in-flight keys go (a group that stopped
            committing)
  expedite  make pending messages due now, by id, business key or target
  cancel    delete messages by id
  park      park pending messages by id, with a note of why (--why)
  replay    send parked or rejected messages again, by filter, at a rate
  pause     stop republishing to a target topic; resume undoes it
  resume    republish to a paused target topic again
  limit     cap a target topic's rate in messages per second, or lift it (off)
  weight    give a target topic more turns in dispatch's claims (1 to 100)
  targets   list the per-target controls: paused, rate limit, weight, note

Configuration comes from environment variables; "scheduler run --help" lists
them with their defaults. "scheduler <command> --help" describes a command.
To see it all work with nothing set up: make demo.
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
		return service.RunCommand(ctx, version, rest, environ, stdout, stderr)
	case "migrate":
		return service.MigrateCommand(ctx, rest, environ, stdout, stderr)
	case "console":
		return console.Command(ctx, rest, environ, stdin, stdout, stderr)
	}
	if code, ok := opscli.Run(ctx, cmd, rest, environ, stdin, stdout, stderr); ok {
		return code
	}
	fmt.Fprintf(stderr, "scheduler: unknown command %q; commands are run, migrate, console, version, %s (see scheduler --help)\n",
		cmd, strings.Join(opscli.Commands(), ", "))
	return 2
}
