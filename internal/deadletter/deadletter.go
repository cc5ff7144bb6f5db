// Package deadletter publishes the dead-letter copies of parked messages: a
// parked message whose row names a dead-letter topic (dlq_topic, from its
// target's retry policy) gets a copy published there, once per stay in the
// parking lot. The row stays the source of truth: the copy is a
// notification for whoever watches that topic, and an operator still
// replays or deletes the row. The publisher works as an outbox with leases
// (see dlq_claim.sql and docs/design.md section 13).
package deadletter

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/backoff"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/sql/queries"
)

// A copy is published again, with the same defer.id, if its publisher dies
// between the publish and the mark: at-least-once, like dispatch. Each
// process runs one publisher (the runner starts it), which polls every
// dlqPoll and looks at once when one of its loops parked something.
const (
	dlqPoll  = time.Second
	dlqBatch = 100
	// dlqBatchBytes bounds the bytes of the copies one round holds (see
	// dlq_claim.sql): a hundred records near Kafka's 1 MB limit would
	// otherwise be a hundred megabytes. The first copy always comes.
	dlqBatchBytes = 4 << 20
	// A copy that failed is retried after a back-off of its own, doubling
	// from dlqRetryBase up to dlqRetryMax, so that a copy that cannot be
	// published (its topic does not exist) does not hold up the others. The
	// back-off is kept in the copy's lease, so no publisher retries it sooner.
	dlqRetryBase = time.Second
	dlqRetryMax  = 5 * time.Minute
	// The whole publisher backs off like this when a round fails as a whole
	// (database down, every copy refused).
	dlqBackoffMax = time.Minute
)

// Publisher publishes dead-letter copies. It is used by one goroutine.
type Publisher struct {
	pool     *pgxpool.Pool
	producer dispatch.Producer
	logger   *slog.Logger
	metrics  *metrics.Metrics
	batch    int
	// batchBytes bounds the bytes of one round's copies.
	batchBytes int
	// lease is how long a claimed copy is this publisher's
	// (deferred_message.dlq_leased_until); it must outlast the longest
	// publish, or another publisher could send the copy a second time.
	lease time.Duration
	now   func() time.Time

	// failing counts, by message id, the consecutive failed publishes of a
	// copy, which set its back-off; until is when that back-off ends. It
	// lives in memory only: another process, or this one after a restart,
	// starts the count over, which only shortens one back-off.
	failing map[int64]dlqFailure
}

type dlqFailure struct {
	attempts int
	until    time.Time
}

// NewPublisher returns a Publisher that claims copies from pool, holding each
// for lease (which must outlast the longest publish), and publishes them
// with producer.
func NewPublisher(pool *pgxpool.Pool, producer dispatch.Producer, m *metrics.Metrics, lease time.Duration, logger *slog.Logger) *Publisher {
	return &Publisher{pool: pool, producer: producer, logger: logger, metrics: m, batch: dlqBatch,
		batchBytes: dlqBatchBytes, lease: lease,
		now: time.Now, failing: map[int64]dlqFailure{}}
}

// dlqResult is what one publish round did.
type dlqResult struct {
	claimed, published, failed int
	// full says the round took all it could hold, by count or by bytes:
	// more may be waiting.
	full bool
}

// Run publishes copies until ctx is done. wake, when it receives, makes it
// look at once instead of at the next poll.
func (dl *Publisher) Run(ctx context.Context, wake <-chan struct{}) {
	failures := 0
	for ctx.Err() == nil {
		res, err := dl.publishOnce(ctx)
		wait, wakeable := dlqPoll, true
		switch {
		case err != nil || (res.claimed > 0 && res.published == 0):
			// Nothing got through: the database or the broker is away, or
			// every copy at hand is refused. Failed copies back off by
			// themselves; this keeps the publisher from hammering meanwhile.
			failures++
			if err != nil && ctx.Err() == nil {
				dl.logger.Warn("publishing dead-letter copies failed", "error", err, "consecutive", failures)
			}
			wait, wakeable = backoff.Exp(failures, dlqRetryBase, dlqBackoffMax), false
		case res.full && res.failed == 0:
			failures = 0
			continue // a full batch: more may be waiting
		default:
			failures = 0
		}
		if !wakeable {
			wake = nil
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
		case <-t.C:
		case <-wake:
		}
		t.Stop()
	}
}

