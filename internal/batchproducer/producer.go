// Package batchproducer publishes messages to Kafka so that, within one call,
// a message is never acknowledged after an earlier message of its partition
// failed.
//
// sarama's producers do not promise that. They count retries per message, so
// when a request has failed Producer.Retry.Max times its messages are given
// up on while later messages of the same partition, which have been retried
// fewer times, are sent with a fresh idempotent epoch and succeed: message
// n+1 of a key is out while n is not, and n goes out later. A deferral
// scheduler promises per-key order, so it needs a producer whose failures are
// monotonic per partition. This one sends each partition's messages as whole
// record batches, one batch per partition per request, and a partition's next
// batch only after the previous one was acknowledged. A batch that fails
// Producer.Retry.Max+1 times fails together with every later message of its
// partition (ErrNotSent); the other partitions go on. A batch the broker
// refuses for good is sent again one message per batch, so that the refusal
// lands on the message that caused it, and the partition stops there.
//
// Retries are not idempotent: a batch whose request failed (a timeout, a
// broken connection) after the broker wrote it is written again, and the
// original may land after the copy and after later batches. Each
// message's first delivery still comes after the first delivery of every
// message before it in the partition, which is the order a deferral
// scheduler promises; a consumer recognises copies by their headers
// (defer.id).
package batchproducer

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/IBM/sarama"
)

// PartitionKey, as a message's Metadata, chooses its partition in place of
// its record key: the partition Java-compatible murmur2 gives these bytes.
// The record key is sent unchanged. Dispatch uses it to send every message
// of a business key to one partition whatever their record keys.
type PartitionKey []byte

// ErrNotSent is the error of a message that was not sent because an earlier
// message of its partition failed in the same call. It is retriable: the
// message itself was never refused.
var ErrNotSent = errors.New("not sent: an earlier message of its partition failed")

// ErrOutOfTime is the error of a message that was not sent because the call
// had used its time (see MaxDuration). It is retriable.
var ErrOutOfTime = errors.New("not sent: the publish ran out of time")

// batchOverhead is the size of a record batch's header (v2), which
// ProducerMessage.ByteSize does not count.
const batchOverhead = 61

// Fits reports whether m fits in a record batch of its own under
// maxMessageBytes (Producer.MaxMessageBytes); SendMessages refuses a message
// that does not, with a sarama.ConfigurationError as sarama's producer does.
func Fits(m *sarama.ProducerMessage, maxMessageBytes int) bool {
	return m.ByteSize(2)+batchOverhead <= maxMessageBytes
}

// maxRequestBytes caps the record bytes of one produce request; partitions
// beyond it wait for the next request. Brokers refuse requests above
// socket.request.max.bytes (100 MiB by default).
const maxRequestBytes = 16 << 20

// Producer publishes messages with the guarantee of the package comment. It
// is safe for concurrent use; concurrent calls do not order each other.
type Producer struct {
	client  sarama.Client
	conf    *sarama.Config
	version int16
	limit   time.Duration // MaxDuration(conf)
}

// New connects to brokers with conf and returns a Producer. It uses from conf
// the producer's acks, timeout, compression, retries and back-off, and
// MaxMessageBytes as the largest record batch it builds; the Kafka version
// must be at least 0.11 (record batches).
func New(brokers []string, conf *sarama.Config) (*Producer, error) {
	if !conf.Version.IsAtLeast(sarama.V0_11_0_0) {
		return nil, fmt.Errorf("batch producer: Kafka version %s is older than 0.11, which has no record batches", conf.Version)
	}
	if conf.Metadata.Timeout <= 0 {
		return nil, fmt.Errorf("batch producer: Metadata.Timeout must be set: it bounds the metadata refreshes within MaxDuration")
	}
	client, err := sarama.NewClient(brokers, conf)
	if err != nil {
		return nil, err
	}
	return &Producer{client: client, conf: conf, version: requestVersion(conf.Version), limit: MaxDuration(conf)}, nil
}

