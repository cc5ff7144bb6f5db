package metrics

import (
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/deferq/scheduler/internal/reason"
)

// OtherTarget is the target label of messages whose target topic is missing,
// not a valid topic name or not allowed by TARGET_TOPICS. Such values come
// from producers (rejected records) or operators, not from configuration, so
// they are folded into one series to keep the label bounded. It cannot be a
// Kafka topic name, so it never collides with a real target.
const OtherTarget = "(other)"

// MaxTargets bounds the target label: the first MaxTargets distinct targets
// a process sees get series of their own, any further one counts as
// OtherTarget. TARGET_TOPICS globs can allow topics without end (a producer
// bug sending orders.<uuid>), and each would otherwise leave counter series
// behind for good.
const MaxTargets = 200

// states returns the states of deferred_message, always exported per target
// (0 when none), so that a series does not vanish when its count drops to 0.
func states() [3]string { return [3]string{"pending", "parked", "rejected"} }

// ingestResults returns the ingest results, always exported.
func ingestResults() [3]string { return [3]string{"stored", "duplicate", "rejected"} }

// ingestParkedReasons returns the reason codes of records parked at ingest
// (package deferral), always exported.
func ingestParkedReasons() [3]string { return [3]string{"permanent", "non_retriable", "exhausted"} }

// Metrics holds the scheduler's Prometheus metrics. A nil *Metrics is valid
// and records nothing, so components built without one (tests) need no
// special case.
type Metrics struct {
	ingestRecords       *prometheus.CounterVec
	ingestRejected      *prometheus.CounterVec
	ingestParked        *prometheus.CounterVec
	ingestBatchRecords  prometheus.Histogram
	ingestBatchDuration prometheus.Histogram
	ingestLag           *prometheus.GaugeVec
	ingestRollbacks     prometheus.Counter
	ingestReread        prometheus.Counter
	ingestUnrecoverable prometheus.Counter
	ingestResets        prometheus.Counter
	ingestBuffered      prometheus.Gauge

	published     *prometheus.CounterVec
	publishErrors *prometheus.CounterVec
	parked        *prometheus.CounterVec
	lateness      prometheus.Histogram
	roundDuration prometheus.Histogram
	claimWait     prometheus.Histogram
	expressKeys   prometheus.Counter

	backlog *backlogCollector

	dlqPublished     prometheus.Counter
	dlqPublishErrors *prometheus.CounterVec

	ingestGated      prometheus.Counter
	ingestMisrouted  prometheus.Counter
	keyStateRequests *prometheus.CounterVec
	keyStateDuration prometheus.Histogram
	keyStateKeys     *prometheus.CounterVec
	keySetRequests   *prometheus.CounterVec
	inflightReleased prometheus.Counter
	inflightErrors   prometheus.Counter

	riverJobs *prometheus.CounterVec
	ready     prometheus.Gauge
	pool      *poolCollector

	// targetsMu guards targets, the target labels handed out (see Target).
	targetsMu sync.Mutex
	targets   map[string]struct{}
}

