// Package deferkgo is the consumer side of the defer scheduler for Go
// services that consume Kafka with franz-go (github.com/twmb/franz-go, its
// kgo package), with the guarantees of deferclient, its sarama
// counterpart: Client.Defer forwards a failed record to the scheduler's
// input topic, and Client.Consume runs a kgo consumer group's poll loop
// that keeps the order of every business key end to end: once message n
// of a key is deferred, no later message of the key (from the main topic,
// or republished from the retry topic) reaches the handler before n was
// handled successfully by the group, or an operator removed n.
//
// The two packages share deferclient/gate, which holds what does not
// depend on a Kafka client (Deferral, KeyState, Stats, Permanent,
// DefaultClassify); a franz-go service does not import sarama, nor a sarama
// service franz-go. See the README's "Key order end to end" and
// docs/design.md section 23.
package deferkgo

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/deferq/scheduler/deferclient/gate"
	"github.com/deferq/scheduler/internal/defer/protocol"
)

// DefaultDeferTopic is the scheduler's input topic unless it is configured
// otherwise (DEFER_TOPIC).
const DefaultDeferTopic = gate.DefaultDeferTopic

// Deferral says how to defer a record (gate.Deferral).
type Deferral = gate.Deferral

// KeyState says whether a business key is blocked for the Client's group
// (gate.KeyState; its Reason is one of gate's Reason constants).
type KeyState = gate.KeyState

// Stats counts what a Client did since it was created (gate.Stats).
type Stats = gate.Stats

// Config configures a Client.
type Config struct {
	// Brokers are the Kafka brokers of the cluster that holds the defer
	// topic.
	Brokers []string
	// Opts are more options for the Client's producing kgo.Client, for
	// what the cluster needs: TLS (kgo.DialTLSConfig), SASL (kgo.SASL), a
	// client id. New sets the producer's settings after them: every
	// in-sync replica acknowledges a record (acks=all), its partition is
	// the one Defer chose (kgo.ManualPartitioner). Records are written
	// idempotently, kgo's default: do not pass
	// kgo.DisableIdempotentWrite, with which a retry may reorder them, nor
	// consumer options.
	Opts []kgo.Opt
	// DeferTopic is the scheduler's input topic; "" means
	// DefaultDeferTopic.
	DeferTopic string
	// Group is the consumer group the service consumes as, the one the
	// consuming kgo.Client joins (kgo.ConsumerGroup). Deferred records
	// name it (defer.group), and the scheduler answers key-state queries
	// for it. Required for Consume and KeyStates.
	Group string
	// SchedulerURL is the scheduler's HTTP address (its HTTP_ADDR), e.g.
	// "http://scheduler:8080", for the key-state query; or several,
	// separated by commas (the replicas, without a load balancer): a
	// question that one does not answer (no connection, or a 5xx) goes to
	// the next. Required for Consume and KeyStates.
	SchedulerURL string
	// Source names this service (1 to 128 of [A-Za-z0-9._-]); with
	// SourceKey, deferred records are signed and key-state queries
	// authenticated with it, as the scheduler's SIGNING_KEYS expect.
	Source    string
	SourceKey []byte
	// HTTPClient sends the key-state queries; nil means a client with a
	// timeout of KeyStateWait plus 5 seconds.
	HTTPClient *http.Client
	// KeyStateWait bounds how long the scheduler may wait for its ingest
	// to catch up with the defer topic before it answers (0: 2 seconds).
	// Past it, the answer is that it does not know, and the keys count as
	// blocked.
	KeyStateWait time.Duration
}

// deliveryTimeout bounds how long a deferral may wait for the broker's
// acknowledgement: past it the deferral fails, and the record it defers is
// read again, rather than the consumer waiting without end while the
// cluster cannot take it.
const deliveryTimeout = 30 * time.Second

// Client defers records, asks which business keys are blocked, and runs a
// consumer group's poll loop through the gate. It is safe for concurrent
// use.
type Client struct {
	gate *gate.Gate
	p    *producer

	// members are the consuming kgo.Clients whose group membership the
	// hooks of GroupOpts followed.
	mu      sync.Mutex
	members map[*kgo.Client]*member
	// noGate: Consume runs with HandlerConfig.NoGate, and an assignment
	// loads no blocked-key set.
	noGate atomic.Bool
}

// member is what the Client knows of one consuming kgo.Client.
type member struct {
	// claims holds the state of each partition the client was assigned,
	// made fresh at each assignment.
	claims map[topicPartition]*gate.ClaimState
	// left: Consume made the client leave the group (ErrLeftGroup).
	left bool
}

type topicPartition struct {
	topic     string
	partition int32
}

