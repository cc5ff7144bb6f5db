package dispatch

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/IBM/sarama"

	deferral "github.com/deferq/scheduler/internal/defer"
	"github.com/deferq/scheduler/internal/keylock"
)

// Producer is the part of sarama.SyncProducer dispatch uses.
type Producer interface {
	SendMessages(msgs []*sarama.ProducerMessage) error
}

// ProducerConfig sets on base, and returns it, the producer settings: idempotent, acks=all, one
// request in flight (so retries cannot reorder a partition), the
// Java-compatible murmur2 partitioner (a key lands on the partition the Java
// client would pick), no topic auto-creation (an unknown target must fail,
// not create a topic), and few retries so that a publish ends well inside a
// lease. The network timeouts come from base (KAFKA_TIMEOUT); callers set
// brokers, TLS and SASL there too.
func ProducerConfig(base *sarama.Config) *sarama.Config {
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

// MaxPublishDuration bounds how long one SendMessages call can take with
// config c (from ProducerConfig): every produce attempt can wait for a dial, a
// write and a read, plus the back-off before the next; and the producer
// refreshes metadata before the first attempt and after each failed one, each
// refresh bounded by Metadata.Timeout. A lease must be longer, or a slow
// publish could overlap a second holder's. With every network timeout T, this
// is 17T + 0.3s.
func MaxPublishDuration(c *sarama.Config) time.Duration {
	step := c.Net.DialTimeout + c.Net.WriteTimeout + c.Net.ReadTimeout
	tries := time.Duration(c.Producer.Retry.Max + 1)
	return tries*(step+c.Producer.Retry.Backoff) + (tries+1)*c.Metadata.Timeout
}

// scheduledHeaders are the headers the scheduler writes on every republished
// record, in the order they are appended.
func scheduledHeaders() [4]string {
	return [4]string{deferral.HeaderID, deferral.HeaderSeq, deferral.HeaderAttempt, deferral.HeaderScheduledAt}
}

// Record builds the republished record for m (DESIGN.md section 2): same key,
// value and headers in the same order, except that defer.at and defer.delay
// are removed (they are one-shot), defer.id, defer.seq, defer.attempt and
// defer.scheduled-at are set (in place where the input had them, appended
// otherwise; extra copies dropped), and defer.target is set to the row's
// target, which differs from the header only after an operator edited it.
func Record(m keylock.Message) *sarama.ProducerMessage {
	names := scheduledHeaders()
	values := [len(names)][]byte{
		[]byte(strconv.FormatInt(m.ID, 10)),
		[]byte(strconv.FormatInt(m.Seq, 10)),
		[]byte(strconv.FormatInt(int64(m.Attempt)+1, 10)),
		[]byte(m.NextRunAt.UTC().Format(time.RFC3339Nano)),
	}
	var written [len(names)]bool
	out := make([]sarama.RecordHeader, 0, len(m.Headers)+len(names))
	for _, h := range m.Headers {
		switch h.Key {
		case deferral.HeaderAt, deferral.HeaderDelay:
			continue
		case deferral.HeaderTarget:
			out = append(out, sarama.RecordHeader{Key: []byte(h.Key), Value: []byte(m.Target)})
			continue
		}
		i := slices.Index(names[:], h.Key)
		if i < 0 {
			out = append(out, sarama.RecordHeader{Key: []byte(h.Key), Value: h.Value})
			continue
		}
		if !written[i] {
			out = append(out, sarama.RecordHeader{Key: []byte(h.Key), Value: values[i]})
			written[i] = true
		}
	}
	for i, name := range names {
		if !written[i] {
			out = append(out, sarama.RecordHeader{Key: []byte(name), Value: values[i]})
		}
	}
	pm := &sarama.ProducerMessage{Topic: m.Target, Headers: out}
	// A nil key must stay nil (no key, random partition); an empty key is a
	// key and hashes like one.
	if m.Key != nil {
		pm.Key = sarama.ByteEncoder(m.Key)
	}
	if m.Value != nil {
		pm.Value = sarama.ByteEncoder(m.Value)
	}
	return pm
}

// errorKind says what a failed publish means for the message.
type errorKind int

const (
	// retriable: the broker or network may recover; keep it pending.
	retriable errorKind = iota
	// permanent: this message can never be published as it is; park it.
	permanent
)

// classify sorts a publish error. Only errors that are about the message or
// its target (and so will fail the same way every time) are permanent;
// anything that could be the broker being away is retriable. The reason of a
// permanent error is what the parked row's reason says.
func classify(err error) (errorKind, string) {
	code := publishErrorCode(err)
	if code == "retriable" {
		return retriable, code
	}
	return permanent, fmt.Sprintf("publish_failed: %s: %v", code, err)
}

// publishErrorCode names a publish error for metrics and reasons: the code of
// a permanent error, or "retriable".
func publishErrorCode(err error) string {
	var cfgErr sarama.ConfigurationError
	switch {
	case errors.As(err, &cfgErr) && strings.Contains(string(cfgErr), "MaxMessageBytes"):
		// sarama checks the size before sending and reports it this way.
		return "too_large"
	case errors.Is(err, sarama.ErrUnknownTopicOrPartition):
		return "unknown_topic"
	case errors.Is(err, sarama.ErrInvalidTopic):
		return "invalid_topic"
	case errors.Is(err, sarama.ErrTopicAuthorizationFailed):
		return "not_authorized"
	case errors.Is(err, sarama.ErrMessageSizeTooLarge), errors.Is(err, sarama.ErrMessageSetSizeTooLarge):
		return "too_large"
	case errors.Is(err, sarama.ErrInvalidRecord), errors.Is(err, sarama.ErrPolicyViolation):
		return "invalid_record"
	}
	return "retriable"
}
