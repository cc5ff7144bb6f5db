package deferclient

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/defer/protocol"
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
	if hc.RetryTopic == nil {
		hc.RetryTopic = func(topic string) string { return topic + ".retry" }
	}
	if hc.Classify == nil {
		hc.Classify = DefaultClassify
	}
	if hc.BusinessKey == nil {
		hc.BusinessKey = BusinessKey
	}
	if hc.MaxBatch <= 0 {
		hc.MaxBatch = 500
	}
	return &groupHandler{c: c, h: h, cfg: hc}
}

type groupHandler struct {
	c   *Client
	h   Handler
	cfg HandlerConfig
}

func (g *groupHandler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (g *groupHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim implements sarama.ConsumerGroupHandler.
func (g *groupHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	ctx := sess.Context()
	// Until a question that waited for the whole defer topic was answered
	// in this claim, the deferrals of the partition's previous owner may
	// be on their way to the scheduler: each question waits for them.
	// After, only this process's own deferrals can be missing from an
	// answer, and it keeps those blocked itself until an answer covers
	// them: a question waits for nothing.
	waited := false
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
		if err := g.handle(ctx, sess, batch, &waited); err != nil {
			return err
		}
	}
}

// handle gates and handles one batch of one partition, in order.
//
// Gated deferrals are queued and produced together, in record order,
// before anything after them is marked: one round trip for all of a
// batch's blocked records, not one each. A failed record's deferral is
// produced at once, after what is queued, so produce order is record
// order. Records are marked only once everything up to them is handled or
// durably deferred.
func (g *groupHandler) handle(ctx context.Context, sess sarama.ConsumerGroupSession, batch []*sarama.ConsumerMessage, waited *bool) error {
	keys := make([]string, len(batch))
	for i, m := range batch {
		keys[i] = g.cfg.BusinessKey(m)
	}
	// An unsure answer leaves every key blocked: the records then go to the
	// scheduler, which keeps their order, rather than to the handler.
	states := map[string]KeyState{}
	if !g.cfg.NoGate {
		var err error
		states, err = g.c.keyStates(ctx, keys, !*waited)
		*waited = *waited || err == nil
	}
	var queued []outgoing
	var done []*sarama.ConsumerMessage // handled or deferred, not marked yet
	flush := func() error {
		if err := g.c.sendAll(queued); err != nil {
			return err
		}
		queued = queued[:0]
		for _, m := range done {
			sess.MarkMessage(m, "")
		}
		done = done[:0]
		return nil
	}
	republished := false
	for i, m := range batch {
		key := keys[i]
		seq, fromScheduler := schedulerSeq(m)
		republished = republished || fromScheduler
		if !g.cfg.NoGate && key != "" && blocks(states[key], fromScheduler, seq) {
			o, err := g.c.build(m, Deferral{Target: g.target(m), BusinessKey: key}, true)
			if err != nil {
				return fmt.Errorf("deferclient: defer the record of %s/%d at offset %d behind its blocked key: %w", m.Topic, m.Partition, m.Offset, err)
			}
			queued = append(queued, o)
			done = append(done, m)
			states[key] = block(states[key], seq)
			continue
		}
		err := g.h(ctx, m)
		if err == nil {
			g.c.count(func(s *Stats) { s.Handled++ })
			done = append(done, m)
			if st := states[key]; fromScheduler && st.HeadSeq != 0 && seq >= st.HeadSeq {
				// The key's first waiting message was this one: the
				// scheduler published it (and what followed it in its
				// round, which comes next in this partition) before its
				// finalize said so. What comes after it here passes;
				// main-topic records still wait until the group commits.
				states[key] = KeyState{Blocked: true, Reason: ReasonInFlight}
			}
			continue
		}
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			// The session ends; this record is read again. What came
			// before it is settled first, as far as the broker lets.
			if ferr := flush(); ferr != nil {
				return ferr
			}
			return nil
		}
		if err := flush(); err != nil {
			return fmt.Errorf("deferclient: defer the records gated before %s/%d at offset %d: %w", m.Topic, m.Partition, m.Offset, err)
		}
		class, message := g.cfg.Classify(err)
		if _, derr := g.c.deferRecord(ctx, m, Deferral{Target: g.target(m), BusinessKey: key, ErrorClass: class, ErrorMessage: message}, false); derr != nil {
			return fmt.Errorf("deferclient: defer the record of %s/%d at offset %d that failed (%v): %w", m.Topic, m.Partition, m.Offset, err, derr)
		}
		if key != "" {
			states[key] = block(states[key], seq)
		}
		done = append(done, m)
	}
	if err := flush(); err != nil {
		return fmt.Errorf("deferclient: defer the records of %s/%d gated behind their keys: %w", batch[0].Topic, batch[0].Partition, err)
	}
	if republished {
		// The scheduler releases a key once the group committed past the
		// record it republished: commit now rather than at the next
		// auto-commit.
		sess.Commit()
	}
	return nil
}

