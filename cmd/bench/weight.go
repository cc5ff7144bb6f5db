package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"
)

// The weighted drain's targets: two backlogs made due at once, the first
// of weight weightHeavy, the second of the default weight 1, and a quiet
// target of the default weight whose records come in meanwhile.
const (
	topicWeightHeavy = "bench.weight.payments"
	topicWeightLight = "bench.weight.reports"
	topicWeightQuiet = "bench.weight.alerts"
	weightHeavy      = 3
)

// weightResult is what the weighted drain measured.
type weightResult struct {
	each int // messages of each target
	// applied is whether the schema had target_control.weight (migration
	// 0019): an older BENCH_SCHEDULER drains both alike.
	applied bool
	speed   float64
	// heavy is the weighted target's drain, from the UPDATE's commit to its
	// last message on its target; lightThen is how many of the other's
	// were on theirs by then; all is both, to the last message of either.
	heavy     rate
	lightThen int64
	all       rate
	// quiet is the lateness of the quiet target's records due from the
	// UPDATE's commit to the last message of either backlog (none if the
	// drain was too short for one), quietSent all it sent: the stream runs
	// fairAside longer, so that it does not end with the drain.
	quiet     latencies
	quietSent int
	// checks are the read back of both backlogs' topics; quietCheck the
	// quiet target's.
	checks     []check
	quietCheck check
}

// lightRate is the default-weight target's rate while the weighted one
// drained.
func (r weightResult) lightRate() float64 {
	if r.heavy.wall <= 0 {
		return 0
	}
	return float64(r.lightThen) / r.heavy.wall.Seconds()
}

// overlapRate is both targets' rate together while both drained, and
// tailRate the default-weight target's alone after the weighted one was
// done: a weight makes the lighter target drain its rest alone.
func (r weightResult) overlapRate() float64 {
	if r.heavy.wall <= 0 {
		return 0
	}
	return float64(r.heavy.n+r.lightThen) / r.heavy.wall.Seconds()
}

func (r weightResult) tailRate() float64 {
	tail := r.all.wall - r.heavy.wall
	if tail <= 0 {
		return 0
	}
	return float64(r.all.n-r.heavy.n-r.lightThen) / tail.Seconds()
}

// ratio is the weighted target's rate over the other's while both drained.
func (r weightResult) ratio() float64 {
	if l := r.lightRate(); l > 0 {
		return r.heavy.perSecond() / l
	}
	return 0
}

