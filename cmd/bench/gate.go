package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/deferclient"
)

// The key gate scenario's topics. TARGET_TOPICS=bench.* allows the targets.
const (
	// topicMain is the consumers' main topic, filled before they start.
	topicMain = "bench.main"
	// topicMainRetry is deferclient's default retry topic of topicMain:
	// the target of the deferrals that block keys and of gated records.
	topicMainRetry = "bench.main.retry"
	// topicGateLoad is the target of the background deferrals that keep
	// ingest busy while the query is timed; they are due in an hour, so
	// that only ingest works for them.
	topicGateLoad = "bench.gate.load"
	// topicRelease is where the release phase's messages are republished.
	topicRelease = "bench.release"
)

// gateBatch is the number of distinct keys of one timed key-state query:
// the most the handler asks about per batch (HandlerConfig.MaxBatch's
// default).
const gateBatch = 500

// gateLargeBatch is the batch of the large-batch runs: sarama's buffer of
// each partition (ChannelBufferSize) and the handler's MaxBatch.
const gateLargeBatch = 2000

// gateBlockedEvery: one main-topic key in this many is blocked in the
// blocked run (1%).
const gateBlockedEvery = 100

// gateLatencyFor bounds each series of timed key-state queries: a query
// that takes seconds must not stretch the run to hours (nor, under load,
// fill the database with the background deferrals of all that time).
const gateLatencyFor = 30 * time.Second

// releaseSpread is the time between two deferrals of the release phase.
const releaseSpread = 20 * time.Millisecond

// releasePoll is how often the release phase asks whether its keys are
// free: the resolution of its measurement.
const releasePoll = 20 * time.Millisecond

// Consumer groups, one per run, so that each reads the main topic from its
// oldest offset and sees only the deferrals made for it.
const (
	groupGateOff     = "bench.gate.off"
	groupGateOn      = "bench.gate.on"
	groupGateBlocked = "bench.gate.blocked"
	groupRelease     = "bench.gate.release"
)

// gateKey is the business key (and record key) of main-topic record i.
func gateKey(i int) string { return "g-" + strconv.Itoa(i) }

// gateRun is one consumption of the whole main topic.
type gateRun struct {
	rate           rate  // records handled or gated, from the session's start to the last
	handled, gated int64 // by the handler; deferred behind a blocked key
	queries        int64 // key-state queries answered
	unsure         int64 // queries that failed or came back unsure (their keys count as blocked)
}

// meanBatch is the mean number of records gated by one query.
func (r gateRun) meanBatch() float64 {
	if r.queries+r.unsure == 0 {
		return 0
	}
	return float64(r.rate.n) / float64(r.queries+r.unsure)
}

// callLatency is the client-side latency of a series of key-state queries.
type callLatency struct {
	calls          int
	unsure         int // calls that returned an error (still timed)
	p50, p99, max  time.Duration
	loadPerSecond  float64 // deferrals produced per second meanwhile, 0 for none
	loadForSeconds float64
}

// gateResult is what the key gate scenario measured.
type gateResult struct {
	n       int
	off, on gateRun // gate off (NoGate); gate on, no key blocked
	blocked gateRun // gate on, blockedKeys keys blocked
	// offLarge and onLarge are off and on with batches of up to
	// gateLargeBatch records (sarama's ChannelBufferSize and MaxBatch):
	// the gate's cost is per batch, so a consumer that can take larger
	// batches pays it less often.
	offLarge, onLarge gateRun
	blockedKeys       int
	idle, busy        callLatency
	// release is, per key of the release phase, the time from its record's
	// commit (from when it was marked, just before) to the first answer
	// saying the key is free.
	release []time.Duration
	// early counts keys that read free before their record was committed:
	// the gate would have let a later record overtake it.
	early int
}

