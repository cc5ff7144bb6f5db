// Package deferclient is the consumer side of the defer scheduler, for Go
// services that consume Kafka with sarama (github.com/IBM/sarama).
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
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/defer/protocol"
)

// DefaultDeferTopic is the scheduler's input topic unless it is configured
// otherwise (DEFER_TOPIC).
const DefaultDeferTopic = "scheduler.defer"

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
	cfg      Config
	urls     []string
	kafka    sarama.Client
	producer sarama.SyncProducer
	http     *http.Client
	// next rotates the scheduler URL a query starts with.
	next atomic.Uint32
	// waitAllOnly: a scheduler refused a question that waits for less
	// than the whole topic (a release before the wait field); every
	// question waits for all from then on.
	waitAllOnly atomic.Bool

	// pending remembers the keys this process deferred until the scheduler
	// confirms them (see KeyStates).
	pendingMu sync.Mutex
	pending   map[string]localDeferral

	statsMu sync.Mutex
	stats   Stats
}

// localDeferral is a deferral of this process the scheduler may not have
// stored yet.
type localDeferral struct {
	at time.Time
	// seq is the deferred record's defer.seq (a re-deferral keeps its
	// place); 0 for a new message, which lands behind everything.
	seq int64
	// partition and offset are where the key's latest deferral went in
	// the defer topic: an answer whose Stored passes offset covers it.
	partition int32
	offset    int64
}

// New returns a Client connected to cfg.Brokers.
func New(cfg Config) (*Client, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("deferclient: no brokers")
	}
	if cfg.Source != "" && !protocol.ValidSource(cfg.Source) {
		return nil, fmt.Errorf("deferclient: source %q is not 1 to %d of [A-Za-z0-9._-]", cfg.Source, protocol.MaxSourceBytes)
	}
	if len(cfg.SourceKey) > 0 && len(cfg.SourceKey) < protocol.MinKeyBytes {
		return nil, fmt.Errorf("deferclient: source key of %d bytes, need at least %d", len(cfg.SourceKey), protocol.MinKeyBytes)
	}
	if len(cfg.SourceKey) > 0 && cfg.Source == "" {
		return nil, errors.New("deferclient: a source key needs a source name")
	}
	if len(cfg.Group) > protocol.MaxGroupBytes {
		return nil, fmt.Errorf("deferclient: group of %d bytes, at most %d", len(cfg.Group), protocol.MaxGroupBytes)
	}
	if cfg.DeferTopic == "" {
		cfg.DeferTopic = DefaultDeferTopic
	}
	if cfg.KeyStateWait <= 0 {
		cfg.KeyStateWait = 2 * time.Second
	}
	kc := producerConfig(cfg.Kafka)
	client, err := sarama.NewClient(cfg.Brokers, kc)
	if err != nil {
		return nil, fmt.Errorf("deferclient: connect to %v: %w", cfg.Brokers, err)
	}
	producer, err := sarama.NewSyncProducerFromClient(client)
	if err != nil {
		client.Close()
		return nil, fmt.Errorf("deferclient: producer: %w", err)
	}
	hc := cfg.HTTPClient
	if hc == nil {
		hc = &http.Client{Timeout: cfg.KeyStateWait + 5*time.Second}
	}
	var urls []string
	for _, u := range strings.Split(cfg.SchedulerURL, ",") {
		if u = strings.TrimRight(strings.TrimSpace(u), "/"); u != "" {
			urls = append(urls, u)
		}
	}
	return &Client{cfg: cfg, urls: urls, kafka: client, producer: producer, http: hc, pending: map[string]localDeferral{}}, nil
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

// Close closes the Client's producer and connections.
func (c *Client) Close() error {
	return errors.Join(c.producer.Close(), c.kafka.Close())
}

// Deferral says how to defer a record.
type Deferral struct {
	// Target is the topic the scheduler republishes the record to, the
	// consumer's retry topic. "" keeps the record's defer.target (a record
	// the scheduler republished has one); Defer fails when it has none.
	Target string
	// BusinessKey orders the record among the others of its business
	// process. "" keeps the record's defer.key, else uses the record key as
	// text (a key that is not UTF-8 becomes "\x" and hex, as the scheduler
	// does); a record with neither is unordered.
	BusinessKey string
	// Delay or At, not both, say when to republish; with neither, the
	// scheduler's retry policy for Target picks the delay from the attempt.
	Delay time.Duration
	At    time.Time
	// ErrorClass and ErrorMessage say why the record failed, for the
	// scheduler's policies (ErrorClass "permanent", or one matching its
	// NON_RETRIABLE_ERRORS, parks the record) and for operators.
	ErrorClass   string
	ErrorMessage string
}

