package deferral

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/deferq/scheduler/internal/backoff"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/policy"
)

// ConsumerConfig returns consumer-group settings for ingest: start from the
// oldest record when the group has no committed offset (records produced
// before the first start are not skipped), and commit only offsets that were
// marked, which ingest does after the rows are committed. Callers add
// brokers, TLS and SASL.
func ConsumerConfig(base *sarama.Config) *sarama.Config {
	c := base
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Enable = true
	c.Consumer.Offsets.AutoCommit.Interval = time.Second
	c.Consumer.Return.Errors = true
	c.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategySticky()}
	c.ChannelBufferSize = 1024
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

// IngestConfig tunes an Ingester.
type IngestConfig struct {
	Topic string
	Rules Rules
	// BatchSize and BatchLinger bound a batch by count and by age: a batch is
	// written when it is full or when its first record has waited BatchLinger.
	BatchSize   int
	BatchLinger time.Duration
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
	cfg    IngestConfig
	logger *slog.Logger
	now    func() time.Time

	joined atomic.Bool
	// from holds, for the current session, the next offset already stored
	// per partition; set in Setup before any claim runs, read-only after.
	from map[int32]int64
	// stored, rejected and parked count rows written since start,
	// duplicates records skipped as stored before.
	stored, rejected, parked, duplicates atomic.Int64
	// storeErr holds the error of the last failed attempt to store a batch,
	// nil after one succeeds.
	storeErr atomic.Pointer[error]

	// afterStore, when set (tests), runs after a batch is committed to the
	// database and before its offsets are marked; an error ends the claim
	// there, as a crash would.
	afterStore func() error
}

// NewIngester returns an Ingester that reads with group. It resolves nil
// cfg.Rules.Policies to the built-in default policy, capped at
// cfg.Rules.MaxDelay, which must then be positive.
func NewIngester(group sarama.ConsumerGroup, store *Store, cfg IngestConfig, logger *slog.Logger) (*Ingester, error) {
	switch {
	case cfg.Topic == "":
		return nil, errors.New("ingest: topic is empty")
	case cfg.BatchSize < 1:
		return nil, fmt.Errorf("ingest: batch size %d, need at least 1", cfg.BatchSize)
	case cfg.BatchLinger <= 0:
		return nil, fmt.Errorf("ingest: batch linger %v must be positive", cfg.BatchLinger)
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
	return &Ingester{group: group, store: store, cfg: cfg, logger: logger, now: time.Now}, nil
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

// Setup implements sarama.ConsumerGroupHandler. It starts each claimed
// partition after the last record stored in Postgres, which may be ahead of
// the group's committed offset (a crash after the rows committed and before
// the offsets did): those records may already be dispatched and deleted, so
// the unique source coordinates alone would not keep them from being stored
// again.
func (in *Ingester) Setup(sess sarama.ConsumerGroupSession) error {
	parts := sess.Claims()[in.cfg.Topic]
	from, err := in.store.Offsets(sess.Context(), in.cfg.Topic, parts)
	if err != nil {
		return err
	}
	for p, next := range from {
		sess.MarkOffset(in.cfg.Topic, p, next, "")
	}
	in.from = from
	in.joined.Store(true)
	// Which member holds which partitions, per generation: with every
	// process's lines, a partition nobody claims (or two processes claim)
	// shows. Partition numbers and group identifiers only.
	in.logger.Info("ingest partitions claimed", "topic", in.cfg.Topic, "generation", sess.GenerationID(),
		"member", sess.MemberID(), "partitions", parts)
	return nil
}

// Cleanup implements sarama.ConsumerGroupHandler.
func (in *Ingester) Cleanup(sess sarama.ConsumerGroupSession) error {
	in.joined.Store(false)
	in.logger.Info("ingest partitions released", "topic", in.cfg.Topic, "generation", sess.GenerationID(),
		"member", sess.MemberID(), "partitions", sess.Claims()[in.cfg.Topic])
	return nil
}

// ConsumeClaim implements sarama.ConsumerGroupHandler: it batches the
// partition's records by count and by time and stores each batch before
// marking its offsets. When the session ends (rebalance, shutdown) it writes
// what it holds, so nothing read is left unstored, and returns.
func (in *Ingester) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) (err error) {
	ctx := sess.Context()
	batch := make([]*sarama.ConsumerMessage, 0, in.cfg.BatchSize)
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()

	// Lag is the high-water mark minus the next offset to store. The
	// consumer reads the high-water mark when the claim starts and with every
	// fetch that returns records, whose batch then updates the lag: so
	// updating at the start and after each batch keeps it current. The series
	// belongs to whoever consumes the partition: it goes when the claim ends
	// (a rebalance may give the partition to another process).
	if next := claim.InitialOffset(); next >= 0 {
		in.cfg.Metrics.SetLag(claim.Partition(), claim.HighWaterMarkOffset()-next)
	}
	defer in.cfg.Metrics.DeleteLag(claim.Partition())
	in.logger.Info("ingest claim started", "topic", claim.Topic(), "partition", claim.Partition(),
		"generation", sess.GenerationID(), "initial_offset", claim.InitialOffset(), "high_water_mark", claim.HighWaterMarkOffset())
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
		in.logger.Info("ingest claim ended", "topic", claim.Topic(), "partition", claim.Partition(),
			"generation", sess.GenerationID(), "reason", why, "error", err)
	}()
	flush := func(ctx context.Context) error {
		if len(batch) == 0 {
			return nil
		}
		next := batch[len(batch)-1].Offset + 1
		err := in.flush(ctx, sess, claim, batch)
		batch = batch[:0]
		if err == nil {
			in.cfg.Metrics.SetLag(claim.Partition(), claim.HighWaterMarkOffset()-next)
		}
		return err
	}
	for {
		select {
		case msg, ok := <-claim.Messages():
			if !ok {
				fctx, cancel := finalContext(ctx)
				defer cancel()
				return flush(fctx)
			}
			if next, ok := in.from[msg.Partition]; ok && msg.Offset < next {
				// Setup starts the claim at next, so this only happens when the
				// consumer reset its offset (the topic was re-created, say).
				// Such a record was stored before; say so rather than skip it
				// silently.
				in.logger.Error("skipping a record below the stored ingest position; delete its ingest_offset row to ingest it again",
					"topic", msg.Topic, "partition", msg.Partition, "offset", msg.Offset, "stored_up_to", next)
				continue
			}
			if len(batch) == 0 {
				linger.Reset(in.cfg.BatchLinger)
			}
			batch = append(batch, msg)
			if len(batch) >= in.cfg.BatchSize {
				linger.Stop()
				if err := flush(ctx); err != nil {
					return err
				}
			}
		case <-linger.C:
			if err := flush(ctx); err != nil {
				return err
			}
		case <-ctx.Done():
			fctx, cancel := finalContext(ctx)
			defer cancel()
			return flush(fctx)
		}
	}
}