// runGate measures what deferclient's gate costs a consumer and how fast a
// key flows again after its message was handled, against the real service:
//
//  1. cost: N records of distinct keys wait in topicMain; three fresh
//     consumer groups read all of them through ConsumerGroupHandler with a
//     handler that only counts, one after the other: (a) gate off, (b) gate
//     on with no key blocked, (c) gate on with 1% of the keys blocked (a
//     message of each deferred by an hour for (c)'s group, so those records
//     are deferred behind it, not handled). Each is timed from its
//     session's start to the last record handled or gated;
//  2. release: GateRelease keys, a message of each deferred due now for a
//     group that commits each republished record as soon as it reads it;
//     how long after the commit the key reads free (the scheduler reads
//     committed offsets about once a second);
//  3. the query's latency, client side: GateCalls key-state queries of 500
//     distinct keys one after the other, with the defer topic quiet, then
//     while a producer defers GateRate records a second (each query then
//     waits for ingest to store what was produced before it).
func (b *bench) runGate(ctx context.Context) (res gateResult, err error) {
	res.n = b.cfg.N
	db, err := b.pg.freshService(ctx, "svc_gate")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	kc, addr, err := startKafka(b.cfg.Partitions, deferTopic, topicMain, topicMainRetry, topicGateLoad, topicRelease)
	if err != nil {
		return res, err
	}
	defer kc.Close()
	lp, err := newLoadProducer(addr)
	if err != nil {
		return res, err
	}
	defer lp.close()

	// The main topic is full before any consumer starts, so that each run
	// reads at the consumer's pace, not the producer's.
	if _, _, err := produceAll(ctx, lp, res.n, func(i int) *sarama.ProducerMessage {
		return &sarama.ProducerMessage{Topic: topicMain, Key: sarama.StringEncoder(gateKey(i)), Value: sarama.ByteEncoder(payload(i))}
	}); err != nil {
		return res, err
	}

	svc, err := b.startService(ctx, db.url, addr, false)
	if err != nil {
		return res, err
	}
	defer svc.Kill() // after Stop, it does nothing
	withLogs := func(err error) error { return fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs()) }
	g := gateEnv{b: b, addr: addr, url: "http://" + svc.HTTPAddr, pid: svc.Pid(), db: db.name}

	// 1. What the gate costs the consumer.
	b.say("  consuming %d records: gate off", res.n)
	if res.off, err = g.consume(ctx, groupGateOff, true, res.n, nil, 0); err != nil {
		return res, withLogs(fmt.Errorf("gate off: %w", err))
	}
	b.say("  consuming %d records: gate on, no key blocked", res.n)
	if res.on, err = g.consume(ctx, groupGateOn, false, res.n, nil, 0); err != nil {
		return res, withLogs(fmt.Errorf("gate on: %w", err))
	}
	b.say("  consuming %d records in batches of up to %d: gate off, then on", res.n, gateLargeBatch)
	if res.offLarge, err = g.consume(ctx, groupGateOff+".large", true, res.n, nil, gateLargeBatch); err != nil {
		return res, withLogs(fmt.Errorf("gate off, large batches: %w", err))
	}
	if res.onLarge, err = g.consume(ctx, groupGateOn+".large", false, res.n, nil, gateLargeBatch); err != nil {
		return res, withLogs(fmt.Errorf("gate on, large batches: %w", err))
	}
	blocker, err := g.client(groupGateBlocked)
	if err != nil {
		return res, err
	}
	defer blocker.Close()
	var blockedKeys []string
	isBlocked := map[string]bool{}
	for i := 0; i < res.n; i += gateBlockedEvery {
		blockedKeys = append(blockedKeys, gateKey(i))
		isBlocked[gateKey(i)] = true
	}
	res.blockedKeys = len(blockedKeys)
	b.say("  blocking %d keys for group %s", len(blockedKeys), groupGateBlocked)
	if err := block(ctx, blocker, blockedKeys); err != nil {
		return res, withLogs(err)
	}
	b.say("  consuming %d records: gate on, %d keys blocked", res.n, len(blockedKeys))
	if res.blocked, err = g.consume(ctx, groupGateBlocked, false, res.n, isBlocked, 0); err != nil {
		return res, withLogs(fmt.Errorf("gate on, keys blocked: %w", err))
	}

	// 2. Release after commit, before the load phase below fills the
	// database with deferrals: this figure is about the release loop, the
	// query's own cost is measured next.
	b.say("  release of %d keys after their commit", b.cfg.GateRelease)
	if res.release, res.early, err = g.release(ctx, b.cfg.GateRelease); err != nil {
		return res, withLogs(err)
	}

	// 3. The query's latency, quiet and under ingest load. The blocker's
	// group has its 1% of keys pending, as a real group would have some.
	b.say("  %d key-state queries of %d keys, defer topic quiet", b.cfg.GateCalls, gateBatch)
	if res.idle, err = keyStateLatency(ctx, blocker, b.cfg.GateCalls, res.n); err != nil {
		return res, withLogs(err)
	}
	b.say("  %d key-state queries of %d keys, %d deferrals/s produced", b.cfg.GateCalls, gateBatch, b.cfg.GateRate)
	if res.busy, err = busyLatency(ctx, lp, blocker, b.cfg.GateRate, b.cfg.GateCalls, res.n); err != nil {
		return res, withLogs(err)
	}

	if err := svc.Stop(time.Minute); err != nil {
		return res, err
	}
	return res, nil
}

