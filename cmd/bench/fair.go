package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
)

// The fairness scenario's targets: one whose backlog drains, and a quiet one
// whose records come in meanwhile. TARGET_TOPICS=bench.* allows both.
const (
	topicFairBacklog = "bench.fair.orders"
	topicFairQuiet   = "bench.fair.alerts"
)

// fairAside is how long the quiet target's records come alone before the
// backlog is made due (what its lateness is with nothing else due: the
// path from the defer topic to the target), and how long they keep coming
// after the backlog is on its target (so that the stream does not end with
// the drain).
const fairAside = 2 * time.Second

// fairResult is what the fairness scenario measured.
type fairResult struct {
	backlog  int           // messages of the draining target
	rate     int           // quiet records offered per second
	fill     time.Duration // inserting the backlog
	expedite time.Duration // the UPDATE that made it due, before the clock starts
	speed    float64       // cpuSpeed right before the service started
	// drain is the backlog, from the UPDATE's commit to its last message on
	// its target.
	drain rate
	// The quiet target's records: due before the backlog was made due
	// (alone), from then until it was on its target (during), and after.
	alone, during, after latencies
	// checks are the read back of the warm-up's, the backlog's and the
	// quiet target's topics.
	checks []check
	// vacuum is what autovacuum did in the scenario's database from the
	// UPDATE's commit to the end of the quiet records, and the quiet
	// records due during the drain or after it split by whether an
	// autovacuum worker ran at their due time: on two cores, a vacuum of
	// the drained tables competes with everything else.
	vacuum             vacuumSeen
	underVacuum, clear latencies
	// toStore and toPublish split the lateness of the quiet records due
	// during the drain at the moment ingest stored each one (its
	// 'deferred' history row's recorded_at, the insert's transaction
	// start): the way through the defer topic and ingest, then the wait
	// for a claim and the publish. Their p99s need not add up.
	toStore, toPublish latencies
	// aloneToStore and aloneToPublish split the records due alone, before
	// the drain, the same way.
	aloneToStore, aloneToPublish latencies
	// weight is the weighted drain that runs after it (weight.go).
	weight weightResult
}

// vacuumSeen is what sampling pg_stat_activity saw of autovacuum workers.
type vacuumSeen struct {
	// at holds, per sample, its time and whether a worker ran then.
	at      []time.Time
	running []bool
	// busy is, per worker query ("autovacuum: VACUUM public.deferred_message"),
	// the time it was seen running (samples times the interval).
	busy map[string]time.Duration
}

// vacuumSample is how often watchVacuum looks.
const vacuumSample = 50 * time.Millisecond

// watchVacuum samples the autovacuum workers of db's database until stop
// is closed, then returns what it saw. A failed sample is skipped: this
// only explains figures, it measures none.
func watchVacuum(ctx context.Context, db *database, stop <-chan struct{}) vacuumSeen {
	v := vacuumSeen{busy: map[string]time.Duration{}}
	tick := time.NewTicker(vacuumSample)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return v
		case <-ctx.Done():
			return v
		case now := <-tick.C:
			rows, err := db.pool.Query(ctx, `SELECT query FROM pg_stat_activity
				WHERE backend_type = 'autovacuum worker' AND datname = current_database() AND query <> ''`)
			if err != nil {
				continue
			}
			queries, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				continue
			}
			for _, q := range queries {
				v.busy[q] += vacuumSample
			}
			v.at = append(v.at, now)
			v.running = append(v.running, len(queries) > 0)
		}
	}
}

// runningAt reports whether the last sample at or before t saw a worker.
func (v vacuumSeen) runningAt(t time.Time) bool {
	i := sort.Search(len(v.at), func(i int) bool { return v.at[i].After(t) })
	return i > 0 && v.running[i-1]
}

// summary names what the workers vacuumed and for how long
// ("VACUUM public.deferred_message 1.2s, ..."), "none" if none was seen.
func (v vacuumSeen) summary() string {
	if len(v.busy) == 0 {
		return "none"
	}
	names := make([]string, 0, len(v.busy))
	for q := range v.busy {
		names = append(names, q)
	}
	sort.Strings(names)
	parts := make([]string, len(names))
	for i, q := range names {
		parts[i] = fmt.Sprintf("%s %.1fs", strings.TrimPrefix(q, "autovacuum: "), v.busy[q].Seconds())
	}
	return strings.Join(parts, ", ")
}

