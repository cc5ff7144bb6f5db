package deferkgo

import (
	"context"
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/deferq/scheduler/deferclient/gate"
)

// Handler handles one record. A nil error means handled: its offset may be
// committed. An error defers the record (see HandlerConfig.Classify).
type Handler func(ctx context.Context, r *kgo.Record) error

// HandlerConfig configures Consume.
type HandlerConfig struct {
	// RetryTopic returns the retry topic of a main topic: where a failed
	// record of it is republished, which the same consumer group must also
	// consume through Consume. Nil means the main topic plus ".retry". A
	// record the scheduler republished keeps the target it came with.
	RetryTopic func(mainTopic string) string
	// Classify says what a handler's error means: its error class (the
	// scheduler's policies match it; "permanent" parks the record at once)
	// and a message for operators. Nil means gate.DefaultClassify, which
	// gives errors marked with gate.Permanent the class "permanent".
	Classify func(err error) (class, message string)
	// BusinessKey returns a record's business key; nil means the
	// package's BusinessKey (defer.key, else the record key).
	BusinessKey func(r *kgo.Record) string
	// MaxBatch bounds the records of one poll (0: 500), and so the records
	// gated with one key-state query: each partition's records of a poll
	// are a batch. A rebalance waits for the poll's records to be
	// settled, so MaxBatch handlings must fit in the group's rebalance
	// timeout.
	MaxBatch int
	// NoGate hands every record to the handler without asking the
	// scheduler, as a consumer without the library would: failed records
	// are still deferred, but a later record of a deferred key is no longer
	// held back. For measuring what the gate costs, and for moving a
	// consumer group to the library one instance at a time; the order
	// guarantee does not hold with it.
	NoGate bool
}

// ErrLeftGroup is returned, wrapped, by Consume when it stopped with
// records it had polled and not settled (handled or durably deferred): it
// made the consuming kgo.Client leave its group, committing the offsets of
// what was settled, so that the group reads the rest again from there.
// That kgo.Client cannot consume again: close it, and make a new one to
// rejoin the group.
var ErrLeftGroup = errors.New("deferkgo: the consuming kgo.Client left its group with records unsettled")

// GroupOpts returns the options the consuming kgo.Client must have, next
// to kgo.SeedBrokers, kgo.ConsumerGroup(Config.Group) and
// kgo.ConsumeTopics(main topic, retry topic):
//
//   - kgo.BlockRebalanceOnPoll: a rebalance waits until Consume settled
//     what it polled, so no partition moves with records half handled;
//   - kgo.AutoCommitMarks: only offsets Consume marked, those of records
//     handled or durably deferred, are committed (periodically, at the
//     end of a batch that held republished records, and on revocation);
//   - kgo.OnPartitionsAssigned: each partition assigned starts a fresh
//     claim, whose first key-state question waits for the whole defer
//     topic, so that a new owner sees its predecessor's deferrals;
//   - kgo.OnPartitionsRevoked: commits the marked offsets before the
//     partitions go, as sarama's session does at its end;
//   - kgo.OnPartitionsLost: forgets the partitions, without committing
//     for a generation that is gone.
//
// Options given after them replace them: do not pass these five again.
func (c *Client) GroupOpts() []kgo.Opt {
	return []kgo.Opt{
		kgo.BlockRebalanceOnPoll(),
		kgo.AutoCommitMarks(),
		kgo.OnPartitionsAssigned(c.assigned),
		kgo.OnPartitionsRevoked(c.revoked),
		kgo.OnPartitionsLost(c.lost),
	}
}

// assigned starts a fresh claim of each partition cl was assigned, and
// has the gate load its group's blocked keys for them
// (gate.Gate.Assigned); when the load fails, the claims ask the scheduler
// about each batch's keys until one succeeds.
func (c *Client) assigned(ctx context.Context, cl *kgo.Client, parts map[string][]int32) {
	c.mu.Lock()
	defer func() {
		c.mu.Unlock()
		if !c.noGate.Load() {
			_ = c.gate.Assigned(ctx) // counted in Stats.FeedFailures
		}
	}()
	m := c.members[cl]
	if m == nil {
		m = &member{claims: map[topicPartition]*gate.ClaimState{}}
		c.members[cl] = m
	}
	for topic, ps := range parts {
		for _, p := range ps {
			m.claims[topicPartition{topic, p}] = &gate.ClaimState{}
		}
	}
}

// revoked commits what was marked, then forgets the partitions.
func (c *Client) revoked(ctx context.Context, cl *kgo.Client, parts map[string][]int32) {
	// With BlockRebalanceOnPoll, Consume has settled (or given up and left
	// over) everything it polled: what is marked is all there is to commit.
	// A failed commit leaves the next owner to read from the previous
	// one, again: at least once.
	_ = cl.CommitMarkedOffsets(ctx)
	c.forget(cl, parts)
}