// New returns a Client that produces to cfg.Brokers. Like every kgo
// client, it connects when it first needs to.
func New(cfg Config) (*Client, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("deferkgo: no brokers")
	}
	p := &producer{}
	// The configuration is checked before the producing client is made.
	g, err := gate.New(gate.Config{DeferTopic: cfg.DeferTopic, Group: cfg.Group, SchedulerURL: cfg.SchedulerURL,
		Source: cfg.Source, SourceKey: cfg.SourceKey, HTTPClient: cfg.HTTPClient, KeyStateWait: cfg.KeyStateWait}, p)
	if err != nil {
		return nil, err
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...),
		// A deferral is awaited by the consumer that sends it: it goes
		// out at once rather than lingering for more records.
		kgo.ProducerLinger(0),
		kgo.RecordDeliveryTimeout(deliveryTimeout),
	}
	opts = append(opts, cfg.Opts...)
	opts = append(opts,
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
	)
	p.cl, err = kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("deferkgo: producing client for %v: %w", cfg.Brokers, err)
	}
	// The defer topic's partition count is read from metadata no older
	// than the client's own (kgo.MetadataMaxAge, 5 minutes by default).
	p.maxAge, _ = p.cl.OptValue(kgo.MetadataMaxAge).(time.Duration)
	return &Client{gate: g, p: p, members: map[*kgo.Client]*member{}}, nil
}

// Close stops following the blocked-key set and closes the Client's
// producing kgo.Client. The consuming one is the caller's to close.
func (c *Client) Close() {
	c.gate.Close()
	c.p.cl.Close()
}

// Defer forwards r to the scheduler as d says, and returns once the broker
// acknowledged it (acks=all): the deferral is then durable and r's offset
// may be committed. Every header of r is kept in order, but the one-shot
// and control headers Defer sets; the attempt is carried over from r's
// defer.attempt, and a record the scheduler republished keeps its place
// among its key's messages (defer.id, defer.seq). The deferral goes to the
// partition of the defer topic of its business key (gate.Partition),
// whatever its record key, which is kept byte for byte. It is signed when
// the Client has a SourceKey.
func (c *Client) Defer(ctx context.Context, r *kgo.Record, d Deferral) error {
	if r == nil {
		return errors.New("deferkgo: Defer of a nil record")
	}
	return c.gate.Defer(ctx, record(r), d)
}

// KeyStates asks the scheduler whether keys are blocked for the Client's
// consumer group, in one request. The answer reflects every record
// produced to the defer topic before the call (the scheduler waits for its
// ingest to catch up, at most Config.KeyStateWait), and this process's own
// deferrals even before the scheduler stored them. On error, which wraps
// gate.ErrUnsure, every key is returned blocked with gate.ReasonUnknown.
func (c *Client) KeyStates(ctx context.Context, keys []string) (map[string]KeyState, error) {
	return c.gate.KeyStates(ctx, keys)
}

// Stats returns the Client's counts so far.
func (c *Client) Stats() Stats {
	return c.gate.Stats()
}

// BusinessKey returns the business key the scheduler gives r when nothing
// else names one: its defer.key header when present, else its record key
// as text (a key that is not UTF-8 becomes "\x" and hex), "" for none
// (unordered).
func BusinessKey(r *kgo.Record) string {
	// As gate.BusinessKey, without converting the headers: it runs for
	// every record consumed.
	for _, h := range r.Headers {
		if h.Key == protocol.HeaderKey {
			return protocol.Text(h.Value)
		}
	}
	return protocol.Text(r.Key)
}

// record converts r for the gate, sharing its bytes.
func record(r *kgo.Record) gate.Record {
	g := gate.Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value}
	if len(r.Headers) > 0 {
		g.Headers = make([]gate.Header, len(r.Headers))
		for i, h := range r.Headers {
			g.Headers[i] = gate.Header{Key: h.Key, Value: h.Value}
		}
	}
	return g
}

// producer is the gate's Producer over a kgo.Client. Its fields are set
// once, by New, before the Client is returned.
type producer struct {
	cl     *kgo.Client
	maxAge time.Duration
}

// Partitions implements gate.Producer from the client's cached metadata.
func (p *producer) Partitions(ctx context.Context, topic string) (int32, error) {
	req := kmsg.NewPtrMetadataRequest()
	rt := kmsg.NewMetadataRequestTopic()
	rt.Topic = kmsg.StringPtr(topic)
	req.Topics = append(req.Topics, rt)
	resp, err := p.cl.RequestCachedMetadata(ctx, req, p.maxAge)
	if err != nil {
		return 0, fmt.Errorf("metadata of %s: %w", topic, err)
	}
	for _, t := range resp.Topics {
		if t.Topic == nil || *t.Topic != topic {
			continue
		}
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
			return 0, fmt.Errorf("metadata of %s: %w", topic, err)
		}
		return int32(len(t.Partitions)), nil
	}
	return 0, fmt.Errorf("metadata of %s: the broker did not answer for it", topic)
}

// Produce implements gate.Producer: kgo.Client.ProduceSync keeps the
// records' order within each partition (idempotent producer) and returns
// their results in the order given.
func (p *producer) Produce(ctx context.Context, outs []gate.Out) ([]gate.Position, error) {
	recs := make([]*kgo.Record, len(outs))
	for i, o := range outs {
		r := &kgo.Record{Topic: o.Topic, Partition: o.Partition, Key: o.Key, Value: o.Value,
			Headers: make([]kgo.RecordHeader, len(o.Headers))}
		for j, h := range o.Headers {
			r.Headers[j] = kgo.RecordHeader{Key: h.Key, Value: h.Value}
		}
		recs[i] = r
	}
	if err := p.cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		return nil, err
	}
	pos := make([]gate.Position, len(recs))
	for i, r := range recs {
		// ProduceSync set where the record went.
		pos[i] = gate.Position{Partition: r.Partition, Offset: r.Offset}
	}
	return pos, nil
}