// New creates the scheduler's metrics and registers them with reg.
func New(reg prometheus.Registerer, version string) *Metrics {
	durations := prometheus.ExponentialBucketsRange(0.001, 10, 14) // 1ms..10s, about x2
	m := &Metrics{
		targets: map[string]struct{}{},
		ingestRecords: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: IngestRecords,
			Help: "Records read from the defer topic, by result: stored (pending, or parked by the retry rules: see scheduler_ingest_parked_total), rejected (stored as rejected), duplicate (stored before, skipped). They add up to the records read.",
		}, []string{"result"}),
		ingestRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: IngestRejected,
			Help: "Records stored as rejected, by reason code (the part of deferred_message.reason before the first colon).",
		}, []string{"reason"}),
		ingestParked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: IngestParked,
			Help: "Records stored straight into the parking lot by the retry rules, by reason code: permanent or non_retriable (error class), exhausted (no retries left). They are counted as stored too.",
		}, []string{"reason"}),
		ingestBatchRecords: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    IngestBatchRecords,
			Help:    "Records per ingested batch (one partition, one insert).",
			Buckets: prometheus.ExponentialBucketsRange(1, 10000, 9),
		}),
		ingestBatchDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    IngestBatchDuration,
			Help:    "Time to parse and store one ingested batch, database retries included.",
			Buckets: durations,
		}),
		ingestLag: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: IngestLag,
			Help: "Records of the defer topic not yet stored, per partition this process consumes: high-water mark minus next offset, after each batch.",
		}, []string{"partition"}),
		ingestRollbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: IngestRollbacks,
			Help: "Times ingest found a partition's stored position behind where it had been: Postgres went back in time (a failover to a lagging replica, a restore). Ingest reads the partition again from there.",
		}),
		ingestReread: prometheus.NewCounter(prometheus.CounterOpts{
			Name: IngestReread,
			Help: "Records of the defer topic read again because the stored position went back (see scheduler_ingest_rollbacks_total).",
		}),
		ingestUnrecoverable: prometheus.NewCounter(prometheus.CounterOpts{
			Name: IngestUnrecoverable,
			Help: "Records the database lost that Kafka no longer has either: the stored position was below the partition's log start (retention deleted them). They are gone; the logs give the offset ranges.",
		}),
		ingestResets: prometheus.NewCounter(prometheus.CounterOpts{
			Name: IngestPartitionResets,
			Help: "Partitions of the defer topic found re-created or truncated (high-water mark below the stored position, or a new topic id): ingest read them again from their start, under a new epoch.",
		}),
		ingestBuffered: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: IngestBufferedBytes,
			Help: "Bytes of records ingest holds now: fetched and queued, batched, being written (INGEST_BUFFER_BYTES bounds it).",
		}),
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: DispatchPublished,
			Help: "Messages republished and acknowledged by the broker, by target topic.",
		}, []string{"target"}),
		publishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: DispatchPublishErrors,
			Help: "Messages whose publish failed, by target topic and kind (retriable, or the permanent error's code such as unknown_topic).",
		}, []string{"target", "kind"}),
		parked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: DispatchParked,
			Help: "Messages moved to the parking lot by dispatch, by target topic and reason code.",
		}, []string{"target", "reason"}),
		lateness: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    DispatchLateness,
			Help:    "Broker acknowledgement time minus due time (next_run_at) of each published message.",
			Buckets: prometheus.ExponentialBucketsRange(0.001, 60, 17), // 1ms..60s, about x2
		}),
		roundDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    DispatchRoundDuration,
			Help:    "Duration of dispatch rounds that claimed keys: claim, publish and finalize.",
			Buckets: durations,
		}),
		claimWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    DispatchClaimWait,
			Help:    "Time dispatch rounds waited for their turn to claim (DISPATCH_CLAIMS claims of this process run at once).",
			Buckets: durations,
		}),
		expressKeys: prometheus.NewCounter(prometheus.CounterOpts{
			Name: DispatchExpressKeys,
			Help: "Keys claimed by express rounds: due heads of targets without a backlog (at most DISPATCH_EXPRESS_HEADS due heads) while another target has one, claimed outside the claim turns when a notification says a head became due. Their rounds are not in the round duration.",
		}),
		dlqPublished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: DLQPublished,
			Help: "Dead-letter copies of parked messages acknowledged by the broker.",
		}),
		dlqPublishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: DLQPublishErrors,
			Help: "Dead-letter copies whose publish failed (each is retried later with a back-off), by kind: retriable, or the error's code such as unknown_topic or invalid_topic (the dead-letter topic is wrong). The log names the topic.",
		}, []string{"kind"}),
		riverJobs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: RiverJobs,
			Help: "River jobs this process finished working, by job kind and outcome (completed, failed, discarded, cancelled, snoozed, interrupted).",
		}, []string{"kind", "outcome"}),
		ready: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: Ready,
			Help: "1 when the last readiness evaluation (/readyz or the periodic one) passed, else 0.",
		}),
		ingestGated: prometheus.NewCounter(prometheus.CounterOpts{
			Name: IngestGated,
			Help: "Records stored pending behind a blocked business key without being tried (defer.gated): a consumer's key gate deferred them. Not failures; counted as stored too.",
		}),
		ingestMisrouted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: IngestMisrouted,
			Help: "Records read from a partition of the defer topic other than the one their business key hashes to (Java-compatible murmur2): records of one key on several partitions keep no order among themselves. Stored as usual; the log gives the offset of the first in each batch.",
		}),
		keyStateRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: KeyStateRequests,
			Help: "Key-state queries (POST /v1/key-state), by result: answered; unsure (ingest did not catch up with the defer topic in time, or the database or broker failed: the client counts the keys as blocked); refused (a bad or unauthenticated request).",
		}, []string{"result"}),
		keyStateDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    KeyStateDuration,
			Help:    "Time to answer a key-state query, the wait for ingest to catch up with the defer topic included.",
			Buckets: durations,
		}),
		keyStateKeys: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: KeyStateKeys,
			Help: "Business keys answered by key-state queries, by answer: blocked or free.",
		}, []string{"answer"}),
		keySetRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: KeySetRequests,
			Help: "Blocked-key set queries of the client library, by query (set: POST /v1/key-set, a page of a group's blocked keys; changes: POST /v1/key-changes, what changed since a cursor) and result: answered; reset (the client must load its set again); unsure (ingest did not catch up in time, or the database failed); refused (a bad or unauthenticated request).",
		}, []string{"query", "result"}),
		inflightReleased: prometheus.NewCounter(prometheus.CounterOpts{
			Name: InflightReleased,
			Help: "Rows of deferred_inflight released because their consumer group committed past the record.",
		}),
		inflightErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: InflightErrors,
			Help: "Failed reads of a consumer group's committed offsets by the in-flight release (retried about once a second; the log names the group).",
		}),
		pool:    newPoolCollector(),
		backlog: newBacklogCollector(),
	}
	buildInfo := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        BuildInfo,
		Help:        "Always 1; the version label says which build runs.",
		ConstLabels: prometheus.Labels{"version": version},
	})
	buildInfo.Set(1)
	// Results are known in advance: export them at 0 so that rate() works
	// from the first increment.
	for _, r := range ingestResults() {
		m.ingestRecords.WithLabelValues(r)
	}
	for _, r := range ingestParkedReasons() {
		m.ingestParked.WithLabelValues(r)
	}
	// The usual kind of failure, so that the family exists before the first.
	m.dlqPublishErrors.WithLabelValues("retriable")
	for _, r := range []string{"answered", "unsure", "refused"} {
		m.keyStateRequests.WithLabelValues(r)
	}
	m.keyStateKeys.WithLabelValues("blocked")
	m.keyStateKeys.WithLabelValues("free")
	for _, q := range []string{"set", "changes"} {
		for _, r := range []string{"answered", "reset", "unsure", "refused"} {
			if q == "set" && r == "reset" {
				continue
			}
			m.keySetRequests.WithLabelValues(q, r)
		}
	}
	reg.MustRegister(
		m.ingestRecords, m.ingestRejected, m.ingestParked, m.ingestBatchRecords, m.ingestBatchDuration, m.ingestLag,
		m.ingestRollbacks, m.ingestReread, m.ingestUnrecoverable, m.ingestResets, m.ingestBuffered,
		m.published, m.publishErrors, m.parked, m.lateness, m.roundDuration, m.claimWait, m.expressKeys,
		m.backlog,
		m.dlqPublished, m.dlqPublishErrors,
		m.ingestGated, m.ingestMisrouted, m.keyStateRequests, m.keyStateDuration, m.keyStateKeys, m.keySetRequests,
		m.inflightReleased, m.inflightErrors,
		m.riverJobs, m.ready, m.pool, buildInfo,
	)
	return m
}

