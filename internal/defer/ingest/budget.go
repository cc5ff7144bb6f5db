package ingest

import (
	"sync"

	"github.com/IBM/sarama"
)

// recordOverhead is what a record costs in memory beyond its key, value and
// headers' bytes (the ConsumerMessage, its header structs, the batch's
// Entry): a rough figure, so that a flood of empty records is bounded too.
const recordOverhead = 256

// Budget bounds the bytes of records ingest holds at once, over every
// partition it consumes: records the consumer fetched and queued for a
// claim, records batched, and records being written. It is the consumer's
// interceptor (see ConsumerConfig): sarama calls OnConsume for each record
// just before queueing it for its claim, and OnConsume waits there while the
// budget is used up, which stops the partition's fetching, and with it the
// broker connection's, until batches are stored and release what they hold.
//
// Counting records alone bounds nothing when records are large: 1,000
// records of 900 KB are most of a gigabyte, and the consumer's queues, the
// batch and the statement's encoding each held their own.
//
// A record larger than the whole budget is still taken, alone: it waits
// until nothing else is held.
type Budget struct {
	limit int64

	mu   sync.Mutex
	cond *sync.Cond
	used int64
	// peak is the most used has been, for tests.
	peak int64
	// accounts holds what each claimed partition holds, so that what a
	// claim leaves behind when it ends (records sarama queued that the claim
	// never read, and which sarama drains itself) is given back.
	accounts map[claimKey]*account
}

type claimKey struct {
	topic     string
	partition int32
}

type account struct {
	held   int64
	closed bool
}

// NewBudget returns a Budget of limit bytes.
func NewBudget(limit int64) *Budget {
	b := &Budget{limit: limit, accounts: map[claimKey]*account{}}
	b.cond = sync.NewCond(&b.mu)
	return b
}

// Limit returns the budget's size in bytes.
func (b *Budget) Limit() int64 { return b.limit }

// Used returns the bytes held now.
func (b *Budget) Used() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.used
}

// recordBytes is what a record counts for against the budget.
func recordBytes(m *sarama.ConsumerMessage) int64 {
	n := int64(len(m.Key) + len(m.Value) + recordOverhead)
	for _, h := range m.Headers {
		n += int64(len(h.Key) + len(h.Value))
	}
	return n
}

// OnConsume implements sarama.ConsumerInterceptor. It copies the record out
// of the fetch response, whose buffer its key, value and headers point into
// (sarama decodes without copying): otherwise one record left in a batch
// would keep a whole response of other records alive, unaccounted. Then it
// waits for room in the budget. A record of a partition with no open claim
// is not counted.
func (b *Budget) OnConsume(m *sarama.ConsumerMessage) {
	detach(m)
	n := recordBytes(m)
	b.mu.Lock()
	defer b.mu.Unlock()
	a := b.accounts[claimKey{m.Topic, m.Partition}]
	for a != nil && !a.closed && b.used > 0 && b.used+n > b.limit {
		b.cond.Wait()
	}
	if a == nil || a.closed {
		return
	}
	b.used += n
	b.peak = max(b.peak, b.used)
	a.held += n
}

// open starts counting what the partition's claim holds. Setup opens every
// claimed partition before the session starts consuming.
func (b *Budget) open(topic string, partition int32) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if a := b.accounts[claimKey{topic, partition}]; a != nil && !a.closed {
		return
	}
	b.accounts[claimKey{topic, partition}] = &account{}
}

// release gives back n bytes the partition's claim held, when its records
// are stored or skipped.
func (b *Budget) release(topic string, partition int32, n int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	a := b.accounts[claimKey{topic, partition}]
	if a == nil {
		return
	}
	// A record taken before its claim was open was never counted.
	n = min(n, a.held)
	a.held -= n
	b.used -= n
	b.cond.Broadcast()
}

// close gives back everything the partition's claim still holds and stops
// counting for it; a record waiting for room in OnConsume goes on uncounted
// (sarama is draining it).
func (b *Budget) close(topic string, partition int32) {
	b.mu.Lock()
	defer b.mu.Unlock()
	k := claimKey{topic, partition}
	a := b.accounts[k]
	if a == nil {
		return
	}
	b.used -= a.held
	a.held = 0
	a.closed = true
	delete(b.accounts, k)
	b.cond.Broadcast()
}

// detach copies m's key, value and header bytes into one allocation of its
// own, keeping nil slices nil (a null key is not an empty one).
func detach(m *sarama.ConsumerMessage) {
	n := len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		n += len(h.Key) + len(h.Value)
	}
	buf := make([]byte, 0, n)
	clone := func(s []byte) []byte {
		if s == nil {
			return nil
		}
		start := len(buf)
		buf = append(buf, s...)
		return buf[start:len(buf):len(buf)]
	}
	m.Key = clone(m.Key)
	m.Value = clone(m.Value)
	for _, h := range m.Headers {
		h.Key = clone(h.Key)
		h.Value = clone(h.Value)
	}
}
