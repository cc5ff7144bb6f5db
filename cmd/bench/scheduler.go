package main

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
)

// rate is a measured throughput: n messages in wall time.
type rate struct {
	n    int64
	wall time.Duration
	cpu  cpuTimes // CPU spent meanwhile, by part
}

func (r rate) perSecond() float64 {
	if r.wall <= 0 {
		return 0
	}
	return float64(r.n) / r.wall.Seconds()
}

// latencies summarises a lateness phase.
type latencies struct {
	offered  int // msgs/s
	sent     int
	sendFor  time.Duration
	p50, p99 time.Duration
	max      time.Duration
}

// scenario is one run of the service: a key shape, a backlog, and what was
// measured.
type scenario struct {
	shape    shape
	backlog  int
	fill     time.Duration // inserting the backlog
	ingest   rate
	dispatch rate
	e2e      rate
	late     *latencies // nil unless measured
	hwm, rss int64      // the service's peak and final resident set
	checks   []check
	// partitions of every topic of the scenario.
	partitions int32
}

// runScheduler runs one scenario against the real service: a fresh database
// (with backlog far-future rows inserted by SQL), a fresh broker, then:
//
//  1. ingest: Warmup due-now records, then N records due in an hour, are
//     produced before the service starts; ingest is timed from 10% of them
//     stored (the start warms it up) to all of them stored;
//  2. dispatch: once the warm-up records are out, the N rows are made due
//     with one SQL UPDATE (an operator's expedite) and timed until all are on
//     their target;
//  3. end to end: N records due now are produced as fast as the producer
//     goes, timed from the first send to the last arrival;
//  4. lateness (when late): records due LateLead after their send, offered
//     at LateRate for LateFor; each one's publish time (the record
//     timestamp, set by the scheduler's producer) minus its due time
//     (defer.scheduled-at).
//
// Every phase's target topic is then read back: every message must be
// there, in per-key order. Every topic has the run's partitions.
func (b *bench) runScheduler(ctx context.Context, sh shape, backlog int, late bool) (sc scenario, err error) {
	return b.runSchedulerOn(ctx, sh, backlog, late, b.cfg.Partitions)
}