// gateEnv is what the gate scenario's phases share.
type gateEnv struct {
	b    *bench
	addr string // the broker
	url  string // the scheduler's HTTP_ADDR
	pid  int    // the scheduler's process
	db   string // the scheduler's database, whose statements a run samples
}

// client returns a deferclient.Client for group.
func (g gateEnv) client(group string) (*deferclient.Client, error) {
	c, err := deferclient.New(deferclient.Config{Brokers: []string{g.addr}, Group: group, SchedulerURL: g.url})
	if err != nil {
		return nil, fmt.Errorf("client of group %s: %w", group, err)
	}
	return c, nil
}

// consume reads the whole main topic as a fresh consumer group, from its
// oldest offset, through ConsumerGroupHandler (noGate sets NoGate), until n
// records were handled or gated. The consumer takes sarama's defaults, as
// the library's example does: its batches are what a partition has ready
// (sarama buffers 256 records a partition), up to 500. A record of a key in
// blocked reaching the handler is an error: the gate failed at its one job.
//
// batch > 0 raises sarama's per-partition buffer (ChannelBufferSize) and
// the handler's MaxBatch to it.
func (g gateEnv) consume(ctx context.Context, group string, noGate bool, n int, blocked map[string]bool, batch int) (gateRun, error) {
	var run gateRun
	client, err := g.client(group)
	if err != nil {
		return run, err
	}
	defer client.Close()
	var handled, leaked atomic.Int64
	h := &timedHandler{ConsumerGroupHandler: client.ConsumerGroupHandler(func(_ context.Context, m *sarama.ConsumerMessage) error {
		handled.Add(1)
		if blocked[string(m.Key)] {
			leaked.Add(1)
		}
		return nil
	}, deferclient.HandlerConfig{NoGate: noGate, MaxBatch: batch})}

	cpu0 := g.b.cpu(g.pid)
	stmts0, err := g.b.pg.statements(ctx, g.db)
	if err != nil {
		return run, err
	}
	stop, err := consumeGroup(ctx, g.addr, group, topicMain, h, batch)
	if err != nil {
		return run, err
	}
	// Polled every millisecond rather than with track's 10: a run of the
	// quick mode lasts a few hundred milliseconds.
	deadline := time.Now().Add(timeoutFor(n))
	var doneAt time.Time
	for {
		s := client.Stats()
		if handled.Load()+s.Gated >= int64(n) {
			doneAt = time.Now()
			break
		}
		if time.Now().After(deadline) {
			return run, errors.Join(fmt.Errorf("%d handled and %d gated of %d records after %v", handled.Load(), s.Gated, n, timeoutFor(n)), stop())
		}
		select {
		case <-ctx.Done():
			return run, errors.Join(ctx.Err(), stop())
		case <-time.After(time.Millisecond):
		}
	}
	cpu := g.b.cpu(g.pid).sub(cpu0)
	stmts1, err := g.b.pg.statements(ctx, g.db)
	if err != nil {
		return run, errors.Join(err, stop())
	}
	if err := stop(); err != nil {
		return run, err
	}
	s := client.Stats()
	run.handled, run.gated, run.queries, run.unsure = handled.Load(), s.Gated, s.Queries, s.QueryFailures
	run.rate = rate{n: run.handled + run.gated, wall: doneAt.Sub(h.started()), cpu: cpu, stmts: stmts1.since(stmts0, g.b.labels)}
	if l := leaked.Load(); l > 0 {
		return run, fmt.Errorf("%d records of %d blocked keys reached the handler", l, len(blocked))
	}
	return run, nil
}

// timedHandler notes when the first session started: a run is timed from
// there, leaving out the group's join, which is the broker's business.
type timedHandler struct {
	sarama.ConsumerGroupHandler
	start atomic.Pointer[time.Time]
}

func (t *timedHandler) Setup(s sarama.ConsumerGroupSession) error {
	now := time.Now()
	t.start.CompareAndSwap(nil, &now)
	return t.ConsumerGroupHandler.Setup(s)
}