// Defer forwards msg to the scheduler as d says, and returns once the
// broker acknowledged it (acks=all): the deferral is then durable and msg's
// offset may be committed. Every header of msg is kept in order, but the
// one-shot and control headers Defer sets; the attempt is carried over from
// msg's defer.attempt, and a record the scheduler republished keeps its
// place among its key's messages (defer.id, defer.seq).
func (c *Client) Defer(ctx context.Context, msg *sarama.ConsumerMessage, d Deferral) error {
	_, err := c.deferRecord(ctx, msg, d, false)
	return err
}

// deferRecord builds and produces the deferral of msg; gated marks a record
// deferred behind a blocked key rather than after a failure. It returns the
// business key the record was deferred under.
func (c *Client) deferRecord(ctx context.Context, msg *sarama.ConsumerMessage, d Deferral, gated bool) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	o, err := c.build(msg, d, gated)
	if err != nil {
		return "", err
	}
	if _, _, err := c.producer.SendMessage(o.out); err != nil {
		return "", fmt.Errorf("deferclient: produce to %s: %w", c.cfg.DeferTopic, err)
	}
	c.sent(o)
	return o.key, nil
}

// outgoing is a deferral built and not sent yet.
type outgoing struct {
	out   *sarama.ProducerMessage
	key   string // business key; "" unordered
	seq   int64  // the record's defer.seq, 0 for none
	gated bool
}

// sendAll produces deferrals in order, in as few requests as the producer
// can: a consumer gating many records of a batch pays one round trip, not
// one per record. Order within each partition is kept (one request in
// flight, idempotent producer). On error some may have been written: their
// records are not marked, so they are read and deferred again (at least
// once).
func (c *Client) sendAll(os []outgoing) error {
	if len(os) == 0 {
		return nil
	}
	msgs := make([]*sarama.ProducerMessage, len(os))
	for i := range os {
		msgs[i] = os[i].out
	}
	if err := c.producer.SendMessages(msgs); err != nil {
		return fmt.Errorf("deferclient: produce %d records to %s: %w", len(msgs), c.cfg.DeferTopic, err)
	}
	for _, o := range os {
		c.sent(o)
	}
	return nil
}

// sent notes a deferral the broker acknowledged.
func (c *Client) sent(o outgoing) {
	if o.key != "" {
		// The producer set where the record went.
		c.remember(o.key, o.seq, o.out.Partition, o.out.Offset)
	}
	c.count(func(s *Stats) {
		if o.gated {
			s.Gated++
		} else {
			s.Deferred++
		}
	})
}

// build makes the record that defers msg as d says.
func (c *Client) build(msg *sarama.ConsumerMessage, d Deferral, gated bool) (outgoing, error) {
	fail := func(err error) (outgoing, error) { return outgoing{}, err }
	if !d.At.IsZero() && d.Delay != 0 {
		return fail(errors.New("deferclient: a deferral has a Delay or an At, not both"))
	}
	if d.Delay < 0 {
		return fail(fmt.Errorf("deferclient: negative delay %v", d.Delay))
	}
	target := d.Target
	if target == "" {
		target = header(msg, protocol.HeaderTarget)
	}
	if target == "" {
		return fail(fmt.Errorf("deferclient: no target for the record of %s/%d at offset %d: set Deferral.Target", msg.Topic, msg.Partition, msg.Offset))
	}
	key := d.BusinessKey
	if key == "" {
		key = BusinessKey(msg)
	}
	if len(key) > protocol.DefaultMaxKeyBytes {
		return fail(fmt.Errorf("deferclient: business key of %d bytes, more than the scheduler's limit of %d", len(key), protocol.DefaultMaxKeyBytes))
	}

	// Every header of the record, in order, but those Defer sets: one-shot
	// schedule headers, the signature (of another source, or stale), and
	// the control headers replaced below.
	set := map[string]string{protocol.HeaderTarget: target, protocol.HeaderKey: key}
	if c.cfg.Group != "" {
		set[protocol.HeaderGroup] = c.cfg.Group
	}
	if d.ErrorClass != "" {
		set[protocol.HeaderErrorClass] = d.ErrorClass
	}
	if d.ErrorMessage != "" {
		set[protocol.HeaderErrorMessage] = d.ErrorMessage
	}
	switch {
	case gated:
		// Not a failure: the record was never tried, so it goes back with
		// the attempts it had, which the scheduler's output counted one up.
		set[protocol.HeaderGated] = "true"
		set[protocol.HeaderDelay] = "0"
		if a, err := strconv.Atoi(header(msg, protocol.HeaderAttempt)); err == nil && a > 0 {
			set[protocol.HeaderAttempt] = strconv.Itoa(a - 1)
		}
	case d.Delay > 0:
		set[protocol.HeaderDelay] = strconv.FormatInt(d.Delay.Milliseconds(), 10)
	case !d.At.IsZero():
		set[protocol.HeaderAt] = d.At.UTC().Format(time.RFC3339Nano)
	}
	if c.cfg.Source != "" {
		set[protocol.HeaderSource] = c.cfg.Source
	}
	drop := map[string]bool{protocol.HeaderDelay: true, protocol.HeaderAt: true, protocol.HeaderSignature: true,
		protocol.HeaderGated: true}
	var headers []sarama.RecordHeader
	for _, h := range msg.Headers {
		name := string(h.Key)
		if v, ok := set[name]; ok {
			headers = append(headers, sarama.RecordHeader{Key: h.Key, Value: []byte(v)})
			delete(set, name)
			continue
		}
		if drop[name] {
			continue
		}
		headers = append(headers, sarama.RecordHeader{Key: h.Key, Value: h.Value})
	}
	for _, name := range []string{protocol.HeaderTarget, protocol.HeaderKey, protocol.HeaderGroup, protocol.HeaderSource,
		protocol.HeaderAttempt, protocol.HeaderErrorClass, protocol.HeaderErrorMessage, protocol.HeaderGated,
		protocol.HeaderDelay, protocol.HeaderAt} {
		if v, ok := set[name]; ok {
			headers = append(headers, sarama.RecordHeader{Key: []byte(name), Value: []byte(v)})
		}
	}
	if len(c.cfg.SourceKey) > 0 {
		rec := protocol.Record{Key: msg.Key, Value: msg.Value}
		for _, h := range headers {
			rec.Headers = append(rec.Headers, protocol.Header{Key: h.Key, Value: h.Value})
		}
		sig, err := protocol.Sign(c.cfg.SourceKey, rec)
		if err != nil {
			return fail(fmt.Errorf("deferclient: sign the record: %w", err))
		}
		headers = append(headers, sarama.RecordHeader{Key: []byte(protocol.HeaderSignature), Value: []byte(sig)})
	}

	partition, err := c.partition(key, msg.Key)
	if err != nil {
		return fail(err)
	}
	out := &sarama.ProducerMessage{Topic: c.cfg.DeferTopic, Partition: partition, Headers: headers}
	if msg.Key != nil {
		out.Key = sarama.ByteEncoder(msg.Key)
	}
	if msg.Value != nil {
		out.Value = sarama.ByteEncoder(msg.Value)
	}
	seq, _ := strconv.ParseInt(header(msg, protocol.HeaderSeq), 10, 64)
	return outgoing{out: out, key: key, seq: seq, gated: gated}, nil
}

