package main

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
)

// rate is a measured throughput: n messages in wall time.
type rate struct {
	n    int64
	wall time.Duration
	cpu  cpuTimes // CPU spent meanwhile, by part
	// stmts is what Postgres's statements cost meanwhile (nil unless
	// the server tracks them: statements.go).
	stmts []stmtCost
}

// perMsg is d per message of the phase, in µs.
func (r rate) perMsg(d time.Duration) float64 {
	return float64(d.Microseconds()) / float64(max(r.n, 1))
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
	// cpu and stmts are what the phase cost, from its first send to its
	// last arrival (zero and nil where not measured).
	cpu   cpuTimes
	stmts []stmtCost
	// autovacuum is what autovacuum workers did in the phase's database
	// from its first send to its last arrival, and the phase's records
	// split by whether one ran at their due time (nil where not watched).
	autovacuum *autovacuumSplit
}

// autovacuumSplit is a lateness phase's autovacuum, sampled, and its
// records' lateness with a worker running at their due time and without.
type autovacuumSplit struct {
	seen         vacuumSeen
	under, clear latencies
}

// setPercentiles sets l's p50, p99 and max from ls.
func (l *latencies) setPercentiles(ls []time.Duration) {
	l.p50, l.p99, l.max = percentile(ls, 0.50), percentile(ls, 0.99), percentile(ls, 1)
}

// measured sets l's percentiles from the lateness ls of its deliveries ds
// and, if its autovacuum was watched, splits them by it.
func (l *latencies) measured(ds []delivery, ls []time.Duration) {
	l.setPercentiles(ls)
	if l.autovacuum == nil {
		return
	}
	under, clear := l.autovacuum.seen.split(ds, ls)
	a := l.autovacuum
	a.under = latencies{offered: l.offered, sent: len(under)}
	a.under.setPercentiles(under)
	a.clear = latencies{offered: l.offered, sent: len(clear)}
	a.clear.setPercentiles(clear)
}

