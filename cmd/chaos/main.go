// Command chaos runs the scheduler under faults and checks its delivery
// guarantees end to end.
//
// Three `scheduler run` processes share one throwaway PostgreSQL cluster
// (internal/pglocal) and one in-process Kafka broker (kfake). A producer
// sends messages over many business keys with random delays; a consumer of
// the target topic re-defers some deliveries (forwarding them with defer.id
// and defer.seq, as a failing consumer would). Meanwhile a driver SIGKILLs a
// random scheduler every few seconds and restarts it, restarts PostgreSQL
// once (pg_ctl restart -m fast), takes the database back in time once (an
// online backup early in the run, restored later: a failover to a replica
// that lagged, or a restore), and makes the broker fail a few percent of
// the service's produce and fetch requests for a while. Then a checker reads
// everything republished and the table and reports: messages sent,
// delivered, lost, duplicates, per-key order violations of first
// deliveries, rows left pending, kills survived.
//
// It prints a table for people and, as its last line, one line starting with
// "RESULT " of key=value pairs for machines, and exits 1 when a guarantee is
// broken. `make chaos` runs it; CHAOS_SHORT=1 makes the short run that
// `make test` also runs (cmd/chaos/chaos_test.go). See docs/chaos.md.
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
		fmt.Fprintf(os.Stderr, "chaos: %v\n", err)
		os.Exit(2)
	}
	res, err := run(ctx, cfg, os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "chaos: %v\n", err)
		os.Exit(1)
	}
	res.print(os.Stdout)
	if !res.ok() {
		os.Exit(1)
	}
}

// config is one run's size and pace.
type config struct {
	// Mode names the size: full or short.
	Mode string
	// Messages is how many messages the producer sends (re-deferrals not
	// counted), over Keys business keys.
	Messages int
	Keys     int
	// Chaos is how long the driver injects faults; the producer sends
	// during the first SendFraction of it.
	Chaos        time.Duration
	SendFraction float64
	// KillEvery is the range of the pause between two kills.
	KillEvery [2]time.Duration
	// Drain bounds the wait, after the chaos, for every message to be
	// delivered and the table to empty.
	Drain time.Duration
	// Seed makes the traffic and the driver's choices reproducible (the
	// timing of the processes is not).
	Seed uint64
	// ProduceFaults and FetchFaults say which broker faults the driver
	// injects (both by default).
	ProduceFaults, FetchFaults bool
	// KafkaTimeout is the services' KAFKA_TIMEOUT; their lease is 20 times
	// that.
	KafkaTimeout time.Duration
	// SchedulerBin is a built scheduler binary; "" builds ./cmd/scheduler.
	SchedulerBin string
	// ServiceLogs, when set, receives the services' logs as they come.
	ServiceLogs io.Writer
}

// modes are the run sizes. Full is what docs/chaos.md records.
var modes = map[string]config{
	"full": {Mode: "full", Messages: 30_000, Keys: 300, Chaos: 75 * time.Second, SendFraction: 0.8,
		KillEvery: [2]time.Duration{2 * time.Second, 5 * time.Second}, Drain: 3 * time.Minute,
		ProduceFaults: true, FetchFaults: true, KafkaTimeout: 300 * time.Millisecond},
	"short": {Mode: "short", Messages: 2_000, Keys: 60, Chaos: 12 * time.Second, SendFraction: 0.75,
		KillEvery: [2]time.Duration{2 * time.Second, 3 * time.Second}, Drain: 90 * time.Second,
		ProduceFaults: true, FetchFaults: true, KafkaTimeout: 300 * time.Millisecond},
}

// configFromEnv picks the mode from CHAOS_SHORT (full when unset) and reads
// CHAOS_MESSAGES, CHAOS_KEYS, CHAOS_DURATION (the chaos phase), CHAOS_SEED,
// CHAOS_KAFKA_TIMEOUT (the services' KAFKA_TIMEOUT, default 300ms),
// CHAOS_FAULTS (broker faults to inject: produce,fetch (default) or none),
// CHAOS_SCHEDULER (a built binary) and CHAOS_VERBOSE (services' logs to
// stderr).
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
	short, err := on("CHAOS_SHORT")
	if err != nil {
		return config{}, err
	}
	verbose, err := on("CHAOS_VERBOSE")
	if err != nil {
		return config{}, err
	}
	cfg := modes["full"]
	if short {
		cfg = modes["short"]
	}
	atLeast := func(name string, min int, dst *int) error {
		v := env[name]
		if v == "" {
			return nil
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < min {
			return fmt.Errorf("%s=%q: want an integer >= %d", name, v, min)
		}
		*dst = n
		return nil
	}
	if err := atLeast("CHAOS_MESSAGES", 10, &cfg.Messages); err != nil {
		return config{}, err
	}
	if err := atLeast("CHAOS_KEYS", 1, &cfg.Keys); err != nil {
		return config{}, err
	}
	if v := env["CHAOS_DURATION"]; v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 5*time.Second {
			return config{}, fmt.Errorf("CHAOS_DURATION=%q: want a Go duration of at least 5s", v)
		}
		cfg.Chaos = d
	}
	cfg.Seed = uint64(time.Now().UnixNano())
	if v := env["CHAOS_SEED"]; v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return config{}, fmt.Errorf("CHAOS_SEED=%q: want an unsigned integer", v)
		}
		cfg.Seed = s
	}
	if v, ok := env["CHAOS_FAULTS"]; ok {
		cfg.ProduceFaults, cfg.FetchFaults = false, false
		for _, f := range strings.Split(v, ",") {
			switch strings.TrimSpace(f) {
			case "produce":
				cfg.ProduceFaults = true
			case "fetch":
				cfg.FetchFaults = true
			case "", "none":
			default:
				return config{}, fmt.Errorf("CHAOS_FAULTS=%q: want a comma-separated list of produce and fetch, or none", v)
			}
		}
	}
	if v := env["CHAOS_KAFKA_TIMEOUT"]; v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 100*time.Millisecond || d > time.Minute {
			return config{}, fmt.Errorf("CHAOS_KAFKA_TIMEOUT=%q: want a Go duration of 100ms..1m", v)
		}
		cfg.KafkaTimeout = d
	}
	cfg.SchedulerBin = env["CHAOS_SCHEDULER"]
	if verbose {
		cfg.ServiceLogs = os.Stderr
	}
	return cfg, nil
}
