package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/keygate"
)

// deferTopic is the service's default DEFER_TOPIC.
const deferTopic = "scheduler.defer"

// Target topics, one per phase, so that each phase's arrivals are counted
// and checked on their own. TARGET_TOPICS=bench.* allows them all.
const (
	topicWarmup   = "bench.warmup"
	topicDispatch = "bench.dispatch"
	topicE2E      = "bench.e2e"
	topicLate     = "bench.late"
	// topicLateVacuumed is the lateness phase's after a VACUUM.
	topicLateVacuumed = "bench.late.vacuumed"
	topicBroker       = "bench.broker"
	topicBacklog      = "bench.far" // the far-future rows' target; never due
)

// shape is how messages map to business keys.
type shape struct {
	name  string
	label string
	// key returns the business key (and record key) of message i of a
	// phase. Keys carry the phase so that phases never share a key.
	key func(phase string, i int) string
}

var (
	ownKeys  = shape{"own", "own key per message", func(ph string, i int) string { return "o-" + ph + "-" + strconv.Itoa(i) }}
	hotKeys  = shape{"hot", "1,000 hot keys", func(ph string, i int) string { return "h-" + ph + "-" + strconv.Itoa(i%1000) }}
	oneKey   = shape{"single", "one single key", func(ph string, _ int) string { return "s-" + ph }}
	valuePad = bytes.Repeat([]byte("x"), 118)
)

// payload is message i's value: its index (which the checks read back),
// then filler, 128 bytes in all, a typical small event.
func payload(i int) []byte {
	v := make([]byte, 0, 128)
	v = fmt.Appendf(v, "%09d|", i)
	return append(v, valuePad...)
}

// index reads the message index back from a value written by payload.
func index(v []byte) (int, bool) {
	if len(v) < 10 || v[9] != '|' {
		return 0, false
	}
	n, err := strconv.Atoi(string(v[:9]))
	return n, err == nil
}

// when is a record's schedule: exactly one of at and delay.
type when struct {
	at    time.Time
	delay time.Duration
}

// deferRecord builds message i as a failing consumer would forward it to
// scheduler.defer: its key, its value, one header of its own, and the
// control headers.
func deferRecord(key string, i int, target string, w when) *sarama.ProducerMessage {
	hs := []sarama.RecordHeader{
		{Key: []byte("trace-id"), Value: []byte("4bf92f3577b34da6a3ce929d0e0e4736")},
		{Key: []byte(protocol.HeaderTarget), Value: []byte(target)},
		{Key: []byte(protocol.HeaderErrorClass), Value: []byte("ProviderTimeout")},
	}
	if w.at.IsZero() {
		hs = append(hs, sarama.RecordHeader{Key: []byte(protocol.HeaderDelay), Value: []byte(w.delay.String())})
	} else {
		hs = append(hs, sarama.RecordHeader{Key: []byte(protocol.HeaderAt), Value: []byte(w.at.UTC().Format(time.RFC3339Nano))})
	}
	return &sarama.ProducerMessage{Topic: deferTopic, Key: sarama.StringEncoder(key),
		Value: sarama.ByteEncoder(payload(i)), Headers: hs}
}

// kafkaConfig is the base client configuration of the bench's own clients.
func kafkaConfig() *sarama.Config {
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	c.ClientID = "bench"
	return c
}

// loadProducer is the producer that plays the failing consumers: idempotent
// with one request in flight, so that records of one key keep their order,
// keyed with murmur2 like the Java client, lingering briefly to batch.
type loadProducer struct {
	p      sarama.AsyncProducer
	mu     sync.Mutex
	acked  int64
	failed error
	done   chan struct{}
}