// perMsg is d per message sent in the phase, in µs.
func (l *latencies) perMsg(d time.Duration) float64 {
	return float64(d.Microseconds()) / float64(max(l.sent, 1))
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
	// lateVacuumed is the lateness phase again after VACUUM of the emptied
	// queue tables (nil unless measured); vacuumedPages is what the VACUUM
	// left of deferred_message (0: truncated, as autovacuum does).
	lateVacuumed  *latencies
	vacuumedPages int32
	hwm, rss      int64 // the service's peak and final resident set
	checks        []check
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
//     (defer.scheduled-at);
//  5. lateness after a VACUUM (when late, without far-future rows): the
//     queue tables, emptied by the phases before, are vacuumed as
//     autovacuum does after a drain, and phase 4 runs again on them.
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

	kc, addr, err := startKafka(partitions, deferTopic, topicWarmup, topicDispatch, topicE2E, topicLate, topicLateVacuumed)
	if err != nil {
		return sc, err
	}
	defer kc.Close()
	lp, w, err := newClients(addr)
	if err != nil {
		return sc, err
	}
	defer lp.close()
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
	defer svc.Kill() // after Stop, it does nothing

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
	stmts0, err := b.pg.statements(ctx, db.name)
	if err != nil {
		return sc, err
	}
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
	stmts1, err := b.pg.statements(ctx, db.name)
	if err != nil {
		return sc, err
	}
	sc.e2e = rate{n: int64(n), wall: pr.doneAt.Sub(start), cpu: cpu3.sub(cpu2), stmts: stmts1.since(stmts0, b.labels)}

	// 4. Lateness at a fixed offered load; then, on a database without
	// far-future rows, the same load once more on the queue tables as
	// autovacuum leaves them after a drain: emptied and truncated by a
	// VACUUM, their indexes counting no tuples (docs/design.md section 14).
	pace := func(topic, keys, what string) (*latencies, int, error) {
		lead := b.cfg.LateLead
		stmts0, err := b.pg.statements(ctx, db.name)
		if err != nil {
			return nil, 0, err
		}
		cpu0 := b.cpu(pid)
		// Autovacuum runs when it likes; a phase's tail may be its. So
		// its workers are sampled meanwhile, as in the fairness scenario.
		stopWatch, watched := make(chan struct{}), make(chan vacuumSeen, 1)
		go func() { watched <- watchVacuum(ctx, db, stopWatch) }()
		endWatch := sync.OnceValue(func() vacuumSeen {
			close(stopWatch)
			return <-watched
		})
		defer endWatch()
		start := time.Now()
		sent, err := producePaced(ctx, lp, b.cfg.LateRate, b.cfg.LateFor, func(i int, now time.Time) *sarama.ProducerMessage {
			return deferRecord(sh.key(keys, i), i, topic, when{at: now.Add(lead)})
		})
		if err != nil {
			return nil, 0, err
		}
		l := &latencies{offered: b.cfg.LateRate, sent: sent, sendFor: time.Since(start)}
		if _, err := track(ctx, what, func() (int64, error) { return w.count(topic) }, 0, int64(sent), timeoutFor(sent)); err != nil {
			return nil, 0, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
		}
		l.autovacuum = &autovacuumSplit{seen: endWatch()}
		l.cpu = b.cpu(pid).sub(cpu0)
		stmts1, err := b.pg.statements(ctx, db.name)
		if err != nil {
			return nil, 0, err
		}
		l.stmts = stmts1.since(stmts0, b.labels)
		return l, sent, nil
	}
	lateSent, vacuumedSent := 0, 0
	if late {
		if sc.late, lateSent, err = pace(topicLate, "l", "lateness phase"); err != nil {
			return sc, err
		}
		if backlog == 0 {
			if sc.vacuumedPages, err = vacuumQueue(ctx, db); err != nil {
				return sc, err
			}
			if sc.lateVacuumed, vacuumedSent, err = pace(topicLateVacuumed, "v", "lateness phase after a VACUUM"); err != nil {
				return sc, err
			}
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
	if err := svc.Stop(time.Minute); err != nil {
		return sc, err
	}

	// Checks, after the service is gone: everything arrived, in order, and
	// nothing is left pending (finalize deleted what was published).
	phases := []phaseTopic{{topicWarmup, warm}, {topicDispatch, n}, {topicE2E, n}}
	if late {
		phases = append(phases, phaseTopic{topicLate, lateSent})
	}
	if sc.lateVacuumed != nil {
		phases = append(phases, phaseTopic{topicLateVacuumed, vacuumedSent})
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
		if ph.topic == topicLate || ph.topic == topicLateVacuumed {
			ls, err := lateness(ds)
			if err != nil {
				return sc, err
			}
			if ph.topic == topicLate {
				sc.late.measured(ds, ls)
			} else {
				sc.lateVacuumed.measured(ds, ls)
			}
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

// vacuumQueue vacuums the queue tables, emptied by the phases before, the
// way autovacuum does after a drain, and returns the pages deferred_message
// has left (0 when the VACUUM truncated it; it skips the truncation if it
// cannot take the table's lock at once).
func vacuumQueue(ctx context.Context, db *database) (int32, error) {
	// The last rounds' finalizes may still be committing after their
	// messages arrived: a row left near the table's end stops the truncation.
	left := func() (int64, error) {
		var n int64
		err := db.pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM deferred_message) + (SELECT count(*) FROM deferred_key)").Scan(&n)
		return n, err
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		n, err := left()
		if err != nil {
			return 0, fmt.Errorf("count the queue's rows before the vacuum: %w", err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("the queue still holds %d rows 30 s after the lateness phase's messages arrived", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := db.pool.Exec(ctx, "VACUUM deferred_message, deferred_key"); err != nil {
		return 0, fmt.Errorf("vacuum the emptied queue tables: %w", err)
	}
	var pages int32
	if err := db.pool.QueryRow(ctx, "SELECT relpages FROM pg_class WHERE oid = 'deferred_message'::regclass").Scan(&pages); err != nil {
		return 0, fmt.Errorf("read deferred_message's pages after the vacuum: %w", err)
	}
	return pages, nil
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