// ReasonCode returns the code of a stored reason ("code: detail",
// deferred_message.reason), the label of the reason metrics: the same code
// `scheduler ls --reason` and split_part(reason, ':', 1) give (package
// reason).
func ReasonCode(r string) string { return reason.Code(r) }

// Target returns the label for target: itself while fewer than MaxTargets
// distinct targets have been seen, OtherTarget after that.
func (m *Metrics) Target(target string) string {
	if m == nil || target == OtherTarget {
		return target
	}
	m.targetsMu.Lock()
	defer m.targetsMu.Unlock()
	if _, ok := m.targets[target]; ok {
		return target
	}
	if len(m.targets) >= MaxTargets {
		return OtherTarget
	}
	m.targets[target] = struct{}{}
	return target
}

// IngestBatch records one stored batch: how many records were stored as
// pending, skipped as duplicates and stored as rejected, the rejected ones by
// reason (codes or full reasons; they are reduced to codes), and how long the
// batch took.
func (m *Metrics) IngestBatch(stored, duplicates, rejected int, rejectedByReason map[string]int, d time.Duration) {
	if m == nil {
		return
	}
	m.ingestRecords.WithLabelValues("stored").Add(float64(stored))
	m.ingestRecords.WithLabelValues("duplicate").Add(float64(duplicates))
	m.ingestRecords.WithLabelValues("rejected").Add(float64(rejected))
	for reason, n := range rejectedByReason {
		if n > 0 {
			m.ingestRejected.WithLabelValues(ReasonCode(reason)).Add(float64(n))
		}
	}
	m.ingestBatchRecords.Observe(float64(stored + duplicates + rejected))
	m.ingestBatchDuration.Observe(d.Seconds())
}

