// Package ingest consumes the defer topic, scheduler.defer, and stores what
// it reads: each partition's records in batches bounded by count, bytes and
// time, judged by the protocol (internal/defer/protocol), written with the
// partition's next offset in one statement that checks the stored position
// is still where this process left it (Store). A claim starts at the
// position stored with the rows, whatever the consumer group committed, and
// tells records Kafka no longer has and partitions re-created under it
// (PartitionLog); what ingest holds in memory is bounded in bytes (Budget).
// See docs/design.md, sections 6 to 8.
package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/deferq/scheduler/internal/backoff"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/policy"
	"github.com/deferq/scheduler/internal/reason"
)

// ConsumerConfig returns consumer-group settings for ingest: start from the
// oldest record when the group has no committed offset (records produced
// before the first start are not skipped), and commit only offsets that were
// marked, which ingest does after the rows are committed. Callers add
// brokers, TLS and SASL.
//
// budget, when not nil, bounds the bytes of records the consumer queues (it
// becomes the consumer's interceptor); one fetch response is then bounded to
// a quarter of it (1 MiB to 50 MiB), since a response is held whole while
// its records are queued.
//
// A claim that stops reading its queue stops its broker connection's
// fetching too, for up to consumerMaxProcessingTime (see there): otherwise
// every claim that waits for a writer keeps a whole fetch response alive
// while the connection fetches the next.
func ConsumerConfig(base *sarama.Config, budget *Budget) *sarama.Config {
	c := base
	if budget != nil {
		c.Consumer.Interceptors = append(c.Consumer.Interceptors, budget)
		c.Consumer.Fetch.MaxBytes = int32(min(max(budget.Limit()/4, 1<<20), 50<<20))
	}
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Enable = true
	c.Consumer.Offsets.AutoCommit.Interval = time.Second
	c.Consumer.Return.Errors = true
	c.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategySticky()}
	c.ChannelBufferSize = 1024
	c.Consumer.MaxProcessingTime = consumerMaxProcessingTime
	// A fetch may wait MaxWaitTime for records before the broker answers,
	// and the connection's read times out after Net.ReadTimeout
	// (KAFKA_TIMEOUT): with a short timeout, every idle fetch would fail and
	// drop the connection, and with it, at times, the group session.
	c.Consumer.MaxWaitTime = min(c.Consumer.MaxWaitTime, c.Net.ReadTimeout/2)
	// A JoinGroup is answered only when every member has rejoined or the
	// rebalance timeout evicted those that did not (a killed replica never
	// does). A read timeout shorter than that makes every survivor give up
	// on its join and retry, and the group never settles: the chaos run
	// (cmd/chaos) stalled ingest for good this way at KAFKA_TIMEOUT=300ms and
	// 1s. The consumer's connections get a read timeout longer than the
	// rebalance; the producer keeps KAFKA_TIMEOUT, which the lease is
	// measured against.
	c.Consumer.Group.Rebalance.Timeout = 20 * time.Second
	c.Net.ReadTimeout = max(c.Net.ReadTimeout, c.Consumer.Group.Rebalance.Timeout+5*time.Second)
	return c
}

// consumerMaxProcessingTime is how long sarama lets a partition's full
// queue wait before it gives up on that partition for the fetch at hand
// (sarama's default: 100 ms). Giving up acknowledges the fetch response to
// the broker connection, which fetches the next one for the other
// partitions, while the partition still holds the rest of its part of the
// response, and with it the whole response's buffer and decoded records,
// none of them counted by the Budget yet. Ingest's claims all wait for the
// same writers, so with many partitions many gave up at once: on 64
// partitions the live heap reached 110-147 MB against a 32 MiB budget, near
// the soft memory limit, and the collector took most of the service's CPU
// (make bench, BENCH_ONLY=partitions, 300,000 records: the service's CPU in
// ingest 6-9 s against 3 on 4 partitions). A claim waits for writers far
// less than this, and waits they all share, so holding the other partitions
// back costs nothing; the live heap then stayed at 43-64 MB
// (docs/design.md section 8).
const consumerMaxProcessingTime = 5 * time.Second

// IngestConfig tunes an Ingester.
type IngestConfig struct {
	Topic string
	// Group is the consumer group ingest reads in; Setup compares its
	// committed offsets with the stored positions, to say when ingest reads
	// records again.
	Group string
	Rules protocol.Rules
	// BatchSize, BatchBytes and BatchLinger bound a batch by count, by
	// bytes and by age: a batch is written when it holds BatchSize records
	// or BatchBytes bytes (see recordBytes), or when its first record has
	// waited BatchLinger, or sooner when its partition has nothing more read
	// and no insert statement runs or waits (nothing to share one with). A
	// record larger than BatchBytes is written alone.
	BatchSize   int
	BatchBytes  int
	BatchLinger time.Duration
	// AlwaysLinger makes a batch wait for BatchLinger (or to fill) even
	// when nothing else is read or written: for a test that needs ingest
	// to hold records, as it does under load.
	AlwaysLinger bool
	// FutureLinger is how long a batch whose every record falls due at
	// least FutureLinger plus FutureMargin after it was read waits to fill
	// (0: such batches are written as any other). Storing such records
	// later costs them nothing, since they are stored well before they
	// fall due and their delays count from when they were read; written
	// together, they cost the database a fraction per record of what a
	// lone record's statement does. A record due sooner joining the batch
	// brings its write back to BatchLinger and the rules above; Flush
	// writes it at once.
	FutureLinger time.Duration
	// Writers is how many insert statements run at once over every
	// partition (0: DefaultWriters). Batches that come while all are busy
	// are written together in the next one, within BatchSize and
	// BatchBytes (see writer).
	Writers int
	// Budget bounds the bytes of records held over every partition; it
	// must be the consumer's interceptor (ConsumerConfig). Nil means none,
	// for tests that build their own consumer.
	Budget *Budget
	// Log tells where each partition's log starts and ends, its topic id and
	// the group's committed offsets.
	Log PartitionLog
	// TopicCheck is how often a session asks for the topic's id, to notice
	// the topic re-created under it (0: every 5 seconds). A consumer reads
	// on at its offsets in a re-created topic that already holds more
	// records, and says nothing.
	TopicCheck time.Duration
	// PositionCheck is how often a session reads its partitions' stored
	// positions, to notice the database gone back in time while no record
	// arrives (0: every 2 seconds). A batch notices at once by itself (its
	// insert checks the position), but a quiet partition has no batch, and
	// the records the database lost would wait for the next one.
	PositionCheck time.Duration
	// Metrics receives per-batch counts, durations and lag; nil records
	// nothing.
	Metrics *metrics.Metrics
	// Rand draws the jitter of policy delays, uniform in [0, 1); it must be
	// safe for concurrent use (partitions are ingested in parallel). Nil
	// means math/rand/v2's Float64. Tests set it to get exact delays.
	Rand func() float64
}