// Close closes the connections. A call in progress fails at its next
// lookup or request (a request already on the wire may still complete).
func (p *Producer) Close() error { return p.client.Close() }

// requestVersion is the produce request version sarama's own producer uses
// for v.
func requestVersion(v sarama.KafkaVersion) int16 {
	switch {
	case v.IsAtLeast(sarama.V3_7_0_0):
		return 10
	case v.IsAtLeast(sarama.V2_8_0_0):
		return 9
	case v.IsAtLeast(sarama.V2_4_0_0):
		return 8
	case v.IsAtLeast(sarama.V2_1_0_0):
		return 7
	case v.IsAtLeast(sarama.V2_0_0_0):
		return 6
	case v.IsAtLeast(sarama.V1_0_0_0):
		return 5
	}
	return 3
}

// step is the longest one request can take: a dial, a write and a read.
func step(c *sarama.Config) time.Duration {
	return c.Net.DialTimeout + c.Net.WriteTimeout + c.Net.ReadTimeout
}

// MaxDuration bounds how long one SendMessages call can take with config c:
// the time Producer.Retry.Max+1 attempts of one batch take, each a request
// (a dial, a write and a read) and a back-off, with a metadata refresh
// (bounded by Metadata.Timeout) before the first and after each. It is the
// bound sarama's own producer has with the same settings. A call does not
// begin a lookup, a request or a refresh it could not finish within it, and
// stops waiting for a request at its end (the request may still complete:
// its messages are then published twice, and later ones of their partition
// were not sent); what is left fails with ErrOutOfTime. So when a
// partition's messages need several batches in a row, or requests queue
// behind other callers' on a connection, the later ones may be left for the
// next call. A lease must be longer, or a slow publish could overlap a
// second holder's.
func MaxDuration(c *sarama.Config) time.Duration {
	tries := time.Duration(c.Producer.Retry.Max + 1)
	return tries*(step(c)+c.Producer.Retry.Backoff) + (tries+1)*c.Metadata.Timeout
}

// partition is one partition's messages in a call, in order.
type partition struct {
	topic string
	id    int32
	msgs  []*sarama.ProducerMessage
	recs  []*sarama.Record // msgs encoded
	sizes []int            // ByteSize of each message
	next  int              // msgs[:next] are done

	// The batch being sent: msgs[next:next+n].
	n     int
	batch *sarama.RecordBatch
	tries int
	err   error // the batch's last error
	// single: send one message per batch from now on. Set when a batch of
	// several is refused for good, so that the refusal lands on the
	// message that caused it, not on every message batched with it.
	single bool
}

// outOfTime fails the partition's remaining messages with ErrOutOfTime,
// naming the last attempt's error if there was one.
func (pt *partition) outOfTime(errs sarama.ProducerErrors) sarama.ProducerErrors {
	err := error(ErrOutOfTime)
	if pt.err != nil {
		// Not %w: the message was not refused, whatever the last attempt
		// said; it stays retriable.
		err = fmt.Errorf("%w (last attempt: %v)", ErrOutOfTime, pt.err)
	}
	pt.n = 0
	return pt.failRest(errs, err)
}

