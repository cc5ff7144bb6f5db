package deferclient

import (
	"context"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/deferclient/gate"
)

// Handler handles one record. A nil error means handled: its offset may be
// committed. An error defers the record (see HandlerConfig.Classify).
type Handler func(ctx context.Context, msg *sarama.ConsumerMessage) error

// HandlerConfig configures ConsumerGroupHandler.
type HandlerConfig struct {
	// RetryTopic returns the retry topic of a main topic: where a failed
	// record of it is republished, which the same consumer group must also
	// consume through the handler. Nil means the main topic plus ".retry".
	// A record the scheduler republished keeps the target it came with.
	RetryTopic func(mainTopic string) string
	// Classify says what a handler's error means: its error class (the
	// scheduler's policies match it; "permanent" parks the record at once)
	// and a message for operators. Nil means DefaultClassify.
	Classify func(err error) (class, message string)
	// BusinessKey returns a record's business key; nil means the package's
	// BusinessKey (defer.key, else the record key).
	BusinessKey func(msg *sarama.ConsumerMessage) string
	// MaxBatch bounds the records gated with one key-state query (0: 500):
	// the handler takes what the partition has ready, up to this.
	MaxBatch int
	// NoGate hands every record to the handler without asking the
	// scheduler, as a consumer without the library would: failed records
	// are still deferred, but a later record of a deferred key is no longer
	// held back. For measuring what the gate costs, and for moving a
	// consumer group to the library one instance at a time; the order
	// guarantee does not hold with it.
	NoGate bool
}

// ConsumerGroupHandler returns a sarama.ConsumerGroupHandler that hands the
// records of every claimed partition, main and retry topics alike, to h,
// keeping the order of business keys: before a batch of records (what the
// partition has ready, up to MaxBatch) it asks the scheduler once which of
// their keys are blocked (KeyStates); a record of a blocked key is deferred
// behind the blocking message (a gated deferral: no delay of its own, not a
// failure, its attempt unchanged) instead of being handled; a record h fails
// is deferred (see HandlerConfig.Classify) and blocks its key for the rest
// of the batch. A record's offset is marked only after it was handled or
// durably deferred. When deferring fails the session ends, with the record
// unmarked, so that it is read again.
//
// A record the scheduler republished (it has defer.id) may be handled while
// its key is blocked only by messages behind it (a higher defer.seq, or one
// republished but not committed yet): the retry topic's partition keeps the
// key's order among republished messages.
//
// The Client must have a Group, the consumer group's id, and a
// SchedulerURL.
func (c *Client) ConsumerGroupHandler(h Handler, hc HandlerConfig) sarama.ConsumerGroupHandler {
	if hc.BusinessKey == nil {
		hc.BusinessKey = BusinessKey
	}
	if hc.MaxBatch <= 0 {
		hc.MaxBatch = 500
	}
	return &groupHandler{c: c, h: h, cfg: hc,
		batch: gate.BatchConfig{RetryTopic: hc.RetryTopic, Classify: hc.Classify, NoGate: hc.NoGate}}
}

type groupHandler struct {
	c     *Client
	h     Handler
	cfg   HandlerConfig
	batch gate.BatchConfig
}

// Setup implements sarama.ConsumerGroupHandler: each session is an
// assignment, for which the gate loads its group's blocked keys, waiting
// for the scheduler to store what was produced to the defer topic before
// (gate.Gate.Assigned). When the load fails the session goes on: its
// claims ask the scheduler about each batch's keys until a load succeeds.
func (g *groupHandler) Setup(sess sarama.ConsumerGroupSession) error {
	if !g.cfg.NoGate {
		_ = g.c.gate.Assigned(sess.Context()) // counted in Stats.FeedFailures
	}
	return nil
}

// Cleanup implements sarama.ConsumerGroupHandler; a claim's state lives in
// ConsumeClaim.
func (g *groupHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim implements sarama.ConsumerGroupHandler.
func (g *groupHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	ctx := sess.Context()
	// One claim is one ownership of the partition: its first question
	// waits for the whole defer topic (gate.ClaimState).
	var state gate.ClaimState
	for {
		var first *sarama.ConsumerMessage
		select {
		case <-ctx.Done():
			return nil
		case m, ok := <-claim.Messages():
			if !ok {
				return nil
			}
			first = m
		}
		batch := []*sarama.ConsumerMessage{first}
	fill:
		for len(batch) < g.cfg.MaxBatch {
			select {
			case m, ok := <-claim.Messages():
				if !ok {
					break fill
				}
				batch = append(batch, m)
			default:
				break fill
			}
		}
		recs := make([]gate.Record, len(batch))
		for i, m := range batch {
			recs[i] = record(m)
		}
		// An error leaves the failed record unmarked and ends the session:
		// the next one reads it again from the committed offset.
		if err := g.c.gate.HandleBatch(ctx, &state, recs, g.batch, &saramaBatch{g: g, sess: sess, msgs: batch}); err != nil {
			return err
		}
	}
}

// saramaBatch is one batch of a claim, as the gate drives it.
type saramaBatch struct {
	g    *groupHandler
	sess sarama.ConsumerGroupSession
	msgs []*sarama.ConsumerMessage
}

func (b *saramaBatch) BusinessKey(i int) string                { return b.g.cfg.BusinessKey(b.msgs[i]) }
func (b *saramaBatch) Handle(ctx context.Context, i int) error { return b.g.h(ctx, b.msgs[i]) }
func (b *saramaBatch) Mark(i int)                              { b.sess.MarkMessage(b.msgs[i], "") }

// Commit commits the session's marked offsets; sarama reports a failure on
// the group's Errors channel, and commits them again at the next
// auto-commit or at the session's end.
func (b *saramaBatch) Commit(context.Context) { b.sess.Commit() }

// Permanent marks err as not worth retrying: DefaultClassify gives it the
// class "permanent", which the scheduler parks at once. Permanent(nil) is
// nil.
func Permanent(err error) error {
	return gate.Permanent(err)
}

// DefaultClassify is the classifier a HandlerConfig without one uses: class
// "permanent" for errors marked with Permanent, else the Go type of the
// innermost error (what the scheduler's NON_RETRIABLE_ERRORS patterns can
// match, e.g. "*net.OpError"); the message is the error's text, cut to 1 KB.
func DefaultClassify(err error) (class, message string) {
	return gate.DefaultClassify(err)
}