// Ingester consumes the defer topic and stores what it reads.
type Ingester struct {
	group  sarama.ConsumerGroup
	store  *Store
	writer *writer
	cfg    IngestConfig
	logger *slog.Logger
	now    func() time.Time

	joined atomic.Bool
	// positions holds, for the current session, where each claim stands:
	// set in Setup before any claim runs, moved by each claim after each
	// batch, read by the session's position check. posMu guards it.
	posMu     sync.Mutex
	positions map[int32]Position
	// stored, rejected and parked count rows written since start,
	// duplicates records skipped as stored before.
	stored, rejected, parked, duplicates atomic.Int64
	// storeErr holds the error of the last failed attempt to store a batch,
	// nil after one succeeds.
	storeErr atomic.Pointer[error]

	// reread is closed to end the session, so that the next one's Setup
	// looks at the partitions again: set by Setup, closed (once) when the
	// consumer reports the topic gone or an offset out of range, which is
	// what a running consumer sees of a re-created topic. rereadMu guards
	// the field; claims read the channel Setup left them in sessReread.
	rereadMu   sync.Mutex
	reread     chan struct{}
	sessReread chan struct{}

	// partitions is the defer topic's partition count, read by Setup; 0
	// when unknown. misroutedAt is when the last warning about records on
	// the wrong partition was logged (Unix nanoseconds).
	partitions  atomic.Int32
	misroutedAt atomic.Int64

	// flushReq is closed, and replaced, by Flush: claims select on the
	// channel they last loaded.
	flushReq atomic.Pointer[chan struct{}]

	// afterStore, when set (tests), runs after a batch is committed to the
	// database and before its offsets are marked; an error ends the claim
	// there, as a crash would.
	afterStore func() error
	// afterPositions, when set (tests), runs in watchPositions between
	// reading the stored positions and comparing them.
	afterPositions func()
}

// DefaultWriters is IngestConfig.Writers when unset.
const DefaultWriters = 2

// FutureMargin is how long before its due time a record is always
// stored, whatever FutureLinger says: the write, the head's notification
// and a dispatch loop's wake-up all fit well within it.
const FutureMargin = time.Second

// errReread ends a claim whose partition must be read again from its stored
// position: returning an error from ConsumeClaim ends the session, and the
// next one's Setup starts every claim from the stored positions.
var errReread = errors.New("ingest: the stored position moved; reading the partition again from it")

// NewIngester returns an Ingester that reads with group. It resolves nil
// cfg.Rules.Policies to the built-in default policy, capped at
// cfg.Rules.MaxDelay, which must then be positive.
func NewIngester(group sarama.ConsumerGroup, store *Store, cfg IngestConfig, logger *slog.Logger) (*Ingester, error) {
	switch {
	case cfg.Topic == "":
		return nil, errors.New("ingest: topic is empty")
	case cfg.BatchSize < 1:
		return nil, fmt.Errorf("ingest: batch size %d, need at least 1", cfg.BatchSize)
	case cfg.BatchBytes < 0:
		return nil, fmt.Errorf("ingest: batch bytes %d, need 0 (no bound) or more", cfg.BatchBytes)
	case cfg.BatchLinger <= 0:
		return nil, fmt.Errorf("ingest: batch linger %v must be positive", cfg.BatchLinger)
	case cfg.FutureLinger < 0:
		return nil, fmt.Errorf("ingest: future linger %v must be 0 (off) or positive", cfg.FutureLinger)
	case cfg.Log == nil:
		return nil, errors.New("ingest: no partition log to position claims with")
	}
	if cfg.Rules.Policies == nil {
		set, err := policy.Parse("", cfg.Rules.MaxDelay)
		if err != nil {
			return nil, fmt.Errorf("ingest: default retry policy with maximum delay %v: %w", cfg.Rules.MaxDelay, err)
		}
		cfg.Rules.Policies = set
	}
	if cfg.Rand == nil {
		cfg.Rand = rand.Float64
	}
	if cfg.TopicCheck <= 0 {
		cfg.TopicCheck = 5 * time.Second
	}
	if cfg.PositionCheck <= 0 {
		cfg.PositionCheck = 2 * time.Second
	}
	if cfg.Writers <= 0 {
		cfg.Writers = DefaultWriters
	}
	w := newWriter(store, cfg.Writers, cfg.BatchSize, int64(cfg.BatchBytes))
	in := &Ingester{group: group, store: store, writer: w, cfg: cfg, logger: logger, now: time.Now}
	flushReq := make(chan struct{})
	in.flushReq.Store(&flushReq)
	return in, nil
}

// Flush makes every claim write the batch it holds, lingering or not, as
// soon as it has taken what the consumer has queued for it: a key-state
// query waits for ingest to store what the defer topic holds (docs/design.md
// section 23.2), and must not wait for a FutureLinger. A claim busy writing
// when it comes does so right after. A claim with nothing held or queued
// has nothing to do: records read later linger as usual (the key-state
// query asks again while it waits). Safe from any goroutine.
func (in *Ingester) Flush() {
	next := make(chan struct{})
	close(*in.flushReq.Swap(&next))
}

// Joined reports whether ingest currently holds a consumer-group session.
func (in *Ingester) Joined() bool { return in.joined.Load() }

// Counts returns rows stored, how many of those were stored as rejected, and
// records skipped as already stored, since start.
func (in *Ingester) Counts() (stored, rejected, duplicates int64) {
	return in.stored.Load(), in.rejected.Load(), in.duplicates.Load()
}

// Parked returns how many of the rows stored since start went straight to
// the parking lot (non-retriable error class, retries exhausted).
func (in *Ingester) Parked() int64 { return in.parked.Load() }

