package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/deferq/scheduler/internal/defer/ingest"
	"github.com/deferq/scheduler/internal/pglocal"
	"github.com/deferq/scheduler/internal/schedproc"
)

// services is how many `scheduler run` processes share the work.
const services = 3

// run does one chaos run and returns its result; an error means the run
// itself could not be done (a guarantee the service broke is in the result).
// Progress goes to log.
func run(ctx context.Context, cfg config, log io.Writer) (res *result, err error) {
	began := time.Now()
	// The driver's goroutines report concurrently; log need not be safe
	// for that (the test passes a bytes.Buffer).
	log = &lockedWriter{w: log}
	res = &result{Mode: cfg.Mode, Seed: cfg.Seed, Services: services}
	say := func(format string, args ...any) {
		fmt.Fprintf(log, "chaos %5.1fs: %s\n", time.Since(began).Seconds(), fmt.Sprintf(format, args...))
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))

	bin := cfg.SchedulerBin
	if bin == "" {
		dir, err := os.MkdirTemp("", "chaos-")
		if err != nil {
			return nil, fmt.Errorf("temporary directory for the scheduler binary: %w", err)
		}
		defer os.RemoveAll(dir)
		say("building ./cmd/scheduler")
		if bin, err = schedproc.Build(ctx, dir); err != nil {
			return nil, err
		}
	}

	// A cluster of our own, because the run restarts it.
	if _, err := pglocal.Binaries(); err != nil {
		return nil, fmt.Errorf("%w: run scripts/install-postgres.sh (make chaos does)", err)
	}
	say("starting a throwaway PostgreSQL cluster and an in-process Kafka broker")
	pg, err := pglocal.Start(ctx, pglocal.Options{})
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, pg.Stop(context.WithoutCancel(ctx))) }()
	dbURL := pg.URL("postgres")
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return nil, fmt.Errorf("connect to the throwaway cluster: %w", err)
	}
	defer pool.Close()

	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, deferTopic, targetTopic))
	if err != nil {
		return nil, fmt.Errorf("start in-process Kafka broker: %w", err)
	}
	defer kc.Close()
	addr := kc.ListenAddrs()[0]

	env := serviceEnv(dbURL, addr, cfg.KafkaTimeout)
	if err := migrate(ctx, bin, env); err != nil {
		return nil, err
	}
	say("starting %d schedulers", services)
	fl, err := newFleet(bin, env, services, cfg.ServiceLogs)
	if err != nil {
		return nil, err
	}
	stopped := false
	defer func() {
		if !stopped {
			fl.killAll()
		}
	}()
	// kfake can keep a killed process's member in the group for good, with
	// partitions nobody then reads; the reaper removes such members once
	// their session has expired, as Kafka would (see reaper).
	reapCtx, stopReaper := context.WithCancel(ctx)
	defer stopReaper()
	reaped := make(chan int, 1)
	cc := ingest.ConsumerConfig(kafkaConfig(), nil)
	rp := &reaper{kc: kc, addr: addr, group: consumerGroup, gone: fl.gone, say: say,
		session: cc.Consumer.Group.Session.Timeout, rebalance: cc.Consumer.Group.Rebalance.Timeout}
	go func() { reaped <- rp.run(reapCtx, 500*time.Millisecond) }()
	if err := fl.waitReady(ctx, time.Minute); err != nil {
		return nil, err
	}

	prod, err := newProducer(addr)
	if err != nil {
		return nil, err
	}
	defer prod.Close()
	fwd, err := newProducer(addr)
	if err != nil {
		return nil, err
	}
	defer fwd.Close()
	cons, err := newConsumer(addr, fwd)
	if err != nil {
		return nil, err
	}
	defer cons.close()

	msgs := plan(rng, cfg.Messages, cfg.Keys)
	say("chaos for %s: sending %d messages over %d keys, killing a scheduler every %s-%s, one PostgreSQL restart, one rewind, broker faults",
		cfg.Chaos, len(msgs), cfg.Keys, cfg.KillEvery[0], cfg.KillEvery[1])
	chaosCtx, endChaos := context.WithTimeout(ctx, cfg.Chaos)
	defer endChaos()
	var (
		wg                     sync.WaitGroup
		errMu                  sync.Mutex
		runErr                 error
		kills, pgRestarts      atomic.Int64
		rewinds                atomic.Int64
		rewoundFrom, rewoundTo atomic.Pointer[time.Time]
		produceHits, fetchHits atomic.Int64
	)
	fail := func(err error) {
		errMu.Lock()
		runErr = errors.Join(runErr, err)
		errMu.Unlock()
	}
	sendRng := rand.New(rand.NewPCG(rng.Uint64(), rng.Uint64()))
	driverRng := rand.New(rand.NewPCG(rng.Uint64(), rng.Uint64()))
	wg.Go(func() {
		sendFor := time.Duration(float64(cfg.Chaos) * cfg.SendFraction)
		if err := send(ctx, prod, sendRng, msgs, sendFor); err != nil {
			fail(err)
			return
		}
		say("all %d messages sent", len(msgs))
	})
	wg.Go(func() { // kills
		for {
			pause := cfg.KillEvery[0] + time.Duration(driverRng.Int64N(int64(cfg.KillEvery[1]-cfg.KillEvery[0])+1))
			select {
			case <-chaosCtx.Done():
				return
			case <-time.After(pause):
			}
			i := driverRng.IntN(services)
			if err := fl.kill(i); err != nil {
				fail(err)
				return
			}
			say("kill %d: SIGKILL scheduler s%d and restart it", kills.Add(1), i)
		}
	})
	wg.Go(func() { // one PostgreSQL restart, early enough to be followed by more chaos
		select {
		case <-chaosCtx.Done():
			return
		case <-time.After(cfg.Chaos * 2 / 5):
		}
		say("restarting PostgreSQL (pg_ctl restart -m fast)")
		if err := pg.Restart(ctx); err != nil {
			fail(err)
			return
		}
		pgRestarts.Add(1)
		say("PostgreSQL is back")
	})
	wg.Go(func() { // one rewind: back up at 1/5, restore the backup at 3/5
		select {
		case <-chaosCtx.Done():
			return
		case <-time.After(cfg.Chaos / 5):
		}
		from := time.Now()
		backup, err := pg.Backup(ctx)
		if err != nil {
			fail(err)
			return
		}
		rewoundFrom.Store(&from)
		say("PostgreSQL backed up (pg_basebackup, online)")
		select {
		case <-chaosCtx.Done():
			return
		case <-time.After(cfg.Chaos * 2 / 5):
		}
		say("rewinding PostgreSQL to the backup: a failover to a replica that lagged, or a restore")
		if err := pg.Rewind(ctx, backup); err != nil {
			fail(err)
			return
		}
		// When the server is back, not when the rewind began: rounds
		// published while it was down could not be finalized, and go out
		// again like those the rewind undid.
		to := time.Now()
		rewoundTo.Store(&to)
		rewinds.Add(1)
		say("PostgreSQL is back, %s behind", cfg.Chaos*2/5)
	})
	wg.Go(func() { // broker fault windows
		produce, fetch := faultWindows(chaosCtx, kc, cfg, say)
		produceHits.Store(int64(produce))
		fetchHits.Store(int64(fetch))
	})
	<-chaosCtx.Done()
	chaosEnd := time.Now()
	wg.Wait()
	errMu.Lock()
	err = runErr
	errMu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("%w; services' last output:\n%s", err, fl.logs)
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	res.Kills, res.PGRestarts, res.Rewinds = int(kills.Load()), int(pgRestarts.Load()), int(rewinds.Load())
	if res.Rewinds > 0 {
		res.RewoundFrom, res.RewoundTo = *rewoundFrom.Load(), *rewoundTo.Load()
	}
	res.ProduceFaults, res.FetchFaults = int(produceHits.Load()), int(fetchHits.Load())

	say("chaos over; waiting for every message to be delivered and the table to empty")
	// Not being ready again is a finding, not the end of the run: what it
	// kept from being delivered is counted below.
	if err := fl.waitReady(ctx, time.Minute); err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		res.NotReady = err.Error()
		if i := strings.Index(res.NotReady, "; their last output"); i >= 0 {
			res.NotReady = res.NotReady[:i]
		}
		say("%s", res.NotReady)
	}
	drainErr := drain(ctx, cons, pool, msgs, res, cfg.Drain)
	res.Drained = time.Since(chaosEnd)
	if drainErr != nil {
		say("%v; checking what arrived", drainErr)
	}
	say("%s", groupSummary(kc.GroupInfo(consumerGroup), deferTopic, partitions, fl.running()))
	stopReaper()
	res.Reaped = <-reaped
	// Late duplicates (a lease taken over just now) would arrive within a
	// poll or two.
	time.Sleep(time.Second)
	stopped = true
	res.UnexpectedExits = fl.unexpectedExits()
	res.CleanStops, err = fl.stop()
	if err != nil {
		say("%v", err)
	}
	if err := cons.caughtUp(ctx, 30*time.Second); err != nil {
		return nil, err
	}
	ds, redefers, err := cons.snapshot()
	if err != nil {
		return nil, err
	}
	res.Redefers = redefers
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'pending'),
		count(*) FILTER (WHERE state = 'parked'), count(*) FILTER (WHERE state = 'rejected')
		FROM deferred_message`).Scan(&res.Pending, &res.Parked, &res.Rejected); err != nil {
		return nil, fmt.Errorf("count rows left: %w", err)
	}
	// Where undelivered messages stopped: still in the defer topic, or
	// stored (the view deferred_history has a 'deferred' event per stored
	// row, with the attempt: re-deferrals have attempt >= 1).
	end, err := cons.endOffsets(deferTopic)
	if err != nil {
		return nil, err
	}
	var ingested int64
	if err := pool.QueryRow(ctx, "SELECT coalesce(sum(next_offset), 0) FROM ingest_offset WHERE topic = $1",
		deferTopic).Scan(&ingested); err != nil {
		return nil, fmt.Errorf("read ingest offsets: %w", err)
	}
	res.IngestLag = int(end - ingested)
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE attempt = 0), count(*) FILTER (WHERE attempt > 0)
		FROM deferred_history WHERE event = 'deferred'`).Scan(&res.StoredFirst, &res.StoredRedefers); err != nil {
		return nil, fmt.Errorf("count stored rows: %w", err)
	}
	check(msgs, ds, res)
	res.Duration = time.Since(began)
	if !res.ok() {
		fmt.Fprintf(log, "services' last output:\n%s\n", fl.logs)
	}
	return res, nil
}