// finalContext is for the last write of a session that is ending: the session
// context is already cancelled, but the records it read should still be stored
// if the database answers soon.
func finalContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
}

// flush parses and stores one batch, retrying the database until it succeeds
// or ctx ends, then marks the batch's offsets. Offsets of a batch that was not
// stored are never marked, so its records are read again by whoever owns the
// partition next.
func (in *Ingester) flush(ctx context.Context, sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim, msgs []*sarama.ConsumerMessage) error {
	topic, partition := claim.Topic(), claim.Partition()
	start := in.now()
	entries := make([]Entry, len(msgs))
	for i, m := range msgs {
		rec := Record{Key: m.Key, Value: m.Value, Headers: make([]Header, len(m.Headers))}
		for j, h := range m.Headers {
			rec.Headers[j] = Header{Key: h.Key, Value: h.Value}
		}
		entries[i] = prepare(m.Offset, rec, in.cfg.Rules, start, in.cfg.Rand)
	}

	var n Inserted
	for attempt := 1; ; attempt++ {
		var err error
		n, err = in.insert(ctx, topic, partition, entries)
		if err != nil && poison(err) {
			// The database refused something in this batch, and would refuse
			// it again: find the record(s) by storing one at a time, so that
			// one bad record neither stops the partition nor goes missing.
			in.logger.Warn("store batch refused; storing its records one by one", "error", err,
				"topic", topic, "partition", partition, "first_offset", msgs[0].Offset, "last_offset", msgs[len(msgs)-1].Offset)
			var stored []Entry
			stored, n, err = in.storeEach(ctx, topic, partition, entries)
			if err == nil {
				entries = stored
			}
		}
		if err == nil {
			in.storeErr.Store(nil)
			break
		}
		in.storeErr.Store(&err)
		if ctx.Err() != nil {
			return fmt.Errorf("ingest stopped before storing: %w", err)
		}
		in.logger.Warn("store batch failed; retrying, offsets not committed", "error", err,
			"topic", topic, "partition", partition, "attempt", attempt)
		// The lag must keep growing while ingest is stuck: that is what the
		// lag alert is for.
		in.cfg.Metrics.SetLag(partition, claim.HighWaterMarkOffset()-msgs[0].Offset)
		backoff.Sleep(ctx, backoff.Exp(attempt, 100*time.Millisecond, 5*time.Second))
	}
	if in.afterStore != nil {
		if err := in.afterStore(); err != nil {
			return err
		}
	}
	sess.MarkMessage(msgs[len(msgs)-1], "")

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
	attrs := []any{"topic", topic, "partition", partition,
		"records", len(msgs), "stored", n.Stored, "rejected", n.Rejected, "parked", n.Parked,
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
	return nil
}

// insert stores entries in one statement. The statement runs to its end even
// if the session ends meanwhile: a write cancelled after it reached Postgres
// would commit rows whose offsets then go unmarked. The session is checked
// between attempts.
func (in *Ingester) insert(ctx context.Context, topic string, partition int32, entries []Entry) (Inserted, error) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	return in.store.Insert(actx, topic, partition, entries)
}