// Run consumes until ctx is done. Errors from the group (a broker away, a
// rebalance failing) are logged and retried: ingest must come back by itself.
func (in *Ingester) Run(ctx context.Context) {
	go func() {
		for err := range in.group.Errors() {
			in.logger.Warn("ingest consumer error", "error", err)
			var ce *sarama.ConsumerError
			if errors.As(err, &ce) && ce.Topic == in.cfg.Topic &&
				(errors.Is(ce.Err, sarama.ErrUnknownTopicOrPartition) || errors.Is(ce.Err, sarama.ErrOffsetOutOfRange)) {
				// The topic was deleted, maybe to be created again: offsets
				// may be reused. Setup tells, from the high-water mark and
				// the topic id.
				in.requestReread()
			}
		}
	}()
	var failures int
	for ctx.Err() == nil {
		err := in.group.Consume(ctx, []string{in.cfg.Topic}, in)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			failures++
			in.logger.Warn("ingest session ended", "error", err, "consecutive", failures)
			backoff.Sleep(ctx, backoff.Exp(failures, 100*time.Millisecond, 5*time.Second))
			continue
		}
		failures = 0
	}
}

// requestReread ends the current session, if it has not ended yet.
func (in *Ingester) requestReread() {
	in.rereadMu.Lock()
	defer in.rereadMu.Unlock()
	if in.reread != nil {
		close(in.reread)
		in.reread = nil
	}
}

// Setup implements sarama.ConsumerGroupHandler. It starts each claimed
// partition at the position stored in Postgres with the rows, whether that
// is ahead of the group's committed offset (a crash after the rows committed
// and before the offsets did: those records may already be dispatched and
// deleted) or behind it (Postgres went back in time: a failover to a lagging
// replica, a restore; the records in between are still in Kafka). sarama's
// MarkOffset only moves an offset forward and ResetOffset only back, so both
// are called: one of them takes. The claim's consumer starts from the
// result (sarama's consumerGroupSession.consume reads it after Setup).
//
// Where the stored position is not in the partition's log, Setup says so
// and decides (see resume).
func (in *Ingester) Setup(sess sarama.ConsumerGroupSession) error {
	ctx := sess.Context()
	topic := in.cfg.Topic
	parts := sess.Claims()[topic]
	if in.cfg.Budget != nil {
		for _, p := range parts {
			in.cfg.Budget.open(topic, p)
		}
	}
	stored, err := in.store.Positions(ctx, topic, parts)
	if err != nil {
		return err
	}
	topicID, err := in.cfg.Log.TopicID(topic)
	if err != nil {
		return err
	}
	if n, err := in.cfg.Log.Partitions(topic); err == nil {
		in.partitions.Store(n)
	} else {
		in.partitions.Store(0) // the misrouting check is skipped; nothing else needs it
	}
	committed, err := in.cfg.Log.Committed(in.cfg.Group, topic)
	if err != nil {
		// Only said in logs; the stored positions decide.
		in.logger.Warn("cannot read the group's committed offsets; starting from the stored positions anyway", "error", err)
		committed = nil
	}
	// The marks every member committed with its offsets: what a process
	// that starts after the database went back knows of the ids it handed
	// out before (see internal/highwater). Every partition's, not only the
	// claimed ones': ids come from one sequence.
	for _, c := range committed {
		if id, seq, ok := parseMarks(c.Metadata); ok {
			in.store.marks.Observe(id, seq)
		}
	}
	from := make(map[int32]Position, len(parts))
	for _, p := range parts {
		logStart, hwm, err := in.cfg.Log.Bounds(topic, p)
		if err != nil {
			return err
		}
		sp, ok := stored[p]
		if !ok {
			sp = StoredPosition{Position: Position{Topic: topic, Partition: p, Next: NoPosition}}
		}
		cm, hasCommitted := committed[p]
		c := NoPosition
		if hasCommitted {
			c = cm.Offset
		}
		pos, offset, err := in.resume(ctx, sp, logStart, hwm, topicID, c)
		if err != nil {
			return err
		}
		from[p] = pos
		if !ok && !hasCommitted {
			// Nothing stored, nothing committed: sarama starts at the
			// oldest record (ConsumerConfig), and commits nothing before
			// a batch is stored.
			continue
		}
		sess.MarkOffset(topic, p, offset, in.marksMetadata())
		sess.ResetOffset(topic, p, offset, in.marksMetadata())
	}
	in.posMu.Lock()
	in.positions = from
	in.posMu.Unlock()
	in.rereadMu.Lock()
	in.reread = make(chan struct{})
	in.sessReread = in.reread
	in.rereadMu.Unlock()
	if topicID != "" {
		go in.watchTopicID(ctx, topicID)
	}
	go in.watchPositions(ctx, topic, parts)
	in.joined.Store(true)
	// Which member holds which partitions, per generation: with every
	// process's lines, a partition nobody claims (or two processes claim)
	// shows. Partition numbers and group identifiers only.
	in.logger.Info("ingest partitions claimed", "topic", topic, "generation", sess.GenerationID(),
		"member", sess.MemberID(), "partitions", parts)
	return nil
}

// watchTopicID ends the session when the topic's id is no longer id: the
// topic was deleted and created again while this session consumed it, and
// Setup must look at every partition again. Records the session read from
// the new topic meanwhile are stored under the old epoch, and read again
// under the new one: duplicates, not loss.
func (in *Ingester) watchTopicID(ctx context.Context, id string) {
	t := time.NewTicker(in.cfg.TopicCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now, err := in.cfg.Log.TopicID(in.cfg.Topic)
		if err != nil || now == id {
			// An error is the consumer's to report; a topic that is gone
			// shows as an id that changed once it is back.
			continue
		}
		if now != "" {
			in.logger.Warn("the defer topic's id changed: it was re-created; looking at its partitions again",
				"topic", in.cfg.Topic, "topic_id", id, "new_topic_id", now)
			in.requestReread()
			return
		}
	}
}

