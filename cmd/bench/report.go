package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/deferq/scheduler/internal/schedproc"
)

// bench is one run.
type bench struct {
	cfg   config
	log   io.Writer // progress
	start time.Time
	pg    *postgres
	pmPID int    // Postgres's postmaster, 0 if not on this machine
	bin   string // the scheduler binary
	// labels names the statements of pg_stat_statements (statements.go).
	labels *stmtLabeler
}

func (b *bench) say(format string, args ...any) {
	fmt.Fprintf(b.log, "[%6.1fs] %s\n", time.Since(b.start).Seconds(), fmt.Sprintf(format, args...))
}

// cpu samples CPU times, of the service with process id svcPID if not 0.
func (b *bench) cpu(svcPID int) cpuTimes { return sampleCPU(svcPID, b.pmPID) }

// profile starts a CPU profile of this process into ProfileDir/name.cpu.pprof
// when ProfileDir is set, and returns the function that ends it.
func (b *bench) profile(name string) (func(), error) {
	if b.cfg.ProfileDir == "" {
		return func() {}, nil
	}
	if err := os.MkdirAll(b.cfg.ProfileDir, 0o755); err != nil {
		return nil, fmt.Errorf("BENCH_PROFILE_DIR: %w", err)
	}
	path := filepath.Join(b.cfg.ProfileDir, name+".cpu.pprof")
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("BENCH_PROFILE_DIR: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("CPU profile %s: %w", path, err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			b.say("writing CPU profile %s: %v", path, err)
			return
		}
		b.say("wrote CPU profile %s", path)
	}, nil
}

// results is everything a run measured.
type results struct {
	cfg     config
	machine []string
	// speedStart and speedEnd are cpuSpeed at the start and the end of the
	// run, in million integers sorted per second.
	speedStart, speedEnd float64
	scenarios            []scenario // own/0 (with lateness), hot/0, single/0, own/backlog
	large                largeResult
	gate                 gateResult
	console              consoleResult
	ceiling              ceilingResult
	broker               brokerResult
	river                riverResult
	// wide is the own-key scenario on widePartitions partitions, nil when
	// not run; bare the bare durable queue (bare.go) and ordered the
	// ordered bare queue, zero when not run.
	wide    *scenario
	bare    bareResult
	ordered bareResult

	// fair is the fairness scenario (fair.go); scale the scaling curves
	// (scale.go), zero unless BENCH_ONLY=scale.
	fair  fairResult
	scale scaleResult
}