// partition returns the partition of the defer topic a record of business
// key key goes to: the key's murmur2 partition, so that every record of the
// key is read in order, whatever its record key; an unordered record goes
// by its record key, as a Java producer would send it.
func (c *Client) partition(key string, recordKey []byte) (int32, error) {
	parts, err := c.kafka.Partitions(c.cfg.DeferTopic)
	if err != nil {
		return 0, fmt.Errorf("deferclient: partitions of %s: %w", c.cfg.DeferTopic, err)
	}
	if len(parts) == 0 {
		return 0, fmt.Errorf("deferclient: %s has no partitions", c.cfg.DeferTopic)
	}
	n := int32(len(parts))
	if key != "" {
		return protocol.Partition([]byte(key), n), nil
	}
	if recordKey != nil {
		return protocol.Partition(recordKey, n), nil
	}
	return int32(time.Now().UnixNano() % int64(n)), nil
}

// Partition returns the partition, of partitions, a record of business key
// key goes to: in the defer topic when Defer sends it, and in the retry
// topic when the scheduler republishes it. It is the Java client's default
// partitioner applied to the key's bytes.
func Partition(key string, partitions int32) int32 {
	return protocol.Partition([]byte(key), partitions)
}

// BusinessKey returns the business key the scheduler gives msg when
// nothing else names one: its defer.key header when present, else its
// record key as text (a key that is not UTF-8 becomes "\x" and hex), "" for
// none (unordered).
func BusinessKey(msg *sarama.ConsumerMessage) string {
	for _, h := range msg.Headers {
		if string(h.Key) == protocol.HeaderKey {
			return protocol.Text(h.Value)
		}
	}
	return protocol.Text(msg.Key)
}

// header returns the value of msg's first header named name, "" if none.
func header(msg *sarama.ConsumerMessage, name string) string {
	for _, h := range msg.Headers {
		if string(h.Key) == name {
			return string(h.Value)
		}
	}
	return ""
}

// Stats counts what a Client did since it was created.
type Stats struct {
	// Handled counts records the wrapped handler handled successfully.
	Handled int64
	// Deferred counts records deferred after a failure (Defer, or the
	// handler's error); Gated those deferred behind a blocked key.
	Deferred, Gated int64
	// Queries counts key-state queries answered; QueryFailures those that
	// failed or came back unsure, whose keys then counted as blocked.
	Queries, QueryFailures int64
}

// Stats returns the Client's counts so far.
func (c *Client) Stats() Stats {
	c.statsMu.Lock()
	defer c.statsMu.Unlock()
	return c.stats
}

func (c *Client) count(f func(*Stats)) {
	c.statsMu.Lock()
	defer c.statsMu.Unlock()
	f(&c.stats)
}