// watchPositions ends the session when a claimed partition's stored
// position is found behind where its claim stands, or gone, or under
// another epoch: the database went back in time (a failover to a replica
// that lagged, a restore) while this process ran, and the records in
// between, still in Kafka, must be read again. The next session's Setup
// starts every claim from the stored positions and counts what it reads
// again. A position ahead of the claim's is the claim's own batch being
// stored, and is left alone.
//
// The stored positions are compared with the claims' positions from before
// the query, not after it: a claim moves its position once its batch has
// committed, so the query must see at least what it had before the query
// began. A batch that commits while the query runs moves the claim's
// position past what the query saw; compared after, that read as the
// database going back in time, ended the session and logged an error
// (docs/benchmarks.md, "The key-state query and the linger").
func (in *Ingester) watchPositions(ctx context.Context, topic string, parts []int32) {
	t := time.NewTicker(in.cfg.PositionCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		in.posMu.Lock()
		before := maps.Clone(in.positions)
		in.posMu.Unlock()
		stored, err := in.store.Positions(ctx, topic, parts)
		if err != nil {
			continue // the database is away; batches retry and readiness says so
		}
		if in.afterPositions != nil {
			in.afterPositions()
		}
		var moved []any
		for _, p := range parts {
			cur, ok := before[p]
			if !ok || cur.Next == NoPosition {
				continue
			}
			sp, has := stored[p]
			if !has || sp.Epoch != cur.Epoch || sp.Next < cur.Next {
				moved = append(moved, p)
				next := NoPosition
				if has {
					next = sp.Next
				}
				in.logger.Error("ingest position rolled back: Postgres went back in time; reading the records in between again",
					"topic", topic, "partition", p, "expected_position", cur.Next, "expected_epoch", cur.Epoch,
					"stored_position", next, "stored_epoch", sp.Epoch)
			}
		}
		if len(moved) > 0 {
			in.requestReread()
			return
		}
	}
}

// marksPrefix starts the metadata ingest commits with its offsets: the
// highest message id and seq the process has seen, as "hw:<id>,<seq>".
// Kafka keeps them where a rewound database does not reach: a process
// started after the rewind reads them back in Setup.
const marksPrefix = "hw:"

// marksMetadata renders the process's marks for an offset commit.
func (in *Ingester) marksMetadata() string {
	id, seq := in.store.marks.Get()
	return fmt.Sprintf("%s%d,%d", marksPrefix, id, seq)
}

// parseMarks reads what marksMetadata wrote; ok is false for any other
// metadata (none, or another consumer's).
func parseMarks(meta string) (id, seq int64, ok bool) {
	rest, found := strings.CutPrefix(meta, marksPrefix)
	if !found {
		return 0, 0, false
	}
	a, b, found := strings.Cut(rest, ",")
	if !found {
		return 0, 0, false
	}
	id, err1 := strconv.ParseInt(a, 10, 64)
	seq, err2 := strconv.ParseInt(b, 10, 64)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return id, seq, true
}

// resume decides where a claim of sp's partition starts, given the
// partition's log start and high-water mark, the topic's id ("" if the
// broker gives none) and the group's committed offset (NoPosition if none).
// It returns the position the claim's first batch must find stored, and the
// offset to consume from.
//
//   - No stored position: the partition was never ingested, or Postgres went
//     back to before it was. Read it from its log start: the records Kafka
//     still has are all there is to recover. (A new deployment with a new
//     group starts there too: sarama's initial offset is the oldest.)
//   - The high-water mark is below the stored position, or the topic id
//     changed: the partition was re-created or truncated, and offsets are
//     reused. Start at its log start under a new epoch, so that the new
//     records are not taken for the old ones stored at the same offsets.
//   - The stored position is below the log start: retention deleted records
//     the database lost. They are gone; say exactly which, and go on from
//     the log start.
//   - Otherwise start at the stored position, and say so when that reads
//     again records the group had committed (Postgres went back).
//
// The first three cases store the new position at once, so that they are
// reported once, a crash before the first batch does not lose the epoch, and
// the topic id is kept from the first claim on.
func (in *Ingester) resume(ctx context.Context, sp StoredPosition, logStart, hwm int64, topicID string, committed int64) (Position, int64, error) {
	cur := sp.Position
	attrs := []any{"topic", cur.Topic, "partition", cur.Partition, "stored_position", cur.Next, "epoch", cur.Epoch,
		"log_start", logStart, "high_water_mark", hwm, "committed", committed}
	setTo := func(to Position) error {
		return in.store.SetPosition(ctx, cur, to, topicID)
	}
	switch {
	case cur.Next == NoPosition:
		if committed > logStart && committed <= hwm {
			in.logger.Error("no stored ingest position, but the group committed records of the partition: reading it again from its log start",
				append(attrs, "reread", committed-logStart)...)
			in.cfg.Metrics.IngestRollback(committed - logStart)
		}
		// Stored now, with the topic id, so that a re-created topic is
		// told apart even before the first batch.
		to := Position{Topic: cur.Topic, Partition: cur.Partition, Next: logStart}
		if err := setTo(to); err != nil {
			return Position{}, 0, err
		}
		return to, logStart, nil

	case cur.Next > hwm || (sp.TopicID != "" && topicID != "" && sp.TopicID != topicID):
		to := Position{Topic: cur.Topic, Partition: cur.Partition, Epoch: cur.Epoch + 1, Next: logStart}
		in.logger.Error("partition was re-created or truncated; ingesting it from its start",
			append(attrs, "stored_topic_id", sp.TopicID, "topic_id", topicID, "new_epoch", to.Epoch)...)
		in.cfg.Metrics.IngestPartitionReset()
		if err := setTo(to); err != nil {
			return Position{}, 0, err
		}
		return to, logStart, nil

	case cur.Next < logStart:
		to := cur
		to.Next = logStart
		in.logger.Error("records lost: the stored ingest position is below the partition's log start",
			append(attrs, "from", cur.Next, "to", logStart, "records", logStart-cur.Next)...)
		in.cfg.Metrics.IngestUnrecoverable(logStart - cur.Next)
		if err := setTo(to); err != nil {
			return Position{}, 0, err
		}
		return to, logStart, nil
	}
	// A committed offset above the high-water mark is from before the
	// partition was re-created, not something to read again.
	if committed > cur.Next && committed <= hwm {
		in.logger.Error("ingest resumes behind the group's committed offset: Postgres went back in time; reading the records in between again",
			append(attrs, "reread", committed-cur.Next)...)
		in.cfg.Metrics.IngestRollback(committed - cur.Next)
	}
	if sp.TopicID == "" && topicID != "" {
		// First sight of the topic's id (a row from before migration 0005,
		// or a broker upgraded): keep it, to tell a re-created topic later.
		if err := setTo(cur); err != nil {
			return Position{}, 0, err
		}
	}
	return cur, cur.Next, nil
}

