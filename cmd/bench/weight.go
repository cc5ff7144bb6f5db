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
// of weight weightHeavy, the second of the default weight 1.
const (
	topicWeightHeavy = "bench.weight.payments"
	topicWeightLight = "bench.weight.reports"
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
	checks    []check
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
// the other's (docs/design.md section 4.10).
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

	kc, addr, err := startKafka(b.cfg.Partitions, deferTopic, topicWeightHeavy, topicWeightLight)
	if err != nil {
		return res, err
	}
	defer kc.Close()
	w, err := newWatcher(addr)
	if err != nil {
		return res, err
	}
	defer w.close()
	res.speed = cpuSpeed(b.cfg.SpeedProbe)
	svc, err := b.startService(ctx, db.url, addr, false)
	if err != nil {
		return res, err
	}
	defer svc.Kill() // after Stop, it does nothing
	pid := svc.Pid()

	b.say("  making %d rows of each target due with one SQL UPDATE", res.each)
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
	fmt.Fprintf(w, "While both drained, %s went %.2f times as fast as %s. CPU to the last message: service %.1fs, Postgres %.1fs;\n",
		topicWeightHeavy, r.ratio(), topicWeightLight, r.all.cpu.service.Seconds(), r.all.cpu.postgres.Seconds())
	fmt.Fprintf(w, "one core sorted %.1f M integers/s before the service started.\n", r.speed)
}