// lost forgets the partitions: the group moved on without this member, and
// a commit for its old generation would be refused.
func (c *Client) lost(_ context.Context, cl *kgo.Client, parts map[string][]int32) {
	c.forget(cl, parts)
}

func (c *Client) forget(cl *kgo.Client, parts map[string][]int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.members[cl]
	if m == nil {
		return
	}
	for topic, ps := range parts {
		for _, p := range ps {
			delete(m.claims, topicPartition{topic, p})
		}
	}
	if len(m.claims) == 0 && !m.left {
		delete(c.members, cl)
	}
}

// claim returns the state of cl's claim of topic/partition, nil if cl was
// not assigned it through the hooks of GroupOpts.
func (c *Client) claim(cl *kgo.Client, topic string, partition int32) *gate.ClaimState {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m := c.members[cl]; m != nil {
		return m.claims[topicPartition{topic, partition}]
	}
	return nil
}

// check says what is wrong with cl as Consume's consumer, nil if nothing.
func (c *Client) check(cl *kgo.Client) error {
	c.mu.Lock()
	left := c.members[cl] != nil && c.members[cl].left
	c.mu.Unlock()
	if left {
		return fmt.Errorf("deferkgo: consume with a kgo.Client that left its group: %w", ErrLeftGroup)
	}
	var problems []error
	group, _ := cl.OptValue(kgo.ConsumerGroup).(string)
	if want := c.gate.Config().Group; group == "" || group != want {
		problems = append(problems, fmt.Errorf("it consumes as group %q, the Client's Config.Group is %q: set kgo.ConsumerGroup to it", group, want))
	}
	if block, _ := cl.OptValue(kgo.BlockRebalanceOnPoll).(bool); !block {
		problems = append(problems, errors.New("it lacks kgo.BlockRebalanceOnPoll"))
	}
	if marks, _ := cl.OptValue(kgo.AutoCommitMarks).(bool); !marks {
		problems = append(problems, errors.New("it lacks kgo.AutoCommitMarks"))
	}
	// The partition hooks cannot be told from kgo's own wrappers here:
	// settle finds them missing at the first record of a partition they
	// never saw assigned.
	if len(problems) > 0 {
		return fmt.Errorf("deferkgo: the consuming kgo.Client needs Client.GroupOpts(): %w", errors.Join(problems...))
	}
	return nil
}

// Consume runs cl's poll loop until ctx is done, handing the records of
// every partition cl is assigned, main and retry topics alike, to h,
// keeping the order of business keys. cl is a consumer group member made
// with the options of GroupOpts (see there), kgo.ConsumerGroup set to
// Config.Group, and kgo.ConsumeTopics naming the main topic and its retry
// topic; Consume refuses a client without them. One goroutine at a time
// may run Consume on cl.
//
// Each poll (kgo.Client.PollRecords, up to MaxBatch records) is handled
// partition by partition, each partition's records as one batch, with the
// semantics of deferclient.ConsumerGroupHandler: before a batch it asks
// the scheduler once which of its keys are blocked; a record of a blocked
// key is deferred behind the blocking message (a gated deferral: no delay
// of its own, not a failure, its attempt unchanged) instead of being
// handled; a record h fails is deferred (see HandlerConfig.Classify) and
// blocks its key for the rest of the batch. A record's offset is marked
// (kgo.Client.MarkCommitRecords) only after it was handled or durably
// deferred; a batch that held records the scheduler republished is
// committed at once (kgo.Client.CommitMarkedOffsets), so that the
// scheduler releases their keys. After each poll's records, Consume lets
// a waiting rebalance go on (kgo.Client.AllowRebalance).
//
// A record the scheduler republished (it has defer.id) may be handled
// while its key is blocked only by messages behind it (a higher defer.seq,
// or one republished but not committed yet): the retry topic's partition
// keeps the key's order among republished messages.
//
// Consume returns nil once ctx is done. When a deferral fails, or ctx ends
// while h works on a record, the record and those after it were polled
// but not settled: kgo keeps no way to read them again in this membership,
// so Consume makes cl leave the group, which commits what was settled, and
// returns (an error wrapping ErrLeftGroup unless ctx is done); the group
// reads the rest again from the committed offsets. Errors of the fetches
// (kgo.Fetches.Errors) are returned, joined, after the records polled with
// them were settled; cl keeps its place, and Consume may be called again.
// An error wrapping kgo.ErrClientClosed means cl was closed.
func (c *Client) Consume(ctx context.Context, cl *kgo.Client, h Handler, hc HandlerConfig) error {
	if err := c.check(cl); err != nil {
		return err
	}
	if hc.BusinessKey == nil {
		hc.BusinessKey = BusinessKey
	}
	if hc.MaxBatch <= 0 {
		hc.MaxBatch = 500
	}
	bc := gate.BatchConfig{RetryTopic: hc.RetryTopic, Classify: hc.Classify, NoGate: hc.NoGate}
	c.noGate.Store(hc.NoGate)
	for ctx.Err() == nil {
		fetches := cl.PollRecords(ctx, hc.MaxBatch)
		settled, err := c.settle(ctx, cl, fetches, h, hc, bc)
		// Every record of the poll is settled, or the client leaves:
		// either way a partition may move now.
		cl.AllowRebalance()
		if !settled {
			return c.leave(ctx, cl, err)
		}
		var ferrs []error
		fetches.EachError(func(topic string, partition int32, err error) {
			if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
				return // the poll was cut short by ctx: not the fetch's fault
			}
			ferrs = append(ferrs, fmt.Errorf("%s/%d: %w", topic, partition, err))
		})
		if len(ferrs) > 0 {
			return fmt.Errorf("deferkgo: fetch: %w", errors.Join(ferrs...))
		}
	}
	return nil
}