// Cleanup implements sarama.ConsumerGroupHandler.
func (in *Ingester) Cleanup(sess sarama.ConsumerGroupSession) error {
	in.joined.Store(false)
	if in.cfg.Budget != nil {
		for _, p := range sess.Claims()[in.cfg.Topic] {
			in.cfg.Budget.close(in.cfg.Topic, p)
		}
		in.cfg.Metrics.SetIngestBuffered(in.cfg.Budget.Used())
	}
	in.logger.Info("ingest partitions released", "topic", in.cfg.Topic, "generation", sess.GenerationID(),
		"member", sess.MemberID(), "partitions", sess.Claims()[in.cfg.Topic])
	return nil
}

// batch is the records a claim has read and not yet stored.
type batch struct {
	msgs  []*sarama.ConsumerMessage
	bytes int64
	// entries are msgs parsed and judged as they were read, readAt when.
	entries []Entry
	readAt  []time.Time
	// due is when the batch must be written: its earliest record's read
	// time plus that record's linger (BatchLinger, or FutureLinger for a
	// record due later than that plus FutureMargin). soon says some record
	// is not such a far one.
	due  time.Time
	soon bool
	// asked says a Flush came while records were queued for the claim:
	// the batch goes once it has read them, lingering or not.
	asked bool
}

// ConsumeClaim implements sarama.ConsumerGroupHandler: it batches the
// partition's records by count, bytes and time and stores each batch before
// marking its offsets. When the session ends (rebalance, shutdown) it writes
// what it holds, so nothing read is left unstored, and returns. When the
// stored position is not where this claim left it, it returns errReread.
func (in *Ingester) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) (err error) {
	ctx := sess.Context()
	topic, partition := claim.Topic(), claim.Partition()
	in.posMu.Lock()
	pos, ok := in.positions[partition]
	in.posMu.Unlock()
	reread := in.sessReread
	if !ok {
		// Setup positions every claim; a claim it did not see (a
		// cooperative rebalance adding one) is read from its stored
		// position by the next session.
		return fmt.Errorf("ingest: claim of %s/%d not positioned by Setup", topic, partition)
	}
	b := &batch{msgs: make([]*sarama.ConsumerMessage, 0, in.cfg.BatchSize)}
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()
	if in.cfg.Budget != nil {
		// What the claim still holds when it ends goes back: the records
		// sarama queued and this claim never read are drained by sarama.
		defer func() {
			in.cfg.Budget.close(topic, partition)
			in.cfg.Metrics.SetIngestBuffered(in.cfg.Budget.Used())
		}()
	}

	// Lag is the high-water mark minus the next offset to store. The
	// consumer reads the high-water mark when the claim starts and with every
	// fetch that returns records, whose batch then updates the lag: so
	// updating at the start and after each batch keeps it current. The series
	// belongs to whoever consumes the partition: it goes when the claim ends
	// (a rebalance may give the partition to another process).
	if next := claim.InitialOffset(); next >= 0 {
		in.cfg.Metrics.SetLag(partition, claim.HighWaterMarkOffset()-next)
	}
	defer in.cfg.Metrics.DeleteLag(partition)
	in.logger.Info("ingest claim started", "topic", topic, "partition", partition,
		"generation", sess.GenerationID(), "initial_offset", claim.InitialOffset(), "high_water_mark", claim.HighWaterMarkOffset(),
		"epoch", pos.Epoch)
	defer func() {
		// Why the claim ended: the session ending (rebalance, shutdown),
		// the consumer closing the partition, or an error, which ends
		// the session for every claim.
		why := "session ended"
		switch {
		case err != nil:
			why = "error"
		case ctx.Err() == nil:
			why = "partition consumer closed"
		}
		in.logger.Info("ingest claim ended", "topic", topic, "partition", partition,
			"generation", sess.GenerationID(), "reason", why, "error", err)
	}()
	flush := func(ctx context.Context) error {
		if len(b.msgs) == 0 {
			return nil
		}
		next, err := in.flush(ctx, sess, claim, pos, b)
		in.release(topic, partition, b)
		if err == nil {
			pos.Next = next
			in.posMu.Lock()
			in.positions[partition] = pos
			in.posMu.Unlock()
			in.cfg.Metrics.SetLag(partition, claim.HighWaterMarkOffset()-next)
		}
		return err
	}
	// The claim keeps the flush channel it loaded until that one is
	// closed: loaded afresh at each turn, one closed while a batch was
	// being written would be missed, and the records read next, which may
	// be what the asker waits for, would linger.
	flushReq := *in.flushReq.Load()
	for {
		select {
		case msg, ok := <-claim.Messages():
			if !ok {
				fctx, cancel := finalContext(ctx)
				defer cancel()
				return flush(fctx)
			}
			size := recordBytes(msg)
			if pos.Next != NoPosition && msg.Offset < pos.Next {
				// Setup starts the claim at the stored position, so this only
				// happens when the consumer reset its offset by itself. Such
				// a record was stored before; say so rather than skip it
				// silently.
				in.logger.Error("skipping a record below the stored ingest position; delete its ingest_offset row to ingest the partition again from its log start",
					"topic", msg.Topic, "partition", msg.Partition, "offset", msg.Offset, "stored_up_to", pos.Next, "epoch", pos.Epoch)
				in.release(topic, partition, &batch{bytes: size})
				continue
			}
			if len(b.msgs) > 0 && in.cfg.BatchBytes > 0 && b.bytes+size > int64(in.cfg.BatchBytes) {
				// A record that would take the batch past its bytes goes in
				// the next one (alone, if it is larger than a batch).
				linger.Stop()
				if err := flush(ctx); err != nil {
					return err
				}
			}
			now := in.now()
			e := prepare(msg.Offset, record(msg), in.cfg.Rules, now, in.cfg.Rand)
			wait, far := in.linger(&e, now)
			if due := now.Add(wait); len(b.msgs) == 0 || due.Before(b.due) {
				b.due = due
				linger.Reset(wait)
			}
			b.soon = b.soon || !far
			b.msgs = append(b.msgs, msg)
			b.entries = append(b.entries, e)
			b.readAt = append(b.readAt, now)
			b.bytes += size
			full := len(b.msgs) >= in.cfg.BatchSize || (in.cfg.BatchBytes > 0 && b.bytes >= int64(in.cfg.BatchBytes))
			// A batch also goes before its linger when the partition has
			// nothing more read and no insert statement runs: the linger
			// would only delay it, as nothing else is being written to
			// share a statement with. Under load, statements run and
			// records queue while they do, so batches still fill. Not a
			// batch of far records only: waiting costs them nothing, and
			// the records read meanwhile share its statement.
			queued := len(claim.Messages())
			if full || (b.asked && queued == 0) || (!in.cfg.AlwaysLinger && b.soon && queued == 0 && in.writer.idle()) {
				linger.Stop()
				if err := flush(ctx); err != nil {
					return err
				}
			}
		case <-linger.C:
			if err := flush(ctx); err != nil {
				return err
			}
		case <-flushReq:
			flushReq = *in.flushReq.Load()
			if len(claim.Messages()) > 0 {
				// What the consumer has already queued goes in this write
				// too: it may be what the asker is waiting for.
				b.asked = true
				continue
			}
			linger.Stop()
			if err := flush(ctx); err != nil {
				return err
			}
		case <-reread:
			// What was read before is stored as read; then the session ends.
			fctx, cancel := finalContext(ctx)
			defer cancel()
			if err := flush(fctx); err != nil {
				return err
			}
			in.logger.Warn("the defer topic is gone or an offset out of range; looking at the partition again",
				"topic", topic, "partition", partition)
			return errReread
		case <-ctx.Done():
			fctx, cancel := finalContext(ctx)
			defer cancel()
			return flush(fctx)
		}
	}
}

