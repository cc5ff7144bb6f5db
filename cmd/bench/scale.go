package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
)

// defaultWorkers is internal/config's DISPATCH_WORKERS default: the loops
// curve's point at this value is the run on the service's defaults.
const defaultWorkers = 4

// scaleGroup is the consumer group every replica of a scaling point joins:
// the service's default CONSUMER_GROUP, set explicitly so that the bench
// watches the group the replicas are in whatever a binary's default.
const scaleGroup = "defer-scheduler"

// scaleSpec is one configuration of the service the scaling curves measure.
type scaleSpec struct {
	workers  int // DISPATCH_WORKERS of each replica; 0: the service's default
	replicas int // processes on the same database and broker
	backlog  int // far-future rows inserted before the service starts
}

func (sp scaleSpec) String() string {
	loops := "default loops"
	if sp.workers > 0 {
		loops = fmt.Sprintf("DISPATCH_WORKERS=%d", sp.workers)
	}
	if sp.replicas > 1 {
		loops += fmt.Sprintf(", DISPATCH_LOOPS=%d", defaultWorkers*sp.replicas)
	}
	return fmt.Sprintf("%s, %d replicas, %d far-future rows", loops, sp.replicas, sp.backlog)
}

// scalePoint is what one configuration measured.
type scalePoint struct {
	spec  scaleSpec
	fill  time.Duration // inserting its backlog
	speed float64       // cpuSpeed right before the service started
	// settle is how long the service and Postgres took after the warm-up
	// to spend less than settleBelow of CPU a second (at most SettleMax;
	// settled says whether they did): what a service does once at start,
	// such as the first count of the backlog gauges and the first
	// maintenance run's lease sweep, both of which read every row.
	settle  time.Duration
	settled bool
	// idle is the CPU the service and Postgres spent while nothing was due,
	// per second of wall time, once settled.
	idle time.Duration
	e2e  rate
	// published is how many of the measured messages each replica says it
	// published (scheduler_dispatch_published_total on its /metrics; a
	// replica that published none has no such line); -1 where /metrics did
	// not answer.
	published []int64
	checks    []check
}

// scaleResult is the scaling curves: indexes into points, which holds each
// configuration once in the order they ran (the default one is on every
// curve).
type scaleResult struct {
	points                    []scalePoint
	loops, replicas, backlogs []int
	settleMax                 time.Duration // the mode's SettleMax
}

// runScale measures end-to-end throughput, as runScheduler's end-to-end
// phase does (own keys, N records due now produced as fast as the producer
// goes, from the first send to the last arrival), against the dispatch
// loops of one replica (DISPATCH_WORKERS), the number of replicas (service
// processes on one database and one broker, each running the default
// DISPATCH_WORKERS loops: DISPATCH_LOOPS is raised to match),
// and the far-future rows waiting in the database (inserted with
// fillBacklog's set-based SQL). Each configuration gets a fresh database and
// broker and its rows; the machine's speed is probed (it is shared, and a
// figure means something only beside the speed it ran at); the replicas
// start and settle in their consumer group, Warmup records go through, and
// then the N records are timed. The claim's cost must not grow with the far-future rows, so each
// point also reports Postgres's CPU per message.
func (b *bench) runScale(ctx context.Context) (res scaleResult, err error) {
	res.settleMax = b.cfg.SettleMax
	ran := map[scaleSpec]int{}
	point := func(sp scaleSpec) (int, error) {
		if i, ok := ran[sp]; ok {
			return i, nil
		}
		b.say("scale: %s", sp)
		p, err := b.runScalePoint(ctx, sp)
		if err != nil {
			return 0, fmt.Errorf("scale, %s: %w", sp, err)
		}
		b.say("  %.0f msgs/s end to end, Postgres %.0f µs/msg, speed %.1f", p.e2e.perSecond(), perMessage(p.e2e.cpu.postgres, p.e2e.n), p.speed)
		res.points = append(res.points, p)
		ran[sp] = len(res.points) - 1
		return ran[sp], nil
	}
	for _, k := range b.cfg.ScaleLoops {
		sp := scaleSpec{workers: k, replicas: 1}
		if k == defaultWorkers {
			sp.workers = 0
		}
		i, err := point(sp)
		if err != nil {
			return res, err
		}
		res.loops = append(res.loops, i)
	}
	for _, r := range b.cfg.ScaleReplicas {
		i, err := point(scaleSpec{replicas: r})
		if err != nil {
			return res, err
		}
		res.replicas = append(res.replicas, i)
	}
	for _, n := range b.cfg.ScaleBacklogs {
		i, err := point(scaleSpec{replicas: 1, backlog: n})
		if err != nil {
			return res, err
		}
		res.backlogs = append(res.backlogs, i)
	}
	return res, nil
}