// SendMessages publishes msgs and returns nil, or sarama.ProducerErrors
// naming each message that was not acknowledged and why. A message whose
// partition cannot be resolved fails with the metadata error (for example
// sarama.ErrUnknownTopicOrPartition). Messages keep their order within a
// partition; messages without a key all go to one partition of their topic
// per call, chosen at random, so that their order holds too. On success a
// message's Partition and Offset are set.
func (p *Producer) SendMessages(msgs []*sarama.ProducerMessage) error {
	end := time.Now().Add(p.limit)
	var errs sarama.ProducerErrors
	parts := p.partition(msgs, &errs, end)
	for {
		var active []*partition
		for _, pt := range parts {
			if pt.next < len(pt.msgs) {
				active = append(active, pt)
			}
		}
		if len(active) == 0 {
			break
		}
		retry := p.round(active, &errs, end)
		if len(retry) == 0 {
			continue
		}
		// What failed may have moved: look again before the next attempt,
		// after the back-off (which the refresh counts in). Without the
		// time for that and one more round, the retries end here.
		pause := p.conf.Metadata.Timeout + p.conf.Producer.Retry.Backoff
		if time.Now().Add(pause + p.roundTime()).After(end) {
			for _, pt := range retry {
				errs = pt.outOfTime(errs)
			}
			continue
		}
		started := time.Now()
		var topics []string
		for _, pt := range retry {
			if !slices.Contains(topics, pt.topic) {
				topics = append(topics, pt.topic)
			}
		}
		_ = p.client.RefreshMetadata(topics...) // a failure shows in the next attempt
		if wait := p.conf.Producer.Retry.Backoff - time.Since(started); wait > 0 {
			time.Sleep(wait)
		}
	}
	if len(errs) > 0 {
		return errs
	}
	return nil
}

// roundTime is the longest a round's first lookup and request take: a
// metadata refresh and a request.
func (p *Producer) roundTime() time.Duration {
	return step(p.conf) + p.conf.Metadata.Timeout
}

// partition assigns every message its partition, encodes it and groups the
// messages by partition, in order of first appearance. Messages that cannot
// be sent go to errs, with the rest of their partition after them.
func (p *Producer) partition(msgs []*sarama.ProducerMessage, errs *sarama.ProducerErrors, end time.Time) []*partition {
	type topicInfo struct {
		n      int32
		sticky int32
		hash   sarama.Partitioner
		err    error
		parts  map[int32]*partition
	}
	topics := map[string]*topicInfo{}
	var order []*partition
	for _, m := range msgs {
		ti := topics[m.Topic]
		if ti == nil {
			ti = &topicInfo{parts: map[int32]*partition{}}
			// A topic not in the cache costs a metadata refresh.
			if time.Now().Add(p.conf.Metadata.Timeout).After(end) {
				ti.err = ErrOutOfTime
			} else if ids, err := p.client.Partitions(m.Topic); err != nil {
				ti.err = err
			} else if len(ids) == 0 {
				ti.err = sarama.ErrLeaderNotAvailable
			} else {
				ti.n = int32(len(ids))
				ti.hash = sarama.NewMurmur2Partitioner(m.Topic)
				// Keyless messages go to a partition with a leader, as
				// sarama's random partitioner picks.
				if w, err := p.client.WritablePartitions(m.Topic); err == nil && len(w) > 0 {
					ti.sticky = w[rand.IntN(len(w))]
				} else {
					ti.sticky = ids[rand.IntN(len(ids))]
				}
			}
			topics[m.Topic] = ti
		}
		if ti.err != nil {
			*errs = append(*errs, &sarama.ProducerError{Msg: m, Err: ti.err})
			continue
		}
		id := ti.sticky
		if pk, ok := m.Metadata.(PartitionKey); ok {
			// Hashed as a record key would be: the same partition a Java
			// producer picks for a record whose key is these bytes.
			var err error
			if id, err = ti.hash.Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder(pk)}, ti.n); err != nil {
				*errs = append(*errs, &sarama.ProducerError{Msg: m, Err: err})
				continue
			}
		} else if m.Key != nil {
			var err error
			if id, err = ti.hash.Partition(m, ti.n); err != nil {
				*errs = append(*errs, &sarama.ProducerError{Msg: m, Err: err})
				continue
			}
		}
		m.Partition = id
		pt := ti.parts[id]
		if pt == nil {
			pt = &partition{topic: m.Topic, id: id}
			ti.parts[id] = pt
			order = append(order, pt)
		}
		if pt.err != nil {
			// An earlier message of the partition cannot be sent.
			*errs = append(*errs, &sarama.ProducerError{Msg: m, Err: ErrNotSent})
			continue
		}
		r, size, err := p.encode(m)
		if err != nil {
			pt.err = err
			*errs = append(*errs, &sarama.ProducerError{Msg: m, Err: err})
			continue
		}
		pt.msgs = append(pt.msgs, m)
		pt.recs = append(pt.recs, r)
		pt.sizes = append(pt.sizes, size)
	}
	for _, pt := range order {
		pt.err = nil
	}
	return order
}