// release empties b and gives its bytes back to the budget.
func (in *Ingester) release(topic string, partition int32, b *batch) {
	if in.cfg.Budget != nil && b.bytes > 0 {
		in.cfg.Budget.release(topic, partition, b.bytes)
		in.cfg.Metrics.SetIngestBuffered(in.cfg.Budget.Used())
	}
	clear(b.msgs) // no record kept alive by the slice's backing array
	b.msgs = b.msgs[:0]
	clear(b.entries)
	b.entries = b.entries[:0]
	b.readAt = b.readAt[:0]
	b.bytes = 0
	b.soon = false
	b.asked = false
}

// linger returns how long a record read at now may wait for its batch to
// fill, and whether it is a far record: one that falls due at least
// FutureLinger plus FutureMargin after now, which may wait FutureLinger.
// A record rejected or parked at ingest is never far: nothing about it
// waits for a due time.
func (in *Ingester) linger(e *Entry, now time.Time) (time.Duration, bool) {
	if in.cfg.FutureLinger <= 0 || e.Reject != nil || e.Decision.Park != nil {
		return in.cfg.BatchLinger, false
	}
	dueIn := e.Schedule.At.Sub(now)
	if d := e.delay(); d != nil {
		dueIn = *d
	}
	if dueIn < in.cfg.FutureLinger+FutureMargin {
		return in.cfg.BatchLinger, false
	}
	return max(in.cfg.FutureLinger, in.cfg.BatchLinger), true
}

// record is msg as the protocol reads it.
func record(msg *sarama.ConsumerMessage) protocol.Record {
	rec := protocol.Record{Key: msg.Key, Value: msg.Value, Headers: make([]protocol.Header, len(msg.Headers))}
	for j, h := range msg.Headers {
		rec.Headers[j] = protocol.Header{Key: h.Key, Value: h.Value}
	}
	return rec
}

// finalContext is for the last write of a session that is ending: the session
// context is already cancelled, but the records it read should still be stored
// if the database answers soon.
func finalContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
}

// flush parses and stores one batch read after pos, retrying the database
// until it succeeds or ctx ends, then marks the batch's offsets, and returns
// the partition's next offset. Offsets of a batch that was not stored are
// never marked, so its records are read again by whoever owns the partition
// next. When the stored position is not pos, flush stores nothing, says what
// happened and returns errReread.
func (in *Ingester) flush(ctx context.Context, sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim, pos Position, b *batch) (int64, error) {
	topic, partition := claim.Topic(), claim.Partition()
	start := in.now()
	msgs, entries := b.msgs, b.entries
	// A delay counts from when ingest read the record (docs/design.md
	// section 2.1): the time it waited here for its batch comes off it.
	for i := range entries {
		entries[i].waited(start.Sub(b.readAt[i]))
	}
	next := msgs[len(msgs)-1].Offset + 1
	in.checkRouting(topic, partition, entries)

	// done counts the entries stored; the rest are retried after pos, which
	// moves with them (storeEach stores some and may then fail).
	var n Inserted
	for attempt, done := 1, 0; done < len(entries); attempt++ {
		rest := entries[done:]
		got, err := in.insert(ctx, pos, rest)
		if err == nil {
			n = n.add(got)
			break
		}
		if errors.Is(err, ErrPositionMoved) {
			if ours, rerr := in.storedByUs(ctx, pos, rest); rerr == nil && ours {
				// A write that committed although its answer was lost
				// (the connection dropped after the commit). Its counts
				// are gone with the answer: count every record as new.
				in.logger.Warn("a batch was stored although the database's answer was lost; going on after it",
					"topic", topic, "partition", partition, "first_offset", rest[0].Offset, "last_offset", rest[len(rest)-1].Offset)
				n = n.add(Inserted{Stored: int64(len(rest))})
				break
			}
			return 0, in.positionMoved(ctx, pos, msgs)
		}
		if poison(err) {
			// The database refused something in this batch, and would refuse
			// it again: find the record(s) by storing one at a time, so that
			// one bad record neither stops the partition nor goes missing.
			in.logger.Warn("store batch refused; storing its records one by one", "error", err,
				"topic", topic, "partition", partition, "first_offset", rest[0].Offset, "last_offset", rest[len(rest)-1].Offset)
			var k int
			var got Inserted
			k, got, pos, err = in.storeEach(ctx, pos, rest)
			n = n.add(got)
			done += k
			if err == nil {
				break
			}
			if errors.Is(err, ErrPositionMoved) {
				return 0, in.positionMoved(ctx, pos, msgs)
			}
		}
		in.storeErr.Store(&err)
		if ctx.Err() != nil {
			return 0, fmt.Errorf("ingest stopped before storing: %w", err)
		}
		in.logger.Warn("store batch failed; retrying, offsets not committed", "error", err,
			"topic", topic, "partition", partition, "attempt", attempt)
		// The lag must keep growing while ingest is stuck: that is what the
		// lag alert is for.
		in.cfg.Metrics.SetLag(partition, claim.HighWaterMarkOffset()-entries[done].Offset)
		backoff.Sleep(ctx, backoff.Exp(attempt, 100*time.Millisecond, 5*time.Second))
	}
	in.storeErr.Store(nil)
	if in.afterStore != nil {
		if err := in.afterStore(); err != nil {
			return 0, err
		}
	}
	sess.MarkMessage(msgs[len(msgs)-1], in.marksMetadata())

	in.stored.Add(n.Stored)
	in.rejected.Add(n.Rejected)
	in.parked.Add(n.Parked)
	in.duplicates.Add(int64(len(msgs)) - n.Stored)
	took := in.now().Sub(start)
	byCode := rejectedByCode(entries, n.Rejected)
	parkedBy := parkedByCode(entries, n.Parked)
	// Parked rows count as stored: they are valid and kept, and
	// scheduler_ingest_parked_total says how many of them went to the
	// parking lot.
	in.cfg.Metrics.IngestBatch(int(n.Stored-n.Rejected), len(msgs)-int(n.Stored), int(n.Rejected), byCode, took)
	in.cfg.Metrics.IngestParked(parkedBy)
	in.cfg.Metrics.IngestGated(n.Gated)
	// The counts are the metrics': stored are the valid rows (pending or
	// parked; parked and gated say how many of them), rejected the rows
	// stored as rejected, duplicates the records stored before.
	attrs := []any{"topic", topic, "partition", partition,
		"records", len(msgs), "stored", n.Stored - n.Rejected, "rejected", n.Rejected, "parked", n.Parked, "gated", n.Gated,
		"duplicates", int64(len(msgs)) - n.Stored,
		"first_offset", msgs[0].Offset, "last_offset", msgs[len(msgs)-1].Offset, "duration", took}
	// Codes only: the rows hold the details, and a batch of bad records
	// stays one line.
	if len(byCode) > 0 {
		attrs = append(attrs, "rejected_by_reason", byCode)
	}
	if len(parkedBy) > 0 {
		attrs = append(attrs, "parked_by_reason", parkedBy)
	}
	in.logger.Info("ingested batch", attrs...)
	return next, nil
}