// run performs a whole benchmark and writes the report to out, progress to
// log.
func run(ctx context.Context, cfg config, out, log io.Writer) (err error) {
	b := &bench{cfg: cfg, log: log, start: time.Now()}
	if b.labels, err = newStmtLabeler(); err != nil {
		return err
	}
	res := &results{cfg: cfg}
	b.say("mode %s: %d messages per phase, backlog %d rows, lateness %d msgs/s for %v", cfg.Mode, cfg.N, cfg.Backlog, cfg.LateRate, cfg.LateFor)
	loadStart := loadAverage()
	res.speedStart = cpuSpeed(cfg.SpeedProbe)

	b.bin = cfg.SchedulerBin
	if b.bin == "" {
		dir, err := os.MkdirTemp("", "bench-scheduler-")
		if err != nil {
			return fmt.Errorf("temporary directory for the scheduler binary: %w", err)
		}
		defer os.RemoveAll(dir)
		b.say("building ./cmd/scheduler")
		if b.bin, err = schedproc.Build(ctx, dir); err != nil {
			return err
		}
	}
	if b.pg, err = startPostgres(ctx, cfg.DatabaseURL, cfg.DBLocale, cfg.ProfileDir != "", b.say); err != nil {
		return err
	}
	defer func() {
		var saveLog string
		if cfg.ProfileDir != "" && os.MkdirAll(cfg.ProfileDir, 0o755) == nil {
			saveLog = filepath.Join(cfg.ProfileDir, "postgres.log")
		}
		err = errors.Join(err, b.pg.close(context.WithoutCancel(ctx), saveLog))
	}()
	if cfg.SchedulerBin != "" {
		if err := b.pg.serviceTemplate(ctx, b.bin); err != nil {
			return err
		}
	}
	b.pmPID = b.pg.postmasterPID(ctx)
	pgInfo := b.pg.serverInfo(ctx)
	finish := func() {
		res.speedEnd = cpuSpeed(cfg.SpeedProbe)
		res.machine = machine(pgInfo, loadStart, loadAverage(), res.speedStart, res.speedEnd)
		if len(cfg.ServiceEnv) > 0 {
			res.machine = append(res.machine, "settings: the service ran with "+strings.Join(cfg.ServiceEnv, " ")+
				" (BENCH_SERVICE_ENV), not on its defaults")
		}
		res.write(out)
	}
	gate := func() error {
		b.say("key gate: the client library's consumers (sarama, franz-go), %d records, and the key-state query", cfg.GateN)
		g, err := b.runGate(ctx)
		if err != nil {
			return fmt.Errorf("key gate: %w", err)
		}
		res.gate = g
		for _, c := range gateClients {
			off := g.offRate(c, handlerNoop)
			b.say("  %s, no-op handler: gate on / off %.2f, 1%% blocked / off %.2f, busy / off %.2f", c, ratio(g.rateOf(c, handlerNoop, gateOn), off),
				ratio(g.rateOf(c, handlerNoop, gateBlocked), off), ratio(g.rateOf(c, handlerNoop, gateBusy), off))
		}
		b.say("  query p99 %.1fms (%.1fms under load), release p99 %.0fms", ms(g.idle.p99), ms(g.busy.p99), ms(percentile(g.release, 0.99)))
		return nil
	}
	consolePages := func() error {
		b.say("console: %d messages seeded, every page %d times", cfg.ConsoleRows, cfg.ConsoleRequests)
		c, err := b.runConsole(ctx)
		if err != nil {
			return fmt.Errorf("console: %w", err)
		}
		res.console = c
		return nil
	}
	switch cfg.Only {
	case onlyGate:
		if err := gate(); err != nil {
			return err
		}
		finish()
		return nil
	case onlyConsole:
		if err := consolePages(); err != nil {
			return err
		}
		finish()
		return nil
	case onlyFair:
		if err := b.runFairness(ctx, res); err != nil {
			return err
		}
		finish()
		return nil
	case onlyScale:
		if res.scale, err = b.runScale(ctx); err != nil {
			return err
		}
		finish()
		return nil
	case onlyBare, onlyPartitions, onlyLateness:
		if err := b.runOnlyDurability(ctx, res); err != nil {
			return err
		}
		finish()
		return nil
	}

	for _, s := range []struct {
		shape   shape
		backlog int
		late    bool
	}{{ownKeys, 0, true}, {hotKeys, 0, false}, {oneKey, 0, false}, {ownKeys, cfg.Backlog, false}} {
		b.say("scheduler: %s, %d far-future rows", s.shape.label, s.backlog)
		sc, err := b.runScheduler(ctx, s.shape, s.backlog, s.late)
		if err != nil {
			return fmt.Errorf("scheduler, %s, backlog %d: %w", s.shape.label, s.backlog, err)
		}
		b.say("  ingest %.0f/s, dispatch %.0f/s, end to end %.0f/s", sc.ingest.perSecond(), sc.dispatch.perSecond(), sc.e2e.perSecond())
		res.scenarios = append(res.scenarios, sc)
	}
	if err := b.runWide(ctx, res); err != nil {
		return err
	}

	b.say("scheduler: %d records of %d bytes", cfg.Large, largeSize)
	if res.large, err = b.runLarge(ctx); err != nil {
		return fmt.Errorf("scheduler, large records: %w", err)
	}
	b.say("  peak RSS %.1f MB", float64(res.large.hwm)/(1<<20))

	if err := b.runFairness(ctx, res); err != nil {
		return err
	}

	if err := gate(); err != nil {
		return err
	}
	if err := consolePages(); err != nil {
		return err
	}

	b.say("database ceiling: the service's SQL without Kafka")
	stop, err := b.profile("ceiling")
	if err != nil {
		return err
	}
	res.ceiling, err = b.runCeiling(ctx)
	stop()
	if err != nil {
		return err
	}
	b.say("  %.0f/s", res.ceiling.pipeline.perSecond())

	b.say("broker ceiling: sarama to kfake")
	if stop, err = b.profile("broker"); err != nil {
		return err
	}
	res.broker, err = b.runBroker(ctx)
	stop()
	if err != nil {
		return err
	}
	b.say("  %.0f/s", res.broker.sync.perSecond())

	b.say("River, one job per message")
	if res.river, err = b.runRiver(ctx); err != nil {
		return fmt.Errorf("the River contender: %w", err)
	}
	b.say("  %.0f/s", res.river.e2e.perSecond())

	if err := b.runBareContender(ctx, res); err != nil {
		return fmt.Errorf("the bare queue: %w", err)
	}

	finish()
	return nil
}