// encode makes m's record and returns its size, or the reason m cannot be
// sent: a key or value that does not encode, or a record too large for a
// batch (the error sarama's producer gives).
func (p *Producer) encode(m *sarama.ProducerMessage) (*sarama.Record, int, error) {
	r := &sarama.Record{}
	var err error
	if m.Key != nil {
		if r.Key, err = m.Key.Encode(); err != nil {
			return nil, 0, fmt.Errorf("encode key: %w", err)
		}
	}
	if m.Value != nil {
		if r.Value, err = m.Value.Encode(); err != nil {
			return nil, 0, fmt.Errorf("encode value: %w", err)
		}
	}
	for i := range m.Headers {
		r.Headers = append(r.Headers, &m.Headers[i])
	}
	size := m.ByteSize(2)
	if !Fits(m, p.conf.Producer.MaxMessageBytes) {
		return nil, 0, sarama.ConfigurationError(fmt.Sprintf(
			"Attempt to produce message larger than configured Producer.MaxMessageBytes: %d > %d",
			size, p.conf.Producer.MaxMessageBytes))
	}
	return r, size, nil
}

// failRest fails the partition's messages from next on: the batch being sent
// (msgs[next:next+n]) with err, the rest with ErrNotSent.
func (pt *partition) failRest(errs sarama.ProducerErrors, err error) sarama.ProducerErrors {
	for i, m := range pt.msgs[pt.next:] {
		e := err
		if pt.n > 0 && i >= pt.n {
			e = ErrNotSent
		}
		errs = append(errs, &sarama.ProducerError{Msg: m, Err: e})
	}
	pt.next, pt.n, pt.batch = len(pt.msgs), 0, nil
	return errs
}

// build makes the partition's next batch, if it has none: as many messages
// as fit in Producer.MaxMessageBytes, at least one.
func (p *Producer) build(pt *partition) {
	if pt.batch != nil {
		return
	}
	now := time.Now().Truncate(time.Millisecond)
	b := &sarama.RecordBatch{
		Version:          2,
		Codec:            p.conf.Producer.Compression,
		CompressionLevel: p.conf.Producer.CompressionLevel,
		FirstTimestamp:   now,
		MaxTimestamp:     now,
		ProducerID:       -1,
		ProducerEpoch:    -1,
		FirstSequence:    -1,
	}
	size := batchOverhead
	n := 0
	var maxDelta time.Duration
	for i := pt.next; i < len(pt.msgs); i++ {
		if n > 0 && (pt.single || size+pt.sizes[i] > p.conf.Producer.MaxMessageBytes) {
			break
		}
		r := pt.recs[i]
		r.OffsetDelta = int64(n)
		r.TimestampDelta = 0
		if ts := pt.msgs[i].Timestamp; !ts.IsZero() {
			r.TimestampDelta = ts.Truncate(time.Millisecond).Sub(now)
			maxDelta = max(maxDelta, r.TimestampDelta)
		}
		b.Records = append(b.Records, r)
		size += pt.sizes[i]
		n++
	}
	b.LastOffsetDelta = int32(n - 1)
	b.MaxTimestamp = now.Add(maxDelta)
	pt.batch, pt.n, pt.tries, pt.err = b, n, 0, nil
}