func newLoadProducer(addr string) (*loadProducer, error) {
	c := kafkaConfig()
	c.Producer.Return.Successes = true
	c.Producer.Return.Errors = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Idempotent = true
	c.Net.MaxOpenRequests = 1
	c.Producer.Partitioner = sarama.NewMurmur2Partitioner
	c.Producer.Flush.Frequency = 2 * time.Millisecond
	c.Producer.Flush.Messages = 1000
	c.ChannelBufferSize = 4096
	p, err := sarama.NewAsyncProducer([]string{addr}, c)
	if err != nil {
		return nil, fmt.Errorf("load producer: %w", err)
	}
	lp := &loadProducer{p: p, done: make(chan struct{})}
	var wg sync.WaitGroup
	wg.Go(func() {
		for range p.Successes() {
			lp.mu.Lock()
			lp.acked++
			lp.mu.Unlock()
		}
	})
	wg.Go(func() {
		for pe := range p.Errors() {
			lp.mu.Lock()
			if lp.failed == nil {
				lp.failed = pe.Err
			}
			lp.mu.Unlock()
		}
	})
	go func() {
		wg.Wait()
		close(lp.done)
	}()
	return lp, nil
}

// send queues msg; its acknowledgement is counted by waitAcked.
func (lp *loadProducer) send(ctx context.Context, msg *sarama.ProducerMessage) error {
	select {
	case lp.p.Input() <- msg:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// waitAcked waits until n records in all were acknowledged.
func (lp *loadProducer) waitAcked(ctx context.Context, n int64) error {
	for {
		lp.mu.Lock()
		acked, failed := lp.acked, lp.failed
		lp.mu.Unlock()
		if failed != nil {
			return fmt.Errorf("produce to %s: %w", deferTopic, failed)
		}
		if acked >= n {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d records acknowledged: %w", acked, n, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func (lp *loadProducer) close() error {
	err := lp.p.Close()
	<-lp.done
	return err
}

// produceAll sends records 0..n-1 built by mk and waits for their
// acknowledgements; it returns when the first was sent and when the last was
// acknowledged.
func produceAll(ctx context.Context, lp *loadProducer, n int, mk func(i int) *sarama.ProducerMessage) (first, last time.Time, err error) {
	lp.mu.Lock()
	base := lp.acked
	lp.mu.Unlock()
	first = time.Now()
	for i := range n {
		if err := lp.send(ctx, mk(i)); err != nil {
			return first, time.Time{}, err
		}
	}
	if err := lp.waitAcked(ctx, base+int64(n)); err != nil {
		return first, time.Time{}, err
	}
	return first, time.Now(), nil
}

// producePaced sends records at rate per second for dur, record i built by
// mk at its send time, and waits for their acknowledgements. It returns how
// many it sent.
func producePaced(ctx context.Context, lp *loadProducer, rate int, dur time.Duration, mk func(i int, now time.Time) *sarama.ProducerMessage) (int, error) {
	stop := time.NewTimer(dur)
	defer stop.Stop()
	return producePacedUntil(ctx, lp, rate, stop.C, mk)
}

// producePacedUntil sends records at rate per second until stop delivers or
// is closed, record i built by mk at its send time, and waits for their
// acknowledgements. It returns how many it sent. Sends are spread evenly:
// every millisecond tick tops the count up to rate × elapsed.
func producePacedUntil[T any](ctx context.Context, lp *loadProducer, rate int, stop <-chan T, mk func(i int, now time.Time) *sarama.ProducerMessage) (int, error) {
	lp.mu.Lock()
	base := lp.acked
	lp.mu.Unlock()
	start := time.Now()
	sent := 0
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		now := time.Now()
		want := int(float64(rate) * now.Sub(start).Seconds())
		for ; sent < want; sent++ {
			if err := lp.send(ctx, mk(sent, now)); err != nil {
				return sent, err
			}
		}
		select {
		case <-tick.C:
		case <-stop:
			return sent, lp.waitAcked(ctx, base+int64(sent))
		case <-ctx.Done():
			return sent, ctx.Err()
		}
	}
}

// watcher reads high-water marks: how many records a topic holds, without
// consuming them, so that waiting for arrivals costs the contenders little.
type watcher struct {
	client sarama.Client
}

func newWatcher(addr string) (*watcher, error) {
	c, err := sarama.NewClient([]string{addr}, kafkaConfig())
	if err != nil {
		return nil, fmt.Errorf("watch client: %w", err)
	}
	return &watcher{client: c}, nil
}

func (w *watcher) close() { _ = w.client.Close() } // nothing to flush

// newClients opens a scenario's load producer and watcher on the broker at
// addr; on an error it closes what it opened.
func newClients(addr string) (*loadProducer, *watcher, error) {
	lp, err := newLoadProducer(addr)
	if err != nil {
		return nil, nil, err
	}
	w, err := newWatcher(addr)
	if err != nil {
		_ = lp.close()
		return nil, nil, err
	}
	return lp, w, nil
}

// count returns the number of records in topic (it is never truncated).
// It asks each partition leader once for all its partitions' high-water
// marks (keygate's KafkaOffsets.Marks): track calls it every 10ms while a
// phase is measured, and a request per partition (sarama's GetOffset) made
// the watcher itself a load that grew with the partitions. On 64 it sent
// 64 requests in a row per poll to the in-process broker the service
// shares two cores with, and the service's own statements then ran about
// a quarter slower than on 4.
func (w *watcher) count(topic string) (int64, error) {
	marks, err := keygate.KafkaOffsets{Client: w.client}.Marks(topic)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, m := range marks {
		n += m
	}
	return n, nil
}

// progress is when a count passed a mark and when it reached its target.
type progress struct {
	// fromAt and fromN are the last sample below the mark (the first sample
	// if none was): a rate measured from there covers whole poll intervals.
	fromAt time.Time
	fromN  int64
	doneAt time.Time
}

// track polls count every 10ms until it reaches target, and records the
// last sample below mark (<= target). It gives up after timeout, saying how
// far it got, or after maxCountFailures failed counts in a row: one failed
// offset request (sarama then drops the broker connection) is polled past.
func track(ctx context.Context, what string, count func() (int64, error), mark, target int64, timeout time.Duration) (progress, error) {
	const maxCountFailures = 20
	var pr progress
	deadline := time.Now().Add(timeout)
	failures, sampled := 0, false
	for {
		n, err := count()
		if err != nil {
			if failures++; failures == maxCountFailures || ctx.Err() != nil || time.Now().After(deadline) {
				return pr, fmt.Errorf("%s, %d counts in a row failed: %w", what, failures, err)
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		failures = 0
		now := time.Now()
		if !sampled || n < mark {
			pr.fromAt, pr.fromN = now, n
		}
		sampled = true
		if n >= target {
			pr.doneAt = now
			return pr, nil
		}
		if now.After(deadline) {
			return pr, fmt.Errorf("%s: %d of %d after %v", what, n, target, timeout)
		}
		select {
		case <-ctx.Done():
			return pr, fmt.Errorf("%s: %d of %d: %w", what, n, target, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// timeoutFor bounds a phase of n messages: generous (a 200 msgs/s floor and
// a minute of slack), so that only a stuck pipeline trips it.
func timeoutFor(n int) time.Duration {
	return time.Minute + time.Duration(n)*time.Second/200
}

// delivery is one record read back from a target topic.
type delivery struct {
	partition   int32
	key         string
	index       int
	id          string // defer.id, or the contender's equivalent
	published   time.Time
	scheduledAt time.Time
}

// readBack reads every record of topic, in partition order, after the
// measurement (so it costs the contenders nothing). The partitions are read
// at once: one after the other, each costs a few round trips and a fetch
// wait, which on 64 partitions made a topic take seconds.
func readBack(ctx context.Context, addr, topic string) ([]delivery, error) {
	c := kafkaConfig()
	c.Consumer.Fetch.Default = 4 << 20
	c.Consumer.MaxWaitTime = 50 * time.Millisecond
	client, err := sarama.NewClient([]string{addr}, c)
	if err != nil {
		return nil, fmt.Errorf("read back %s: %w", topic, err)
	}
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, fmt.Errorf("read back %s: %w", topic, err)
	}
	defer consumer.Close()
	parts, err := client.Partitions(topic)
	if err != nil {
		return nil, fmt.Errorf("read back %s: %w", topic, err)
	}
	byPart := make([][]delivery, len(parts))
	errs := make([]error, len(parts))
	var wg sync.WaitGroup
	for i, p := range parts {
		wg.Go(func() { byPart[i], errs[i] = readPartition(ctx, client, consumer, topic, p) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	var out []delivery
	for _, ds := range byPart {
		out = append(out, ds...)
	}
	return out, nil
}

// readPartition reads every record of partition p of topic, for readBack.
func readPartition(ctx context.Context, client sarama.Client, consumer sarama.Consumer, topic string, p int32) ([]delivery, error) {
	hwm, pc, err := openPartition(ctx, client, consumer, topic, p)
	if err != nil || pc == nil {
		return nil, err
	}
	defer pc.Close()
	var out []delivery
	for {
		select {
		case m := <-pc.Messages():
			d, err := parseDelivery(m)
			if err != nil {
				return nil, fmt.Errorf("read back %s/%d offset %d: %w", topic, p, m.Offset, err)
			}
			out = append(out, d)
			if m.Offset >= hwm-1 {
				return out, nil
			}
		case err := <-pc.Errors():
			return nil, fmt.Errorf("read back %s/%d: %w", topic, p, err)
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(30 * time.Second):
			return nil, fmt.Errorf("read back %s/%d: nothing for 30s", topic, p)
		}
	}
}

// openPartition returns partition p's high-water mark and, unless it is
// empty, a consumer of it from its oldest record. The partitions' readers
// share one client, and sarama closes a broker connection on any failed
// offset request, failing every request the other readers have in flight
// on it with ErrNotConnected; the next attempt reopens it. So a failure
// here is retried a few times before the read back gives up (a CI run once
// failed on it under load).
func openPartition(ctx context.Context, client sarama.Client, consumer sarama.Consumer, topic string, p int32) (int64, sarama.PartitionConsumer, error) {
	const attempts = 5
	for attempt := 1; ; attempt++ {
		hwm, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err == nil && hwm == 0 {
			return 0, nil, nil
		}
		var pc sarama.PartitionConsumer
		if err == nil {
			pc, err = consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		}
		if err == nil {
			return hwm, pc, nil
		}
		if attempt == attempts {
			return 0, nil, fmt.Errorf("read back %s/%d, %d attempts: %w", topic, p, attempts, err)
		}
		select {
		case <-ctx.Done():
			return 0, nil, ctx.Err()
		case <-time.After(time.Duration(attempt) * 200 * time.Millisecond):
		}
	}
}

func parseDelivery(m *sarama.ConsumerMessage) (delivery, error) {
	i, ok := index(m.Value)
	if !ok {
		return delivery{}, fmt.Errorf("value %.20q is not a bench payload", m.Value)
	}
	d := delivery{partition: m.Partition, key: string(m.Key), index: i, published: m.Timestamp}
	for _, h := range m.Headers {
		switch string(h.Key) {
		case protocol.HeaderID:
			d.id = string(h.Value)
		case protocol.HeaderScheduledAt:
			t, err := time.Parse(time.RFC3339Nano, string(h.Value))
			if err != nil {
				return d, fmt.Errorf("%s %q: %w", protocol.HeaderScheduledAt, h.Value, err)
			}
			d.scheduledAt = t
		}
	}
	return d, nil
}

// check is what reading a phase's target topic back found.
type check struct {
	expected   int
	delivered  int // distinct messages
	duplicates int // extra copies (at-least-once allows them; none expected here)
	outOfOrder int // a message of a key after a later one of the same key
}

// err returns an error naming what is wrong, if anything.
func (c check) err(what string) error {
	var errs []error
	if c.delivered != c.expected {
		errs = append(errs, fmt.Errorf("%s: %d of %d messages delivered", what, c.delivered, c.expected))
	}
	if c.outOfOrder > 0 {
		errs = append(errs, fmt.Errorf("%s: %d messages out of per-key order", what, c.outOfOrder))
	}
	return errors.Join(errs...)
}

// verify checks deliveries of messages 0..expected-1: each present, and per
// key in index order (indexes grow with production order within a key).
func verify(ds []delivery, expected int) check {
	c := check{expected: expected}
	seen := make(map[int]bool, len(ds))
	last := map[string]int{}
	for _, d := range ds {
		if seen[d.index] {
			c.duplicates++
			continue
		}
		seen[d.index] = true
		if d.index >= 0 && d.index < expected {
			c.delivered++
		}
		if prev, ok := last[d.key]; ok && d.index < prev {
			c.outOfOrder++
		}
		last[d.key] = d.index
	}
	return c
}

// lateness returns publish time minus due time of each delivery, in order.
func lateness(ds []delivery) ([]time.Duration, error) {
	out := make([]time.Duration, 0, len(ds))
	for _, d := range ds {
		if d.scheduledAt.IsZero() {
			return nil, fmt.Errorf("message %d has no %s", d.index, protocol.HeaderScheduledAt)
		}
		out = append(out, d.published.Sub(d.scheduledAt))
	}
	return out, nil
}

// endToEnd runs an in-process contender's end-to-end phase, as runScheduler
// times the service's: Warmup records due now (keys warmKeys) through to
// topicWarmup, then, under the CPU profile named profile, N records due now
// (keys keys) produced as fast as the producer goes, timed from the first
// send to the last arrival on topicE2E, with the statements it ran in db.
// what names the phase in errors.
func (b *bench) endToEnd(ctx context.Context, lp *loadProducer, w *watcher, db *database, what, profile, warmKeys, keys string) (rate, error) {
	n, warm := b.cfg.N, b.cfg.Warmup
	if _, _, err := produceAll(ctx, lp, warm, func(i int) *sarama.ProducerMessage {
		return deferRecord(ownKeys.key(warmKeys, i), i, topicWarmup, when{})
	}); err != nil {
		return rate{}, err
	}
	if _, err := track(ctx, what+" warm-up", func() (int64, error) { return w.count(topicWarmup) }, 0, int64(warm), timeoutFor(warm)); err != nil {
		return rate{}, err
	}
	stopProfile, err := b.profile(profile)
	if err != nil {
		return rate{}, err
	}
	stmts0, err := b.pg.statements(ctx, db.name)
	if err != nil {
		return rate{}, err
	}
	cpu0 := b.cpu(0)
	start := time.Now()
	sent := make(chan error, 1)
	go func() {
		_, _, err := produceAll(ctx, lp, n, func(i int) *sarama.ProducerMessage {
			return deferRecord(ownKeys.key(keys, i), i, topicE2E, when{})
		})
		sent <- err
	}()
	pr, err := track(ctx, what+" end to end", func() (int64, error) { return w.count(topicE2E) }, 0, int64(n), timeoutFor(n))
	stopProfile()
	if perr := <-sent; perr != nil {
		return rate{}, perr
	}
	if err != nil {
		return rate{}, err
	}
	cpu := b.cpu(0).sub(cpu0)
	stmts1, err := b.pg.statements(ctx, db.name)
	if err != nil {
		return rate{}, err
	}
	return rate{n: int64(n), wall: pr.doneAt.Sub(start), cpu: cpu, stmts: stmts1.since(stmts0, b.labels)}, nil
}