// IngestParked counts records parked at ingest, by reason (codes or full
// reasons; they are reduced to codes).
func (m *Metrics) IngestParked(byReason map[string]int) {
	if m == nil {
		return
	}
	for reason, n := range byReason {
		if n > 0 {
			m.ingestParked.WithLabelValues(ReasonCode(reason)).Add(float64(n))
		}
	}
}

// SetLag sets the ingest lag of a partition of the defer topic. A negative
// lag (the high-water mark read before the batch's records) counts as 0.
func (m *Metrics) SetLag(partition int32, lag int64) {
	if m == nil {
		return
	}
	m.ingestLag.WithLabelValues(strconv.Itoa(int(partition))).Set(float64(max(lag, 0)))
}

// DeleteLag forgets the lag of a partition this process no longer consumes,
// so that after a rebalance only its new owner reports it.
func (m *Metrics) DeleteLag(partition int32) {
	if m == nil {
		return
	}
	m.ingestLag.DeleteLabelValues(strconv.Itoa(int(partition)))
}

// IngestRollback counts one stored position found behind where it had
// been, and the records read again because of it.
func (m *Metrics) IngestRollback(reread int64) {
	if m == nil {
		return
	}
	m.ingestRollbacks.Inc()
	m.ingestReread.Add(float64(max(reread, 0)))
}

// IngestUnrecoverable counts n records lost for good: below the log start.
func (m *Metrics) IngestUnrecoverable(n int64) {
	if m == nil || n <= 0 {
		return
	}
	m.ingestUnrecoverable.Add(float64(n))
}

// IngestPartitionReset counts one partition found re-created or truncated.
func (m *Metrics) IngestPartitionReset() {
	if m == nil {
		return
	}
	m.ingestResets.Inc()
}

// SetIngestBuffered sets the bytes of records ingest holds.
func (m *Metrics) SetIngestBuffered(n int64) {
	if m == nil {
		return
	}
	m.ingestBuffered.Set(float64(n))
}

