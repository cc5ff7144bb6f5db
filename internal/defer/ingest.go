package deferral

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/backoff"
	"github.com/deferq/scheduler/internal/metrics"
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
	// stored and rejected count rows written since start.
	stored, rejected, duplicates atomic.Int64

	// afterStore, when set (tests), runs after a batch is committed to the
	// database and before its offsets are marked; an error ends the claim
	// there, as a crash would.
	afterStore func() error
}

// NewIngester returns an Ingester that reads with group.
func NewIngester(group sarama.ConsumerGroup, store *Store, cfg IngestConfig, logger *slog.Logger) (*Ingester, error) {
	switch {
	case cfg.Topic == "":
		return nil, errors.New("ingest: topic is empty")
	case cfg.BatchSize < 1:
		return nil, fmt.Errorf("ingest: batch size %d, need at least 1", cfg.BatchSize)
	case cfg.BatchLinger <= 0:
		return nil, fmt.Errorf("ingest: batch linger %v must be positive", cfg.BatchLinger)
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
	return nil
}

// Cleanup implements sarama.ConsumerGroupHandler.
func (in *Ingester) Cleanup(sarama.ConsumerGroupSession) error {
	in.joined.Store(false)
	return nil
}

// ConsumeClaim implements sarama.ConsumerGroupHandler: it batches the
// partition's records by count and by time and stores each batch before
// marking its offsets. When the session ends (rebalance, shutdown) it writes
// what it holds, so nothing read is left unstored, and returns.
func (in *Ingester) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
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
		sc, err := Parse(rec, in.cfg.Rules, start)
		entries[i] = Entry{Offset: m.Offset, Record: rec, Schedule: sc}
		if err != nil {
			var rej *RejectError
			if !errors.As(err, &rej) {
				rej = &RejectError{Code: "invalid_record", Detail: err.Error()}
			}
			entries[i].Reject = rej
		}
	}

	var stored, rejected int64
	for attempt := 1; ; attempt++ {
		// Each attempt runs to its end even if the session ends meanwhile: a
		// write cancelled after it reached Postgres would commit rows whose
		// offsets then go unmarked. The session is checked between attempts.
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		var err error
		stored, rejected, err = in.store.Insert(actx, topic, partition, entries)
		cancel()
		if err == nil {
			break
		}
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

	in.stored.Add(stored)
	in.rejected.Add(rejected)
	in.duplicates.Add(int64(len(msgs)) - stored)
	took := in.now().Sub(start)
	byCode := rejectedByCode(entries, rejected)
	in.cfg.Metrics.IngestBatch(int(stored-rejected), len(msgs)-int(stored), int(rejected), byCode, took)
	attrs := []any{"topic", topic, "partition", partition,
		"records", len(msgs), "stored", stored, "rejected", rejected, "duplicates", int64(len(msgs)) - stored,
		"first_offset", msgs[0].Offset, "last_offset", msgs[len(msgs)-1].Offset, "duration", took}
	if len(byCode) > 0 {
		// Codes only: the rows hold the details, and a batch of bad records
		// stays one line.
		attrs = append(attrs, "rejected_by_reason", byCode)
	}
	in.logger.Info("ingested batch", attrs...)
	return nil
}

// rejectedByCode counts by reason code the rejected entries of a batch that
// were stored, of which the database reports there were stored. Usually that
// is every rejected entry. When some were duplicates, the batch replays
// records stored before, which precede the new ones in the partition: the
// stored rejections are then the last ones, so they are counted from the end.
func rejectedByCode(entries []Entry, stored int64) map[string]int {
	if stored == 0 {
		return nil
	}
	out := map[string]int{}
	for i := len(entries) - 1; i >= 0 && stored > 0; i-- {
		if rej := entries[i].Reject; rej != nil {
			out[rej.Code]++
			stored--
		}
	}
	return out
}