// runWeighted drains two backlogs of half the fairness backlog each, made
// due by one UPDATE, the first target of weight weightHeavy: while both
// have due heads, claims take weightHeavy of its heads per turn and one of
// the other's (docs/design.md section 4.10). Meanwhile a quiet target of
// the default weight receives FairRate records a second, due on arrival,
// as in runFair: weights must not take from a target what the round's
// turns and express claims give it.
func (b *bench) runWeighted(ctx context.Context) (res weightResult, err error) {
	res = weightResult{each: max(1, b.cfg.FairBacklog/2)}
	db, err := b.pg.freshService(ctx, "svc_weight")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	for _, t := range []string{topicWeightHeavy, topicWeightLight} {
		if err := fillTarget(ctx, db, res.each, t, t+"-"); err != nil {
			return res, err
		}
	}
	if err := db.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM information_schema.columns
		WHERE table_schema = current_schema() AND table_name = 'target_control' AND column_name = 'weight')`).Scan(&res.applied); err != nil {
		return res, fmt.Errorf("look for target_control.weight: %w", err)
	}
	if res.applied {
		if _, err := db.pool.Exec(ctx, `INSERT INTO target_control (target_topic, weight) VALUES ($1, $2)`, topicWeightHeavy, weightHeavy); err != nil {
			return res, fmt.Errorf("weight %s: %w", topicWeightHeavy, err)
		}
	}

	kc, addr, err := startKafka(b.cfg.Partitions, deferTopic, topicWarmup, topicWeightHeavy, topicWeightLight, topicWeightQuiet)
	if err != nil {
		return res, err
	}
	defer kc.Close()
	lp, w, err := newClients(addr)
	if err != nil {
		return res, err
	}
	defer lp.close()
	defer w.close()
	res.speed = cpuSpeed(b.cfg.SpeedProbe)
	svc, err := b.startService(ctx, db.url, addr, false)
	if err != nil {
		return res, err
	}
	defer svc.Kill() // after Stop, it does nothing
	pid := svc.Pid()
	if err := warmUp(ctx, lp, w, svc, b.cfg.Warmup); err != nil {
		return res, err
	}

	b.say("  making %d rows of each target due with one SQL UPDATE, %d quiet records/s from its commit", res.each, b.cfg.FairRate)
	tag, err := db.pool.Exec(ctx, `UPDATE deferred_message SET next_run_at = now()
		WHERE target_topic IN ($1, $2) AND state = 'pending'`, topicWeightHeavy, topicWeightLight)
	if err != nil {
		return res, fmt.Errorf("make the backlogs due: %w", err)
	}
	t0 := time.Now()
	cpu0 := b.cpu(pid)
	if tag.RowsAffected() != int64(2*res.each) {
		return res, fmt.Errorf("make the backlogs due: %d rows pending, want %d", tag.RowsAffected(), 2*res.each)
	}
	quiet := startQuiet(ctx, lp, b.cfg.FairRate, topicWeightQuiet, "wq", 0)
	defer quiet.end()
	pr, err := track(ctx, "weighted backlog drain", func() (int64, error) { return w.count(topicWeightHeavy) }, 0, int64(res.each), timeoutFor(res.each))
	if err != nil {
		return res, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}
	if res.lightThen, err = w.count(topicWeightLight); err != nil {
		return res, err
	}
	res.heavy = rate{n: int64(res.each), wall: pr.doneAt.Sub(t0)}
	pr, err = track(ctx, "default-weight backlog drain", func() (int64, error) { return w.count(topicWeightLight) }, 0, int64(res.each), timeoutFor(res.each))
	if err != nil {
		return res, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}
	res.all = rate{n: int64(2 * res.each), wall: pr.doneAt.Sub(t0), cpu: b.cpu(pid).sub(cpu0)}
	drained := pr.doneAt
	sent, err := quiet.finish(ctx, w, svc)
	if err != nil {
		return res, err
	}
	res.quietSent = sent.n
	if err := svc.Stop(time.Minute); err != nil {
		return res, err
	}
	for _, t := range []string{topicWeightHeavy, topicWeightLight} {
		ds, err := readBack(ctx, addr, t)
		if err != nil {
			return res, err
		}
		c := verify(ds, res.each)
		res.checks = append(res.checks, c)
		if err := c.err("scheduler, weighted drain, " + t); err != nil {
			return res, err
		}
	}
	// The warm-up's records, like the fairness scenario's: all there once,
	// in order; they count in no figure.
	ds, err := readBack(ctx, addr, topicWarmup)
	if err != nil {
		return res, err
	}
	if err := verify(ds, b.cfg.Warmup).err("scheduler, weighted drain, " + topicWarmup); err != nil {
		return res, err
	}
	if ds, err = readBack(ctx, addr, topicWeightQuiet); err != nil {
		return res, err
	}
	res.quietCheck = verify(ds, sent.n)
	if err := res.quietCheck.err("scheduler, weighted drain, " + topicWeightQuiet); err != nil {
		return res, err
	}
	ls, err := lateness(ds)
	if err != nil {
		return res, err
	}
	var during []time.Duration
	for i, d := range ds {
		if !d.scheduledAt.After(drained) {
			during = append(during, ls[i])
		}
	}
	res.quiet = latencies{offered: b.cfg.FairRate, sent: len(during), sendFor: drained.Sub(t0),
		p50: percentile(during, 0.50), p99: percentile(during, 0.99), max: percentile(during, 1)}
	return res, nil
}

func (r weightResult) summarize(s *summary) {
	s.set("weight_heavy_msgs_per_s", r.heavy.perSecond())
	s.set("weight_light_msgs_per_s", r.lightRate())
	s.set("weight_ratio", r.ratio())
	s.set("weight_drain_msgs_per_s", r.all.perSecond())
	s.set("weight_overlap_msgs_per_s", r.overlapRate())
	s.set("weight_tail_msgs_per_s", r.tailRate())
	applied := 0.0
	if r.applied {
		applied = 1
	}
	s.set("weight_applied", applied)
	var delivered, expected, outOfOrder int
	for _, c := range r.checks {
		delivered += c.delivered
		expected += c.expected
		outOfOrder += c.outOfOrder
	}
	s.set("weight_delivered", float64(delivered))
	s.set("weight_expected", float64(expected))
	s.set("weight_out_of_order", float64(outOfOrder))
	s.set("weight_quiet_msgs", float64(r.quiet.sent))
	s.set("weight_quiet_p50_ms", ms(r.quiet.p50))
	s.set("weight_quiet_p99_ms", ms(r.quiet.p99))
	s.set("weight_quiet_max_ms", ms(r.quiet.max))
	s.set("weight_quiet_delivered", float64(r.quietCheck.delivered))
	s.set("weight_quiet_expected", float64(r.quietCheck.expected))
	s.set("weight_quiet_out_of_order", float64(r.quietCheck.outOfOrder))
}

func (r weightResult) write(w io.Writer) {
	how := fmt.Sprintf("%s of weight %d (target_control.weight), %s of the default 1", topicWeightHeavy, weightHeavy, topicWeightLight)
	if !r.applied {
		how = "both of weight 1: this binary's schema has no target_control.weight (before migration 0019)"
	}
	fmt.Fprintf(w, "\nWEIGHTED DRAIN: %s messages of each of two targets (own keys), inserted with SQL due in a week, made due at once\n",
		group(float64(r.each)))
	fmt.Fprintf(w, "by one SQL UPDATE; %s. Claims share each round turn by turn, a turn taking a target's weight in heads.\n", how)
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "target\tphase\tmsgs\twall\tmsgs/s\t")
	fmt.Fprintf(tw, "%s\tits whole backlog\t%s\t%.2fs\t%s\t\n", topicWeightHeavy, group(float64(r.each)), r.heavy.wall.Seconds(), group(r.heavy.perSecond()))
	fmt.Fprintf(tw, "%s\tmeanwhile\t%s\t%.2fs\t%s\t\n", topicWeightLight, group(float64(r.lightThen)), r.heavy.wall.Seconds(), group(r.lightRate()))
	fmt.Fprintf(tw, "both\twhile both drained\t%s\t%.2fs\t%s\t\n", group(float64(r.heavy.n+r.lightThen)), r.heavy.wall.Seconds(), group(r.overlapRate()))
	fmt.Fprintf(tw, "%s\tits rest, alone\t%s\t%.2fs\t%s\t\n", topicWeightLight, group(float64(r.all.n-r.heavy.n-r.lightThen)),
		(r.all.wall - r.heavy.wall).Seconds(), group(r.tailRate()))
	fmt.Fprintf(tw, "both\tto the last message\t%s\t%.2fs\t%s\t\n", group(float64(r.all.n)), r.all.wall.Seconds(), group(r.all.perSecond()))
	tw.Flush()
	if r.quiet.sent > 0 {
		fmt.Fprintf(w, "%s (weight 1, %d msgs/s due on arrival): %s records due during the drain, lateness p50 %.1fms, p99 %.1fms, max %.1fms.\n",
			topicWeightQuiet, r.quiet.offered, group(float64(r.quiet.sent)), ms(r.quiet.p50), ms(r.quiet.p99), ms(r.quiet.max))
	} else {
		fmt.Fprintf(w, "%s (weight 1, %d msgs/s due on arrival): none of its %s records fell due during the drain.\n",
			topicWeightQuiet, r.quiet.offered, group(float64(r.quietSent)))
	}
	fmt.Fprintf(w, "While both drained, %s went %.2f times as fast as %s. CPU to the last message: service %.1fs, Postgres %.1fs;\n",
		topicWeightHeavy, r.ratio(), topicWeightLight, r.all.cpu.service.Seconds(), r.all.cpu.postgres.Seconds())
	fmt.Fprintf(w, "one core sorted %.1f M integers/s before the service started.\n", r.speed)
}