// runSchedulerOn is runScheduler with every topic on the given partitions.
func (b *bench) runSchedulerOn(ctx context.Context, sh shape, backlog int, late bool, partitions int32) (sc scenario, err error) {
	sc = scenario{shape: sh, backlog: backlog, partitions: partitions}
	label := fmt.Sprintf("svc_%s_%d", sh.name, backlog)
	if partitions != b.cfg.Partitions {
		// Its own database and profiles, apart from the scenario's on the
		// run's partitions.
		label += fmt.Sprintf("_p%d", partitions)
	}
	db, err := b.pg.freshService(ctx, label)
	if err != nil {
		return sc, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	if backlog > 0 {
		b.say("  inserting %d far-future rows with SQL", backlog)
		start := time.Now()
		if err := fillBacklog(ctx, db, backlog); err != nil {
			return sc, err
		}
		sc.fill = time.Since(start)
	}

	kc, addr, err := startKafka(partitions, deferTopic, topicWarmup, topicDispatch, topicE2E, topicLate)
	if err != nil {
		return sc, err
	}
	defer kc.Close()
	lp, err := newLoadProducer(addr)
	if err != nil {
		return sc, err
	}
	defer lp.close()
	w, err := newWatcher(addr)
	if err != nil {
		return sc, err
	}
	defer w.close()

	n, warm := b.cfg.N, b.cfg.Warmup
	farAt := time.Now().Add(time.Hour)
	if _, _, err := produceAll(ctx, lp, warm, func(i int) *sarama.ProducerMessage {
		return deferRecord(sh.key("w", i), i, topicWarmup, when{})
	}); err != nil {
		return sc, err
	}
	if _, _, err := produceAll(ctx, lp, n, func(i int) *sarama.ProducerMessage {
		return deferRecord(sh.key("d", i), i, topicDispatch, when{at: farAt})
	}); err != nil {
		return sc, err
	}

	b.say("  starting the scheduler (%d records waiting in %s)", warm+n, deferTopic)
	// Ingest is tracked from before the process starts, so that the first
	// batches are seen however fast the service gets going.
	total := int64(warm + n)
	stored := func() (int64, error) {
		var s int64
		err := db.pool.QueryRow(ctx, "SELECT coalesce(sum(next_offset), 0) FROM ingest_offset WHERE topic = $1", deferTopic).Scan(&s)
		return s, err
	}
	type tracked struct {
		pr  progress
		err error
	}
	ingested := make(chan tracked, 1)
	tctx, stopTracking := context.WithCancel(ctx)
	defer stopTracking()
	go func() {
		pr, err := track(tctx, "ingest", stored, int64(warm)+int64(n)/10, total, timeoutFor(warm+n))
		ingested <- tracked{pr, err}
	}()
	cpu0 := b.cpu(0)
	svc, err := b.startService(ctx, db.url, addr, b.cfg.ProfileDir != "")
	if err != nil {
		return sc, err
	}
	// With BENCH_PROFILE_DIR, the service's CPU over the first seconds of
	// each phase (the profile endpoint takes a fixed duration; the phases
	// run at a steady rate), or, when the previous profile is still running
	// then, from its end.
	var profiles []func() error
	profiled := func(phase string) func() error {
		path := filepath.Join(b.cfg.ProfileDir, fmt.Sprintf("service_%s_%s.cpu.pprof", label, phase))
		var prev func() error
		if len(profiles) > 0 {
			prev = profiles[len(profiles)-1]
		}
		return svc.cpuProfile(path, b.cfg.ServiceProfile, prev)
	}
	defer func() {
		// On an early return. Each wait includes the waits before it, and
		// returns the same after the first call.
		if len(profiles) > 0 {
			_ = profiles[len(profiles)-1]()
		}
	}()
	profiles = append(profiles, profiled("ingest"))
	pid := svc.Pid()
	stopped := false
	defer func() {
		if !stopped {
			svc.Kill()
		}
	}()

	// 1. Ingest, from the last sample below 10% of the records past the
	// warm-up (what comes before warms ingest up) to all stored.
	tr := <-ingested
	if tr.err != nil {
		return sc, fmt.Errorf("%w; scheduler's last output:\n%s", tr.err, svc.Logs())
	}
	cpu1 := b.cpu(pid)
	sc.ingest = rate{n: total - tr.pr.fromN, wall: tr.pr.doneAt.Sub(tr.pr.fromAt), cpu: cpu1.sub(cpu0)}
	if _, err := track(ctx, "warm-up delivery", func() (int64, error) { return w.count(topicWarmup) }, 0, int64(warm), timeoutFor(warm)); err != nil {
		return sc, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}

	// 2. Dispatch of a due backlog, timed (and its CPU counted) from the
	// moment the expedite commits.
	tag, err := db.pool.Exec(ctx, `UPDATE deferred_message SET next_run_at = now()
		WHERE source_topic = $1 AND target_topic = $2 AND state = 'pending'`, deferTopic, topicDispatch)
	if err != nil {
		return sc, fmt.Errorf("expedite the dispatch phase's rows: %w", err)
	}
	t0 := time.Now()
	profiles = append(profiles, profiled("dispatch"))
	cpu1 = b.cpu(pid)
	if tag.RowsAffected() != int64(n) {
		return sc, fmt.Errorf("expedite the dispatch phase's rows: %d rows pending, want %d", tag.RowsAffected(), n)
	}
	pr, err := track(ctx, "dispatch", func() (int64, error) { return w.count(topicDispatch) }, 0, int64(n), timeoutFor(n))
	if err != nil {
		return sc, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}
	cpu2 := b.cpu(pid)
	sc.dispatch = rate{n: int64(n), wall: pr.doneAt.Sub(t0), cpu: cpu2.sub(cpu1)}

	// 3. End to end.
	sent := make(chan error, 1)
	profiles = append(profiles, profiled("e2e"))
	start := time.Now()
	go func() {
		_, _, err := produceAll(ctx, lp, n, func(i int) *sarama.ProducerMessage {
			return deferRecord(sh.key("e", i), i, topicE2E, when{})
		})
		sent <- err
	}()
	pr, err = track(ctx, "end to end", func() (int64, error) { return w.count(topicE2E) }, 0, int64(n), timeoutFor(n))
	if perr := <-sent; perr != nil {
		return sc, perr
	}
	if err != nil {
		return sc, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}
	cpu3 := b.cpu(pid)
	sc.e2e = rate{n: int64(n), wall: pr.doneAt.Sub(start), cpu: cpu3.sub(cpu2)}

	// 4. Lateness at a fixed offered load.
	lateSent := 0
	if late {
		lead := b.cfg.LateLead
		start := time.Now()
		lateSent, err = producePaced(ctx, lp, b.cfg.LateRate, b.cfg.LateFor, func(i int, now time.Time) *sarama.ProducerMessage {
			return deferRecord(sh.key("l", i), i, topicLate, when{at: now.Add(lead)})
		})
		if err != nil {
			return sc, err
		}
		sc.late = &latencies{offered: b.cfg.LateRate, sent: lateSent, sendFor: time.Since(start)}
		if _, err := track(ctx, "lateness phase", func() (int64, error) { return w.count(topicLate) }, 0, int64(lateSent), timeoutFor(lateSent)); err != nil {
			return sc, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
		}
	}

	if sc.hwm, sc.rss, err = svc.Memory(); err != nil {
		return sc, err
	}
	if len(profiles) > 0 {
		// Profiles still running need the service.
		if perr := profiles[len(profiles)-1](); perr != nil {
			b.say("%v", perr)
		}
	}
	stopped = true
	if err := svc.Stop(time.Minute); err != nil {
		return sc, err
	}

	// Checks, after the service is gone: everything arrived, in order, and
	// nothing is left pending (finalize deleted what was published).
	phases := []phaseTopic{{topicWarmup, warm}, {topicDispatch, n}, {topicE2E, n}}
	if late {
		phases = append(phases, phaseTopic{topicLate, lateSent})
	}
	for _, ph := range phases {
		ds, err := readBack(ctx, addr, ph.topic)
		if err != nil {
			return sc, err
		}
		c := verify(ds, ph.n)
		sc.checks = append(sc.checks, c)
		if err := c.err(fmt.Sprintf("scheduler, %s, %s", sh.name, ph.topic)); err != nil {
			return sc, err
		}
		if ph.topic == topicLate {
			ls, err := lateness(ds)
			if err != nil {
				return sc, err
			}
			sc.late.p50, sc.late.p99, sc.late.max = percentile(ls, 0.50), percentile(ls, 0.99), percentile(ls, 1)
		}
	}
	var left int64
	if err := db.pool.QueryRow(ctx, "SELECT count(*) FROM deferred_message WHERE source_topic = $1 AND state = 'pending'",
		deferTopic).Scan(&left); err != nil {
		return sc, fmt.Errorf("count rows left pending: %w", err)
	}
	if left > 0 {
		return sc, fmt.Errorf("scheduler, %s: %d published rows still pending after a clean stop", sh.name, left)
	}
	return sc, nil
}

// phaseTopic is a phase's target topic and how many messages it must hold.
type phaseTopic struct {
	topic string
	n     int
}

// fillBacklog inserts n rows due in a week, each its own business key, with
// the shape of an ingested message, directly with SQL in chunks, so that the
// statement-level triggers build their heads (and history) as they would for
// ingest. Each chunk runs on a new connection after ANALYZE: the triggers'
// statements are planned once per connection, and a plan made when the
// tables were empty can turn a chunk's cost quadratic (see
// docs/benchmarks.md). A real backlog of this size has been analyzed by
// autovacuum long before; the service's own connections are left to what
// the service does.
func fillBacklog(ctx context.Context, db *database, n int) error {
	const chunk = 100_000
	for from := 1; from <= n; from += chunk {
		to := min(from+chunk-1, n)
		if err := fillChunk(ctx, db.url, from, to); err != nil {
			return err
		}
	}
	if _, err := db.pool.Exec(ctx, "VACUUM ANALYZE"); err != nil {
		return fmt.Errorf("vacuum analyze after the backlog: %w", err)
	}
	return nil
}

func fillChunk(ctx context.Context, url string, from, to int) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("insert backlog rows %d..%d: %w", from, to, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "ANALYZE"); err != nil {
		return fmt.Errorf("analyze before backlog rows %d..%d: %w", from, to, err)
	}
	_, err = conn.Exec(ctx, `
INSERT INTO deferred_message (source_topic, source_partition, source_offset, business_key, target_topic,
    next_run_at, attempt, error_class, key, value, header_keys, header_values)
SELECT 'bench.backlog', 0, g, 'far-' || g, $3::text,
    now() + interval '7 days' + g * interval '1 millisecond', 0, 'ProviderTimeout',
    convert_to('far-' || g, 'UTF8'), convert_to(lpad(g::text, 9, '0') || '|' || repeat('x', 118), 'UTF8'),
    ARRAY['trace-id', 'defer.target', 'defer.error.class', 'defer.delay'],
    ARRAY['4bf92f3577b34da6a3ce929d0e0e4736'::bytea, convert_to($3::text, 'UTF8'), 'ProviderTimeout'::bytea, '168h'::bytea]
FROM generate_series($1::bigint, $2::bigint) AS g
ORDER BY g`, from, to, topicBacklog)
	if err != nil {
		return fmt.Errorf("insert backlog rows %d..%d: %w", from, to, err)
	}
	return nil
}