func (t *timedHandler) started() time.Time {
	if p := t.start.Load(); p != nil {
		return *p
	}
	return time.Time{}
}

// consumeGroup runs a consumer group on topic with h, from the oldest
// offset, in the background, until the returned stop is called; stop
// returns why it ended early, if it did.
func consumeGroup(ctx context.Context, addr, group, topic string, h sarama.ConsumerGroupHandler, buffer int) (stop func() error, err error) {
	kc := kafkaConfig()
	kc.Consumer.Offsets.Initial = sarama.OffsetOldest
	if buffer > 0 {
		kc.ChannelBufferSize = buffer
	}
	cg, err := sarama.NewConsumerGroup([]string{addr}, group, kc)
	if err != nil {
		return nil, fmt.Errorf("consumer group %s: %w", group, err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		// Consume returns at every rebalance; the loop rejoins, as a real
		// consumer does.
		for cctx.Err() == nil {
			if err := cg.Consume(cctx, []string{topic}, h); err != nil && cctx.Err() == nil {
				done <- fmt.Errorf("consumer group %s: %w", group, err)
				return
			}
		}
		done <- nil
	}()
	return func() error {
		cancel()
		err := <-done
		if cerr := cg.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("close consumer group %s: %w", group, cerr))
		}
		return err
	}, nil
}

// block defers one message of each key by an hour for client's group, a
// few at a time (each Defer waits for acks=all), and waits until the
// scheduler answers that every key is pending: the blocked run then
// measures the gate, not ingest catching up with these deferrals.
func block(ctx context.Context, client *deferclient.Client, keys []string) error {
	const writers = 8
	// A failed writer ends the feeding, which would wait for it otherwise.
	wctx, failed := context.WithCancel(ctx)
	defer failed()
	next := make(chan int)
	errs := make([]error, writers)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range next {
				msg := &sarama.ConsumerMessage{Topic: topicMain, Key: []byte(keys[i]), Value: payload(i)}
				if err := client.Defer(wctx, msg, deferclient.Deferral{Target: topicMainRetry, BusinessKey: keys[i], Delay: time.Hour}); err != nil {
					errs[w] = fmt.Errorf("block key %s: %w", keys[i], err)
					failed()
					return
				}
			}
		})
	}
	func() {
		defer close(next)
		for i := range keys {
			select {
			case next <- i:
			case <-wctx.Done():
				return
			}
		}
	}()
	wg.Wait()
	if err := errors.Join(append(errs, ctx.Err())...); err != nil {
		return err
	}
	for from := 0; from < len(keys); from += gateBatch {
		part := keys[from:min(from+gateBatch, len(keys))]
		states, err := client.KeyStates(ctx, part)
		if err != nil {
			return fmt.Errorf("state of the blocked keys: %w", err)
		}
		for _, k := range part {
			if st := states[k]; !st.Blocked || st.Reason != deferclient.ReasonPending {
				return fmt.Errorf("key %s deferred for an hour reads %+v, want blocked, %s", k, st, deferclient.ReasonPending)
			}
		}
	}
	return nil
}

// keyStateLatency times up to calls key-state queries of gateBatch
// distinct main-topic keys each (past the n records, keys nobody used), one
// after the other, client side, for at most gateLatencyFor. An unsure
// answer is timed and counted.
func keyStateLatency(ctx context.Context, client *deferclient.Client, calls, n int) (callLatency, error) {
	var l callLatency
	span := max(n, gateBatch) // consecutive indexes modulo span are distinct
	keys := make([]string, gateBatch)
	ds := make([]time.Duration, 0, calls)
	end := time.Now().Add(gateLatencyFor)
	for c := 0; c < calls && time.Now().Before(end); c++ {
		for j := range keys {
			keys[j] = gateKey((c*gateBatch + j) % span)
		}
		t0 := time.Now()
		_, err := client.KeyStates(ctx, keys)
		ds = append(ds, time.Since(t0))
		if err != nil {
			if ctx.Err() != nil {
				return l, ctx.Err()
			}
			l.unsure++
		}
	}
	l.calls = len(ds)
	l.p50, l.p99, l.max = percentile(ds, 0.50), percentile(ds, 0.99), percentile(ds, 1)
	return l, nil
}