// split returns ls, the lateness of ds in the same order, split by whether
// a worker ran at each delivery's due time.
func (v vacuumSeen) split(ds []delivery, ls []time.Duration) (under, clear []time.Duration) {
	for i, d := range ds {
		if v.runningAt(d.scheduledAt) {
			under = append(under, ls[i])
		} else {
			clear = append(clear, ls[i])
		}
	}
	return under, clear
}

// runFair measures fairness between targets: a backlog of FairBacklog
// messages of one target (own keys) all become due at the same moment, and
// from then on a quiet target receives FairRate records a second, due on
// arrival, until the backlog is on its target and fairAside more (and for
// fairAside before, alone, for comparison). A service that takes due heads
// in due-time order across all targets makes every quiet record wait for
// the whole backlog; the figures say how long.
//
// The backlog is inserted with SQL as fillBacklog does (ingesting a million
// records would take longer than draining them), due in a week, with the
// service running and idle; one SQL UPDATE of deferred_message (an
// operator's expedite, as in runScheduler's dispatch phase; the triggers
// move the key heads) then makes it due at once. The drain is timed from
// the UPDATE's commit, when the rows become visible as due, to the last
// message on its target; each quiet record's lateness is its publish time
// (the record timestamp, set by the scheduler's producer) minus its due
// time (defer.scheduled-at, the defer.at it was sent with: its send time).
// Both targets are then read back: every message there once, in per-key
// order, and nothing left pending.
func (b *bench) runFair(ctx context.Context) (res fairResult, err error) {
	res = fairResult{backlog: b.cfg.FairBacklog, rate: b.cfg.FairRate}
	db, err := b.pg.freshService(ctx, "svc_fair")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	b.say("  inserting %d rows for %s with SQL, due in a week", res.backlog, topicFairBacklog)
	start := time.Now()
	if err := fillTarget(ctx, db, res.backlog, topicFairBacklog, "fair-"); err != nil {
		return res, err
	}
	res.fill = time.Since(start)

	kc, addr, err := startKafka(b.cfg.Partitions, deferTopic, topicWarmup, topicFairBacklog, topicFairQuiet)
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

	// The machine's speed before the service starts: a service that burns
	// CPU while idle (a claim walking the backlog's heads while they are
	// not due) must show in its own figures, not pass for a slow machine.
	res.speed = cpuSpeed(b.cfg.SpeedProbe)
	svc, err := b.startService(ctx, db.url, addr, false)
	if err != nil {
		return res, err
	}
	defer svc.Kill() // after Stop, it does nothing
	pid := svc.Pid()
	// The warm-up's records go through ingest and dispatch first, so that
	// the first quiet record does not pay for the service's first round.
	warm := b.cfg.Warmup
	if err := warmUp(ctx, lp, w, svc, warm); err != nil {
		return res, err
	}
	// The quiet target alone, its records delivered before the backlog is
	// made due.
	nAlone, err := producePaced(ctx, lp, res.rate, fairAside, func(i int, now time.Time) *sarama.ProducerMessage {
		return deferRecord(ownKeys.key("q", i), i, topicFairQuiet, when{at: now})
	})
	if err != nil {
		return res, err
	}
	if _, err := track(ctx, "quiet target alone", func() (int64, error) { return w.count(topicFairQuiet) }, 0, int64(nAlone), timeoutFor(nAlone)); err != nil {
		return res, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}

	b.say("  making the %d rows due with one SQL UPDATE, %d quiet records/s from its commit", res.backlog, res.rate)
	updating := time.Now()
	tag, err := db.pool.Exec(ctx, `UPDATE deferred_message SET next_run_at = now()
		WHERE target_topic = $1 AND state = 'pending'`, topicFairBacklog)
	if err != nil {
		return res, fmt.Errorf("make %s's backlog due: %w", topicFairBacklog, err)
	}
	t0 := time.Now()
	res.expedite = t0.Sub(updating)
	cpu0 := b.cpu(pid)
	if tag.RowsAffected() != int64(res.backlog) {
		return res, fmt.Errorf("make %s's backlog due: %d rows pending, want %d", topicFairBacklog, tag.RowsAffected(), res.backlog)
	}
	quiet := startQuiet(ctx, lp, res.rate, topicFairQuiet, "q", nAlone)
	defer quiet.end()
	stopWatch := make(chan struct{})
	watched := make(chan vacuumSeen, 1)
	go func() { watched <- watchVacuum(ctx, db, stopWatch) }()
	endWatch := func() vacuumSeen {
		if stopWatch != nil {
			close(stopWatch)
			stopWatch = nil
			res.vacuum = <-watched
		}
		return res.vacuum
	}
	defer endWatch()
	pr, err := track(ctx, "backlog drain", func() (int64, error) { return w.count(topicFairBacklog) }, 0, int64(res.backlog), timeoutFor(res.backlog))
	if err != nil {
		return res, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}
	res.drain = rate{n: int64(res.backlog), wall: pr.doneAt.Sub(t0), cpu: b.cpu(pid).sub(cpu0)}
	drained := pr.doneAt
	sent, err := quiet.finish(ctx, w, svc)
	if err != nil {
		return res, err
	}
	vacuum := endWatch()
	if err := svc.Stop(time.Minute); err != nil {
		return res, err
	}

	// Checks, after the service is gone.
	for _, ph := range []phaseTopic{{topicWarmup, warm}, {topicFairBacklog, res.backlog}, {topicFairQuiet, sent.n}} {
		ds, err := readBack(ctx, addr, ph.topic)
		if err != nil {
			return res, err
		}
		c := verify(ds, ph.n)
		res.checks = append(res.checks, c)
		if err := c.err("scheduler, fairness, " + ph.topic); err != nil {
			return res, err
		}
		if ph.topic != topicFairQuiet {
			continue
		}
		ls, err := lateness(ds)
		if err != nil {
			return res, err
		}
		var alone, during, after []time.Duration
		// The records due from the UPDATE on, split by autovacuum below.
		var since []delivery
		var sinceLs []time.Duration
		for i, d := range ds {
			switch {
			case d.scheduledAt.Before(t0):
				alone = append(alone, ls[i])
				continue
			case !d.scheduledAt.After(drained):
				during = append(during, ls[i])
			default:
				after = append(after, ls[i])
			}
			since, sinceLs = append(since, d), append(sinceLs, ls[i])
		}
		vacuuming, clear := vacuum.split(since, sinceLs)
		of := func(ls []time.Duration, d time.Duration) latencies {
			return latencies{offered: res.rate, sent: len(ls), sendFor: d,
				p50: percentile(ls, 0.50), p99: percentile(ls, 0.99), max: percentile(ls, 1)}
		}
		res.alone, res.during, res.after = of(alone, fairAside), of(during, drained.Sub(t0)), of(after, fairAside)
		res.underVacuum, res.clear = of(vacuuming, 0), of(clear, 0)
		stored, err := storedAt(ctx, db, topicFairQuiet)
		if err != nil {
			return res, err
		}
		var toStore, toPublish, aloneToStore, aloneToPublish []time.Duration
		for _, d := range ds {
			if d.scheduledAt.After(drained) {
				continue
			}
			at, ok := stored[d.id]
			if !ok {
				return res, fmt.Errorf("scheduler, fairness: %s's message %s has no 'deferred' history row", ph.topic, d.id)
			}
			if d.scheduledAt.Before(t0) {
				aloneToStore = append(aloneToStore, at.Sub(d.scheduledAt))
				aloneToPublish = append(aloneToPublish, d.published.Sub(at))
				continue
			}
			toStore = append(toStore, at.Sub(d.scheduledAt))
			toPublish = append(toPublish, d.published.Sub(at))
		}
		res.toStore, res.toPublish = of(toStore, 0), of(toPublish, 0)
		res.aloneToStore, res.aloneToPublish = of(aloneToStore, 0), of(aloneToPublish, 0)
	}
	var left int64
	if err := db.pool.QueryRow(ctx, "SELECT count(*) FROM deferred_message WHERE state = 'pending'").Scan(&left); err != nil {
		return res, fmt.Errorf("count rows left pending: %w", err)
	}
	if left > 0 {
		return res, fmt.Errorf("scheduler, fairness: %d published rows still pending after a clean stop", left)
	}
	return res, nil
}