// drain waits until every message's final delivery has arrived and no row
// is pending, or timeout.
//
// res0 says what the chaos did (rewinds), which check needs.
func drain(ctx context.Context, cons *consumer, pool *pgxpool.Pool, msgs []message, res0 *result, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ds, _, err := cons.snapshot()
		if err != nil {
			return err
		}
		r := *res0
		check(msgs, ds, &r)
		var pending int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM deferred_message WHERE state = 'pending'").Scan(&pending); err != nil {
			pending = -1 // the database may still be coming back; ask again
		}
		if r.Lost == 0 && pending == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after %s, %d messages undelivered and %d rows pending", timeout, r.Lost, pending)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// faultWindows makes the broker fail 5% of the service's produce requests to
// the target topic and of its fetch requests from the defer topic, in
// windows of 3 s every 7 s until ctx ends, alternating between
// NOT_LEADER_FOR_PARTITION (nothing written) and REQUEST_TIMED_OUT (on
// produce: written, but the producer is told it failed). The run's own
// clients use other topics' requests and are not faulted. It returns how
// many requests were failed.
func faultWindows(ctx context.Context, kc *kfake.Cluster, cfg config, say func(string, ...any)) (produce, fetch int) {
	if !cfg.ProduceFaults && !cfg.FetchFaults {
		return 0, 0
	}
	const rate = 0.05
	sometimes := func(kmsg.Request) bool { return rand.Float64() < rate }
	codes := []*kerr.Error{kerr.NotLeaderForPartition, kerr.RequestTimedOut}
	for w := 0; ; w++ {
		select {
		case <-ctx.Done():
			return produce, fetch
		case <-time.After(min(4*time.Second, cfg.Chaos/4)):
		}
		code := codes[w%len(codes)]
		// A fault that matches nothing stands in for a kind not injected.
		never := func(kmsg.Request) bool { return false }
		pw, fw := sometimes, sometimes
		if !cfg.ProduceFaults {
			pw = never
		}
		if !cfg.FetchFaults {
			fw = never
		}
		ph := kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: targetTopic, Err: code, Count: -1, When: pw})
		fh := kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Fetch}, Topic: deferTopic, Err: kerr.NotLeaderForPartition, Count: -1, When: fw})
		say("broker faults on: %.0f%% of produce (%s, %v) and fetch (%v) requests", rate*100, code.Message, cfg.ProduceFaults, cfg.FetchFaults)
		select {
		case <-ctx.Done():
		case <-time.After(3 * time.Second):
		}
		ph.Remove()
		fh.Remove()
		produce += ph.Hits()
		fetch += fh.Hits()
		say("broker faults off (%d produce and %d fetch requests failed so far)", produce, fetch)
	}
}

// lockedWriter serializes writes to w.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
