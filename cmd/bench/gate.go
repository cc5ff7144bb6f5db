package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/deferq/scheduler/deferclient"
	"github.com/deferq/scheduler/deferclient/deferkgo"
	"github.com/deferq/scheduler/deferclient/gate"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/keystate"
)

// The key gate scenario's topics. TARGET_TOPICS=bench.* allows the targets.
const (
	// topicMain is the consumers' main topic, filled before they start.
	topicMain = "bench.main"
	// topicMainRetry is the client library's default retry topic of
	// topicMain: the target of the deferrals that block keys and of gated
	// records.
	topicMainRetry = "bench.main.retry"
	// topicGateLoad is the target of the other groups' deferrals that keep
	// ingest busy in the busy runs and while the query is timed; they are
	// due in an hour, so that only ingest works for them.
	topicGateLoad = "bench.gate.load"
	// topicRelease is where the release phase's messages are republished.
	topicRelease = "bench.release"
)

// gateBatch is the number of distinct keys of one timed key-state query:
// the most the handler asks about per batch when it asks (HandlerConfig.
// MaxBatch's default).
const gateBatch = 500

// gateBlockedEvery: one main-topic key in this many is blocked in the
// blocked runs (1%).
const gateBlockedEvery = 100

// gateWork is what the working handler spends on each record, spinning
// (time.Sleep's granularity is too coarse).
const gateWork = 25 * time.Microsecond

// gateSettle is how long the statements of an "on" and a "blocked1" run go
// on being counted after its last record, for the per-deferral figure:
// ingest stores the gated deferrals well within it.
const gateSettle = time.Second

// gateOtherGroups is how many other consumer groups the busy runs'
// deferrals are made for.
const gateOtherGroups = 10

// gateLatencyFor bounds each series of timed key-state queries: a query
// that takes seconds must not stretch the run to hours (nor, under load,
// fill the database with the background deferrals of all that time).
const gateLatencyFor = 30 * time.Second

// releaseSpread is the time between two deferrals of the release phase.
const releaseSpread = 20 * time.Millisecond

// releasePoll is how often the release phase asks whether its keys are
// free: the resolution of its measurement.
const releasePoll = 20 * time.Millisecond

// groupRelease is the release phase's consumer group.
const groupRelease = "bench.gate.release"

// The Kafka clients, the handlers and the modes of the consumer runs.
const (
	clientSarama = "sarama" // deferclient.ConsumerGroupHandler
	clientFranz  = "franz"  // deferkgo.Client.Consume
	handlerNoop  = "noop"   // counts the record
	handlerWork  = "work25" // counts it and spins gateWork
)

// gateMode is how the gate is set in a consumer run.
type gateMode string

const (
	gateOff      gateMode = "off"      // NoGate
	gateOn       gateMode = "on"       // on, no key blocked
	gateBlocked  gateMode = "blocked1" // on, 1% of the keys blocked
	gateBusy     gateMode = "busy"     // on, no key blocked, other groups deferring GateRate records a second
	gateBusyOff  gateMode = "busyoff"  // NoGate, other groups deferring as in busy: what their storage alone costs
	gateOffAgain gateMode = "off2"     // NoGate again, after every round: with the off runs, the ratios' base
)

var (
	gateClients  = []string{clientSarama, clientFranz}
	gateHandlers = []string{handlerNoop, handlerWork}
	// gateModes are the runs of a client and handler, in their order: a
	// round of all but off2 (blocked1 in the first round only), repeated,
	// then off2.
	gateModes = []gateMode{gateOff, gateOn, gateBlocked, gateBusy, gateBusyOff, gateOffAgain}
	// gateOnModes are the runs with the gate on.
	gateOnModes = []gateMode{gateOn, gateBlocked, gateBusy}
	// gateMeasured are the runs whose Postgres time and assignment are
	// reported, and compared with off.
	gateMeasured = []gateMode{gateOff, gateOn, gateBlocked, gateBusy, gateBusyOff}
)

// gateSpec names one consumer run.
type gateSpec struct {
	client, handler string
	mode            gateMode
	round           int // from 0
}

// group is the run's consumer group: each run has its own, so that it
// reads the main topic from its oldest offset and sees only the deferrals
// made for it.
func (s gateSpec) group() string {
	return "bench.gate." + s.client + "." + s.handler + "." + string(s.mode) + "." + strconv.Itoa(s.round)
}

func (s gateSpec) String() string {
	return fmt.Sprintf("%s, %s handler, gate %s, round %d", s.client, s.handler, s.mode, s.round+1)
}

// key is the RESULT key of metric of the run.
func (s gateSpec) key(metric string) string {
	return "gate_" + s.client + "_" + s.handler + "_" + string(s.mode) + "_" + metric
}

// gateKey is the business key (and record key) of main-topic record i.
func gateKey(i int) string { return "g-" + strconv.Itoa(i) }