// machine describes where the run happened.
func machine(pgInfo, loadStart, loadEnd string, speedStart, speedEnd float64) []string {
	model := "unknown CPU"
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				model = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	mem := ""
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "MemTotal:" {
				if kb, err := strconv.ParseFloat(f[1], 64); err == nil {
					mem = fmt.Sprintf(", %.1f GiB RAM", kb/(1<<20))
				}
			}
		}
	}
	return []string{
		fmt.Sprintf("machine:  %d cores, %s%s, %s/%s, %s", runtime.NumCPU(), model, mem, runtime.GOOS, runtime.GOARCH, runtime.Version()),
		"load:     1-minute load average " + loadStart + " at start, " + loadEnd + " at end (other work on the machine skews every number)",
		fmt.Sprintf("speed:    one core sorts %.1f M integers/s at start, %.1f at end (cmd/bench/speed.go): compare runs only at like speeds", speedStart, speedEnd),
		"database: " + pgInfo,
		"broker:   kfake, in-process in this bench (it shares the CPUs with everything else); one broker, fresh per contender",
	}
}

func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "unknown"
	}
	return f[0]
}

// percentile returns the q-quantile (0 < q <= 1) of ds by nearest rank, 0 for
// none.
func percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// group formats n with thousands separators.
func group(n float64) string {
	s := strconv.FormatInt(int64(math.Round(n)), 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var out []byte
	for i := range len(s) {
		if i > 0 && (len(s)-i)%3 == 0 {
			out = append(out, ',')
		}
		out = append(out, s[i])
	}
	if neg {
		return "-" + string(out)
	}
	return string(out)
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// summary holds the headline numbers, in RESULT's order.
type summary struct {
	keys []string
	vals map[string]float64
}

func (s *summary) set(k string, v float64) {
	if _, ok := s.vals[k]; !ok {
		s.keys = append(s.keys, k)
	}
	s.vals[k] = v
}

// requiredKeys are the RESULT keys every run reports (the test checks them).
var requiredKeys = []string{
	"e2e_msgs_per_s", "dispatch_msgs_per_s", "ingest_msgs_per_s", "ceiling_msgs_per_s", "river_msgs_per_s",
	"p99_lateness_ms", "hotkey_msgs_per_s", "backlog1m_dispatch_msgs_per_s", "rss_mb", "large_rss_mb",
	"delivered", "expected", "out_of_order",
	"gate_sarama_noop_on_vs_off", "gate_sarama_noop_blocked1_vs_off", "gate_sarama_noop_busy_vs_off",
	"gate_franz_noop_on_vs_off", "gate_franz_noop_blocked1_vs_off", "gate_franz_noop_busy_vs_off", "gate_p99_ms", "gate_busy_p99_ms", "release_p50_ms", "release_p99_ms",
	"console_rows", "console_worst_p95_ms", "console_pages_over_budget",
	"bare_msgs_per_s", "e2e_vs_bare", "bare_pg_cpu_us_per_msg", "bare_go_cpu_us_per_msg",
	"ordered_msgs_per_s", "ordered_vs_bare", "e2e_vs_ordered", "ordered_pg_cpu_us_per_msg",
	"e2e_p64_msgs_per_s", "ingest_p64_msgs_per_s", "e2e_p64_vs_p4", "ingest_p64_vs_p4",
	"fair_quiet_p99_ms", "fair_quiet_p50_ms", "fair_backlog_msgs_per_s",
	"weight_ratio", "weight_heavy_msgs_per_s", "weight_light_msgs_per_s", "weight_drain_msgs_per_s", "weight_applied",
}

func (r *results) summary() *summary {
	s := &summary{vals: map[string]float64{}}
	if r.cfg.Only == onlyGate {
		r.gate.summarize(s)
		s.set("cpu_speed_start", r.speedStart)
		s.set("cpu_speed_end", r.speedEnd)
		s.set("messages_per_phase", float64(r.cfg.N))
		return s
	}
	if r.cfg.Only == onlyConsole {
		r.console.summarize(s)
		s.set("cpu_speed_start", r.speedStart)
		s.set("cpu_speed_end", r.speedEnd)
		return s
	}
	if r.cfg.Only == onlyBare || r.cfg.Only == onlyPartitions || r.cfg.Only == onlyLateness {
		r.summarizeOnlyDurability(s)
		return s
	}
	if r.cfg.Only == onlyFair || r.cfg.Only == onlyScale {
		if r.cfg.Only == onlyFair {
			r.fair.summarize(s)
		} else {
			r.scale.summarize(s)
			s.set("messages_per_phase", float64(r.cfg.N))
		}
		s.set("cpu_speed_start", r.speedStart)
		s.set("cpu_speed_end", r.speedEnd)
		return s
	}
	own, hot, single, backlog := r.scenarios[0], r.scenarios[1], r.scenarios[2], r.scenarios[3]
	var hwm int64
	var delivered, expected, outOfOrder, dupes int
	for _, sc := range r.scenarios {
		hwm = max(hwm, sc.hwm)
		for _, c := range sc.checks {
			delivered += c.delivered
			expected += c.expected
			outOfOrder += c.outOfOrder
			dupes += c.duplicates
		}
	}
	if r.wide != nil {
		// Checked as the others; its memory is p64_rss_mb.
		for _, c := range r.wide.checks {
			delivered += c.delivered
			expected += c.expected
			outOfOrder += c.outOfOrder
			dupes += c.duplicates
		}
	}
	s.set("e2e_msgs_per_s", own.e2e.perSecond())
	s.set("dispatch_msgs_per_s", own.dispatch.perSecond())
	s.set("ingest_msgs_per_s", own.ingest.perSecond())
	s.set("ceiling_msgs_per_s", r.ceiling.pipeline.perSecond())
	s.set("river_msgs_per_s", r.river.e2e.perSecond())
	s.set("hotkey_msgs_per_s", hot.e2e.perSecond())
	s.set("backlog1m_dispatch_msgs_per_s", backlog.dispatch.perSecond())
	s.set("rss_mb", float64(hwm)/(1<<20))
	s.set("large_rss_mb", float64(r.large.hwm)/(1<<20))
	s.set("large_ingest_mb_per_s", float64(r.large.bytes)/(1<<20)/r.large.ingest.wall.Seconds())
	s.set("large_msgs", float64(r.large.n))
	own.summarizeLateness(s)
	s.set("hotkey_dispatch_msgs_per_s", hot.dispatch.perSecond())
	s.set("singlekey_msgs_per_s", single.e2e.perSecond())
	s.set("singlekey_dispatch_msgs_per_s", single.dispatch.perSecond())
	s.set("backlog1m_e2e_msgs_per_s", backlog.e2e.perSecond())
	s.set("backlog_rows", float64(backlog.backlog))
	s.set("ceiling_insert_msgs_per_s", r.ceiling.insert.perSecond())
	s.set("ceiling_drain_msgs_per_s", r.ceiling.drain.perSecond())
	s.set("broker_msgs_per_s", r.broker.sync.perSecond())
	s.set("broker_async_msgs_per_s", r.broker.async.perSecond())
	s.set("river_p99_lateness_ms", ms(r.river.late.p99))
	s.set("e2e_vs_ceiling", ratio(own.e2e.perSecond(), r.ceiling.pipeline.perSecond()))
	s.set("e2e_vs_river", ratio(own.e2e.perSecond(), r.river.e2e.perSecond()))
	s.set("hotkey_vs_own", ratio(hot.e2e.perSecond(), own.e2e.perSecond()))
	s.set("backlog1m_vs_empty_dispatch", ratio(backlog.dispatch.perSecond(), own.dispatch.perSecond()))
	cpu := own.e2e.cpu
	perMsg := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(max(own.e2e.n, 1)) }
	s.set("e2e_cpu_us_per_msg", perMsg(cpu.service+cpu.postgres+cpu.bench))
	s.set("e2e_pg_cpu_us_per_msg", perMsg(cpu.postgres))
	s.set("e2e_svc_cpu_us_per_msg", perMsg(cpu.service))
	r.summarizeDurability(s)
	r.fair.summarize(s)
	r.gate.summarize(s)
	r.console.summarize(s)
	s.set("cpu_speed_start", r.speedStart)
	s.set("cpu_speed_end", r.speedEnd)
	s.set("messages_per_phase", float64(r.cfg.N))
	s.set("delivered", float64(delivered))
	s.set("expected", float64(expected))
	s.set("out_of_order", float64(outOfOrder))
	s.set("duplicates", float64(dupes))
	return s
}

// resultLine is the machine-readable last line.
func (s *summary) resultLine() string {
	var sb strings.Builder
	sb.WriteString("RESULT")
	for _, k := range s.keys {
		v := s.vals[k]
		prec := 0
		if strings.HasSuffix(k, "_ms") || strings.HasSuffix(k, "_mb") || strings.HasPrefix(k, "cpu_speed_") || strings.HasSuffix(k, "_speed") {
			prec = 1
		} else if strings.Contains(k, "_vs_") {
			prec = 3
		} else if strings.HasSuffix(k, "_us_per_record") {
			prec = 3
		}
		sb.WriteString(" " + k + "=" + strconv.FormatFloat(v, 'f', prec, 64))
	}
	return sb.String()
}

func (r *results) write(w io.Writer) {
	s := r.summary()
	cfg := r.cfg
	if cfg.Only == onlyBare || cfg.Only == onlyPartitions || cfg.Only == onlyLateness {
		r.writeOnlyDurability(w, s)
		return
	}
	if cfg.Only == onlyFair {
		r.writeOnlyFair(w, s)
		return
	}
	if cfg.Only == onlyScale {
		r.writeOnlyScale(w, s)
		return
	}
	if cfg.Only == onlyGate {
		fmt.Fprintf(w, "\ndefer-scheduler benchmark, mode %s, the key gate scenario alone (BENCH_ONLY=gate): %s records, %d partitions per topic\n",
			cfg.Mode, group(float64(cfg.GateN)), cfg.Partitions)
		for _, m := range r.machine {
			fmt.Fprintln(w, m)
		}
		r.gate.write(w, s.vals)
		fmt.Fprintln(w, "\nCOMPARED WITH THE TARGETS")
		tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
		gateTargets(targetRow(tw), s.vals)
		tw.Flush()
		fmt.Fprintln(w, s.resultLine())
		return
	}
	if cfg.Only == onlyConsole {
		fmt.Fprintf(w, "\ndefer-scheduler benchmark, mode %s, the console scenario alone (BENCH_ONLY=console)\n", cfg.Mode)
		for _, m := range r.machine {
			fmt.Fprintln(w, m)
		}
		r.console.write(w, cfg.ConsoleRequests)
		fmt.Fprintln(w, "\nCOMPARED WITH THE TARGETS")
		tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
		consoleTargets(targetRow(tw), s.vals)
		tw.Flush()
		fmt.Fprintln(w, s.resultLine())
		return
	}
	fmt.Fprintf(w, "\ndefer-scheduler benchmark, mode %s: %s messages per measured phase (after %s of warm-up), %d partitions per topic\n",
		cfg.Mode, group(float64(cfg.N)), group(float64(cfg.Warmup)), cfg.Partitions)
	for _, m := range r.machine {
		fmt.Fprintln(w, m)
	}
	fmt.Fprintln(w, "service:  ./cmd/scheduler as a subprocess on its defaults (4 dispatch loops claiming one at a time, 500 keys x 100 msgs per claim within 5,000 msgs per round, ingest batches of 1,000 / 20ms)")

	fmt.Fprintln(w, "\nTHROUGHPUT (CPU seconds spent meanwhile: the service process, all Postgres processes, this process with kfake and the load generators)")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "contender\tphase\tkeys\tfar-future rows\tmsgs\twall\tmsgs/s\tCPU svc\tCPU pg\tCPU bench\t")
	row := func(who, phase, keys string, backlog int, rt rate) {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%.2fs\t%s\t%.1f\t%.1f\t%.1f\t\n", who, phase, keys, group(float64(backlog)),
			group(float64(rt.n)), rt.wall.Seconds(), group(rt.perSecond()),
			rt.cpu.service.Seconds(), rt.cpu.postgres.Seconds(), rt.cpu.bench.Seconds())
	}
	for _, sc := range r.scenarios {
		row("scheduler", "ingest", sc.shape.name, sc.backlog, sc.ingest)
		row("scheduler", "dispatch", sc.shape.name, sc.backlog, sc.dispatch)
		row("scheduler", "end to end", sc.shape.name, sc.backlog, sc.e2e)
	}
	row("DB ceiling", "insert+claim+delete", "own", 0, r.ceiling.pipeline)
	row("DB ceiling", "insert alone", "own", 0, r.ceiling.insert)
	row("DB ceiling", "claim+delete alone", "own", 0, r.ceiling.drain)
	row("broker", "service's producer", "own", 0, r.broker.sync)
	row("broker", "async producer", "own", 0, r.broker.async)
	row("River", "end to end", "own", 0, r.river.e2e)
	r.durabilityRows(row)
	row("reference", "\"1,000 msgs/s\"", "", 0, rate{n: 1000, wall: time.Second})
	tw.Flush()
	fmt.Fprintln(w, "ingest is timed from 10% to 100% of a backlog produced before the service starts (its CPU columns include the")
	fmt.Fprintln(w, "service's start-up); dispatch from one SQL UPDATE making N stored rows due to the last arrival; end to end from")
	fmt.Fprintln(w, "the first produce of N due-now records to the last arrival. Arrivals are counted from the target's high-water marks.")
	fmt.Fprintln(w, "DB ceiling: ingest.Store.Insert (4 writers, batches of 1,000) and keylock.Locker Claim/Finalize (4 loops), no Kafka.")
	fmt.Fprintf(w, "River: one job per message (InsertManyFast per consumed batch, %d workers, FetchCooldown %v, FetchPollInterval %v);\n",
		riverWorkers, riverFetchCool, riverFetchPoll)
	fmt.Fprintf(w, "its worker publishes with the service's producer settings; %s of its end-to-end messages left out of per-key order.\n",
		group(float64(r.river.outOfOrder)))
	for _, sc := range r.scenarios {
		if sc.backlog > 0 {
			fmt.Fprintf(w, "The %s far-future rows (own keys, due in 7 days) were inserted with SQL in %.1fs before the service started.\n",
				group(float64(sc.backlog)), sc.fill.Seconds())
		}
	}

	own := r.scenarios[0]
	writeLateness(w, cfg, []lateRow{{"scheduler", own.late}, {"scheduler, after a VACUUM", own.lateVacuumed}, {"River", r.river.late}})

	fmt.Fprintln(w, "\nMEMORY of the scheduler process (/proc/PID/status, read at the end of each scenario)")
	tw = tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "keys\tfar-future rows\tVmHWM (peak)\tVmRSS (end)\t")
	for _, sc := range r.scenarios {
		fmt.Fprintf(tw, "%s\t%s\t%.1f MB\t%.1f MB\t\n", sc.shape.name, group(float64(sc.backlog)),
			float64(sc.hwm)/(1<<20), float64(sc.rss)/(1<<20))
	}
	fmt.Fprintf(tw, "own, %s records of %s bytes\t0\t%.1f MB\t%.1f MB\t\n", group(float64(r.large.n)), group(largeSize),
		float64(r.large.hwm)/(1<<20), float64(r.large.rss)/(1<<20))
	tw.Flush()
	fmt.Fprintf(w, "The large records (%.0f MB in all) waited in %s when the service started, half due at once, half in an hour:\n",
		float64(r.large.bytes)/(1<<20), deferTopic)
	fmt.Fprintf(w, "all stored in %.2fs (%.0f MB/s), the due half on its target after %.2fs.\n",
		r.large.ingest.wall.Seconds(), s.vals["large_ingest_mb_per_s"], r.large.dispatch.wall.Seconds())

	r.writeDurability(w, s.vals)
	r.fair.write(w)

	r.gate.write(w, s.vals)
	r.console.write(w, cfg.ConsoleRequests)

	fmt.Fprintln(w, "\nCOMPARED WITH THE TARGETS")
	tw = tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	target := targetRow(tw)
	v := s.vals
	target("end to end, own keys", group(v["e2e_msgs_per_s"])+" msgs/s", ">= 20,000", v["e2e_msgs_per_s"] >= 20_000)
	target("end to end / DB ceiling", fmt.Sprintf("%.2f", v["e2e_vs_ceiling"]), ">= 0.5", v["e2e_vs_ceiling"] >= 0.5)
	target("end to end / River per message", fmt.Sprintf("%.1fx", v["e2e_vs_river"]), ">= 5x", v["e2e_vs_river"] >= 5)
	target("end to end / \"1,000 msgs/s\"", fmt.Sprintf("%.1fx", v["e2e_msgs_per_s"]/1000), "> 10x", v["e2e_msgs_per_s"] > 10_000)
	latenessTargets(target, cfg, v)
	target("1,000 hot keys / own keys (end to end)", fmt.Sprintf("%.2f", v["hotkey_vs_own"]), ">= 0.5", v["hotkey_vs_own"] >= 0.5)
	target("one single key, end to end", group(v["singlekey_msgs_per_s"])+" msgs/s", ">= 2,000", v["singlekey_msgs_per_s"] >= 2000)
	target(fmt.Sprintf("dispatch with %s far-future rows / without", group(v["backlog_rows"])), fmt.Sprintf("%.2f", v["backlog1m_vs_empty_dispatch"]),
		">= 0.9", v["backlog1m_vs_empty_dispatch"] >= 0.9)
	durabilityTargets(target, v)
	target("scheduler peak RSS", fmt.Sprintf("%.1f MB", v["rss_mb"]), "<= 150 MB", v["rss_mb"] <= 150)
	target("scheduler peak RSS, records near 1 MB", fmt.Sprintf("%.1f MB", v["large_rss_mb"]), "<= 244 MB (256,000,000 bytes)",
		v["large_rss_mb"]*(1<<20) <= 256_000_000)
	gateTargets(target, v)
	consoleTargets(target, v)
	fairTargets(target, v)
	tw.Flush()

	// What the throughput target asks of the CPU, in the units the
	// THROUGHPUT table measures: the whole machine's CPU per message.
	cores := float64(runtime.NumCPU())
	fmt.Fprintf(w, "\nCPU PER MESSAGE, end to end, own keys: %.0f µs (service %.0f, Postgres %.0f, this process with kfake and the\n",
		v["e2e_cpu_us_per_msg"], v["e2e_svc_cpu_us_per_msg"], v["e2e_pg_cpu_us_per_msg"])
	fmt.Fprintf(w, "load generators %.0f), %.2f of %d cores busy; %d cores at 20,000 msgs/s leave %.0f µs per message.\n",
		v["e2e_cpu_us_per_msg"]-v["e2e_svc_cpu_us_per_msg"]-v["e2e_pg_cpu_us_per_msg"],
		v["e2e_cpu_us_per_msg"]*v["e2e_msgs_per_s"]/1e6, runtime.NumCPU(), runtime.NumCPU(), cores*1e6/20_000)

	fmt.Fprintf(w, "\nCHECKS: %s of %s messages delivered (read back from every target topic), %s out of per-key order, %s duplicates\n",
		group(v["delivered"]), group(v["expected"]), group(v["out_of_order"]), group(v["duplicates"]))
	writeFairChecks(w, v)
	fmt.Fprintln(w, s.resultLine())
}