// Published counts n messages acknowledged by the broker for target.
func (m *Metrics) Published(target string, n int) {
	if m == nil || n <= 0 {
		return
	}
	m.published.WithLabelValues(m.Target(target)).Add(float64(n))
}

// PublishError counts one message whose publish to target failed with an
// error of the given kind.
func (m *Metrics) PublishError(target, kind string) {
	if m == nil {
		return
	}
	m.publishErrors.WithLabelValues(m.Target(target), kind).Inc()
}

// Parked counts one message parked by dispatch; reason may be the full
// reason string, only its code is kept.
func (m *Metrics) Parked(target, reason string) {
	if m == nil {
		return
	}
	m.parked.WithLabelValues(m.Target(target), ReasonCode(reason)).Inc()
}

// ObserveLateness records how late one message was published.
func (m *Metrics) ObserveLateness(d time.Duration) {
	if m == nil {
		return
	}
	m.lateness.Observe(max(d, 0).Seconds())
}

// Round records the duration of a dispatch round that claimed keys.
func (m *Metrics) Round(d time.Duration) {
	if m == nil {
		return
	}
	m.roundDuration.Observe(d.Seconds())
}

// ClaimWait records how long a round waited for its turn to claim
// (dispatch.Config.ClaimTurns).
func (m *Metrics) ClaimWait(d time.Duration) {
	if m == nil {
		return
	}
	m.claimWait.Observe(d.Seconds())
}

// ExpressKeys counts n keys claimed by an express round.
func (m *Metrics) ExpressKeys(n int) {
	if m == nil {
		return
	}
	m.expressKeys.Add(float64(n))
}

// DLQPublished counts n dead-letter copies acknowledged by the broker.
func (m *Metrics) DLQPublished(n int) {
	if m == nil || n <= 0 {
		return
	}
	m.dlqPublished.Add(float64(n))
}

// DLQPublishError counts one dead-letter copy whose publish failed with an
// error of the given kind.
func (m *Metrics) DLQPublishError(kind string) {
	if m == nil {
		return
	}
	m.dlqPublishErrors.WithLabelValues(kind).Inc()
}

// RiverJob counts one River job outcome.
func (m *Metrics) RiverJob(kind, outcome string) {
	if m == nil {
		return
	}
	m.riverJobs.WithLabelValues(kind, outcome).Inc()
}

// SetReady records the result of a readiness evaluation.
func (m *Metrics) SetReady(ready bool) {
	if m == nil {
		return
	}
	if ready {
		m.ready.Set(1)
	} else {
		m.ready.Set(0)
	}
}

// Backlog is what the periodic backlog query found. Targets are labels
// already (see OtherTarget).
type Backlog struct {
	// Messages counts messages by target and state.
	Messages map[string]map[string]int64
	// Due counts pending messages past their due time, by target.
	Due map[string]int64
	// OldestDue is how long ago the earliest due head became due.
	OldestDue time.Duration
	// HeldKeys counts keys backing off after retriable failures.
	HeldKeys int64
	// KeysHeldParked counts keys held by a parked message.
	KeysHeldParked int64
	// DLQUnsent counts parked messages whose dead-letter copy is not
	// acknowledged yet.
	DLQUnsent int64
	// OldestTransaction is the age of the oldest open transaction in the
	// database that holds back vacuum.
	OldestTransaction time.Duration
	// InflightKeys counts deferred_inflight's rows; InflightOldest is the
	// age of the oldest.
	InflightKeys   int64
	InflightOldest time.Duration
}

// SetBacklog sets the backlog gauges. Every target present gets a series for
// each state and for due messages (0 when none); targets absent from b have
// none, so a target that has no message left disappears. A scrape shows one
// read of the backlog whole: Prometheus gathers collectors concurrently, and
// with a gauge per figure a scrape during SetBacklog could mix two reads
// (a target's count from one, the held keys from the next).
func (m *Metrics) SetBacklog(b Backlog) {
	if m == nil {
		return
	}
	m.backlog.set(b)
}