// gateRun is one consumption of the whole main topic.
type gateRun struct {
	// rate counts records handled or gated, timed from the first record
	// handled to the last record handled or gated; its statements are
	// those from before the consumer started to that last record.
	rate           rate
	handled, gated int64
	stats          gate.Stats // the client's, at the end
	// first is the time from the assignment to the first record handled
	// (sarama: from the handler's Setup; franz-go: from reading the
	// SyncGroup answer, just before kgo runs OnPartitionsAssigned); load
	// is the round trips of the POST /v1/key-set requests sent before it
	// (the blocked keys' load, at the assignment; 0 for none).
	first, load time.Duration
	// settled are the statements from before the consumer started to
	// gateSettle after the last record (on and blocked1 runs only).
	settled []stmtCost
	// other is the busy run's deferrals for other groups, per second.
	other float64
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
	// n is the records of the main topic, which the no-op handler's runs
	// read; nWork the first of them, which the working handler's read.
	n, nWork int
	runs     map[gateSpec]gateRun
	// rounds is how many rounds of runs each handler had.
	rounds map[string]int
	// tracked: the server tracks statements (pg_stat_statements), so the
	// runs' statement figures mean something.
	tracked     bool
	blockedKeys int
	idle, busy  callLatency
	// release is, per key of the release phase, the time from its record's
	// commit (from when it was marked, just before) to the first answer
	// saying the key is free.
	release []time.Duration
	// early counts keys that read free before their record was committed:
	// the gate would have let a later record overtake it.
	early int
}

// runGate measures what the client library's key gate costs a consumer and
// how fast a key flows again after its message was handled, against the
// real service:
//
//  1. cost: N records of distinct keys wait in topicMain; fresh consumer
//     groups read all of them, one after the other, with each client
//     (sarama through deferclient.ConsumerGroupHandler, franz-go through
//     deferkgo.Client.Consume) and each handler (one that only counts, one
//     that also spins gateWork a record), in each mode: gate off; on with
//     no key blocked; on with 1% of the keys blocked (a message of each
//     deferred by an hour for the run's group first, so that those records
//     are deferred behind it, not handled); on while a producer defers
//     GateRate records a second for other groups. Each is timed from its
//     first record handled to the last handled or gated, and the
//     scheduler's statements are sampled around it;
//  2. release: GateRelease keys, a message of each deferred due now for a
//     group that commits each republished record as soon as it reads it;
//     how long after the commit the key reads free (the scheduler reads
//     committed offsets about once a second);
//  3. the key-state query's latency, client side (what a batch asks when
//     the set cannot be trusted, and what republished records ask):
//     GateCalls queries of 500 distinct keys one after the other, with the
//     defer topic quiet, then while other groups defer GateRate records a
//     second (each query then waits for ingest to store what was produced
//     before it).
func (b *bench) runGate(ctx context.Context) (res gateResult, err error) {
	res.n, res.nWork = b.cfg.GateN, min(b.cfg.GateWorkN, b.cfg.GateN)
	res.runs, res.tracked = map[gateSpec]gateRun{}, b.pg.stmts
	// The no-op handler's runs last under a second: on a shared machine
	// they vary by a fifth from one to the next, so they are repeated, and
	// their median counts.
	res.rounds = map[string]int{handlerNoop: max(b.cfg.GateRounds, 1), handlerWork: 1}
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
	g := gateEnv{b: b, addr: addr, url: "http://" + svc.HTTPAddr, pid: svc.Pid(), db: db.name, lp: lp}

	// The blocked runs' keys are blocked first, for every blocked run's
	// group, so that their storage is not in any run's figures.
	var blockedKeys []string
	isBlocked := map[string]bool{}
	for i := 0; i < res.n; i += gateBlockedEvery {
		blockedKeys = append(blockedKeys, gateKey(i))
		isBlocked[gateKey(i)] = true
	}
	res.blockedKeys = len(blockedKeys)
	// The key-state queries of step 3 ask as the first blocked group,
	// which has its 1% of keys pending, as a real group would have some.
	var blocker *deferclient.Client
	for _, h := range gateHandlers {
		for _, c := range gateClients {
			group := gateSpec{c, h, gateBlocked, 0}.group()
			bc, err := g.client(group)
			if err != nil {
				return res, err
			}
			if blocker == nil {
				blocker = bc
				defer blocker.Close()
			} else {
				defer bc.Close()
			}
			b.say("  blocking %d keys for group %s", len(blockedKeys), group)
			if err := block(ctx, lp, bc, group, blockedKeys); err != nil {
				return res, withLogs(err)
			}
		}
	}

	// 1. What the gate costs the consumer. Each client first reads the
	// topic once, gate off, unreported: the first reads of a run are
	// slower (the heap grows; the service and Postgres may still be
	// busy with the blocked keys).
	for _, c := range gateClients {
		spec := gateSpec{c, handlerNoop, gateOff, 0}
		b.say("  warming up: %s, reading %d records, not reported", spec, res.n)
		if _, err := g.consume(ctx, spec, "bench.gate.warmup."+c, res.n, nil); err != nil {
			return res, withLogs(fmt.Errorf("warm-up, %s: %w", spec, err))
		}
	}
	for _, h := range gateHandlers {
		n := res.n
		if h == handlerWork {
			n = res.nWork
		}
		for _, c := range gateClients {
			var specs []gateSpec
			for r := range res.rounds[h] {
				for _, m := range gateModes[:len(gateModes)-1] {
					if m != gateBlocked || r == 0 {
						specs = append(specs, gateSpec{c, h, m, r})
					}
				}
			}
			for _, spec := range append(specs, gateSpec{c, h, gateOffAgain, 0}) {
				var blocked map[string]bool
				if spec.mode == gateBlocked {
					blocked = isBlocked
				}
				b.say("  consuming %d records: %s", n, spec)
				run, err := g.consume(ctx, spec, spec.group(), n, blocked)
				if err != nil {
					return res, withLogs(fmt.Errorf("%s: %w", spec, err))
				}
				res.runs[spec] = run
			}
		}
	}

	// 2. Release after commit, before the load phase below fills the
	// database with deferrals: this figure is about the release loop, the
	// query's own cost is measured next.
	b.say("  release of %d keys after their commit", b.cfg.GateRelease)
	if res.release, res.early, err = g.release(ctx, b.cfg.GateRelease); err != nil {
		return res, withLogs(err)
	}

	// 3. The query's latency, quiet and under ingest load.
	b.say("  %d key-state queries of %d keys, defer topic quiet", b.cfg.GateCalls, gateBatch)
	if res.idle, err = keyStateLatency(ctx, blocker, b.cfg.GateCalls, res.n); err != nil {
		return res, withLogs(err)
	}
	b.say("  %d key-state queries of %d keys, %d deferrals/s produced for other groups", b.cfg.GateCalls, gateBatch, b.cfg.GateRate)
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
	lp   *loadProducer
}

