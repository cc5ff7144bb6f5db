// Package deferclient is the consumer side of the defer scheduler, for Go
// services that consume Kafka with sarama (github.com/IBM/sarama); services
// on franz-go (github.com/twmb/franz-go) use deferclient/deferkgo, which
// keeps the same guarantees. Both build on deferclient/gate, which holds
// what does not depend on a Kafka client.
//
// A consumer that fails on a record for a reason that will heal defers it:
// Client.Defer forwards the record, unchanged but for a few headers, to the
// scheduler's input topic (scheduler.defer), and the scheduler republishes
// it to a retry topic when it is due, keeping the order of its business key.
//
// The library also keeps that order end to end, which the scheduler alone
// cannot: once message n of a business key is deferred, no later message of
// the key (from the main topic, or republished from the retry topic) is
// handed to the application before n was handled successfully by the
// consumer group, or an operator removed n. Client.ConsumerGroupHandler
// wraps the application's handler to do it: before a batch of records is
// handled, one request asks the scheduler which of their keys are blocked
// (Client.KeyStates), and a record of a blocked key is deferred behind the
// blocking message instead of being handled (a gated deferral, which is not
// a failure). The scheduler answers read-your-writes: it first waits until
// it has stored every record produced to the defer topic before the
// question, so a consumer that takes over a partition after a rebalance or
// a crash sees its predecessor's deferrals. After the scheduler republished
// the last message of a key, it keeps the key blocked until the consumer
// group's committed offset passed that record, so the next main-topic
// record of the key cannot overtake it while it waits, unconsumed, in the
// retry topic.
//
// The guarantee holds for a consumer group that handles its main topic and
// its retry topic through ConsumerGroupHandler, with records of one business
// key produced to one partition of the main topic. See the README's "Key
// order end to end" and docs/design.md section 23.
//
// Records go to the partition of scheduler.defer chosen by the business key
// (Java-compatible murmur2, see Partition), whatever the record key, which
// is kept byte for byte; the scheduler republishes to the retry topic's
// partition of the business key likewise. A record is signed when the
// Client has a source key (docs/signing.md).
package deferclient

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/deferclient/gate"
	"github.com/deferq/scheduler/internal/defer/protocol"
)

// DefaultDeferTopic is the scheduler's input topic unless it is configured
// otherwise (DEFER_TOPIC).
const DefaultDeferTopic = gate.DefaultDeferTopic

// Config configures a Client.
type Config struct {
	// Brokers are the Kafka brokers of the cluster that holds the defer
	// topic.
	Brokers []string
	// Kafka is the sarama configuration to start from: version, TLS, SASL,
	// client id. New copies what it needs and sets the producer's settings
	// itself (acks=all, idempotent, one request in flight, explicit
	// partitions). Nil: sarama's defaults at Kafka 3.6.
	Kafka *sarama.Config
	// DeferTopic is the scheduler's input topic; "" means DefaultDeferTopic.
	DeferTopic string
	// Group is the consumer group the service consumes as. Deferred records
	// name it (defer.group), and the scheduler answers key-state queries
	// for it. Required for ConsumerGroupHandler and KeyStates.
	Group string
	// SchedulerURL is the scheduler's HTTP address (its HTTP_ADDR), e.g.
	// "http://scheduler:8080", for the key-state query; or several,
	// separated by commas (the replicas, without a load balancer): a
	// question that one does not answer (no connection, or a 5xx) goes to
	// the next. Required for ConsumerGroupHandler and KeyStates.
	SchedulerURL string
	// Source names this service (1 to 128 of [A-Za-z0-9._-]); with
	// SourceKey, deferred records are signed and key-state queries
	// authenticated with it, as the scheduler's SIGNING_KEYS expect.
	Source    string
	SourceKey []byte
	// HTTPClient sends the key-state queries; nil means a client with a
	// timeout of KeyStateWait plus 5 seconds.
	HTTPClient *http.Client
	// KeyStateWait bounds how long the scheduler may wait for its ingest to
	// catch up with the defer topic before it answers (0: 2 seconds). Past
	// it, the answer is that it does not know, and the keys count as
	// blocked.
	KeyStateWait time.Duration
}

// Client defers records and asks which business keys are blocked. It is
// safe for concurrent use.
type Client struct {
	gate *gate.Gate
	p    *producer
}

// New returns a Client connected to cfg.Brokers.
func New(cfg Config) (*Client, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("deferclient: no brokers")
	}
	p := &producer{}
	// The configuration is checked before anything connects.
	g, err := gate.New(gate.Config{DeferTopic: cfg.DeferTopic, Group: cfg.Group, SchedulerURL: cfg.SchedulerURL,
		Source: cfg.Source, SourceKey: cfg.SourceKey, HTTPClient: cfg.HTTPClient, KeyStateWait: cfg.KeyStateWait}, p)
	if err != nil {
		return nil, err
	}
	kc := producerConfig(cfg.Kafka)
	p.client, err = sarama.NewClient(cfg.Brokers, kc)
	if err != nil {
		return nil, fmt.Errorf("deferclient: connect to %v: %w", cfg.Brokers, err)
	}
	p.producer, err = sarama.NewSyncProducerFromClient(p.client)
	if err != nil {
		p.client.Close()
		return nil, fmt.Errorf("deferclient: producer: %w", err)
	}
	return &Client{gate: g, p: p}, nil
}