// latenessTargets writes the lateness rows of the targets table: the p99 at
// the offered load, first and after a VACUUM, against 50 ms (issue 17's bar;
// 100 ms before it).
func latenessTargets(target func(what, got, want string, ok bool), cfg config, v map[string]float64) {
	target("p99 lateness at "+group(float64(cfg.LateRate))+" msgs/s", fmt.Sprintf("%.1f ms", v["p99_lateness_ms"]), "<= 50 ms", v["p99_lateness_ms"] <= 50)
	if _, ok := v["p99_lateness_vacuumed_ms"]; ok {
		target("the same after a VACUUM emptied the queue", fmt.Sprintf("%.1f ms", v["p99_lateness_vacuumed_ms"]), "<= 50 ms",
			v["p99_lateness_vacuumed_ms"] <= 50)
	}
}

// durabilityTargets writes the rows of the targets table that compare the
// service with the bare durable queue and 64 partitions with 4, of those
// the run measured.
func durabilityTargets(target func(what, got, want string, ok bool), v map[string]float64) {
	if r, ok := v["e2e_vs_bare"]; ok {
		target("end to end / bare durable queue", fmt.Sprintf("%.2f", r), ">= 0.8", r >= 0.8)
	}
	for _, k := range []struct{ what, key string }{
		{"end to end, 64 partitions / 4", "e2e_p64_vs_p4"},
		{"ingest, 64 partitions / 4", "ingest_p64_vs_p4"},
	} {
		if r, ok := v[k.key]; ok {
			target(k.what, fmt.Sprintf("%.2f", r), ">= 0.8", r >= 0.8)
		}
	}
}