// client returns a deferclient.Client for group.
func (g gateEnv) client(group string) (*deferclient.Client, error) {
	c, err := deferclient.New(deferclient.Config{Brokers: []string{g.addr}, Group: group, SchedulerURL: g.url})
	if err != nil {
		return nil, fmt.Errorf("client of group %s: %w", group, err)
	}
	return c, nil
}

// consume reads the main topic as a fresh consumer group, from its oldest
// offset, as spec says, until n records were handled or gated. The consumers
// take their clients' defaults, as the library's examples do: sarama's
// batches are what a partition has ready (sarama buffers 256 records a
// partition), up to 500; franz-go's a poll of up to 500. A record of a key
// in blocked reaching the handler is an error: the gate failed at its one
// job.
func (g gateEnv) consume(ctx context.Context, spec gateSpec, group string, n int, blocked map[string]bool) (run gateRun, err error) {
	h := &gateCounter{blocked: blocked}
	if spec.handler == handlerWork {
		h.work = gateWork
	}
	if spec.mode == gateBusy || spec.mode == gateBusyOff {
		stopOthers := otherGroups(ctx, g.lp, g.b.cfg.GateRate, spec.group())
		defer func() {
			perSecond, oerr := stopOthers()
			run.other = perSecond
			err = errors.Join(err, oerr)
		}()
		// Ingest reaches its steady pace before the consumer starts.
		select {
		case <-time.After(500 * time.Millisecond):
		case <-ctx.Done():
			return run, ctx.Err()
		}
	}
	timer := &setTimer{base: http.DefaultTransport}
	// The library's default timeout (KeyStateWait plus 5 seconds).
	hc := &http.Client{Timeout: 7 * time.Second, Transport: timer}

	cpu0 := g.b.cpu(g.pid)
	stmts0, err := g.b.pg.statements(ctx, g.db)
	if err != nil {
		return run, err
	}
	m, err := g.member(ctx, spec, group, h, hc)
	if err != nil {
		return run, err
	}
	stopped := false
	defer func() {
		if !stopped {
			err = errors.Join(err, m.stop())
		}
	}()
	// Polled every millisecond: a run of the quick mode lasts a few
	// hundred milliseconds.
	deadline := time.Now().Add(timeoutFor(n))
	var doneAt time.Time
	var done int64 // records handled or gated by doneAt
	for {
		if done = h.handled.Load() + m.stats().Gated; done >= int64(n) {
			doneAt = time.Now()
			break
		}
		if time.Now().After(deadline) {
			return run, fmt.Errorf("%d handled and %d gated of %d records after %v", h.handled.Load(), m.stats().Gated, n, timeoutFor(n))
		}
		select {
		case <-ctx.Done():
			return run, ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	cpu := g.b.cpu(g.pid).sub(cpu0)
	stmts1, err := g.b.pg.statements(ctx, g.db)
	if err != nil {
		return run, err
	}
	if spec.mode == gateOn || spec.mode == gateBlocked {
		select {
		case <-time.After(gateSettle):
		case <-ctx.Done():
			return run, ctx.Err()
		}
		stmts2, err := g.b.pg.statements(ctx, g.db)
		if err != nil {
			return run, err
		}
		run.settled = stmts2.since(stmts0, g.b.labels)
	}
	stopped = true
	if err := m.stop(); err != nil {
		return run, err
	}
	first := h.firstAt()
	// The counts go on after doneAt (the working handler's runs read
	// more than n records, and the settling runs go on reading).
	run.handled, run.stats = h.handled.Load(), m.stats()
	run.gated = run.stats.Gated
	run.rate = rate{n: done, wall: doneAt.Sub(first), cpu: cpu, stmts: stmts1.since(stmts0, g.b.labels)}
	if at := m.assigned(); !at.IsZero() && first.After(at) {
		run.first = first.Sub(at)
	}
	run.load = timer.before(first)
	if l := h.leaked.Load(); l > 0 {
		return run, fmt.Errorf("%d records of %d blocked keys reached the handler", l, len(blocked))
	}
	return run, nil
}

// gateCounter is the runs' handler: it counts the records handled, notes
// when the first came, spins work a record, and counts the records of
// blocked keys it was given.
type gateCounter struct {
	work            time.Duration
	blocked         map[string]bool
	handled, leaked atomic.Int64
	first           atomic.Pointer[time.Time]
}

func (c *gateCounter) handle(key []byte) {
	if c.first.Load() == nil {
		now := time.Now()
		c.first.CompareAndSwap(nil, &now)
	}
	if c.work > 0 {
		spin(c.work)
	}
	c.handled.Add(1)
	if c.blocked[string(key)] {
		c.leaked.Add(1)
	}
}

func (c *gateCounter) firstAt() time.Time {
	if p := c.first.Load(); p != nil {
		return *p
	}
	return time.Time{}
}

// spin keeps the CPU busy for d, as a handler's own work would.
func spin(d time.Duration) {
	start := time.Now()
	for time.Since(start) < d {
	}
}

// setTimer times the POST /v1/key-set requests a client sends: the loads
// of its group's blocked keys.
type setTimer struct {
	base  http.RoundTripper
	mu    sync.Mutex
	loads []timedLoad
}

type timedLoad struct {
	start time.Time
	d     time.Duration
}

func (t *setTimer) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Path != keystate.SetPath {
		return t.base.RoundTrip(r)
	}
	start := time.Now()
	resp, err := t.base.RoundTrip(r)
	if err == nil {
		// The body is read after RoundTrip: a page of 10,000 keys takes
		// its share of time too.
		resp.Body = &timedBody{ReadCloser: resp.Body, t: t, start: start}
	}
	return resp, err
}

// timedBody notes its request's round trip when its body was read.
type timedBody struct {
	io.ReadCloser
	t     *setTimer
	start time.Time
	once  sync.Once
}

func (b *timedBody) Close() error {
	b.once.Do(func() {
		b.t.mu.Lock()
		b.t.loads = append(b.t.loads, timedLoad{b.start, time.Since(b.start)})
		b.t.mu.Unlock()
	})
	return b.ReadCloser.Close()
}

// before returns the time spent in the requests sent before at.
func (t *setTimer) before(at time.Time) time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	var d time.Duration
	for _, l := range t.loads {
		if l.start.Before(at) {
			d += l.d
		}
	}
	return d
}

