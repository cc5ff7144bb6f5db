package gate

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/deferq/scheduler/internal/defer/protocol"
)

// ClaimState is what the gate keeps about one ownership of one partition
// (a claim): an adapter keeps one per partition it was assigned, makes a
// fresh one at every assignment, and passes it to each HandleBatch of the
// partition's records. The zero value is a fresh claim. It is used by one
// goroutine at a time.
type ClaimState struct {
	// waited: a question that waited for the whole defer topic was
	// answered in this claim. Until then, the deferrals of the
	// partition's previous owner may be on their way to the scheduler, so
	// each question waits for them. After, only this process's own
	// deferrals can be missing from an answer, and the gate keeps those
	// blocked itself until an answer covers them: a question waits for
	// nothing.
	waited bool
	// gen is the assignment (Gate.Assigned) the claim came with, taken at
	// its first batch: the blocked-key set serves it once loaded for that
	// assignment or a later one.
	gen uint64
}

// Consumer is what HandleBatch needs of an adapter, over its Kafka
// client's records of one batch: the i-th record is the batch's i-th
// Record.
type Consumer interface {
	// BusinessKey returns the business key of the batch's i-th record.
	BusinessKey(i int) string
	// Handle hands the batch's i-th record to the application. A nil
	// error means handled.
	Handle(ctx context.Context, i int) error
	// Mark marks the batch's i-th record consumed: its offset may be
	// committed. HandleBatch marks records in order.
	Mark(i int)
	// Commit commits the marked offsets now.
	Commit(ctx context.Context)
}

// BatchConfig says how HandleBatch treats records.
type BatchConfig struct {
	// RetryTopic returns the retry topic of a main topic: where a failed
	// record of it is republished. Nil means the main topic plus
	// ".retry". A record the scheduler republished keeps the target it
	// came with.
	RetryTopic func(mainTopic string) string
	// Classify says what a handler's error means: its error class and a
	// message for operators. Nil means DefaultClassify.
	Classify func(err error) (class, message string)
	// NoGate hands every record to the handler without asking the
	// scheduler: failed records are still deferred, but a later record of
	// a deferred key is no longer held back.
	NoGate bool
}

