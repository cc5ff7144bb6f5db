package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/keygate"
)

const (
	deferTopic    = "scheduler.defer"
	targetTopic   = "chaos.orders"
	targetPattern = "chaos.*"
	// retryPolicies gives re-deferrals that name no delay a short ladder,
	// so that they come back within the run; its five steps allow five
	// retries, more than the most
	// re-deferrals a message gets (maxRedefers), so none is exhausted.
	retryPolicies = "chaos.*: ladder 300ms,600ms,1s,1s,1s"
	maxRedefers   = 2
	partitions    = 4
)

// message is one message the producer sends: business key Key, its number
// N among that key's messages (0, 1, ...), and how many times the consumer
// re-defers it before accepting it.
type message struct {
	Key      string
	N        int
	Redefers int
}

// value is the message's payload; the checker reads the message back from
// it, so it identifies the message across re-deferrals (each of which has a
// defer.id of its own).
func (m message) value() string {
	return fmt.Sprintf("%s|%d|%d", m.Key, m.N, m.Redefers)
}

func parseValue(v string) (message, error) {
	parts := strings.Split(v, "|")
	if len(parts) != 3 {
		return message{}, fmt.Errorf("value %q: want key|n|redefers", v)
	}
	n, err1 := strconv.Atoi(parts[1])
	r, err2 := strconv.Atoi(parts[2])
	if err := errors.Join(err1, err2); err != nil {
		return message{}, fmt.Errorf("value %q: %w", v, err)
	}
	return message{Key: parts[0], N: n, Redefers: r}, nil
}

// plan draws the messages: keys at random, each key's messages numbered in
// send order; 85% are accepted on first delivery, 10% re-deferred once, 5%
// twice.
func plan(rng *rand.Rand, n, keys int) []message {
	next := make([]int, keys)
	msgs := make([]message, n)
	for i := range msgs {
		k := rng.IntN(keys)
		r := 0
		switch x := rng.IntN(100); {
		case x < 5:
			r = 2
		case x < 15:
			r = 1
		}
		msgs[i] = message{Key: fmt.Sprintf("k%04d", k), N: next[k], Redefers: r}
		next[k]++
	}
	return msgs
}

// deferRecord is m as a failing consumer forwards it to scheduler.defer: due
// after a random delay of up to 4 s (one in ten as an absolute defer.at).
func deferRecord(rng *rand.Rand, m message) *sarama.ProducerMessage {
	hs := []sarama.RecordHeader{
		{Key: []byte("trace-id"), Value: []byte("chaos-" + m.Key + "-" + strconv.Itoa(m.N))},
		{Key: []byte(protocol.HeaderTarget), Value: []byte(targetTopic)},
		{Key: []byte(protocol.HeaderErrorClass), Value: []byte("ProviderTimeout")},
	}
	delay := time.Duration(rng.IntN(4000)) * time.Millisecond
	if rng.IntN(10) == 0 {
		hs = append(hs, sarama.RecordHeader{Key: []byte(protocol.HeaderAt),
			Value: []byte(time.Now().Add(delay).UTC().Format(time.RFC3339Nano))})
	} else {
		hs = append(hs, sarama.RecordHeader{Key: []byte(protocol.HeaderDelay), Value: []byte(strconv.FormatInt(delay.Milliseconds(), 10))})
	}
	return &sarama.ProducerMessage{Topic: deferTopic, Key: sarama.StringEncoder(m.Key),
		Value: sarama.StringEncoder(m.value()), Headers: hs}
}

// kafkaConfig is the base configuration of the run's own clients.
func kafkaConfig() *sarama.Config {
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	c.ClientID = "chaos"
	return c
}