// producerConfig returns the settings of the Client's producer: a record is
// acknowledged once every in-sync replica has it, retries cannot duplicate
// or reorder it, and its partition is the one Defer chose.
func producerConfig(base *sarama.Config) *sarama.Config {
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	if base != nil {
		c.Version, c.ClientID, c.Net, c.Metadata = base.Version, base.ClientID, base.Net, base.Metadata
	}
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Idempotent = true
	c.Net.MaxOpenRequests = 1
	c.Producer.Return.Successes = true
	c.Producer.Return.Errors = true
	c.Producer.Partitioner = sarama.NewManualPartitioner
	c.Producer.Retry.Max = 5
	c.Metadata.AllowAutoTopicCreation = false
	return c
}

// Close stops following the blocked-key set and closes the Client's
// producer and connections.
func (c *Client) Close() error {
	c.gate.Close()
	return errors.Join(c.p.producer.Close(), c.p.client.Close())
}

// producer is the gate's Producer over sarama. Its fields are set once, by
// New, before the Client is returned.
type producer struct {
	client   sarama.Client
	producer sarama.SyncProducer
}

// Partitions implements gate.Producer from sarama's metadata, which it
// refreshes in the background (Metadata.RefreshFrequency).
func (p *producer) Partitions(_ context.Context, topic string) (int32, error) {
	parts, err := p.client.Partitions(topic)
	return int32(len(parts)), err
}

// Produce implements gate.Producer. sarama's SyncProducer takes no
// context: a send ends when the broker answered or the retries ran out.
func (p *producer) Produce(_ context.Context, outs []gate.Out) ([]gate.Position, error) {
	msgs := make([]*sarama.ProducerMessage, len(outs))
	for i, o := range outs {
		m := &sarama.ProducerMessage{Topic: o.Topic, Partition: o.Partition, Headers: make([]sarama.RecordHeader, len(o.Headers))}
		for j, h := range o.Headers {
			m.Headers[j] = sarama.RecordHeader{Key: []byte(h.Key), Value: h.Value}
		}
		if o.Key != nil {
			m.Key = sarama.ByteEncoder(o.Key)
		}
		if o.Value != nil {
			m.Value = sarama.ByteEncoder(o.Value)
		}
		msgs[i] = m
	}
	var err error
	if len(msgs) == 1 {
		_, _, err = p.producer.SendMessage(msgs[0])
	} else {
		err = p.producer.SendMessages(msgs)
	}
	if err != nil {
		return nil, err
	}
	pos := make([]gate.Position, len(msgs))
	for i, m := range msgs {
		// The producer set where the record went.
		pos[i] = gate.Position{Partition: m.Partition, Offset: m.Offset}
	}
	return pos, nil
}

// Deferral says how to defer a record.
type Deferral = gate.Deferral

// Defer forwards msg to the scheduler as d says, and returns once the
// broker acknowledged it (acks=all): the deferral is then durable and msg's
// offset may be committed. Every header of msg is kept in order, but the
// one-shot and control headers Defer sets; the attempt is carried over from
// msg's defer.attempt, and a record the scheduler republished keeps its
// place among its key's messages (defer.id, defer.seq).
func (c *Client) Defer(ctx context.Context, msg *sarama.ConsumerMessage, d Deferral) error {
	return c.gate.Defer(ctx, record(msg), d)
}

// record converts msg for the gate, sharing its bytes.
func record(msg *sarama.ConsumerMessage) gate.Record {
	r := gate.Record{Topic: msg.Topic, Partition: msg.Partition, Offset: msg.Offset, Key: msg.Key, Value: msg.Value}
	if len(msg.Headers) > 0 {
		r.Headers = make([]gate.Header, 0, len(msg.Headers))
		for _, h := range msg.Headers {
			if h != nil {
				r.Headers = append(r.Headers, gate.Header{Key: string(h.Key), Value: h.Value})
			}
		}
	}
	return r
}

// Partition returns the partition, of partitions, a record of business key
// key goes to: in the defer topic when Defer sends it, and in the retry
// topic when the scheduler republishes it. It is the Java client's default
// partitioner applied to the key's bytes.
func Partition(key string, partitions int32) int32 {
	return gate.Partition(key, partitions)
}

// BusinessKey returns the business key the scheduler gives msg when
// nothing else names one: its defer.key header when present, else its
// record key as text (a key that is not UTF-8 becomes "\x" and hex), "" for
// none (unordered).
func BusinessKey(msg *sarama.ConsumerMessage) string {
	// As gate.BusinessKey, without converting the headers: a handler's
	// BusinessKey may be called for every record.
	for _, h := range msg.Headers {
		if h != nil && string(h.Key) == protocol.HeaderKey {
			return protocol.Text(h.Value)
		}
	}
	return protocol.Text(msg.Key)
}

// Stats counts what a Client did since it was created.
type Stats = gate.Stats

// Stats returns the Client's counts so far.
func (c *Client) Stats() Stats {
	return c.gate.Stats()
}
