// Command bench measures the scheduler end to end and side by side with what
// bounds it, in one run, on one machine:
//
//   - the real service (the built ./cmd/scheduler binary, run as a
//     subprocess with its defaults) fed through an in-process Kafka broker
//     (kfake): ingest, dispatch and end-to-end throughput for three key
//     shapes, with and without a backlog of far-future rows, dispatch
//     lateness at a fixed offered load, and the process's memory, also
//     with a backlog of records near Kafka's 1 MB limit; the own-key
//     scenario again with 64 partitions per topic;
//   - the database ceiling: the service's own SQL (ingest.Store.Insert,
//     keylock.Locker Claim and Finalize) with no Kafka at all;
//   - the broker ceiling: sarama producing the same records to the same
//     broker;
//   - River alone, one job per message, as a user would build it instead;
//   - a bare durable queue (one table, written once and deleted once per
//     message, with the service's Kafka clients): what durability alone
//     costs; and the same keeping per-key order on the message row (the
//     ordered bare queue): what key order adds at the least;
//   - the "1,000 messages/s" figure often quoted for database-backed queues;
//   - the key gate of the client library (deferclient, deferkgo): a
//     consumer's throughput with the gate off and on, with each client,
//     what it costs Postgres, the key-state query's latency, and how soon
//     a blocked key flows again after its commit.
//
// It also measures the machine's speed at its start and its end (cpuSpeed),
// since runs on a shared machine compare only at like speeds, and the CPU
// per message of the end-to-end phase, against what the throughput target
// leaves. It prints a table for people and, as its last line, one line starting with
// "RESULT " of key=value pairs for machines. `make bench` runs it;
// BENCH_QUICK=1 makes a smaller run (about four minutes on two cores),
// BENCH_SMOKE=1 a tiny one that only checks the program works (the test runs
// that). BENCH_ONLY=gate runs only the key gate scenario (gate.go: what
// deferclient's gate costs a consumer, the key-state query's latency, how
// soon a key flows again after its commit) and reports only its figures;
// BENCH_ONLY=console only the console scenario (console.go: the operator
// console's pages against a production-shaped database of a million
// messages, p50/p95/max each against a 250 ms p95 budget);
// BENCH_ONLY=bare the service's own-key scenario and the bare durable
// queues (bare.go: what durability alone costs, and with per-key order),
// BENCH_ONLY=partitions the own-key scenario on 4 and on 64 partitions,
// BENCH_ONLY=lateness the own-key scenario with its lateness phases (the
// second on queue tables a VACUUM emptied, as autovacuum leaves them). BENCH_ONLY=fair runs only the
// fairness scenario (fair.go: a quiet target's lateness while another
// target's backlog of a million messages drains, then weight.go's two
// backlogs of weights 3 and 1 drained at once; the full run has both too),
// BENCH_ONLY=scale only the scaling curves (scale.go: end-to-end
// throughput against dispatch loops, replicas and far-future rows up to
// ten million; in no other run).
// It uses DATABASE_URL's server when set (creating and dropping
// databases of its own there), else a throwaway cluster from
// internal/pglocal; BENCH_DB_LOCALE=en_US.UTF-8 creates those databases in
// that locale, whose collation is every text column's default. See
// docs/benchmarks.md.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg, err := configFromEnv(os.Environ())
	if err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		os.Exit(2)
	}
	if err := run(ctx, cfg, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		os.Exit(1)
	}
}