// gateMember is a running consumer group member of a run.
type gateMember struct {
	stats    func() gate.Stats
	assigned func() time.Time // when it learnt its first assignment; zero before
	stop     func() error
}

// member starts spec's consumer as group, handing its records to h, its
// gate's questions sent with hc.
func (g gateEnv) member(ctx context.Context, spec gateSpec, group string, h *gateCounter, hc *http.Client) (gateMember, error) {
	noGate := !slices.Contains(gateOnModes, spec.mode)
	if spec.client == clientSarama {
		client, err := deferclient.New(deferclient.Config{Brokers: []string{g.addr}, Group: group, SchedulerURL: g.url, HTTPClient: hc})
		if err != nil {
			return gateMember{}, fmt.Errorf("client of group %s: %w", group, err)
		}
		th := &timedHandler{ConsumerGroupHandler: client.ConsumerGroupHandler(func(_ context.Context, m *sarama.ConsumerMessage) error {
			h.handle(m.Key)
			return nil
		}, deferclient.HandlerConfig{NoGate: noGate})}
		stop, err := consumeGroup(ctx, g.addr, group, topicMain, th, 0)
		if err != nil {
			return gateMember{}, errors.Join(err, client.Close())
		}
		return gateMember{stats: client.Stats, assigned: th.started, stop: func() error { return errors.Join(stop(), client.Close()) }}, nil
	}
	client, err := deferkgo.New(deferkgo.Config{Brokers: []string{g.addr}, Group: group, SchedulerURL: g.url, HTTPClient: hc})
	if err != nil {
		return gateMember{}, fmt.Errorf("client of group %s: %w", group, err)
	}
	hook := &syncHook{}
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(g.addr), kgo.ConsumerGroup(group), kgo.ConsumeTopics(topicMain),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.WithHooks(hook)}, client.GroupOpts()...)...)
	if err != nil {
		client.Close()
		return gateMember{}, fmt.Errorf("consumer of group %s: %w", group, err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- client.Consume(cctx, cl, func(_ context.Context, r *kgo.Record) error {
			h.handle(r.Key)
			return nil
		}, deferkgo.HandlerConfig{NoGate: noGate})
	}()
	return gateMember{stats: client.Stats, assigned: hook.when, stop: func() error {
		cancel()
		err := <-done
		cl.Close()
		client.Close()
		if err != nil {
			return fmt.Errorf("consumer of group %s: %w", group, err)
		}
		return nil
	}}, nil
}