// round sends the next batch of every active partition, one request per
// leader (within maxRequestBytes; partitions beyond wait for the next
// round), and settles the answers. It returns the partitions to retry. It
// looks up no leader it could not look up and send to before end, looks up
// a topic's leaders only until one lookup fails (that one refreshed the
// topic already), and waits for no request past end.
func (p *Producer) round(active []*partition, errs *sarama.ProducerErrors, end time.Time) []*partition {
	type request struct {
		broker *sarama.Broker
		req    *sarama.ProduceRequest
		parts  []*partition
		bytes  int
		resp   *sarama.ProduceResponse
		err    error
	}
	var retry []*partition
	var reqs []*request
	byBroker := map[*sarama.Broker]*request{}
	lookupFailed := map[string]error{}
	for _, pt := range active {
		if time.Now().Add(p.roundTime()).After(end) {
			*errs = pt.outOfTime(*errs)
			continue
		}
		p.build(pt)
		if err := lookupFailed[pt.topic]; err != nil {
			p.failed(pt, err, errs, &retry)
			continue
		}
		broker, err := p.client.Leader(pt.topic, pt.id)
		if err != nil {
			lookupFailed[pt.topic] = err
			p.failed(pt, err, errs, &retry)
			continue
		}
		bytes := 0
		for _, s := range pt.sizes[pt.next : pt.next+pt.n] {
			bytes += s
		}
		r := byBroker[broker]
		if r != nil && r.bytes+bytes > maxRequestBytes {
			continue
		}
		if r == nil {
			r = &request{broker: broker, req: &sarama.ProduceRequest{
				Version:      p.version,
				RequiredAcks: p.conf.Producer.RequiredAcks,
				Timeout:      int32(p.conf.Producer.Timeout / time.Millisecond),
			}}
			byBroker[broker] = r
			reqs = append(reqs, r)
		}
		r.req.AddBatch(pt.topic, pt.id, pt.batch)
		r.parts = append(r.parts, pt)
		r.bytes += bytes
	}
	if len(reqs) == 0 {
		return retry
	}

	// A request can wait behind other callers' on the broker's connection
	// (sarama sends one at a time per connection) and behind a reconnect,
	// so its own network timeouts do not bound it: the wait stops at end.
	// A request given up on here may still be written; its messages are
	// reported failed, retriably, and published twice.
	answered := make(chan *request, len(reqs))
	for _, r := range reqs {
		go func() {
			r.resp, r.err = r.broker.Produce(r.req)
			if r.err != nil && brokenConnection(r.err) {
				// The connection may be broken; Leader opens it again.
				_ = r.broker.Close()
			}
			answered <- r
		}()
	}
	timer := time.NewTimer(time.Until(end))
	defer timer.Stop()
	pending := len(reqs)
	for pending > 0 {
		select {
		case r := <-answered:
			pending--
			for _, pt := range r.parts {
				p.settle(pt, r.resp, r.err, errs, &retry)
			}
			r.parts = nil
		case <-timer.C:
			for _, r := range reqs {
				for _, pt := range r.parts {
					pt.err = errors.New("produce request not answered in time")
					*errs = pt.outOfTime(*errs)
				}
			}
			return retry
		}
	}
	return retry
}

// settle records the answer to the partition's batch.
func (p *Producer) settle(pt *partition, resp *sarama.ProduceResponse, err error, errs *sarama.ProducerErrors, retry *[]*partition) {
	if err != nil {
		p.failed(pt, err, errs, retry)
		return
	}
	if resp == nil { // acks=0: nothing to wait for
		pt.done(-1)
		return
	}
	switch block := resp.GetBlock(pt.topic, pt.id); {
	case block == nil:
		p.failed(pt, sarama.ErrIncompleteResponse, errs, retry)
	case block.Err == sarama.ErrNoError:
		pt.done(block.Offset)
	default:
		p.failed(pt, block.Err, errs, retry)
	}
}

// brokenConnection reports whether err from a request may mean its
// connection is broken: anything but an error about the request itself.
func brokenConnection(err error) bool {
	var enc sarama.PacketEncodingError
	var cfg sarama.ConfigurationError
	return !errors.As(err, &enc) && !errors.As(err, &cfg) && !errors.Is(err, sarama.ErrClosedClient)
}