// storedAt returns when ingest stored each message of target, by defer.id:
// the recorded_at of its 'deferred' history event, which is its insert's
// transaction start (now()), so a little before the row was visible. The
// view deferred_history has that event whether it is a row of its own or
// folded into the 'published' row (migration 0012); a scheduler binary
// from before that migration (BENCH_SCHEDULER) has no view, and a row
// for every deferral.
func storedAt(ctx context.Context, db *database, target string) (map[string]time.Time, error) {
	var view bool
	if err := db.pool.QueryRow(ctx, "SELECT to_regclass('deferred_history') IS NOT NULL").Scan(&view); err != nil {
		return nil, fmt.Errorf("read when %s's messages were stored: %w", target, err)
	}
	history := "deferred_attempt"
	if view {
		history = "deferred_history"
	}
	rows, err := db.pool.Query(ctx, `SELECT message_id::text, recorded_at FROM `+history+`
		WHERE event = 'deferred' AND target_topic = $1`, target)
	if err != nil {
		return nil, fmt.Errorf("read when %s's messages were stored: %w", target, err)
	}
	out := map[string]time.Time{}
	var id string
	var at time.Time
	_, err = pgx.ForEachRow(rows, []any{&id, &at}, func() error {
		out[id] = at
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read when %s's messages were stored: %w", target, err)
	}
	return out, nil
}

// fillTarget inserts n rows for target with SQL the way fillBacklog does
// (chunks of 100,000, each on a new connection after ANALYZE, so that the
// statement-level triggers build the key heads and history as for ingest;
// VACUUM ANALYZE at the end), but as messages that can be delivered and
// checked: row i (0..n-1) is business key and record key prefix+i, with
// payload(i)'s value. They are due in a week; the scenario makes them due.
func fillTarget(ctx context.Context, db *database, n int, target, prefix string) error {
	const chunk = 100_000
	for from := 0; from < n; from += chunk {
		to := min(from+chunk, n) - 1
		if err := fillTargetChunk(ctx, db.url, from, to, target, prefix); err != nil {
			return err
		}
	}
	if _, err := db.pool.Exec(ctx, "VACUUM ANALYZE"); err != nil {
		return fmt.Errorf("vacuum analyze after %s's rows: %w", target, err)
	}
	return nil
}

func fillTargetChunk(ctx context.Context, url string, from, to int, target, prefix string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("insert %s's rows %d..%d: %w", target, from, to, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "ANALYZE"); err != nil {
		return fmt.Errorf("analyze before %s's rows %d..%d: %w", target, from, to, err)
	}
	// The source coordinates are a topic nothing consumes, so that they
	// never meet an ingested record's.
	_, err = conn.Exec(ctx, `
INSERT INTO deferred_message (source_topic, source_partition, source_offset, business_key, target_topic,
    next_run_at, attempt, error_class, key, value, header_keys, header_values)
SELECT $3::text || '.fill', 0, g, $4::text || g, $3::text,
    now() + interval '7 days', 0, 'ProviderTimeout',
    convert_to($4::text || g, 'UTF8'), convert_to(lpad(g::text, 9, '0') || '|' || repeat('x', 118), 'UTF8'),
    ARRAY['trace-id', 'defer.target', 'defer.error.class', 'defer.delay'],
    ARRAY['4bf92f3577b34da6a3ce929d0e0e4736'::bytea, convert_to($3::text, 'UTF8'), 'ProviderTimeout'::bytea, '168h'::bytea]
FROM generate_series($1::bigint, $2::bigint) AS g
ORDER BY g`, from, to, target, prefix)
	if err != nil {
		return fmt.Errorf("insert %s's rows %d..%d: %w", target, from, to, err)
	}
	return nil
}

func (f fairResult) summarize(s *summary) {
	s.set("fair_quiet_p99_ms", ms(f.during.p99))
	s.set("fair_quiet_p50_ms", ms(f.during.p50))
	s.set("fair_quiet_max_ms", ms(f.during.max))
	s.set("fair_quiet_msgs", float64(f.during.sent))
	s.set("fair_quiet_alone_p50_ms", ms(f.alone.p50))
	s.set("fair_quiet_alone_p99_ms", ms(f.alone.p99))
	s.set("fair_quiet_after_p99_ms", ms(f.after.p99))
	s.set("fair_backlog_msgs_per_s", f.drain.perSecond())
	s.set("fair_backlog_msgs", float64(f.backlog))
	s.set("fair_expedite_ms", ms(f.expedite))
	s.set("fair_cpu_speed", f.speed)
	s.set("fair_quiet_vacuum_p99_ms", ms(f.underVacuum.p99))
	s.set("fair_quiet_novacuum_p99_ms", ms(f.clear.p99))
	s.set("fair_quiet_to_store_p99_ms", ms(f.toStore.p99))
	s.set("fair_quiet_to_publish_p99_ms", ms(f.toPublish.p99))
	var delivered, expected, outOfOrder int
	for _, c := range f.checks {
		delivered += c.delivered
		expected += c.expected
		outOfOrder += c.outOfOrder
	}
	s.set("fair_delivered", float64(delivered))
	s.set("fair_expected", float64(expected))
	s.set("fair_out_of_order", float64(outOfOrder))
	f.weight.summarize(s)
}

// fairTargets writes the bar: the quiet target on time while the
// other drains.
func fairTargets(target func(what, got, want string, ok bool), v map[string]float64) {
	target(fmt.Sprintf("quiet target p99 lateness while another drains %s", group(v["fair_backlog_msgs"])),
		fmt.Sprintf("%.1f ms", v["fair_quiet_p99_ms"]), "<= 100 ms", v["fair_quiet_p99_ms"] <= 100)
	if v["weight_quiet_msgs"] > 0 {
		target(fmt.Sprintf("the same while two drain %s each, one of weight %d", group(v["weight_expected"]/2), weightHeavy),
			fmt.Sprintf("%.1f ms", v["weight_quiet_p99_ms"]), "<= 100 ms", v["weight_quiet_p99_ms"] <= 100)
	}
}

// writeFairChecks writes the fairness scenario's and the weighted drain's
// read back.
func writeFairChecks(w io.Writer, v map[string]float64) {
	fmt.Fprintf(w, "fairness: %s of %s messages delivered (read back from every target topic), %s out of per-key order;\n",
		group(v["fair_delivered"]), group(v["fair_expected"]), group(v["fair_out_of_order"]))
	fmt.Fprintf(w, "the weighted drain: %s of %s backlog messages delivered, %s out of per-key order; its quiet target %s of %s, %s out of order\n",
		group(v["weight_delivered"]), group(v["weight_expected"]), group(v["weight_out_of_order"]),
		group(v["weight_quiet_delivered"]), group(v["weight_quiet_expected"]), group(v["weight_quiet_out_of_order"]))
}

func (f fairResult) write(w io.Writer) {
	fmt.Fprintf(w, "\nFAIRNESS BETWEEN TARGETS: %s messages of %s (own keys), inserted with SQL due in a week, made due at once\n",
		group(float64(f.backlog)), topicFairBacklog)
	fmt.Fprintf(w, "by one SQL UPDATE. %s gets %d msgs/s (own keys) due on arrival (defer.at = send time): alone for %v, then from\n",
		topicFairQuiet, f.rate, fairAside)
	fmt.Fprintf(w, "the UPDATE's commit until the backlog is on its target, and %v more. Lateness: record timestamp set by the publisher\n", fairAside)
	fmt.Fprintln(w, "minus defer.scheduled-at, so it includes the way through the defer topic and ingest.")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "target\tmessages\tmsgs\twall\tmsgs/s\tp50\tp99\tmax\t")
	fmt.Fprintf(tw, "%s\tbacklog, made due at once\t%s\t%.2fs\t%s\t\t\t\t\n", topicFairBacklog, group(float64(f.backlog)),
		f.drain.wall.Seconds(), group(f.drain.perSecond()))
	for _, l := range []struct {
		what string
		l    latencies
	}{{fmt.Sprintf("alone, %v before", fairAside), f.alone}, {"due during the drain", f.during}, {fmt.Sprintf("%v after the drain", fairAside), f.after}} {
		fmt.Fprintf(tw, "%s\t%s\t%s\t\t\t%.1fms\t%.1fms\t%.1fms\t\n", topicFairQuiet, l.what, group(float64(l.l.sent)),
			ms(l.l.p50), ms(l.l.p99), ms(l.l.max))
	}
	tw.Flush()
	fmt.Fprintln(w, "The quiet records' lateness split where ingest stored them (their 'deferred' history row's time, the insert's start):")
	for _, l := range []struct {
		what           string
		store, publish latencies
	}{{"alone", f.aloneToStore, f.aloneToPublish}, {"during the drain", f.toStore, f.toPublish}} {
		fmt.Fprintf(w, "  %s: due to stored p50 %.1fms, p99 %.1fms, max %.1fms; stored to published p50 %.1fms, p99 %.1fms, max %.1fms.\n",
			l.what, ms(l.store.p50), ms(l.store.p99), ms(l.store.max), ms(l.publish.p50), ms(l.publish.p99), ms(l.publish.max))
	}
	fmt.Fprintf(w, "Inserting the backlog took %.1fs and the UPDATE %.1fs, both before the drain's clock starts. CPU during the drain:\n",
		f.fill.Seconds(), f.expedite.Seconds())
	fmt.Fprintf(w, "service %.1fs, Postgres %.1fs, this process %.1fs; one core sorted %.1f M integers/s before the service started.\n",
		f.drain.cpu.service.Seconds(), f.drain.cpu.postgres.Seconds(), f.drain.cpu.bench.Seconds(), f.speed)
	f.writeVacuum(w)
	f.weight.write(w)
}