// IngestGated counts records stored pending behind a blocked key.
func (m *Metrics) IngestGated(n int64) {
	if m == nil || n <= 0 {
		return
	}
	m.ingestGated.Add(float64(n))
}

// IngestMisrouted counts records read from a partition other than their
// business key's.
func (m *Metrics) IngestMisrouted(n int) {
	if m == nil || n <= 0 {
		return
	}
	m.ingestMisrouted.Add(float64(n))
}

// KeyStateAnswered records an answered key-state query: how long it took
// and how many keys were blocked and free.
func (m *Metrics) KeyStateAnswered(d time.Duration, blocked, free int) {
	if m == nil {
		return
	}
	m.keyStateRequests.WithLabelValues("answered").Inc()
	m.keyStateDuration.Observe(d.Seconds())
	m.keyStateKeys.WithLabelValues("blocked").Add(float64(blocked))
	m.keyStateKeys.WithLabelValues("free").Add(float64(free))
}

// KeySetRequest counts a blocked-key set query (query "set" or "changes")
// by result: answered, reset, unsure or refused.
func (m *Metrics) KeySetRequest(query, result string) {
	if m == nil {
		return
	}
	m.keySetRequests.WithLabelValues(query, result).Inc()
}

// KeyStateUnsure counts a key-state query answered "cannot say".
func (m *Metrics) KeyStateUnsure() {
	if m == nil {
		return
	}
	m.keyStateRequests.WithLabelValues("unsure").Inc()
}

// KeyStateRefused counts a refused key-state query.
func (m *Metrics) KeyStateRefused() {
	if m == nil {
		return
	}
	m.keyStateRequests.WithLabelValues("refused").Inc()
}

// InflightReleased counts in-flight rows released by a group's commit.
func (m *Metrics) InflightReleased(n int64) {
	if m == nil || n <= 0 {
		return
	}
	m.inflightReleased.Add(float64(n))
}

// InflightError counts a failed read of a group's committed offsets.
func (m *Metrics) InflightError() {
	if m == nil {
		return
	}
	m.inflightErrors.Inc()
}

// WatchPool makes the pool metrics report pool's statistics. Until it is
// called they report nothing.
func (m *Metrics) WatchPool(pool *pgxpool.Pool) {
	if m == nil {
		return
	}
	m.pool.pool.Store(pool)
}

// poolCollector samples pgxpool.Pool.Stat at scrape time: Stat only reads
// counters the pool keeps anyway, so sampling is cheaper than tracking.
type poolCollector struct {
	pool  atomic.Pointer[pgxpool.Pool]
	conns *prometheus.Desc
	wait  *prometheus.Desc
}