// config is one run's size and environment.
type config struct {
	// Mode names the size: smoke, quick or full.
	Mode string
	// N is the number of messages of each measured phase.
	N int
	// Warmup is the number of messages sent through each contender before
	// anything is measured.
	Warmup int
	// Backlog is the number of far-future rows of the backlog scenario.
	Backlog int
	// LateRate and LateFor are the offered load and the duration of the
	// lateness phase; LateLead is how far in the future each record's
	// defer.at is when it is produced.
	LateRate int
	LateFor  time.Duration
	LateLead time.Duration
	// Large is the number of records near 1 MB of the large-message
	// scenario's backlog.
	Large int
	// Partitions of every topic.
	Partitions int32
	// GateCalls is the number of timed key-state queries of the key gate
	// scenario, quiet and under load each; GateRate the deferrals a second
	// produced meanwhile under load; GateRelease the keys whose release
	// after commit is timed.
	GateCalls, GateRate, GateRelease int
	// GateN is the number of records the key gate scenario's consumers
	// read with a handler that does nothing, GateWorkN with one that
	// works 25 µs a record (the first GateWorkN of the same topic): a
	// consumer that does nothing reads millions of records a second, and
	// must read many for its runs to last long enough to be timed.
	GateN, GateWorkN int
	// GateRounds is how many times the no-op handler's runs are repeated,
	// interleaved; their median counts.
	GateRounds int
	// ConsoleRows is the number of messages the console scenario seeds;
	// ConsoleRequests how many times it requests each page.
	ConsoleRows, ConsoleRequests int
	// FairBacklog is the number of messages of the target whose backlog
	// drains in the fairness scenario (fair.go), FairRate the records a
	// second the quiet target gets meanwhile.
	FairBacklog, FairRate int
	// ScaleLoops, ScaleReplicas and ScaleBacklogs are the points of the
	// scaling curves (scale.go): dispatch loops of one replica
	// (DISPATCH_WORKERS), replicas, far-future rows.
	ScaleLoops, ScaleReplicas, ScaleBacklogs []int
	// SettleMax is how long a scaling point waits at most for the service
	// and Postgres to settle after the warm-up (scale.go's settle).
	SettleMax time.Duration
	// Only names the one scenario to run ("gate" or "console"); "" runs them
	// all.
	Only string
	// SpeedProbe is how long cpuSpeed runs at the start and at the end.
	SpeedProbe time.Duration
	// DatabaseURL is a server to create the bench's databases on; "" starts a
	// throwaway cluster.
	DatabaseURL string
	// DBLocale, when set, is the libc locale every database of the bench is
	// created in (BENCH_DB_LOCALE, e.g. en_US.UTF-8, the official postgres
	// image's): its collation is the default of every text column. ""
	// keeps the server's default (C in the throwaway cluster).
	DBLocale string
	// SchedulerBin is a built scheduler binary; "" builds ./cmd/scheduler.
	// Its databases come from a template its own `migrate` made, so that a
	// binary of another version can be measured with this bench.
	SchedulerBin string
	// ProfileDir, when set, receives CPU profiles of the in-process
	// contenders (ceiling, broker, River) and, from a throwaway cluster, the
	// server log with the plans of slow statements.
	ProfileDir string
	// ServiceProfile is how long each phase's CPU profile of the service
	// runs, from the phase's start (with ProfileDir).
	ServiceProfile time.Duration
	// ServiceEnv is extra environment for every service process
	// (BENCH_SERVICE_ENV: KEY=VALUE settings separated by spaces), for
	// experiments with its settings; empty runs it on its defaults.
	ServiceEnv []string
	// ServiceLogs, when set, receives the service's own logs.
	ServiceLogs io.Writer
}

// BENCH_ONLY's values: the key gate scenario alone, the console scenario
// alone.
const (
	onlyGate    = "gate"
	onlyConsole = "console"
)

// modes are the run sizes. Full is what docs/benchmarks.md records.
var modes = map[string]config{
	"full": {Mode: "full", N: 100_000, Warmup: 2_000, Backlog: 1_000_000,
		LateRate: 5_000, LateFor: 30 * time.Second, LateLead: 2 * time.Second, Large: 400, Partitions: 4,
		FairBacklog: 1_000_000, FairRate: 100,
		ScaleLoops: []int{1, 2, 4}, ScaleReplicas: []int{1, 2, 4}, ScaleBacklogs: []int{0, 1_000_000, 10_000_000},
		SettleMax: time.Minute, GateCalls: 200, GateRate: 1_000, GateRelease: 200, GateN: 2_000_000, GateWorkN: 200_000, GateRounds: 3, ConsoleRows: 1_000_000, ConsoleRequests: 20, SpeedProbe: time.Second},
	"quick": {Mode: "quick", N: 20_000, Warmup: 1_000, Backlog: 250_000,
		LateRate: 5_000, LateFor: 8 * time.Second, LateLead: 2 * time.Second, Large: 200, Partitions: 4,
		FairBacklog: 200_000, FairRate: 100,
		ScaleLoops: []int{1, 2, 4}, ScaleReplicas: []int{1, 2, 4}, ScaleBacklogs: []int{0, 250_000, 1_000_000},
		SettleMax: time.Minute, GateCalls: 200, GateRate: 1_000, GateRelease: 200, GateN: 1_000_000, GateWorkN: 100_000, GateRounds: 3, ConsoleRows: 250_000, ConsoleRequests: 10, SpeedProbe: time.Second},
	// Smoke proves the program runs and reports; its numbers mean nothing.
	"smoke": {Mode: "smoke", N: 300, Warmup: 50, Backlog: 10_000,
		LateRate: 300, LateFor: time.Second, LateLead: time.Second, Large: 6, Partitions: 4,
		FairBacklog: 2_000, FairRate: 100,
		ScaleLoops: []int{1, 4}, ScaleReplicas: []int{1, 2}, ScaleBacklogs: []int{0, 10_000},
		SettleMax: time.Second, GateCalls: 20, GateRate: 300, GateRelease: 20, GateN: 300, GateWorkN: 300, GateRounds: 1, ConsoleRows: 20_000, ConsoleRequests: 2, SpeedProbe: 50 * time.Millisecond},
}