// targetRow returns a function that writes one row of the targets table to
// tw: what, the figure got, the target wanted, and whether it was met.
func targetRow(tw io.Writer) func(what, got, want string, ok bool) {
	return func(what, got, want string, ok bool) {
		verdict := "met"
		if !ok {
			verdict = "missed"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", what, got, want, verdict)
	}
}

// lateRow is one contender's lateness phase; l is nil when not measured.
type lateRow struct {
	who string
	l   *latencies
}

// writeLateness writes the LATENESS section, of the rows measured.
func writeLateness(w io.Writer, cfg config, rows []lateRow) {
	if !slices.ContainsFunc(rows, func(r lateRow) bool { return r.l != nil }) {
		return
	}
	fmt.Fprintf(w, "\nLATENESS (publish time minus due time: record timestamp set by the publisher minus defer.scheduled-at;\n")
	fmt.Fprintf(w, "%s msgs/s offered for %v, each due %v after it was produced, own keys. \"After a VACUUM\": the same load again\n",
		group(float64(cfg.LateRate)), cfg.LateFor, cfg.LateLead)
	fmt.Fprintf(w, "once VACUUM emptied and truncated the queue tables, as autovacuum does after a drain)\n")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "contender\tmsgs\toffered/s\tp50\tp99\tmax\tCPU µs/msg: Postgres\tservice\t")
	var stmts []stmtPhase
	for _, r := range rows {
		if r.l == nil {
			continue
		}
		pg, svc := "-", "-"
		if r.l.cpu.postgres > 0 {
			pg, svc = fmt.Sprintf("%.0f", r.l.perMsg(r.l.cpu.postgres)), fmt.Sprintf("%.0f", r.l.perMsg(r.l.cpu.service))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.1fms\t%.1fms\t%.1fms\t%s\t%s\t\n", r.who, group(float64(r.l.sent)),
			group(float64(r.l.sent)/r.l.sendFor.Seconds()), ms(r.l.p50), ms(r.l.p99), ms(r.l.max), pg, svc)
		if r.l.stmts != nil {
			stmts = append(stmts, stmtPhase{r.who, int64(r.l.sent), r.l.stmts})
		}
	}
	tw.Flush()
	header := false
	for _, r := range rows {
		if r.l == nil || r.l.autovacuum == nil {
			continue
		}
		if !header {
			fmt.Fprintf(w, "Autovacuum in these phases (workers sampled every %v; records split by whether one ran at their due time):\n", vacuumSample)
			header = true
		}
		a := r.l.autovacuum
		fmt.Fprintf(w, "  %s: %s; with a worker: %s records, p50 %.1fms, p99 %.1fms; with none: %s, p50 %.1fms, p99 %.1fms\n",
			r.who, a.seen.summary(), group(float64(a.under.sent)), ms(a.under.p50), ms(a.under.p99),
			group(float64(a.clear.sent)), ms(a.clear.p50), ms(a.clear.p99))
	}
	// The full run has the end-to-end phase's table beside the bare queue;
	// BENCH_ONLY=lateness has these.
	if cfg.Only == onlyLateness {
		writeStatements(w, "WHERE POSTGRES'S TIME GOES in the lateness phases (each statement's executor time per message, pg_stat_statements;\n"+
			"wall time, waits included; \"inside\": run by triggers and functions, already in the statement that ran them)", stmts)
	}
}