// busyLatency is keyStateLatency while lp defers rate records a second,
// due in an hour, each its own key, from a moment before the first query
// to the last.
func busyLatency(ctx context.Context, lp *loadProducer, client *deferclient.Client, rate, calls, n int) (callLatency, error) {
	lp.mu.Lock()
	base := lp.acked
	lp.mu.Unlock()
	lctx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	type produced struct {
		sent int
		err  error
	}
	loaded := make(chan produced, 1)
	start := time.Now()
	go func() {
		// Stopped by stopLoad long before the hour.
		sent, err := producePaced(lctx, lp, rate, time.Hour, func(i int, now time.Time) *sarama.ProducerMessage {
			return deferRecord("gl-"+strconv.Itoa(i), i, topicGateLoad, when{at: now.Add(time.Hour)})
		})
		loaded <- produced{sent, err}
	}()
	// Ingest reaches its steady pace before the first query.
	select {
	case <-time.After(500 * time.Millisecond):
	case <-ctx.Done():
		return callLatency{}, ctx.Err()
	}
	l, err := keyStateLatency(ctx, client, calls, n)
	stopLoad()
	p := <-loaded
	elapsed := time.Since(start)
	if err != nil {
		return l, err
	}
	if p.err != nil && (!errors.Is(p.err, context.Canceled) || ctx.Err() != nil) {
		return l, fmt.Errorf("background deferrals: %w", p.err)
	}
	if err := lp.waitAcked(ctx, base+int64(p.sent)); err != nil {
		return l, fmt.Errorf("background deferrals: %w", err)
	}
	l.loadPerSecond, l.loadForSeconds = float64(p.sent)/elapsed.Seconds(), elapsed.Seconds()
	return l, nil
}

// release defers one message of each of k keys, due now, for groupRelease,
// while that group consumes topicRelease and commits each record as soon
// as it reads it, and polls the keys' state every releasePoll. It returns,
// per key, the time from its record's commit to the first answer saying
// the key is free, and how many keys read free before their commit. A
// commit is timed from just before the record is marked: the broker may
// store it, and the scheduler see it, before sarama's Commit returns, and
// a key seen free before that moment is then a true early release.
func (g gateEnv) release(ctx context.Context, k int) (ds []time.Duration, early int, err error) {
	client, err := g.client(groupRelease)
	if err != nil {
		return nil, 0, err
	}
	defer client.Close()
	h := &commitHandler{committed: map[string]time.Time{}}
	stop, err := consumeGroup(ctx, g.addr, groupRelease, topicRelease, h, 0)
	if err != nil {
		return nil, 0, err
	}
	defer func() { err = errors.Join(err, stop()) }()

	keys := make([]string, k)
	waiting := map[string]bool{}
	for i := range keys {
		keys[i] = "r-" + strconv.Itoa(i)
		waiting[keys[i]] = true
	}
	// The deferrals are spread, one every releaseSpread, so that the
	// commits fall at every phase of the scheduler's release loop rather
	// than in one burst, which would time one phase 200 times. Only keys
	// already deferred are asked about: the others are free, and rightly.
	var deferred atomic.Int64
	dctx, stopDeferring := context.WithCancel(ctx)
	deferDone := make(chan struct{})
	var deferErr error // set before deferDone is closed
	go func() {
		defer close(deferDone)
		tick := time.NewTicker(releaseSpread)
		defer tick.Stop()
		for i, key := range keys {
			msg := &sarama.ConsumerMessage{Topic: topicMain, Key: []byte(key), Value: payload(i)}
			// At now, not Delay 0: a deferral with neither takes the
			// target's retry policy's delay (30s by default).
			if err := client.Defer(dctx, msg, deferclient.Deferral{Target: topicRelease, BusinessKey: key, At: time.Now()}); err != nil {
				if dctx.Err() == nil {
					deferErr = fmt.Errorf("defer release key %s: %w", key, err)
				}
				return
			}
			deferred.Store(int64(i + 1))
			select {
			case <-tick.C:
			case <-dctx.Done():
				return
			}
		}
	}()
	defer func() {
		stopDeferring()
		<-deferDone
	}()

	seenEarly := map[string]bool{}
	deadline := time.Now().Add(timeoutFor(k))
	tick := time.NewTicker(releasePoll)
	defer tick.Stop()
	ask := make([]string, 0, k)
	var unsure []error
	for len(waiting) > 0 {
		select {
		case <-deferDone:
			if deferErr != nil {
				return ds, len(seenEarly), deferErr
			}
		default:
		}
		ask = ask[:0]
		for _, key := range keys[:deferred.Load()] {
			if waiting[key] {
				ask = append(ask, key)
			}
		}
		var states map[string]deferclient.KeyState
		var err error
		if len(ask) > 0 {
			states, err = client.KeyStates(ctx, ask)
		}
		answered := time.Now()
		if err != nil {
			unsure = append(unsure, err)
		} else {
			for _, key := range ask {
				if states[key].Blocked {
					continue
				}
				at, ok := h.committedAt(key)
				if !ok {
					// Free before its record was committed (or even
					// published): counted, and watched on.
					seenEarly[key] = true
					continue
				}
				ds = append(ds, answered.Sub(at))
				delete(waiting, key)
			}
		}
		if time.Now().After(deadline) {
			err := fmt.Errorf("release: %d of %d keys still blocked after %v (%d records committed, %d answers unsure)",
				len(waiting), k, timeoutFor(k), h.count(), len(unsure))
			if len(unsure) > 0 {
				err = fmt.Errorf("%w; the last: %w", err, unsure[len(unsure)-1])
			}
			return ds, len(seenEarly), err
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return ds, len(seenEarly), ctx.Err()
		}
	}
	return ds, len(seenEarly), nil
}