// writeVacuum says what autovacuum did from the UPDATE on, and the quiet
// records' lateness with and without a worker running at their due time.
func (f fairResult) writeVacuum(w io.Writer) {
	if len(f.vacuum.busy) == 0 {
		fmt.Fprintf(w, "Autovacuum: no worker seen in this database from the UPDATE's commit on (sampled every %v).\n", vacuumSample)
		return
	}
	fmt.Fprintf(w, "Autovacuum from the UPDATE's commit on (sampled every %v): %s.\n", vacuumSample, f.vacuum.summary())
	fmt.Fprintf(w, "Quiet records due from then on, with a worker running at their due time: %d, p50 %.1fms, p99 %.1fms;\n",
		f.underVacuum.sent, ms(f.underVacuum.p50), ms(f.underVacuum.p99))
	fmt.Fprintf(w, "with none: %d, p50 %.1fms, p99 %.1fms.\n", f.clear.sent, ms(f.clear.p50), ms(f.clear.p99))
}

// onlyFair is BENCH_ONLY's value for the fairness scenario alone.
const onlyFair = "fair"

// runFairness runs the fairness scenario into res.
func (b *bench) runFairness(ctx context.Context, res *results) error {
	b.say("fairness: %d messages of %s made due at once, %d msgs/s of %s meanwhile", b.cfg.FairBacklog, topicFairBacklog,
		b.cfg.FairRate, topicFairQuiet)
	f, err := b.runFair(ctx)
	if err != nil {
		return fmt.Errorf("scheduler, fairness: %w", err)
	}
	b.say("  backlog drained at %.0f msgs/s; quiet target p50 %.1fms, p99 %.1fms, max %.1fms", f.drain.perSecond(),
		ms(f.during.p50), ms(f.during.p99), ms(f.during.max))
	b.say("weighted drain: %d messages of %s (weight %d) and of %s made due at once", max(1, b.cfg.FairBacklog/2),
		topicWeightHeavy, weightHeavy, topicWeightLight)
	if f.weight, err = b.runWeighted(ctx); err != nil {
		return fmt.Errorf("scheduler, weighted drain: %w", err)
	}
	b.say("  %s at %.0f msgs/s, %s at %.0f meanwhile (%.2f times)", topicWeightHeavy, f.weight.heavy.perSecond(),
		topicWeightLight, f.weight.lightRate(), f.weight.ratio())
	res.fair = f
	return nil
}