func newPoolCollector() *poolCollector {
	return &poolCollector{
		conns: prometheus.NewDesc(DBPoolConnections,
			"Postgres pool connections by state: acquired (in use), idle, total (open or opening) and max (DB_MAX_CONNS).",
			[]string{"state"}, nil),
		wait: prometheus.NewDesc(DBPoolAcquireWait,
			"Total time spent waiting for a connection because the pool had none free; its rate is how starved the pool is.",
			nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.conns
	ch <- c.wait
}

// Collect implements prometheus.Collector.
func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	pool := c.pool.Load()
	if pool == nil {
		return
	}
	s := pool.Stat()
	for _, v := range []struct {
		state string
		n     int32
	}{
		{"acquired", s.AcquiredConns()}, {"idle", s.IdleConns()}, {"total", s.TotalConns()}, {"max", s.MaxConns()},
	} {
		ch <- prometheus.MustNewConstMetric(c.conns, prometheus.GaugeValue, float64(v.n), v.state)
	}
	ch <- prometheus.MustNewConstMetric(c.wait, prometheus.CounterValue, s.EmptyAcquireWaitTime().Seconds())
}

// backlogCollector exports the last backlog read (SetBacklog) at scrape
// time, all of it from one read.
type backlogCollector struct {
	mu   sync.Mutex
	last Backlog

	messages, messagesDue, oldestDue, oldestTx, heldKeys, heldParked, dlqUnsent,
	inflightKeys, inflightOldest *prometheus.Desc
}

func newBacklogCollector() *backlogCollector {
	return &backlogCollector{
		messages: prometheus.NewDesc(Messages,
			"Messages in deferred_message by target topic and state, from a periodic query (METRICS_INTERVAL).",
			[]string{"target", "state"}, nil),
		messagesDue: prometheus.NewDesc(MessagesDue,
			"Pending messages whose due time has passed, not yet published, by target topic (periodic query).",
			[]string{"target"}, nil),
		oldestDue: prometheus.NewDesc(OldestDue,
			"How long ago the earliest due key head became due; 0 when none is due (periodic query).",
			nil, nil),
		oldestTx: prometheus.NewDesc(DBOldestTransaction,
			"Age of the oldest open transaction in the database that holds a snapshot (so holds back vacuum of the queue tables); 0 if none (periodic query).",
			nil, nil),
		heldKeys: prometheus.NewDesc(HeldKeys,
			"Business keys that cannot move: backing off after consecutive retriable publish failures (periodic query). Keys held by a parked message are "+KeysHeldParked+".",
			nil, nil),
		heldParked: prometheus.NewDesc(KeysHeldParked,
			"Business keys held by a parked message whose retry policy holds its key: the rest of the key waits until an operator replays or deletes it (periodic query).",
			nil, nil),
		dlqUnsent: prometheus.NewDesc(DLQUnsent,
			"Parked messages whose dead-letter copy the broker has not acknowledged yet (periodic query).",
			nil, nil),
		inflightKeys: prometheus.NewDesc(InflightKeys,
			"Rows of deferred_inflight: keys whose last republished record their consumer group has not committed past yet, per target partition (periodic query).",
			nil, nil),
		inflightOldest: prometheus.NewDesc(InflightOldest,
			"How long ago the oldest record in deferred_inflight was published; 0 when none (periodic query). A group that stopped committing (deleted, renamed, stuck) keeps its keys blocked: see the README's runbook.",
			nil, nil),
	}
}

// set keeps a copy of b: the caller may reuse its maps.
func (c *backlogCollector) set(b Backlog) {
	b.Messages = maps.Clone(b.Messages)
	for t, byState := range b.Messages {
		b.Messages[t] = maps.Clone(byState)
	}
	b.Due = maps.Clone(b.Due)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.last = b
}

// Describe implements prometheus.Collector.
func (c *backlogCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.messages, c.messagesDue, c.oldestDue, c.oldestTx, c.heldKeys,
		c.heldParked, c.dlqUnsent, c.inflightKeys, c.inflightOldest} {
		ch <- d
	}
}

// Collect implements prometheus.Collector. The scalar gauges are exported
// from the start (at 0 until the first read), as plain gauges were.
func (c *backlogCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	b := c.last
	c.mu.Unlock()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	targets := map[string]bool{}
	for t := range b.Messages {
		targets[t] = true
	}
	for t := range b.Due {
		targets[t] = true
	}
	for t := range targets {
		for _, s := range states() {
			gauge(c.messages, float64(b.Messages[t][s]), t, s)
		}
		gauge(c.messagesDue, float64(b.Due[t]), t)
	}
	gauge(c.oldestDue, max(b.OldestDue, 0).Seconds())
	gauge(c.heldKeys, float64(b.HeldKeys))
	gauge(c.oldestTx, max(b.OldestTransaction, 0).Seconds())
	gauge(c.heldParked, float64(b.KeysHeldParked))
	gauge(c.dlqUnsent, float64(b.DLQUnsent))
	gauge(c.inflightKeys, float64(b.InflightKeys))
	gauge(c.inflightOldest, max(b.InflightOldest, 0).Seconds())
}