// commitHandler commits every record as soon as it reads it, and notes when
// the commit of each business key's record began.
type commitHandler struct {
	mu        sync.Mutex
	committed map[string]time.Time
}

func (*commitHandler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (*commitHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (c *commitHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	for {
		select {
		case m, ok := <-claim.Messages():
			if !ok {
				return nil
			}
			c.mu.Lock()
			if _, ok := c.committed[deferclient.BusinessKey(m)]; !ok {
				c.committed[deferclient.BusinessKey(m)] = time.Now()
			}
			c.mu.Unlock()
			sess.MarkMessage(m, "")
			sess.Commit() // synchronous: the broker has the offset when it returns
		case <-sess.Context().Done():
			return nil
		}
	}
}

func (c *commitHandler) committedAt(key string) (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t, ok := c.committed[key]
	return t, ok
}

func (c *commitHandler) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.committed)
}

// summarize adds the scenario's figures to s.
func (g *gateResult) summarize(s *summary) {
	off := g.off.rate.perSecond()
	s.set("gate_off_msgs_per_s", off)
	s.set("gate_on_msgs_per_s", g.on.rate.perSecond())
	s.set("gate_blocked1_msgs_per_s", g.blocked.rate.perSecond())
	s.set("gate_on_vs_off", ratio(g.on.rate.perSecond(), off))
	s.set("gate_blocked1_vs_off", ratio(g.blocked.rate.perSecond(), off))
	s.set("gate_on_vs_off_large", ratio(g.onLarge.rate.perSecond(), g.offLarge.rate.perSecond()))
	// The scheduler's Postgres time per record read, every top-level
	// statement of its database during the run: with the gate off it is
	// the service's background work alone (heartbeats, the in-flight
	// loop, metrics; often none in a run this short), which the gate-on
	// figures include too. Without pg_stat_statements every run's is nil.
	if g.on.rate.stmts != nil {
		s.set("gate_off_pg_us_per_record", g.off.rate.perMsg(topLevel(g.off.rate.stmts)))
		s.set("gate_on_pg_us_per_record", g.on.rate.perMsg(topLevel(g.on.rate.stmts)))
		s.set("gate_blocked1_pg_us_per_record", g.blocked.rate.perMsg(topLevel(g.blocked.rate.stmts)))
	}
	s.set("gate_p50_ms", ms(g.idle.p50))
	s.set("gate_p99_ms", ms(g.idle.p99))
	s.set("gate_busy_p50_ms", ms(g.busy.p50))
	s.set("gate_busy_p99_ms", ms(g.busy.p99))
	s.set("release_p50_ms", ms(percentile(g.release, 0.50)))
	s.set("release_p99_ms", ms(percentile(g.release, 0.99)))
	s.set("release_max_ms", ms(percentile(g.release, 1)))
	s.set("gate_blocked_keys", float64(g.blockedKeys))
	s.set("gate_gated", float64(g.blocked.gated))
	s.set("gate_unsure", float64(g.on.unsure+g.blocked.unsure+int64(g.idle.unsure+g.busy.unsure)))
	s.set("release_keys", float64(len(g.release)))
	s.set("release_early", float64(g.early))
}