// publishOnce publishes the copies of one batch of parked messages, as an
// outbox with leases: a short statement leases the batch (SKIP LOCKED:
// other processes take other rows) and commits; the copies are published
// with no transaction open, so a broker that is down holds back neither
// vacuum nor an operator's replay or DELETE of those rows; then one short
// statement marks what the broker acknowledged, and another keeps what it
// refused leased for the copy's back-off. The marks are guarded by the
// parked_at read at the claim: a row replayed meanwhile, or replayed and
// parked again, is not marked (its new stay gets a copy of its own). A copy
// whose publisher died is claimed again once its lease has passed.
func (dl *Publisher) publishOnce(ctx context.Context) (dlqResult, error) {
	var res dlqResult
	now := dl.now()
	for id, f := range dl.failing {
		if now.Sub(f.until) > 2*dlqRetryMax {
			// Not claimed since its back-off ended: published by another
			// process, replayed or deleted.
			delete(dl.failing, id)
		}
	}

	parked, err := claimDeadLetters(ctx, dl.pool, dl.batch, dl.batchBytes, dl.lease)
	if err != nil {
		return res, err
	}
	res.claimed = len(parked)
	res.full = len(parked) == dl.batch || parkedBytes(parked) >= dl.batchBytes
	if len(parked) == 0 {
		return res, nil
	}

	records := make([]*sarama.ProducerMessage, 0, len(parked))
	index := make(map[*sarama.ProducerMessage]int, len(parked))
	failed := map[int]error{}
	for i, p := range parked {
		if !protocol.ValidTopic(p.DLQTopic) {
			failed[i] = fmt.Errorf("dlq_topic %q is not a valid Kafka topic name: %w", p.DLQTopic, sarama.ErrInvalidTopic)
			continue
		}
		r := dispatch.DeadLetter(p)
		index[r] = i
		records = append(records, r)
	}
	if len(records) > 0 {
		if err := dl.producer.SendMessages(records); err != nil {
			var perrs sarama.ProducerErrors
			if errors.As(err, &perrs) {
				for _, pe := range perrs {
					failed[index[pe.Msg]] = pe.Err
				}
			} else {
				for _, r := range records {
					failed[index[r]] = err
				}
			}
		}
	}

	var sent, retry dlqRows
	var backOffs []time.Duration
	for i, p := range parked {
		err, bad := failed[i]
		if !bad {
			sent.add(p)
			delete(dl.failing, p.ID)
			continue
		}
		f := dl.failing[p.ID]
		f.attempts++
		wait := backoff.Exp(f.attempts, dlqRetryBase, dlqRetryMax)
		f.until = now.Add(wait)
		dl.failing[p.ID] = f
		retry.add(p)
		backOffs = append(backOffs, wait)
		code := dispatch.PublishErrorCode(err)
		dl.metrics.DLQPublishError(code)
		dl.logger.Warn("dead-letter copy not published; retrying later", "id", p.ID, "dlq_topic", p.DLQTopic,
			"kind", code, "attempts", f.attempts, "retry_in", wait, "error", err)
	}
	res.published, res.failed = len(sent.ids), len(retry.ids)
	dl.metrics.DLQPublished(res.published)

	// The copies are out: record it even if ctx ends now, or they would be
	// sent again once the lease passes.
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	b := &pgx.Batch{}
	var marked []int64
	if len(sent.ids) > 0 {
		queries.QueueDLQMarkPublished(b, queries.DLQMarkPublishedParams{IDs: sent.ids, ParkedAt: sent.parkedAt}, &marked)
	}
	if len(retry.ids) > 0 {
		queries.QueueDLQBackOff(b, queries.DLQBackOffParams{IDs: retry.ids, ParkedAt: retry.parkedAt, BackOffs: backOffs})
	}
	if b.Len() > 0 {
		if err := dl.pool.SendBatch(mctx, b).Close(); err != nil {
			return res, fmt.Errorf("record %d dead-letter copies published (sent again when their lease passes) and %d failed: %w",
				len(sent.ids), len(retry.ids), err)
		}
	}
	if left := len(sent.ids) - len(marked); left > 0 {
		dl.logger.Info("dead-letter copies published for rows that left the parking lot meanwhile; not marked",
			"copies", left)
	}
	if res.published > 0 {
		dl.logger.Info("dead-letter copies published", "copies", res.published, "failed", res.failed)
	}
	return res, nil
}

// dlqRows are claimed copies by id, with the parked_at their claim read,
// as parallel arrays for dlq_mark_published.sql and dlq_back_off.sql.
type dlqRows struct {
	ids      []int64
	parkedAt []time.Time
}

func (r *dlqRows) add(p dispatch.Parked) {
	// dlq_claim.sql always returns parked_at (it sets it where missing).
	var at time.Time
	if p.ParkedAt != nil {
		at = *p.ParkedAt
	}
	r.ids, r.parkedAt = append(r.ids, p.ID), append(r.parkedAt, at)
}

// parkedBytes counts the copies' bytes as dlq_claim.sql does.
func parkedBytes(parked []dispatch.Parked) int {
	n := 0
	for _, p := range parked {
		n += len(p.Key) + len(p.Value)
		for _, h := range p.Headers {
			n += len(h.Value)
		}
	}
	return n
}

// claimDeadLetters runs dlq_claim.sql: it leases up to limit copies, within
// maxBytes, for lease and returns them.
func claimDeadLetters(ctx context.Context, pool *pgxpool.Pool, limit, maxBytes int, lease time.Duration) ([]dispatch.Parked, error) {
	rows, err := queries.DLQClaim(ctx, pool, queries.DLQClaimParams{Limit: limit, Lease: lease, MaxBytes: int64(max(1, maxBytes))})
	if err != nil {
		return nil, fmt.Errorf("claim dead-letter copies: %w", err)
	}
	parked := make([]dispatch.Parked, len(rows))
	for i, r := range rows {
		parked[i] = dispatch.Parked{ID: r.ID, Seq: r.Seq, Target: r.Target, Attempt: r.Attempt,
			RedriveCount: r.RedriveCount, DLQTopic: r.DLQTopic, Reason: r.Reason, ErrorClass: r.ErrorClass,
			ErrorMessage: r.ErrorMessage, ParkedAt: r.ParkedAt, SourceTopic: r.SourceTopic,
			SourcePartition: r.SourcePartition, SourceOffset: r.SourceOffset, Key: r.Key, Value: r.Value,
			Headers: make([]keylock.Header, len(r.HeaderKeys))}
		for j := range r.HeaderKeys {
			parked[i].Headers[j] = keylock.Header{Key: r.HeaderKeys[j], Value: r.HeaderValues[j]}
		}
	}
	// Oldest first, as claimed; RETURNING does not promise an order.
	slices.SortFunc(parked, func(a, b dispatch.Parked) int { return cmp.Compare(a.ID, b.ID) })
	return parked, nil
}