// storeEach stores entries one statement per entry, in order. An entry the
// database refuses (see poison) is stored instead as rejected with reason
// code store_failed and the database's error, without its schedule (the
// cause may be in it: a business key too long to index, say); the record's
// key, value and headers are kept, so an operator can fix and replay it.
// It returns the entries as stored, for the batch's counts by reason code,
// or the first error that storing as rejected does not get past; the rows
// stored until then stay stored, and a retry of the batch skips them as
// duplicates.
func (in *Ingester) storeEach(ctx context.Context, topic string, partition int32, entries []Entry) ([]Entry, Inserted, error) {
	var total Inserted
	// A copy: entries stays what the records say, for a retry of the whole
	// batch once the database takes them (a trigger fixed, say).
	stored := append([]Entry(nil), entries...)
	for i := range stored {
		one := stored[i : i+1]
		n, err := in.insert(ctx, topic, partition, one)
		if err != nil && poison(err) {
			in.logger.Error("record refused by the database; storing it as rejected (store_failed)", "error", err,
				"topic", topic, "partition", partition, "offset", stored[i].Offset)
			stored[i] = storeFailed(stored[i], err)
			n, err = in.insert(ctx, topic, partition, one)
		}
		if err != nil {
			return nil, total, err
		}
		total.Stored += n.Stored
		total.Rejected += n.Rejected
		total.Parked += n.Parked
	}
	return stored, total, nil
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
		Reject: &RejectError{Code: "store_failed", Detail: detail},
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
	if !errors.As(err, &pg) || len(pg.Code) != 5 {
		return false
	}
	switch pg.Code[:2] {
	case "22", "P0", "54":
		return true
	case "23":
		return pg.Code != uniqueViolation
	}
	return false
}

// uniqueViolation is SQLSTATE unique_violation.
const uniqueViolation = "23505"

// StoreError returns the error of the last attempt to store a batch if it
// failed, nil once a batch is stored again: ingest is stuck meanwhile, and
// readiness says so.
func (in *Ingester) StoreError() error {
	if p := in.storeErr.Load(); p != nil {
		return *p
	}
	return nil
}

// prepare parses one record read at offset, checks its signature (after
// Parse, so a record with several problems is rejected for the first in
// Parse's order) and, unless it is rejected, applies the retry rules to it.
// rules.Policies must be set (NewIngester resolves nil to the default).
func prepare(offset int64, rec Record, rules Rules, now time.Time, rnd func() float64) Entry {
	sc, err := Parse(rec, rules, now)
	e := Entry{Offset: offset, Record: rec, Schedule: sc}
	if err != nil {
		var rej *RejectError
		if !errors.As(err, &rej) {
			rej = &RejectError{Code: "invalid_record", Detail: err.Error()}
		}
		e.Reject = rej
		return e
	}
	if rej := rules.Signing.check(rec, &e.Schedule); rej != nil {
		e.Reject = rej
		return e
	}
	e.Decision = decide(&e.Schedule, rules.Policies, rules.Classifier, rnd)
	return e
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