// syncHook notes when a kgo consumer first read the answer to its
// SyncGroup request: when it learnt its assignment, just before kgo runs
// the OnPartitionsAssigned hook (and fetches the partitions' offsets after
// it).
type syncHook struct{ at atomic.Pointer[time.Time] }

func (s *syncHook) OnBrokerRead(_ kgo.BrokerMetadata, key int16, _ int, _, _ time.Duration, err error) {
	if key == kmsg.SyncGroup.Int16() && err == nil {
		now := time.Now()
		s.at.CompareAndSwap(nil, &now)
	}
}

func (s *syncHook) when() time.Time {
	if p := s.at.Load(); p != nil {
		return *p
	}
	return time.Time{}
}

// otherGroups produces rate deferrals a second, due in an hour, each its
// own key (tag and a number), for gateOtherGroups consumer groups that are
// none of the runs', in the background until the returned stop is called.
// stop waits for their acknowledgements and returns how many were
// produced a second.
func otherGroups(ctx context.Context, lp *loadProducer, rate int, tag string) (stop func() (float64, error)) {
	lp.mu.Lock()
	base := lp.acked
	lp.mu.Unlock()
	lctx, cancel := context.WithCancel(ctx)
	type produced struct {
		sent int
		err  error
	}
	loaded := make(chan produced, 1)
	start := time.Now()
	go func() {
		// Stopped by cancel long before the hour.
		sent, err := producePaced(lctx, lp, rate, time.Hour, func(i int, now time.Time) *sarama.ProducerMessage {
			m := deferRecord("gl-"+tag+"-"+strconv.Itoa(i), i, topicGateLoad, when{at: now.Add(time.Hour)})
			m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(protocol.HeaderGroup),
				Value: []byte("bench.gate.other-" + strconv.Itoa(i%gateOtherGroups))})
			return m
		})
		loaded <- produced{sent, err}
	}()
	return func() (float64, error) {
		cancel()
		p := <-loaded
		elapsed := time.Since(start)
		if p.err != nil && (!errors.Is(p.err, context.Canceled) || ctx.Err() != nil) {
			return 0, fmt.Errorf("other groups' deferrals: %w", p.err)
		}
		if err := lp.waitAcked(ctx, base+int64(p.sent)); err != nil {
			return 0, fmt.Errorf("other groups' deferrals: %w", err)
		}
		return float64(p.sent) / elapsed.Seconds(), nil
	}
}

// timedHandler notes when the first session started: the assignment, for
// the sarama runs.
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