// writeOnlyFair writes the report of BENCH_ONLY=fair.
func (r *results) writeOnlyFair(w io.Writer, s *summary) {
	fmt.Fprintf(w, "\ndefer-scheduler benchmark, mode %s, the fairness scenario alone (BENCH_ONLY=fair), %d partitions per topic\n",
		r.cfg.Mode, r.cfg.Partitions)
	for _, m := range r.machine {
		fmt.Fprintln(w, m)
	}
	r.fair.write(w)
	fmt.Fprintln(w, "\nCOMPARED WITH THE TARGETS")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	fairTargets(targetRow(tw), s.vals)
	tw.Flush()
	fmt.Fprint(w, "\nCHECKS: ")
	writeFairChecks(w, s.vals)
	fmt.Fprintln(w, s.resultLine())
}

// quietStream sends a quiet target's records, due on arrival, at a steady
// rate from start until end: what the fairness and weighted drains measure
// a quiet target's lateness by while backlogs drain.
type quietStream struct {
	target string
	stop   chan struct{}
	done   chan quietSent
	sent   *quietSent
}

// quietSent is what a quietStream sent: records first..n-1, and the
// producer's error if any.
type quietSent struct {
	n   int
	err error
}

// startQuiet sends rate records a second to target through lp, record i
// (from first on) of business key and record key ownKeys.key(prefix, i),
// due at its send time, until end is called.
func startQuiet(ctx context.Context, lp *loadProducer, rate int, target, prefix string, first int) *quietStream {
	q := &quietStream{target: target, stop: make(chan struct{}), done: make(chan quietSent, 1)}
	go func() {
		n, err := producePacedUntil(ctx, lp, rate, q.stop, func(i int, now time.Time) *sarama.ProducerMessage {
			return deferRecord(ownKeys.key(prefix, first+i), first+i, target, when{at: now})
		})
		q.done <- quietSent{first + n, err}
	}()
	return q
}