// runScalePoint measures one configuration; see runScale.
func (b *bench) runScalePoint(ctx context.Context, sp scaleSpec) (p scalePoint, err error) {
	p.spec = sp
	db, err := b.pg.freshService(ctx, fmt.Sprintf("scale_w%d_r%d_b%d", sp.workers, sp.replicas, sp.backlog))
	if err != nil {
		return p, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	if sp.backlog > 0 {
		b.say("  inserting %d far-future rows with SQL", sp.backlog)
		start := time.Now()
		if err := fillBacklog(ctx, db, sp.backlog); err != nil {
			return p, err
		}
		p.fill = time.Since(start)
		b.say("  inserted in %.1fs", p.fill.Seconds())
	}
	kc, addr, err := startKafka(b.cfg.Partitions, deferTopic, topicWarmup, topicE2E)
	if err != nil {
		return p, err
	}
	defer kc.Close()
	lp, w, err := newClients(addr)
	if err != nil {
		return p, err
	}
	defer lp.close()
	defer w.close()

	// The machine's speed before the service starts: a service that burns
	// CPU while idle (a claim walking far-future rows) must show in its own
	// figures, not pass for a slow machine.
	p.speed = cpuSpeed(b.cfg.SpeedProbe)
	env := []string{"CONSUMER_GROUP=" + scaleGroup}
	if sp.workers > 0 {
		env = append(env, "DISPATCH_WORKERS="+strconv.Itoa(sp.workers))
	}
	if sp.replicas > 1 {
		// DISPATCH_LOOPS is the loops of the whole database: at its default,
		// the first replica would run them all and the others only ingest.
		// Each replica runs its default loops, as a scale-out would.
		env = append(env, "DISPATCH_LOOPS="+strconv.Itoa(defaultWorkers*sp.replicas))
	}
	var svcs []*service
	defer func() {
		for _, s := range svcs {
			s.Kill() // after Stop, it does nothing
		}
	}()
	for range sp.replicas {
		s, err := b.startService(ctx, db.url, addr, false, env...)
		if err != nil {
			return p, err
		}
		svcs = append(svcs, s)
	}
	logs := func() string {
		var sb strings.Builder
		for i, s := range svcs {
			fmt.Fprintf(&sb, "--- replica %d:\n%s", i+1, s.Logs())
		}
		return sb.String()
	}
	// Each replica that joins rebalances the group; a measurement taken
	// meanwhile would time the rebalance.
	if err := waitGroupStable(ctx, addr, scaleGroup, sp.replicas, time.Minute); err != nil {
		return p, fmt.Errorf("%w; schedulers' last output:\n%s", err, logs())
	}
	warm := b.cfg.Warmup
	if _, _, err := produceAll(ctx, lp, warm, func(i int) *sarama.ProducerMessage {
		return deferRecord(ownKeys.key("w", i), i, topicWarmup, when{})
	}); err != nil {
		return p, err
	}
	if _, err := track(ctx, "warm-up delivery", func() (int64, error) { return w.count(topicWarmup) }, 0, int64(warm), timeoutFor(warm)); err != nil {
		return p, fmt.Errorf("%w; schedulers' last output:\n%s", err, logs())
	}

	pids := make([]int, len(svcs))
	for i, s := range svcs {
		pids[i] = s.Pid()
	}
	if p.settle, p.settled, err = b.settle(ctx, pids); err != nil {
		return p, err
	}
	// Idle, as long as the speed probe: what polling costs with nothing
	// due (the far-future rows must cost nothing here either).
	idleFrom, cpuIdle := time.Now(), b.cpuOf(pids)
	select {
	case <-time.After(b.cfg.SpeedProbe):
	case <-ctx.Done():
		return p, ctx.Err()
	}
	spent := b.cpuOf(pids).sub(cpuIdle)
	p.idle = time.Duration(float64(spent.service+spent.postgres) / time.Since(idleFrom).Seconds())

	// End to end, as runScheduler's phase 3.
	n := b.cfg.N
	cpu0 := b.cpuOf(pids)
	sent := make(chan error, 1)
	start := time.Now()
	go func() {
		_, _, err := produceAll(ctx, lp, n, func(i int) *sarama.ProducerMessage {
			return deferRecord(ownKeys.key("e", i), i, topicE2E, when{})
		})
		sent <- err
	}()
	pr, err := track(ctx, "end to end", func() (int64, error) { return w.count(topicE2E) }, 0, int64(n), timeoutFor(n))
	if perr := <-sent; perr != nil {
		return p, perr
	}
	if err != nil {
		return p, fmt.Errorf("%w; schedulers' last output:\n%s", err, logs())
	}
	p.e2e = rate{n: int64(n), wall: pr.doneAt.Sub(start), cpu: b.cpuOf(pids).sub(cpu0)}
	for _, s := range svcs {
		p.published = append(p.published, publishedTo(s, topicE2E))
	}

	var errs []error
	for _, s := range svcs {
		errs = append(errs, s.Stop(time.Minute))
	}
	if err := errors.Join(errs...); err != nil {
		return p, err
	}
	for _, ph := range []phaseTopic{{topicWarmup, warm}, {topicE2E, n}} {
		ds, err := readBack(ctx, addr, ph.topic)
		if err != nil {
			return p, err
		}
		c := verify(ds, ph.n)
		p.checks = append(p.checks, c)
		if err := c.err(fmt.Sprintf("scheduler, scale (%s), %s", sp, ph.topic)); err != nil {
			return p, err
		}
	}
	var left int64
	if err := db.pool.QueryRow(ctx, "SELECT count(*) FROM deferred_message WHERE source_topic = $1 AND state = 'pending'",
		deferTopic).Scan(&left); err != nil {
		return p, fmt.Errorf("count rows left pending: %w", err)
	}
	if left > 0 {
		return p, fmt.Errorf("scheduler, scale (%s): %d published rows still pending after a clean stop", sp, left)
	}
	return p, nil
}

// cpuOf samples CPU times with the service's being the sum of the processes
// pids (the replicas of one configuration).
func (b *bench) cpuOf(pids []int) cpuTimes {
	t := b.cpu(0)
	for _, pid := range pids {
		t.service += sampleCPU(pid, 0).service
	}
	return t
}

// Settling: the service and Postgres count as settled once they spend less
// than settleBelow of CPU a second over settleWindow; settle waits at most
// the mode's SettleMax for that.
const (
	settleWindow = 500 * time.Millisecond
	settleBelow  = 200 * time.Millisecond
)

// settle waits until the replicas pids and Postgres have settled, and
// returns how long that took and whether they did within SettleMax. The
// curves measure the steady state: with ten million rows, the first count
// of the backlog gauges and the first lease sweep take seconds of every
// core right after the start, and would otherwise land in the idle window
// and in the timed phase. The time they take is reported beside the point.
func (b *bench) settle(ctx context.Context, pids []int) (time.Duration, bool, error) {
	start := time.Now()
	for time.Since(start) < b.cfg.SettleMax {
		before, at := b.cpuOf(pids), time.Now()
		select {
		case <-time.After(settleWindow):
		case <-ctx.Done():
			return time.Since(start), false, ctx.Err()
		}
		spent := b.cpuOf(pids).sub(before)
		if float64(spent.service+spent.postgres)/time.Since(at).Seconds() < float64(settleBelow) {
			return time.Since(start), true, nil
		}
	}
	return time.Since(start), false, nil
}

// waitGroupStable waits until consumer group group is Stable with members
// members, or within passes.
func waitGroupStable(ctx context.Context, addr, group string, members int, within time.Duration) error {
	admin, err := sarama.NewClusterAdmin([]string{addr}, kafkaConfig())
	if err != nil {
		return fmt.Errorf("watch consumer group %s: %w", group, err)
	}
	defer admin.Close()
	deadline := time.Now().Add(within)
	last := "not described yet"
	for {
		ds, err := admin.DescribeConsumerGroups([]string{group})
		switch {
		case err != nil:
			last = err.Error()
		case len(ds) != 1:
			last = fmt.Sprintf("%d descriptions", len(ds))
		default:
			if ds[0].State == "Stable" && len(ds[0].Members) == members {
				return nil
			}
			last = fmt.Sprintf("%s with %d members", ds[0].State, len(ds[0].Members))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("consumer group %s not Stable with %d members after %v: %s", group, members, within, last)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("consumer group %s: %w", group, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// publishedTo returns how many messages s says it published to target, from
// scheduler_dispatch_published_total on its /metrics, or -1 when /metrics
// does not answer. A replica that published nothing to target has no line
// for it: 0 (so does a binary that names the metric otherwise; the
// replicas' figures then do not add up to the messages sent).
func publishedTo(s *service, target string) int64 {
	code, body := s.Get("/metrics")
	if code != http.StatusOK {
		return -1
	}
	var n int64
	label := `target="` + target + `"`
	for line := range strings.SplitSeq(body, "\n") {
		if !strings.HasPrefix(line, "scheduler_dispatch_published_total{") || !strings.Contains(line, label) {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return -1
		}
		n += int64(v)
	}
	return n
}

func perMessage(d time.Duration, n int64) float64 {
	return float64(d.Microseconds()) / float64(max(n, 1))
}

// curves names each curve, its points and the label of a point's value.
func (r scaleResult) curves() []struct {
	name   string
	points []int
	value  func(scaleSpec) int
} {
	return []struct {
		name   string
		points []int
		value  func(scaleSpec) int
	}{
		{"loops", r.loops, func(sp scaleSpec) int {
			if sp.workers == 0 {
				return defaultWorkers
			}
			return sp.workers
		}},
		{"replicas", r.replicas, func(sp scaleSpec) int { return sp.replicas }},
		{"backlog", r.backlogs, func(sp scaleSpec) int { return sp.backlog }},
	}
}

func (r scaleResult) summarize(s *summary) {
	for _, c := range r.curves() {
		for _, i := range c.points {
			p := r.points[i]
			key := fmt.Sprintf("scale_%s%d", c.name, c.value(p.spec))
			s.set(key+"_msgs_per_s", p.e2e.perSecond())
			s.set(key+"_pg_cpu_us_per_msg", perMessage(p.e2e.cpu.postgres, p.e2e.n))
			s.set(key+"_svc_cpu_us_per_msg", perMessage(p.e2e.cpu.service, p.e2e.n))
			s.set(key+"_speed", p.speed)
			s.set(key+"_idle_cpu_ms_per_s", ms(p.idle))
			s.set(key+"_settle_s", p.settle.Seconds())
		}
	}
	if len(r.backlogs) > 1 {
		first, last := r.points[r.backlogs[0]], r.points[r.backlogs[len(r.backlogs)-1]]
		s.set("scale_backlog_pg_cpu_largest_vs_first", ratio(perMessage(last.e2e.cpu.postgres, last.e2e.n), perMessage(first.e2e.cpu.postgres, first.e2e.n)))
		s.set("scale_backlog_largest_vs_first", ratio(last.e2e.perSecond(), first.e2e.perSecond()))
	}
	var delivered, expected, outOfOrder int
	for _, p := range r.points {
		for _, c := range p.checks {
			delivered += c.delivered
			expected += c.expected
			outOfOrder += c.outOfOrder
		}
	}
	s.set("scale_delivered", float64(delivered))
	s.set("scale_expected", float64(expected))
	s.set("scale_out_of_order", float64(outOfOrder))
}

func (r scaleResult) write(w io.Writer, n int) {
	fmt.Fprintf(w, "\nSCALING, end to end, own keys: %s records due now produced as fast as the producer goes, from the first send to the\n", group(float64(n)))
	fmt.Fprintln(w, "last arrival; a fresh database and broker per configuration. CPU per message: the service (all replicas), Postgres")
	fmt.Fprintln(w, "(every process of the server: on a shared server, others' work too), this process. speed: one core's sorting rate")
	fmt.Fprintln(w, "(M integers/s) probed right before the point's service started; compare figures only at like speeds. settle: after")
	fmt.Fprintf(w, "the warm-up, how long the service and Postgres took to spend less than %.0f ms of CPU a second (what they do once\n", ms(settleBelow))
	fmt.Fprintf(w, "at start, e.g. counting every row for the gauges; \"!\" if not within %v); idle: CPU milliseconds a second they\n", r.settleMax)
	fmt.Fprintln(w, "spent with nothing due, once settled. The timed phase starts after both.")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "curve\tloops/replica\treplicas\tfar-future rows\twall\tmsgs/s\tµs svc\tµs pg\tµs bench\tsettle\tidle ms/s\tspeed\tpublished per replica\t")
	for _, c := range r.curves() {
		for _, i := range c.points {
			p := r.points[i]
			loops := strconv.Itoa(defaultWorkers) + " (default)"
			if p.spec.workers > 0 {
				loops = strconv.Itoa(p.spec.workers)
			}
			shares := make([]string, len(p.published))
			for j, v := range p.published {
				shares[j] = "?"
				if v >= 0 {
					shares[j] = group(float64(v))
				}
			}
			settle := fmt.Sprintf("%.1fs", p.settle.Seconds())
			if !p.settled {
				settle += "!"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%.2fs\t%s\t%.0f\t%.0f\t%.0f\t%s\t%.0f\t%.1f\t%s\t\n", c.name, loops, p.spec.replicas, group(float64(p.spec.backlog)),
				p.e2e.wall.Seconds(), group(p.e2e.perSecond()), perMessage(p.e2e.cpu.service, p.e2e.n), perMessage(p.e2e.cpu.postgres, p.e2e.n),
				perMessage(p.e2e.cpu.bench, p.e2e.n), settle, ms(p.idle), p.speed, strings.Join(shares, " / "))
		}
	}
	tw.Flush()
	fmt.Fprintf(w, "The run on the defaults (%d loops, one replica, no far-future rows) ran once and is on every curve. Loops: DISPATCH_WORKERS;\n", defaultWorkers)
	fmt.Fprintf(w, "replicas: DISPATCH_LOOPS, the loop slots of the whole database, is %d per replica, so that each runs its %d loops.\n",
		defaultWorkers, defaultWorkers)
	for _, i := range r.backlogs {
		if p := r.points[i]; p.spec.backlog > 0 {
			fmt.Fprintf(w, "The %s far-future rows were inserted with SQL (fillBacklog) in %.1fs before the service started.\n",
				group(float64(p.spec.backlog)), p.fill.Seconds())
		}
	}
}

// onlyScale is BENCH_ONLY's value for the scaling curves, which no other
// run includes (ten million rows take minutes to insert).
const onlyScale = "scale"

// writeOnlyScale writes the report of BENCH_ONLY=scale.
func (r *results) writeOnlyScale(w io.Writer, s *summary) {
	fmt.Fprintf(w, "\ndefer-scheduler benchmark, mode %s, the scaling curves alone (BENCH_ONLY=scale), %d partitions per topic\n",
		r.cfg.Mode, r.cfg.Partitions)
	for _, m := range r.machine {
		fmt.Fprintln(w, m)
	}
	r.scale.write(w, r.cfg.N)
	fmt.Fprintf(w, "\nCHECKS: %s of %s messages delivered (read back from every target topic), %s out of per-key order\n",
		group(s.vals["scale_delivered"]), group(s.vals["scale_expected"]), group(s.vals["scale_out_of_order"]))
	fmt.Fprintln(w, s.resultLine())
}