// done records the partition's batch as acknowledged at offset (-1:
// unknown).
func (pt *partition) done(offset int64) {
	if offset >= 0 {
		for i, m := range pt.msgs[pt.next : pt.next+pt.n] {
			m.Offset = offset + int64(i)
		}
	}
	pt.next += pt.n
	pt.n, pt.batch, pt.tries, pt.err = 0, nil, 0, nil
}

// failed settles a failed attempt of the partition's batch: it is retried
// while the error is retriable and tries remain; otherwise the batch fails
// with err and the rest of the partition with ErrNotSent.
func (p *Producer) failed(pt *partition, err error, errs *sarama.ProducerErrors, retry *[]*partition) {
	pt.tries++
	pt.err = err
	if retriable(err) {
		if pt.tries <= p.conf.Producer.Retry.Max {
			*retry = append(*retry, pt)
			return
		}
	} else if pt.n > 1 {
		// Refused for good, but maybe for one message of the batch only:
		// the broker rejects a batch whole. Send the partition one message
		// per batch from here, so that the refusal lands on its cause.
		pt.single, pt.batch, pt.n, pt.tries = true, nil, 0, 0
		*retry = append(*retry, pt)
		return
	}
	*errs = pt.failRest(*errs, err)
}

// retriable reports whether err may go away by itself: the broker errors
// sarama's producer retries, and errors that are not a broker's answer (a
// broken connection, a timeout), except the client being closed.
func retriable(err error) bool {
	var kerr sarama.KError
	if !errors.As(err, &kerr) {
		var enc sarama.PacketEncodingError
		var cfg sarama.ConfigurationError
		return !errors.As(err, &enc) && !errors.As(err, &cfg) && !errors.Is(err, sarama.ErrClosedClient)
	}
	switch kerr {
	case sarama.ErrInvalidMessage, sarama.ErrUnknownTopicOrPartition, sarama.ErrLeaderNotAvailable,
		sarama.ErrNotLeaderForPartition, sarama.ErrRequestTimedOut, sarama.ErrNotEnoughReplicas,
		sarama.ErrNotEnoughReplicasAfterAppend, sarama.ErrKafkaStorageError, sarama.ErrNetworkException,
		sarama.ErrFencedLeaderEpoch, sarama.ErrUnknownLeaderEpoch:
		return true
	}
	return false
}

// Config sets on base, and returns it, the producer settings:
// acks=all, few retries so that a publish ends well inside a lease, no topic
// auto-creation (an unknown target must fail, not create a topic), and, for
// a sarama producer built from it (the benchmarks' reference, the tests'
// clients), idempotence, one request in flight and the Java-compatible
// murmur2 partitioner, which this producer uses too (a key lands on the
// partition the Java client would pick). The network timeouts come from base
// (KAFKA_TIMEOUT); callers set brokers, TLS and SASL there too.
func Config(base *sarama.Config) *sarama.Config {
	c := base
	c.Producer.Idempotent = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Return.Successes = true
	c.Producer.Return.Errors = true
	c.Producer.Partitioner = sarama.NewMurmur2Partitioner
	c.Producer.Retry.Max = 2
	c.Producer.Retry.Backoff = 100 * time.Millisecond
	// The broker waits up to Producer.Timeout for replicas; the read timeout
	// must outlast it or a slow but successful produce looks failed.
	c.Producer.Timeout = c.Net.ReadTimeout * 2 / 3
	c.Net.MaxOpenRequests = 1
	c.Metadata.AllowAutoTopicCreation = false
	c.Metadata.Retry.Max = 1
	c.Metadata.Retry.Backoff = 100 * time.Millisecond
	// Without it a metadata refresh tries every broker in turn, each up to
	// the network timeouts, which no lease could bound.
	c.Metadata.Timeout = 2 * c.Net.ReadTimeout
	return c
}