// write prints the scenario's section of the report.
func (g *gateResult) write(w io.Writer, v map[string]float64) {
	fmt.Fprintf(w, "\nKEY GATE: deferclient.ConsumerGroupHandler reading %s records of distinct keys from %s, a fresh consumer group\n",
		group(float64(g.n)), topicMain)
	fmt.Fprintln(w, "per run from the oldest offset (sarama's defaults), a handler that only counts; timed from the session's start to")
	fmt.Fprintln(w, "the last record handled or gated; CPU seconds spent meanwhile as in THROUGHPUT")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "run\trecords\twall\trecords/s\t/ gate off\tqueries\trecords/query\tgated\tunsure\tCPU svc\tCPU pg\tCPU bench\t")
	off := g.off.rate.perSecond()
	for _, r := range []struct {
		what string
		run  gateRun
		off  float64 // the gate-off rate it is compared with
	}{
		{"gate off (NoGate)", g.off, off},
		{"gate on, no key blocked", g.on, off},
		{fmt.Sprintf("gate on, 1%% of keys blocked (%s)", group(float64(g.blockedKeys))), g.blocked, off},
		{fmt.Sprintf("gate off, batches of up to %s", group(gateLargeBatch)), g.offLarge, g.offLarge.rate.perSecond()},
		{fmt.Sprintf("gate on, batches of up to %s", group(gateLargeBatch)), g.onLarge, g.offLarge.rate.perSecond()},
	} {
		rt := r.run.rate
		fmt.Fprintf(tw, "%s\t%s\t%.2fs\t%s\t%.2f\t%s\t%.0f\t%s\t%s\t%.1f\t%.1f\t%.1f\t\n", r.what, group(float64(rt.n)),
			rt.wall.Seconds(), group(rt.perSecond()), ratio(rt.perSecond(), r.off), group(float64(r.run.queries)), r.run.meanBatch(),
			group(float64(r.run.gated)), group(float64(r.run.unsure)), rt.cpu.service.Seconds(), rt.cpu.postgres.Seconds(), rt.cpu.bench.Seconds())
	}
	tw.Flush()

	fmt.Fprintf(w, "\nKEY-STATE QUERY (POST /v1/key-state, %d distinct keys a call, one call at a time for at most %v, timed client side)\n",
		gateBatch, gateLatencyFor)
	tw = tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "defer topic\tcalls\tp50\tp99\tmax\tunsure\t")
	for _, l := range []struct {
		what string
		l    callLatency
	}{
		{"quiet", g.idle},
		{fmt.Sprintf("%s deferrals/s produced for %.1fs", group(g.busy.loadPerSecond), g.busy.loadForSeconds), g.busy},
	} {
		fmt.Fprintf(tw, "%s\t%d\t%.1fms\t%.1fms\t%.1fms\t%d\t\n", l.what, l.l.calls, ms(l.l.p50), ms(l.l.p99), ms(l.l.max), l.l.unsure)
	}
	tw.Flush()

	fmt.Fprintf(w, "\nRELEASE AFTER COMMIT: %s keys, a message of each deferred due now for a group that commits each record as it\n",
		group(float64(len(g.release))))
	fmt.Fprintf(w, "reads it; from the commit to the first answer saying the key is free (asked every %v): p50 %.0f ms, p99 %.0f ms,\n",
		releasePoll, v["release_p50_ms"], v["release_p99_ms"])
	fmt.Fprintf(w, "max %.0f ms; %d keys read free before their record was committed.\n", v["release_max_ms"], g.early)
}

// gateTargets adds the scenario's rows to the targets table.
func gateTargets(target func(what, got, want string, ok bool), v map[string]float64) {
	target("key gate on / off, no key blocked (consumer)", fmt.Sprintf("%.2f", v["gate_on_vs_off"]), ">= 0.8", v["gate_on_vs_off"] >= 0.8)
	target(fmt.Sprintf("  the same, batches of up to %s", group(gateLargeBatch)), fmt.Sprintf("%.2f", v["gate_on_vs_off_large"]), ">= 0.8", v["gate_on_vs_off_large"] >= 0.8)
	target("key released after commit, p99", fmt.Sprintf("%.0f ms", v["release_p99_ms"]), "<= 2,000 ms", v["release_p99_ms"] <= 2000)
	target("keys free before their commit", fmt.Sprintf("%.0f", v["release_early"]), "0", v["release_early"] == 0)
}