// newProducer returns a producer that plays the failing consumers:
// idempotent with one request in flight, so that records of one key keep
// their order and a retried produce cannot store a record twice (which would
// pass for a duplicate of the scheduler's), keyed with murmur2 like the Java
// client.
func newProducer(addr string) (sarama.SyncProducer, error) {
	c := kafkaConfig()
	c.Producer.Return.Successes = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Partitioner = sarama.NewMurmur2Partitioner
	c.Producer.Idempotent = true
	c.Producer.Retry.Max = 20
	c.Net.MaxOpenRequests = 1
	p, err := sarama.NewSyncProducer([]string{addr}, c)
	if err != nil {
		return nil, fmt.Errorf("producer on %s: %w", addr, err)
	}
	return p, nil
}

// send produces msgs in order, spread evenly over d in batches every 100 ms.
func send(ctx context.Context, p sarama.SyncProducer, rng *rand.Rand, msgs []message, d time.Duration) error {
	const tick = 100 * time.Millisecond
	batches := max(1, int(d/tick))
	per := (len(msgs) + batches - 1) / batches
	t := time.NewTicker(tick)
	defer t.Stop()
	for from := 0; from < len(msgs); from += per {
		to := min(from+per, len(msgs))
		batch := make([]*sarama.ProducerMessage, 0, to-from)
		for _, m := range msgs[from:to] {
			batch = append(batch, deferRecord(rng, m))
		}
		if err := p.SendMessages(batch); err != nil {
			return fmt.Errorf("produce messages %d..%d to %s: %w", from, to-1, deferTopic, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

// delivery is one record read from the target topic.
type delivery struct {
	partition int32
	offset    int64
	key       string
	value     string
	id        string    // defer.id
	attempt   int       // defer.attempt
	at        time.Time // when the consumer read it
}

// consumer reads the target topic from the start, records every delivery,
// and re-defers deliveries as the plan says, as a consumer that fails again
// would: it forwards the record unchanged, with a new defer.delay (or none,
// for the retry policy to choose) and its error class.
type consumer struct {
	client sarama.Client
	cons   sarama.Consumer
	fwd    sarama.SyncProducer
	pcs    []sarama.PartitionConsumer
	wg     sync.WaitGroup

	mu         sync.Mutex
	deliveries []delivery
	seen       map[string]bool // defer.ids seen, so that a duplicate is not re-deferred again
	redefers   int
	next       map[int32]int64 // per partition, the offset after the last record read
	err        error
}

func newConsumer(addr string, fwd sarama.SyncProducer) (*consumer, error) {
	client, err := sarama.NewClient([]string{addr}, kafkaConfig())
	if err != nil {
		return nil, fmt.Errorf("client on %s: %w", addr, err)
	}
	cons, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		client.Close()
		return nil, fmt.Errorf("consumer on %s: %w", addr, err)
	}
	c := &consumer{client: client, cons: cons, fwd: fwd, seen: map[string]bool{}, next: map[int32]int64{}}
	parts, err := cons.Partitions(targetTopic)
	if err != nil {
		c.close()
		return nil, fmt.Errorf("partitions of %s: %w", targetTopic, err)
	}
	for _, p := range parts {
		pc, err := cons.ConsumePartition(targetTopic, p, sarama.OffsetOldest)
		if err != nil {
			c.close()
			return nil, fmt.Errorf("consume %s/%d: %w", targetTopic, p, err)
		}
		c.pcs = append(c.pcs, pc)
		c.wg.Go(func() {
			for m := range pc.Messages() {
				c.handle(m)
			}
		})
		c.wg.Go(func() {
			for err := range pc.Errors() {
				c.fail(fmt.Errorf("read %s/%d: %w", targetTopic, p, err))
			}
		})
	}
	return c, nil
}

func (c *consumer) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.err = errors.Join(c.err, err)
}

func (c *consumer) handle(m *sarama.ConsumerMessage) {
	d := delivery{partition: m.Partition, offset: m.Offset, key: string(m.Key), value: string(m.Value), at: time.Now()}
	for _, h := range m.Headers {
		switch string(h.Key) {
		case protocol.HeaderID:
			d.id = string(h.Value)
		case protocol.HeaderAttempt:
			d.attempt, _ = strconv.Atoi(string(h.Value)) // 0 when missing or bad: the checker flags it
		}
	}
	c.mu.Lock()
	c.deliveries = append(c.deliveries, d)
	c.next[m.Partition] = m.Offset + 1
	first := !c.seen[d.id]
	c.seen[d.id] = true
	c.mu.Unlock()
	msg, err := parseValue(d.value)
	if err != nil {
		c.fail(fmt.Errorf("%s/%d@%d: %w", m.Topic, m.Partition, m.Offset, err))
		return
	}
	// The output's attempt is the stored one plus one, so delivery number
	// a (1-based) of a message has attempt a; it is re-deferred while a <=
	// its planned re-deferrals. Only the first copy of a defer.id is: a
	// duplicate is the same delivery again.
	if !first || d.attempt < 1 || d.attempt > msg.Redefers {
		return
	}
	if err := c.redefer(m); err != nil {
		c.fail(err)
		return
	}
	c.mu.Lock()
	c.redefers++
	c.mu.Unlock()
}

// redefer forwards m to scheduler.defer with every header kept in order,
// defer.error.class set, and, for even attempts, a defer.delay of up to
// 1.5 s; odd attempts leave the delay to the target's retry policy.
func (c *consumer) redefer(m *sarama.ConsumerMessage) error {
	var hs []sarama.RecordHeader
	var attempt int
	for _, h := range m.Headers {
		k := string(h.Key)
		if k == protocol.HeaderAttempt {
			attempt, _ = strconv.Atoi(string(h.Value))
		}
		if k == protocol.HeaderErrorClass {
			continue // replaced below
		}
		hs = append(hs, sarama.RecordHeader{Key: h.Key, Value: h.Value})
	}
	hs = append(hs, sarama.RecordHeader{Key: []byte(protocol.HeaderErrorClass), Value: []byte("ProviderTimeout")})
	if attempt%2 == 0 {
		delay := time.Duration(rand.IntN(1500)) * time.Millisecond
		hs = append(hs, sarama.RecordHeader{Key: []byte(protocol.HeaderDelay), Value: []byte(delay.String())})
	}
	_, _, err := c.fwd.SendMessage(&sarama.ProducerMessage{Topic: deferTopic, Key: sarama.ByteEncoder(m.Key),
		Value: sarama.ByteEncoder(m.Value), Headers: hs})
	if err != nil {
		return fmt.Errorf("re-defer %s/%d@%d: %w", m.Topic, m.Partition, m.Offset, err)
	}
	return nil
}

// caughtUp waits until every partition of the target topic has been read up
// to its end as of now.
func (c *consumer) caughtUp(ctx context.Context, timeout time.Duration) error {
	ends, err := keygate.KafkaOffsets{Client: c.client}.Marks(targetTopic)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for {
		c.mu.Lock()
		behind := 0
		for p, end := range ends {
			if c.next[p] < end {
				behind++
			}
		}
		c.mu.Unlock()
		if behind == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("reading %s: %d partitions not read to their end within %s", targetTopic, behind, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// endOffsets returns the sum over topic's partitions of their end offsets:
// how many records the topic holds. Each partition leader is asked once for
// all its partitions (keygate's KafkaOffsets.Marks), not once per partition.
func (c *consumer) endOffsets(topic string) (int64, error) {
	ends, err := keygate.KafkaOffsets{Client: c.client}.Marks(topic)
	if err != nil {
		return 0, err
	}
	var sum int64
	for _, end := range ends {
		sum += end
	}
	return sum, nil
}

// snapshot returns the deliveries so far, the re-deferrals made and any
// error met.
func (c *consumer) snapshot() ([]delivery, int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]delivery(nil), c.deliveries...), c.redefers, c.err
}

func (c *consumer) close() {
	// Partition consumers first, as sarama requires; closing them ends the
	// goroutines reading them.
	for _, pc := range c.pcs {
		pc.AsyncClose()
	}
	c.wg.Wait()
	_ = c.cons.Close()
	_ = c.client.Close()
}