// checkRouting counts, and at most every ten seconds logs, the records of
// a batch read from a partition other than the one their business key
// hashes to (Java-compatible murmur2, as the client library and a producer
// keying records by their business key choose). Records of one business
// key on several partitions are read in no particular order among
// themselves, so their key's order is lost before ingest: nothing else
// would say so (docs/design.md section 23.4). They are stored as usual.
// Keys are never logged: the offset of the first such record finds it.
func (in *Ingester) checkRouting(topic string, partition int32, entries []Entry) {
	n := in.partitions.Load()
	if n <= 0 {
		return
	}
	var count int
	var first int64
	var want int32
	for i := range entries {
		sc := &entries[i].Schedule
		p := int32(-1)
		if sc.Ordered {
			p = protocol.Partition([]byte(sc.BusinessKey), n)
		}
		if p < 0 || p == partition {
			continue
		}
		if count == 0 {
			first, want = entries[i].Offset, p
		}
		count++
	}
	if count == 0 {
		return
	}
	in.cfg.Metrics.IngestMisrouted(count)
	now := in.now().UnixNano()
	if last := in.misroutedAt.Load(); now-last >= int64(10*time.Second) && in.misroutedAt.CompareAndSwap(last, now) {
		in.logger.Warn("records read from a partition other than their business key's: the order of their keys is not kept across partitions; produce each to the partition of its business key (deferclient does, as does keying the record by its business key)",
			"topic", topic, "partition", partition, "records", count,
			"first_offset", first, "its_key_partition", want)
	}
}

// add returns the sum of two counts.
func (n Inserted) add(o Inserted) Inserted {
	return Inserted{Stored: n.Stored + o.Stored, Rejected: n.Rejected + o.Rejected, Parked: n.Parked + o.Parked,
		Gated: n.Gated + o.Gated}
}

// storedByUs reports whether the stored position is the one storing entries
// after pos would have left: the write went through.
func (in *Ingester) storedByUs(ctx context.Context, pos Position, entries []Entry) (bool, error) {
	got, err := in.store.Positions(ctx, pos.Topic, []int32{pos.Partition})
	if err != nil {
		return false, err
	}
	sp, ok := got[pos.Partition]
	return ok && sp.Epoch == pos.Epoch && sp.Next == entries[len(entries)-1].Offset+1, nil
}

// positionMoved says what happened to a partition whose stored position is
// no longer pos, the position this process left it at, and returns
// errReread: the claim ends and the next session reads the partition from
// the stored position.
func (in *Ingester) positionMoved(ctx context.Context, pos Position, msgs []*sarama.ConsumerMessage) error {
	attrs := []any{"topic", pos.Topic, "partition", pos.Partition, "expected_position", pos.Next, "expected_epoch", pos.Epoch,
		"batch_first_offset", msgs[0].Offset, "batch_last_offset", msgs[len(msgs)-1].Offset}
	got, err := in.store.Positions(ctx, pos.Topic, []int32{pos.Partition})
	if err != nil {
		in.logger.Error("the stored ingest position moved under this process; reading the partition again from it",
			append(attrs, "error", err)...)
		return errReread
	}
	sp, ok := got[pos.Partition]
	switch {
	case !ok:
		// Postgres went back to before the partition was ever ingested.
		in.logger.Error("ingest position rolled back: the database no longer has a position for the partition; reading it again from its log start",
			attrs...)
		// How many records is for Setup to say, which knows the log start.
	case sp.Epoch == pos.Epoch && sp.Next < pos.Next:
		reread := pos.Next - sp.Next
		if pos.Next == NoPosition {
			reread = 0
		}
		// The next session's Setup counts the rollback, from the offset
		// the group committed: counted here too, it would count twice.
		in.logger.Error("ingest position rolled back: Postgres went back in time; reading the records in between again",
			append(attrs, "stored_position", sp.Next, "reread", reread)...)
	default:
		in.logger.Warn("ingest position moved by another writer; reading the partition again from the stored position",
			append(attrs, "stored_position", sp.Next, "stored_epoch", sp.Epoch)...)
	}
	return errReread
}