// end stops the stream and waits for the acknowledgements of what it sent;
// it may be called again (a deferred call on every path out, so that the
// stream never outlives the producer it sends through) and returns the
// same.
func (q *quietStream) end() quietSent {
	if q.sent == nil {
		close(q.stop)
		s := <-q.done
		q.sent = &s
	}
	return *q.sent
}

// finish lets the stream run fairAside more, so that it does not end with
// the drain, then ends it and waits until all it sent is on its target.
func (q *quietStream) finish(ctx context.Context, w *watcher, svc *service) (quietSent, error) {
	select {
	case <-time.After(fairAside):
	case <-ctx.Done():
		return quietSent{}, ctx.Err()
	}
	sent := q.end()
	if sent.err != nil {
		return sent, sent.err
	}
	if _, err := track(ctx, "quiet target", func() (int64, error) { return w.count(q.target) }, 0, int64(sent.n), timeoutFor(sent.n)); err != nil {
		return sent, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}
	return sent, nil
}

// warmUp sends n records due now to topicWarmup (keys ownKeys.key("w", i))
// and waits until they are on it, so that what a scenario measures next
// does not pay for the service's first round.
func warmUp(ctx context.Context, lp *loadProducer, w *watcher, svc *service, n int) error {
	if _, _, err := produceAll(ctx, lp, n, func(i int) *sarama.ProducerMessage {
		return deferRecord(ownKeys.key("w", i), i, topicWarmup, when{})
	}); err != nil {
		return err
	}
	if _, err := track(ctx, "warm-up delivery", func() (int64, error) { return w.count(topicWarmup) }, 0, int64(n), timeoutFor(n)); err != nil {
		return fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}
	return nil
}