// block defers one message of each key by an hour for group (client's),
// produced as the group's consumers would have deferred it (to the key's
// partition of the defer topic, naming the group), and waits until the
// scheduler answers that every key is pending: the blocked runs then
// measure the gate, not ingest catching up with these deferrals.
func block(ctx context.Context, lp *loadProducer, client *deferclient.Client, group string, keys []string) error {
	at := time.Now().Add(time.Hour)
	if _, _, err := produceAll(ctx, lp, len(keys), func(i int) *sarama.ProducerMessage {
		m := deferRecord(keys[i], i, topicMainRetry, when{at: at})
		m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(protocol.HeaderGroup), Value: []byte(group)})
		return m
	}); err != nil {
		return fmt.Errorf("block the keys of group %s: %w", group, err)
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

// busyLatency is keyStateLatency while other groups' deferrals are
// produced, rate a second, due in an hour, from a moment before the first
// query to the last.
func busyLatency(ctx context.Context, lp *loadProducer, client *deferclient.Client, rate, calls, n int) (callLatency, error) {
	start := time.Now()
	stop := otherGroups(ctx, lp, rate, "query")
	// Ingest reaches its steady pace before the first query.
	select {
	case <-time.After(500 * time.Millisecond):
	case <-ctx.Done():
		_, _ = stop()
		return callLatency{}, ctx.Err()
	}
	l, err := keyStateLatency(ctx, client, calls, n)
	perSecond, lerr := stop()
	if err != nil {
		return l, err
	}
	if lerr != nil {
		return l, lerr
	}
	l.loadPerSecond, l.loadForSeconds = perSecond, time.Since(start).Seconds()
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

// gateStatements are the statements the gate's requests run: the blocked
// keys' load (key-set) and feed (key-changes), and the key-state query
// with what it reads and sends first.
var gateStatements = map[string]bool{"key_set.sql": true, "key_changes.sql": true, "key_state.sql": true,
	"ingest_stored.sql": true, "ingest_flush.sql": true}

// gateStatementsOnly sums the top-level statements of gateStatements.
func gateStatementsOnly(costs []stmtCost) time.Duration {
	var d time.Duration
	for _, c := range costs {
		if !c.nested && gateStatements[c.label] {
			d += c.exec + c.plan
		}
	}
	return d
}

// ingestOnly sums the top-level statements of ingest: those that store
// deferrals, their triggers included.
func ingestOnly(costs []stmtCost) time.Duration {
	var d time.Duration
	for _, c := range costs {
		if !c.nested && !gateStatements[c.label] && (strings.HasPrefix(c.label, "ingest_") || strings.HasPrefix(c.label, "COPY ")) {
			d += c.exec + c.plan
		}
	}
	return d
}

// runsOf returns the runs of client c, handler h and mode m, in round
// order.
func (g *gateResult) runsOf(c, h string, m gateMode) []gateRun {
	var runs []gateRun
	for r := range g.rounds[h] {
		if run, ok := g.runs[gateSpec{c, h, m, r}]; ok {
			runs = append(runs, run)
		}
	}
	return runs
}

// median returns the median of vs, 0 for none.
func median(vs []float64) float64 {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// rates returns the records a second of runs.
func rates(runs []gateRun) []float64 {
	vs := make([]float64, len(runs))
	for i, r := range runs {
		vs[i] = r.rate.perSecond()
	}
	return vs
}

// rateOf is the median rate of the runs of client c, handler h and mode
// m.
func (g *gateResult) rateOf(c, h string, m gateMode) float64 { return median(rates(g.runsOf(c, h, m))) }

// offRate is the gate-off rate the runs of client c and handler h are
// compared with: the median of the off runs of every round and of off2,
// which followed them all.
func (g *gateResult) offRate(c, h string) float64 {
	return median(rates(append(g.runsOf(c, h, gateOff), g.runsOf(c, h, gateOffAgain)...)))
}

// pgPerRecord returns the scheduler database's top-level statements, and
// the gate's part of them, per record read, in µs, over the runs.
func pgPerRecord(runs []gateRun) (all, gateOnly float64) {
	var n int64
	var a, gt time.Duration
	for _, r := range runs {
		n += r.rate.n
		a += topLevel(r.rate.stmts)
		gt += gateStatementsOnly(r.rate.stmts)
	}
	if n == 0 {
		return 0, 0
	}
	return float64(a) / float64(time.Microsecond) / float64(n), float64(gt) / float64(time.Microsecond) / float64(n)
}

// medianDuration returns the median of the durations f gives of runs.
func medianDuration(runs []gateRun, f func(gateRun) time.Duration) time.Duration {
	ds := make([]time.Duration, len(runs))
	for i, r := range runs {
		ds[i] = f(r)
	}
	return percentile(ds, 0.5)
}

// perDeferral returns the Postgres time per gated deferral, in µs, over
// the blocked1 runs of every client and handler: what their statements,
// counted until gateSettle after their last record, took beyond those of
// the first "on" run of the same client and handler; and ingest's
// statements alone. n is the deferrals.
func (g *gateResult) perDeferral() (total, ingest float64, n int64) {
	var extra, stored time.Duration
	for _, h := range gateHandlers {
		for _, c := range gateClients {
			on, blocked := g.runs[gateSpec{c, h, gateOn, 0}], g.runs[gateSpec{c, h, gateBlocked, 0}]
			extra += topLevel(blocked.settled) - topLevel(on.settled)
			stored += ingestOnly(blocked.settled)
			n += blocked.gated
		}
	}
	if n == 0 {
		return 0, 0, 0
	}
	return float64(extra.Microseconds()) / float64(n), float64(stored.Microseconds()) / float64(n), n
}

// summarize adds the scenario's figures to s.
func (g *gateResult) summarize(s *summary) {
	for _, h := range gateHandlers {
		for _, c := range gateClients {
			for _, m := range gateModes {
				s.set(gateSpec{c, h, m, 0}.key("msgs_per_s"), g.rateOf(c, h, m))
			}
			off := g.offRate(c, h)
			for _, m := range gateMeasured[1:] {
				s.set(gateSpec{c, h, m, 0}.key("vs_off"), ratio(g.rateOf(c, h, m), off))
			}
			// The gate's own part of the busy runs' slowdown, and how far
			// the gate-off rate moved over the runs.
			s.set("gate_"+c+"_"+h+"_busy_vs_busyoff", ratio(g.rateOf(c, h, gateBusy), g.rateOf(c, h, gateBusyOff)))
			s.set("gate_"+c+"_"+h+"_off2_vs_off", ratio(g.rateOf(c, h, gateOffAgain), g.rateOf(c, h, gateOff)))
		}
	}
	// The no-op handler's runs: the scheduler's Postgres time per record
	// read, every top-level statement of its database from before the
	// consumer started to its last record (planning and execution): with
	// the gate off it is the service's background work alone (heartbeats,
	// the in-flight loop, metrics; often none in a run this short), which
	// the other figures include too; busy and busyoff include storing the
	// other groups' deferrals. pg_gate is the gate's own statements' part.
	// Without pg_stat_statements there are none.
	if g.tracked {
		for _, c := range gateClients {
			for _, m := range gateMeasured {
				spec := gateSpec{c, handlerNoop, m, 0}
				all, gateOnly := pgPerRecord(g.runsOf(c, handlerNoop, m))
				s.set(spec.key("pg_us_per_record"), all)
				s.set(spec.key("pg_gate_us_per_record"), gateOnly)
			}
		}
		total, ingest, _ := g.perDeferral()
		s.set("gate_pg_us_per_deferral", total)
		s.set("gate_pg_ingest_us_per_deferral", ingest)
	}
	// From the assignment to the first record handled, and the blocked
	// keys' load within it, the median over the rounds.
	for _, c := range gateClients {
		for _, m := range gateMeasured {
			spec := gateSpec{c, handlerNoop, m, 0}
			runs := g.runsOf(c, handlerNoop, m)
			s.set(spec.key("first_ms"), ms(medianDuration(runs, func(r gateRun) time.Duration { return r.first })))
			if slices.Contains(gateOnModes, m) {
				s.set(spec.key("load_ms"), ms(medianDuration(runs, func(r gateRun) time.Duration { return r.load })))
			}
		}
	}
	s.set("gate_p50_ms", ms(g.idle.p50))
	s.set("gate_p99_ms", ms(g.idle.p99))
	s.set("gate_busy_p50_ms", ms(g.busy.p50))
	s.set("gate_busy_p99_ms", ms(g.busy.p99))
	s.set("release_p50_ms", ms(percentile(g.release, 0.50)))
	s.set("release_p99_ms", ms(percentile(g.release, 0.99)))
	s.set("release_max_ms", ms(percentile(g.release, 1)))
	s.set("gate_records", float64(g.n))
	s.set("gate_work_records", float64(g.nWork))
	s.set("gate_noop_rounds", float64(g.rounds[handlerNoop]))
	s.set("gate_blocked_keys", float64(g.blockedKeys))
	// The fewest records gated by a no-op handler's blocked run: each
	// blocked key has one record, which every run that read all of them
	// must have gated.
	gated, unsure := int64(-1), int64(0)
	for spec, r := range g.runs {
		if spec.mode == gateBlocked && spec.handler == handlerNoop && (gated < 0 || r.gated < gated) {
			gated = r.gated
		}
		unsure += r.stats.QueryFailures + r.stats.FeedFailures
	}
	s.set("gate_gated", float64(max(gated, 0)))
	s.set("gate_unsure", float64(unsure+int64(g.idle.unsure+g.busy.unsure)))
	s.set("release_keys", float64(len(g.release)))
	s.set("release_early", float64(g.early))
}

// write prints the scenario's section of the report.
func (g *gateResult) write(w io.Writer, v map[string]float64) {
	var other float64
	for _, r := range g.runs {
		other = max(other, r.other)
	}
	fmt.Fprintf(w, "\nKEY GATE: %s records of distinct keys in %s, read by a fresh consumer group per run from the oldest offset,\n",
		group(float64(g.n)), topicMain)
	fmt.Fprintln(w, "with the client's defaults (sarama: deferclient.ConsumerGroupHandler; franz: deferkgo.Client.Consume); the handler")
	fmt.Fprintf(w, "only counts (noop: all the records) or also spins %v a record (work25: the first %s). Gate off (NoGate); on;\n",
		gateWork, group(float64(g.nWork)))
	fmt.Fprintf(w, "on with 1%% of the keys blocked (%s); on while other groups defer about %s records/s (busy); off while they\n",
		group(float64(g.blockedKeys)), group(other))
	fmt.Fprintf(w, "do (busyoff); off again at the end (off2). The noop runs go in %d rounds (blocked1 in the first only), in that\n",
		g.rounds[handlerNoop])
	fmt.Fprintln(w, "order; records/s is the median over the rounds, \"/ off\" over the median of off and off2. Each run is timed from")
	fmt.Fprintln(w, "its first record handled to the last handled or gated; each client first read the topic once, unreported. asked:")
	fmt.Fprintln(w, "key-state queries answered; loads and polls: of the blocked-key set and its feed; unsure: queries, loads and polls")
	fmt.Fprintln(w, "that failed (all summed over the rounds); CPU per record over the rounds, as in THROUGHPUT")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "client\thandler\tgate\truns\trecords/s\tmin-max\t/ off\tgated\tasked\tloads\tpolls\tunsure\tCPU µs/rec svc\tpg\tbench\t")
	for _, h := range gateHandlers {
		for _, c := range gateClients {
			off := g.offRate(c, h)
			for _, m := range gateModes {
				runs := g.runsOf(c, h, m)
				rs := rates(runs)
				var gated, asked, loads, polls, unsure, n int64
				var cpu cpuTimes
				for _, r := range runs {
					gated += r.gated
					asked += r.stats.Queries
					loads += r.stats.SetLoads
					polls += r.stats.FeedPolls
					unsure += r.stats.QueryFailures + r.stats.FeedFailures
					n += r.rate.n
					cpu.service += r.rate.cpu.service
					cpu.postgres += r.rate.cpu.postgres
					cpu.bench += r.rate.cpu.bench
				}
				per := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / float64(max(n, 1)) }
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s-%s\t%.2f\t%s\t%d\t%d\t%d\t%d\t%.2f\t%.2f\t%.2f\t\n", c, h, m, len(runs),
					group(median(rs)), group(slices.Min(rs)), group(slices.Max(rs)), ratio(median(rs), off), group(float64(gated)),
					asked, loads, polls, unsure, per(cpu.service), per(cpu.postgres), per(cpu.bench))
			}
		}
	}
	tw.Flush()

	fmt.Fprintln(w, "\nKEY GATE, POSTGRES AND ASSIGNMENT (noop handler): the scheduler database's top-level statements (planning and")
	fmt.Fprintln(w, "execution) from before the consumer started to its last record, per record read over the rounds, and the gate's")
	fmt.Fprintln(w, "statements' part (key-set, key-changes, key-state); from the assignment (sarama: Setup; franz: the SyncGroup answer)")
	fmt.Fprintln(w, "to the first record handled, and the round trips of the blocked keys' load (POST /v1/key-set) within it, medians")
	tw = tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "client\tgate\tPostgres µs/record\tof it the gate's\tassignment to first record\tkey-set load\t")
	for _, c := range gateClients {
		for _, m := range gateMeasured {
			spec := gateSpec{c, handlerNoop, m, 0}
			pg, pgGate := "-", "-"
			if g.tracked {
				pg, pgGate = fmt.Sprintf("%.3f", v[spec.key("pg_us_per_record")]), fmt.Sprintf("%.3f", v[spec.key("pg_gate_us_per_record")])
			}
			load := "-"
			if slices.Contains(gateOnModes, m) {
				load = fmt.Sprintf("%.1f ms", v[spec.key("load_ms")])
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.1f ms\t%s\t\n", c, m, pg, pgGate, v[spec.key("first_ms")], load)
		}
	}
	tw.Flush()
	if g.tracked {
		total, ingest, n := g.perDeferral()
		fmt.Fprintf(w, "Per gated deferral (%s, the blocked1 runs of both clients and handlers): %.0f µs of Postgres, what their statements\n",
			group(float64(n)), total)
		fmt.Fprintf(w, "took until %v after their last record beyond those of the first \"on\" runs; of it ingest's statements %.0f µs.\n",
			gateSettle, ingest)
		var phases []stmtPhase
		for _, c := range gateClients {
			for _, m := range gateOnModes {
				r := g.runs[gateSpec{c, handlerNoop, m, 0}]
				phases = append(phases, stmtPhase{name: c + " " + string(m), n: r.rate.n, costs: r.rate.stmts})
			}
		}
		writeStatements(w, "KEY GATE, WHERE POSTGRES'S TIME WENT (noop handler, first round, per record read)", phases)
	}

	fmt.Fprintf(w, "\nKEY-STATE QUERY (POST /v1/key-state, %d distinct keys a call, one call at a time for at most %v, timed client side;\n",
		gateBatch, gateLatencyFor)
	fmt.Fprintln(w, "what a batch asks when the blocked-key set cannot be trusted, and what republished records ask)")
	tw = tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "defer topic\tcalls\tp50\tp99\tmax\tunsure\t")
	for _, l := range []struct {
		what string
		l    callLatency
	}{
		{"quiet", g.idle},
		{fmt.Sprintf("%s deferrals/s produced for other groups for %.1fs", group(g.busy.loadPerSecond), g.busy.loadForSeconds), g.busy},
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
	for _, c := range gateClients {
		for _, t := range []struct {
			mode gateMode
			what string
			want float64
		}{
			{gateOn, "on / off, no key blocked", 0.9},
			{gateBlocked, "on, 1% of keys blocked / off", 0.8},
			{gateBusy, "on, other groups deferring / off", 0.8},
		} {
			k := gateSpec{c, handlerNoop, t.mode, 0}.key("vs_off")
			target(fmt.Sprintf("key gate %s (%s, no-op handler)", t.what, c), fmt.Sprintf("%.2f", v[k]), fmt.Sprintf(">= %.1f", t.want), v[k] >= t.want)
		}
		if k := (gateSpec{c, handlerNoop, gateOn, 0}).key("pg_us_per_record"); hasKey(v, k) {
			target(fmt.Sprintf("key gate on, Postgres per record read (%s)", c), fmt.Sprintf("%.2f µs", v[k]), "<= 0.5 µs", v[k] <= 0.5)
		}
	}
	target("key released after commit, p99", fmt.Sprintf("%.0f ms", v["release_p99_ms"]), "<= 2,000 ms", v["release_p99_ms"] <= 2000)
	target("keys free before their commit", fmt.Sprintf("%.0f", v["release_early"]), "0", v["release_early"] == 0)
}

func hasKey(v map[string]float64, k string) bool {
	_, ok := v[k]
	return ok
}