// insert stores entries in one statement, alone or with other partitions'
// batches (see writer). The statement runs to its end even if the session
// ends meanwhile: a write cancelled after it reached Postgres would commit
// rows whose offsets then go unmarked. The session is checked between
// attempts.
func (in *Ingester) insert(ctx context.Context, pos Position, entries []Entry) (Inserted, error) {
	return in.writer.insert(ctx, pos, entries)
}

// storeEach stores entries one statement per entry, in order, after pos. An
// entry the database refuses (see poison) is stored instead as rejected with
// reason code store_failed and the database's error, without its schedule
// (the cause may be in it: a business key too long to index, say); the
// record's key, value and headers are kept, so an operator can fix and
// replay it; entries[i] is then replaced, for the batch's counts by reason
// code.
// It returns how many entries it stored, their counts and the position
// after them, and the first error that storing as rejected does not get
// past; the entries stored until then stay stored.
func (in *Ingester) storeEach(ctx context.Context, pos Position, entries []Entry) (int, Inserted, Position, error) {
	var total Inserted
	for i := range entries {
		one := entries[i : i+1]
		n, err := in.insert(ctx, pos, one)
		if err != nil && poison(err) {
			in.logger.Error("record refused by the database; storing it as rejected (store_failed)", "error", err,
				"topic", pos.Topic, "partition", pos.Partition, "offset", entries[i].Offset)
			failed := []Entry{storeFailed(entries[i], err)}
			if n, err = in.insert(ctx, pos, failed); err == nil {
				// Only once stored: a retry of a record refused even as
				// rejected starts again from what the record says (the
				// cause may be fixed meanwhile: a trigger dropped, say).
				entries[i] = failed[0]
			}
		}
		if err != nil {
			return i, total, pos, err
		}
		total = total.add(n)
		pos.Next = entries[i].Offset + 1
	}
	return len(entries), total, pos, nil
}

// maxStoreFailedDetail bounds the database error kept in a store_failed
// reason: messages quote values, which may be long.
const maxStoreFailedDetail = 1000

// storeFailed returns e as a rejected entry with reason code store_failed.
func storeFailed(e Entry, err error) Entry {
	detail := err.Error()
	if len(detail) > maxStoreFailedDetail {
		detail = strings.ToValidUTF8(detail[:maxStoreFailedDetail], "") + "..."
	}
	return Entry{
		Offset: e.Offset,
		Record: e.Record,
		Reject: &protocol.RejectError{Code: reason.StoreFailed, Detail: detail},
	}
}

// poison reports whether err is the database refusing the data of a
// statement, which retrying the same statement cannot fix: a data exception
// (SQLSTATE class 22), an integrity constraint (class 23) other than a
// unique violation (which the ingest statement handles, and which otherwise
// means a race worth retrying), a raise from a trigger or function (P0) or a
// program limit (54, an index row too large). Anything else (connection
// lost, timeouts, serialization failures, a read-only server) may pass on
// retry, and the batch is retried whole.
func poison(err error) bool {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) {
		return false
	}
	switch c := pg.Code; {
	case pgerrcode.IsDataException(c), pgerrcode.IsPLpgSQLError(c), pgerrcode.IsProgramLimitExceeded(c):
		return true
	case pgerrcode.IsIntegrityConstraintViolation(c):
		return c != pgerrcode.UniqueViolation
	}
	return false
}

// StoreError returns the error of the last attempt to store a batch if it
// failed, nil once a batch is stored again: ingest is stuck meanwhile, and
// readiness says so.
func (in *Ingester) StoreError() error {
	if p := in.storeErr.Load(); p != nil {
		return *p
	}
	return nil
}

// prepare judges one record read at offset (see protocol.Judge).
func prepare(offset int64, rec protocol.Record, rules protocol.Rules, now time.Time, rnd func() float64) Entry {
	sc, d, rej := protocol.Judge(rec, rules, now, rnd)
	return Entry{Offset: offset, Record: rec, Schedule: sc, Decision: d, Reject: rej}
}

// waited takes d, the time the record waited in ingest since it was read,
// off the delay its due time is counted with (never below 0). A due time
// given as a time (defer.at), and rows rejected or parked at ingest, keep
// theirs.
func (e *Entry) waited(d time.Duration) {
	if p := e.delay(); p != nil && d > 0 {
		*p = max(*p-d, 0)
	}
}

// delay returns the delay the entry falls due after, counted from when it
// is stored: its defer.delay, or its retry policy's when it names no time.
// It is nil for a due time given as a time (defer.at) and for a row
// rejected or parked at ingest, which is stored due at once.
func (e *Entry) delay() *time.Duration {
	switch sc := &e.Schedule; {
	case e.Reject != nil, e.Decision.Park != nil, sc.HasAt:
		return nil
	case sc.FromPolicy:
		return &e.Decision.Delay
	default:
		return &sc.Delay
	}
}

// rejectedByCode counts by reason code the rejected entries of a batch that
// were stored, of which the database reports there were stored. Usually that
// is every rejected entry. When some were duplicates, the batch replays
// records stored before, which precede the new ones in the partition: the
// stored rejections are then the last ones, so they are counted from the end.
func rejectedByCode(entries []Entry, stored int64) map[string]int {
	return countCodes(entries, stored, func(e *Entry) string {
		if e.Reject != nil {
			return e.Reject.Code
		}
		return ""
	})
}

// parkedByCode counts by reason code the entries of a batch parked at
// ingest, of which stored were stored; see rejectedByCode.
func parkedByCode(entries []Entry, stored int64) map[string]int {
	return countCodes(entries, stored, func(e *Entry) string {
		if e.Reject == nil && e.Decision.Park != nil {
			return e.Decision.Park.Code
		}
		return ""
	})
}

// countCodes counts, from the end of entries, the last stored entries that
// code gives a code for ("" for none), by code.
func countCodes(entries []Entry, stored int64, code func(*Entry) string) map[string]int {
	if stored == 0 {
		return nil
	}
	out := map[string]int{}
	for i := len(entries) - 1; i >= 0 && stored > 0; i-- {
		if c := code(&entries[i]); c != "" {
			out[c]++
			stored--
		}
	}
	return out
}