// target returns where m is republished: the target it came with, else the
// retry topic of its topic.
func (g *groupHandler) target(m *sarama.ConsumerMessage) string {
	if t := header(m, protocol.HeaderTarget); t != "" {
		return t
	}
	return g.cfg.RetryTopic(m.Topic)
}

// blocks says whether a key in state st keeps a record from the handler: a
// main-topic record waits for anything; a record the scheduler republished,
// with defer.seq seq, waits only for a message ahead of it.
func blocks(st KeyState, fromScheduler bool, seq int64) bool {
	if !st.Blocked {
		return false
	}
	if !fromScheduler || st.Reason == ReasonUnknown {
		// Unknown: the scheduler could not say, so nothing is known about
		// what waits ahead of the record either. Deferring it behind the
		// key is safe whatever the truth: it keeps its defer.seq, so the
		// scheduler puts it back in its place.
		return true
	}
	return st.HeadSeq != 0 && st.HeadSeq < seq
}

// block returns st after a record with defer.seq seq (0 for a main-topic
// record) of the key was deferred in this batch: the key is blocked from
// then on, behind the earliest waiting message.
func block(st KeyState, seq int64) KeyState {
	head := st.HeadSeq
	if seq != 0 && (head == 0 || seq < head) {
		head = seq
	}
	if !st.Blocked {
		return KeyState{Blocked: true, Reason: ReasonLocal, HeadSeq: head}
	}
	st.HeadSeq = head
	return st
}

// schedulerSeq returns m's defer.seq and true when the scheduler
// republished m.
func schedulerSeq(m *sarama.ConsumerMessage) (int64, bool) {
	if header(m, protocol.HeaderID) == "" {
		return 0, false
	}
	seq, err := strconv.ParseInt(header(m, protocol.HeaderSeq), 10, 64)
	return seq, err == nil
}

// permanentError marks an error not worth retrying.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent marks err as not worth retrying: DefaultClassify gives it the
// class "permanent", which the scheduler parks at once. Permanent(nil) is
// nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err}
}

// DefaultClassify is the classifier a HandlerConfig without one uses: class
// "permanent" for errors marked with Permanent, else the Go type of the
// innermost error (what the scheduler's NON_RETRIABLE_ERRORS patterns can
// match, e.g. "*net.OpError"); the message is the error's text, cut to 1 KB.
func DefaultClassify(err error) (class, message string) {
	var p permanentError
	if errors.As(err, &p) {
		class = "permanent"
	} else {
		inner := err
		for {
			next := errors.Unwrap(inner)
			if next == nil {
				break
			}
			inner = next
		}
		class = fmt.Sprintf("%T", inner)
	}
	message = err.Error()
	if len(message) > 1024 {
		message = strings.ToValidUTF8(message[:1024], "")
	}
	return class, message
}