// HandleBatch gates and handles one batch of records of one partition, in
// order, through c: before the batch it asks the scheduler once which of
// their keys are blocked; a record of a blocked key is deferred behind the
// blocking message (a gated deferral: no delay of its own, not a failure,
// its attempt unchanged) instead of being handled; a record c.Handle fails
// is deferred (see BatchConfig.Classify) and blocks its key for the rest of
// the batch. A record the scheduler republished (it has defer.id) may be
// handled while its key is blocked only by messages behind it.
//
// A record is marked only after it and everything before it were handled
// or durably deferred. Gated deferrals are queued and produced together,
// in record order, before anything after them is marked: one round trip
// for all of a batch's blocked records, not one each. A failed record's
// deferral is produced at once, after what is queued, so produce order is
// record order. After a batch that held records the scheduler
// republished, HandleBatch commits: the scheduler releases a key once the
// group committed past the record it republished.
//
// When a deferral fails, HandleBatch returns the error with the record
// and those after it unmarked: the adapter must have them read again.
// When ctx ends while the handler works (the handler returns ctx's
// error), HandleBatch settles what came before and returns nil, with the
// rest unmarked likewise.
func (g *Gate) HandleBatch(ctx context.Context, claim *ClaimState, recs []Record, bc BatchConfig, c Consumer) error {
	if len(recs) == 0 {
		return nil
	}
	if bc.RetryTopic == nil {
		bc.RetryTopic = func(topic string) string { return topic + ".retry" }
	}
	if bc.Classify == nil {
		bc.Classify = DefaultClassify
	}
	keys := make([]string, len(recs))
	for i := range recs {
		keys[i] = c.BusinessKey(i)
	}
	states := map[string]KeyState{}
	if !bc.NoGate {
		// An unsure answer leaves every key blocked: the records then go
		// to the scheduler, which keeps their order, rather than to the
		// handler. Its error says nothing more than the states do.
		states, _ = g.batchStates(ctx, recs, keys, claim)
	}
	// Counted once per batch rather than under the lock per record.
	handled := 0
	defer func() {
		if handled > 0 {
			g.count(func(s *Stats) { s.Handled += int64(handled) })
		}
	}()
	var queued []Out
	marked := 0 // recs[:marked] are marked
	done := 0   // recs[:done] are handled or deferred
	flush := func(ctx context.Context) error {
		if err := g.sendAll(ctx, queued); err != nil {
			return err
		}
		queued = queued[:0]
		for ; marked < done; marked++ {
			c.Mark(marked)
		}
		return nil
	}
	target := func(r Record) string {
		if t := r.header(protocol.HeaderTarget); t != "" {
			return t
		}
		return bc.RetryTopic(r.Topic)
	}
	republished := false
	for i, r := range recs {
		key := keys[i]
		seq, fromScheduler := schedulerSeq(r)
		republished = republished || fromScheduler
		if !bc.NoGate && key != "" && blocks(states[key], fromScheduler, seq) {
			o, err := g.build(ctx, r, Deferral{Target: target(r), BusinessKey: key}, true)
			if err != nil {
				return fmt.Errorf("deferclient: defer the record of %s/%d at offset %d behind its blocked key: %w", r.Topic, r.Partition, r.Offset, err)
			}
			queued = append(queued, o)
			done = i + 1
			states[key] = block(states[key], seq)
			continue
		}
		err := c.Handle(ctx, i)
		if err == nil {
			handled++
			done = i + 1
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
			// The consumer stops; this record is read again. What came
			// before it is settled first, as far as the broker lets: the
			// deferrals queued must not fail for the ctx that ended.
			return flush(context.WithoutCancel(ctx))
		}
		if err := flush(ctx); err != nil {
			return fmt.Errorf("deferclient: defer the records gated before %s/%d at offset %d: %w", r.Topic, r.Partition, r.Offset, err)
		}
		class, message := bc.Classify(err)
		o, derr := g.build(ctx, r, Deferral{Target: target(r), BusinessKey: key, ErrorClass: class, ErrorMessage: message}, false)
		if derr == nil {
			derr = g.sendAll(ctx, []Out{o})
		}
		if derr != nil {
			return fmt.Errorf("deferclient: defer the record of %s/%d at offset %d that failed (%v): %w", r.Topic, r.Partition, r.Offset, err, derr)
		}
		if key != "" {
			states[key] = block(states[key], seq)
		}
		done = i + 1
	}
	if err := flush(ctx); err != nil {
		return fmt.Errorf("deferclient: defer the records of %s/%d gated behind their keys: %w", recs[0].Topic, recs[0].Partition, err)
	}
	if republished {
		// The scheduler releases a key once the group committed past the
		// record it republished: commit now rather than at the next
		// auto-commit.
		c.Commit(ctx)
	}
	return nil
}

// batchStates returns the state of the keys of a batch (keys[i] is
// recs[i]'s business key, "" for none), for the claim it was read in. It
// is the one place the gate learns which keys are blocked. An error,
// which wraps ErrUnsure, comes with every key blocked (ReasonUnknown).
func (g *Gate) batchStates(ctx context.Context, recs []Record, keys []string, claim *ClaimState) (map[string]KeyState, error) {
	states, ok := g.setStates(keys, claim)
	if !ok {
		// No set to trust: ask about every key, as without one.
		states, err := g.keyStates(ctx, keys, !claim.waited)
		claim.waited = claim.waited || err == nil
		return states, err
	}
	// The set vouches for main-topic records. A record the scheduler
	// republished passes or not by its defer.seq against the key's head,
	// which the set does not follow: those are asked about, without
	// waiting (the set's load waited for all since the assignment).
	claim.waited = true
	var ask []string
	for i, r := range recs {
		if _, fromScheduler := schedulerSeq(r); fromScheduler && keys[i] != "" {
			ask = append(ask, keys[i])
		}
	}
	if len(ask) == 0 {
		return states, nil
	}
	asked, err := g.keyStates(ctx, ask, false)
	for k, st := range asked {
		states[k] = st
	}
	return states, err
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

// schedulerSeq returns r's defer.seq and true when the scheduler
// republished r.
func schedulerSeq(r Record) (int64, bool) {
	if r.header(protocol.HeaderID) == "" {
		return 0, false
	}
	seq, err := strconv.ParseInt(r.header(protocol.HeaderSeq), 10, 64)
	return seq, err == nil
}