// summarizeLateness sets the RESULT keys of sc's lateness phases, those
// measured: lateness and lateness_vacuumed (see summarize).
func (sc scenario) summarizeLateness(s *summary) {
	if sc.late != nil {
		sc.late.summarize(s, "lateness")
	}
	if sc.lateVacuumed != nil {
		sc.lateVacuumed.summarize(s, "lateness_vacuumed")
		s.set("vacuumed_pages", float64(sc.vacuumedPages))
	}
}

// summarize sets the RESULT keys of one lateness phase: p50_<phase>_ms,
// p99_<phase>_ms, max_<phase>_ms, <phase>_pg_cpu_us_per_msg and, if
// autovacuum was watched, <phase>_autovacuum_msgs (records due while a
// worker ran), p99_<phase>_autovacuum_ms and p99_<phase>_no_autovacuum_ms.
func (l *latencies) summarize(s *summary, phase string) {
	s.set("p99_"+phase+"_ms", ms(l.p99))
	s.set("p50_"+phase+"_ms", ms(l.p50))
	s.set("max_"+phase+"_ms", ms(l.max))
	s.set(phase+"_pg_cpu_us_per_msg", l.perMsg(l.cpu.postgres))
	if l.autovacuum == nil {
		return
	}
	s.set(phase+"_autovacuum_msgs", float64(l.autovacuum.under.sent))
	s.set("p99_"+phase+"_autovacuum_ms", ms(l.autovacuum.under.p99))
	s.set("p99_"+phase+"_no_autovacuum_ms", ms(l.autovacuum.clear.p99))
}