// settle gates and handles the records of one poll, partition by
// partition, and says whether all of them were settled; err says why not.
func (c *Client) settle(ctx context.Context, cl *kgo.Client, fetches kgo.Fetches, h Handler, hc HandlerConfig, bc gate.BatchConfig) (bool, error) {
	// One batch per partition, in the partition's order. A partition
	// normally comes in one fetch; should it come in two, they are one
	// batch, in the order polled.
	var order []topicPartition
	batches := map[topicPartition][]*kgo.Record{}
	fetches.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) == 0 {
			return
		}
		tp := topicPartition{p.Topic, p.Partition}
		if _, ok := batches[tp]; !ok {
			order = append(order, tp)
		}
		batches[tp] = append(batches[tp], p.Records...)
	})
	for _, tp := range order {
		recs := batches[tp]
		claim := c.claim(cl, tp.topic, tp.partition)
		if claim == nil {
			// The assignment hook never ran for it: cl lacks
			// GroupOpts' hooks, or they were replaced.
			return false, fmt.Errorf("deferkgo: records of %s/%d, which the hooks of Client.GroupOpts never saw assigned", tp.topic, tp.partition)
		}
		b := &kgoBatch{cl: cl, h: h, hc: hc, recs: recs}
		grecs := make([]gate.Record, len(recs))
		for i, r := range recs {
			grecs[i] = record(r)
		}
		err := c.gate.HandleBatch(ctx, claim, grecs, bc, b)
		if err != nil || b.marked < len(recs) {
			return false, err
		}
	}
	return true, nil
}

// leave makes cl leave its group after Consume stopped with records
// unsettled (why: cause), and returns what Consume returns.
func (c *Client) leave(ctx context.Context, cl *kgo.Client, cause error) error {
	c.mu.Lock()
	m := c.members[cl]
	if m == nil {
		m = &member{claims: map[topicPartition]*gate.ClaimState{}}
		c.members[cl] = m
	}
	m.left = true
	c.mu.Unlock()
	// Leaving revokes every partition, which commits the marked offsets
	// (GroupOpts' hook) and stops fetching; it must finish even when ctx
	// is what ended, so that nothing unsettled is ever committed past.
	lerr := cl.LeaveGroupContext(context.WithoutCancel(ctx))
	if ctx.Err() != nil {
		// Stopping: a deferral that failed for the ctx that ended is
		// no news, and the records are read again all the same.
		return nil
	}
	if cause == nil {
		cause = errors.New("stopped with records unsettled")
	}
	if lerr != nil {
		return fmt.Errorf("%w: %w (leaving: %v)", ErrLeftGroup, cause, lerr)
	}
	return fmt.Errorf("%w: %w", ErrLeftGroup, cause)
}

// kgoBatch is one partition's records of a poll, as the gate drives them.
type kgoBatch struct {
	cl     *kgo.Client
	h      Handler
	hc     HandlerConfig
	recs   []*kgo.Record
	marked int // recs[:marked] are marked
}

func (b *kgoBatch) BusinessKey(i int) string                { return b.hc.BusinessKey(b.recs[i]) }
func (b *kgoBatch) Handle(ctx context.Context, i int) error { return b.h(ctx, b.recs[i]) }

func (b *kgoBatch) Mark(i int) {
	b.cl.MarkCommitRecords(b.recs[i])
	b.marked = i + 1
}

// Commit commits the marked offsets now. A failure leaves them marked:
// the next auto-commit, or the revocation, commits them.
func (b *kgoBatch) Commit(ctx context.Context) {
	_ = b.cl.CommitMarkedOffsets(ctx)
}