// configFromEnv picks the mode from BENCH_SMOKE and BENCH_QUICK (full when
// neither is set) and reads DATABASE_URL, BENCH_DB_LOCALE, BENCH_SCHEDULER, BENCH_SERVICE_ENV, BENCH_PROFILE_DIR,
// BENCH_VERBOSE, BENCH_N (overrides the phase size), BENCH_CONSOLE_ROWS
// (overrides the console scenario's size), BENCH_LATE_RATE (overrides the
// lateness phases' offered load) and BENCH_ONLY.
func configFromEnv(environ []string) (config, error) {
	env := map[string]string{}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	on := func(name string) (bool, error) {
		v := env[name]
		if v == "" {
			return false, nil
		}
		b, err := strconv.ParseBool(v)
		if err != nil {
			return false, fmt.Errorf("%s=%q: want 1, 0, true or false", name, v)
		}
		return b, nil
	}
	smoke, err := on("BENCH_SMOKE")
	if err != nil {
		return config{}, err
	}
	quick, err := on("BENCH_QUICK")
	if err != nil {
		return config{}, err
	}
	verbose, err := on("BENCH_VERBOSE")
	if err != nil {
		return config{}, err
	}
	cfg := modes["full"]
	switch {
	case smoke:
		cfg = modes["smoke"]
	case quick:
		cfg = modes["quick"]
	}
	if v := env["BENCH_N"]; v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 100 {
			return config{}, fmt.Errorf("BENCH_N=%q: want an integer >= 100", v)
		}
		cfg.N = n
	}
	if v := env["BENCH_CONSOLE_ROWS"]; v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1000 {
			return config{}, fmt.Errorf("BENCH_CONSOLE_ROWS=%q: want an integer >= 1000", v)
		}
		cfg.ConsoleRows = n
	}
	if v := env["BENCH_LATE_RATE"]; v != "" {
		// Below 10 a second the smoke size's one-second phase has too few
		// records for its percentiles to mean anything.
		n, err := strconv.Atoi(v)
		if err != nil || n < 10 {
			return config{}, fmt.Errorf("BENCH_LATE_RATE=%q: want records a second, an integer >= 10", v)
		}
		cfg.LateRate = n
	}
	switch v := env["BENCH_ONLY"]; v {
	case "", onlyGate, onlyConsole, onlyBare, onlyPartitions, onlyLateness, onlyFair, onlyScale:
		cfg.Only = v
	default:
		return config{}, fmt.Errorf("BENCH_ONLY=%q: want %q, %q, %q, %q, %q, %q, %q or nothing", v, onlyGate, onlyConsole, onlyBare, onlyPartitions,
			onlyLateness, onlyFair, onlyScale)
	}
	for _, kv := range strings.Fields(env["BENCH_SERVICE_ENV"]) {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return config{}, fmt.Errorf("BENCH_SERVICE_ENV: %q is not KEY=VALUE (settings are separated by spaces)", kv)
		}
		cfg.ServiceEnv = append(cfg.ServiceEnv, kv)
	}
	cfg.DatabaseURL = env["DATABASE_URL"]
	if v := env["BENCH_DB_LOCALE"]; v != "" {
		if strings.Trim(v, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.@-") != "" {
			return config{}, fmt.Errorf("BENCH_DB_LOCALE=%q: want a locale name such as en_US.UTF-8 (letters, digits and _ . @ -)", v)
		}
		cfg.DBLocale = v
	}
	cfg.SchedulerBin = env["BENCH_SCHEDULER"]
	cfg.ProfileDir = env["BENCH_PROFILE_DIR"]
	cfg.ServiceProfile = 5 * time.Second
	if quick || smoke {
		cfg.ServiceProfile = 2 * time.Second
	}
	if verbose {
		cfg.ServiceLogs = os.Stderr
	}
	return cfg, nil
}
