package dispatch

import (
	"errors"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/reason"
)

// Producer is what dispatch publishes with: a batchproducer.Producer in the
// service, whose failures are monotonic per partition (a message is never
// acknowledged after an earlier one of its partition failed in the same
// call), which the per-key order of a multi-message run relies on. It
// returns nil or sarama.ProducerErrors.
type Producer interface {
	SendMessages(msgs []*sarama.ProducerMessage) error
}

// Headers the scheduler writes on dead-letter copies only (see DeadLetter),
// next to the control headers of internal/defer.
const (
	// HeaderDLQReason is the parked message's reason ("code: detail").
	HeaderDLQReason = "defer.dlq.reason"
	// HeaderParkedAt is when the message was parked, RFC 3339.
	HeaderParkedAt = "defer.parked-at"
	// HeaderSourceTopic, HeaderSourcePartition and HeaderSourceOffset say
	// where the message was read in the defer topic; absent for a row an
	// operator inserted by hand.
	HeaderSourceTopic     = "defer.source.topic"
	HeaderSourcePartition = "defer.source.partition"
	HeaderSourceOffset    = "defer.source.offset"
)

// editMode says what rewriteHeaders does with one header name.
type editMode int

const (
	// set: the first occurrence takes the value in place, later ones are
	// dropped, and the header is appended if absent.
	set editMode = iota
	// replace: every occurrence takes the value; nothing is appended.
	replace
	// drop: every occurrence is removed.
	drop
)

// headerEdit is one change rewriteHeaders makes.
type headerEdit struct {
	name  string
	value []byte
	mode  editMode
}

// setOrDrop is a set of name to *value, or a drop when value is nil (the
// row has no such value, so a stale header must not survive).
func setOrDrop(name string, value *string) headerEdit {
	if value == nil {
		return headerEdit{name: name, mode: drop}
	}
	return headerEdit{name: name, value: []byte(*value), mode: set}
}

// rewriteHeaders returns in with edits applied, keeping every other header
// byte for byte and in order. Headers that are set but were absent are
// appended in the order of edits.
func rewriteHeaders(in []keylock.Header, edits []headerEdit) []sarama.RecordHeader {
	written := make([]bool, len(edits))
	out := make([]sarama.RecordHeader, 0, len(in)+len(edits))
	for _, h := range in {
		i := slices.IndexFunc(edits, func(e headerEdit) bool { return e.name == h.Key })
		if i < 0 {
			out = append(out, sarama.RecordHeader{Key: []byte(h.Key), Value: h.Value})
			continue
		}
		e := edits[i]
		switch {
		case e.mode == drop, e.mode == set && written[i]:
			continue
		}
		out = append(out, sarama.RecordHeader{Key: []byte(h.Key), Value: e.value})
		written[i] = true
	}
	for i, e := range edits {
		if e.mode == set && !written[i] {
			out = append(out, sarama.RecordHeader{Key: []byte(e.name), Value: e.value})
		}
	}
	return out
}

// redriveEdit sets defer.redrive-count to n, or removes a stale copy when n
// is 0: the header says the message went round the parking lot.
func redriveEdit(n int32) headerEdit {
	if n <= 0 {
		return headerEdit{name: protocol.HeaderRedriveCount, mode: drop}
	}
	return headerEdit{name: protocol.HeaderRedriveCount, value: []byte(strconv.FormatInt(int64(n), 10)), mode: set}
}

// Record builds the republished record for m (docs/design.md section 2.2): same key,
// value and headers in the same order, except that defer.at and defer.delay
// are removed (they are one-shot), and so is defer.signature (it covers
// headers removed or rewritten here, so it could not verify; defer.source
// stays, and a consumer that defers the record again signs it anew),
// defer.id, defer.seq, defer.attempt and defer.scheduled-at are set (in
// place where the input had them, appended otherwise; extra copies
// dropped), defer.redrive-count likewise when the message was replayed out
// of the parking lot (and removed when it was not), and defer.target is set
// to the row's target, which differs from the header only after an
// operator edited it. defer.gated is removed too: it described the
// deferral, not the record.
//
// A message of a business key goes to the partition of its target that
// Java-compatible murmur2 gives the business key's UTF-8 bytes, whatever
// its record key (which is sent byte for byte), so that every message of a
// key lands on one partition and its consumer sees them in order. Where the
// business key is the record key (no defer.key), that is the partition a
// Java producer would pick for the record. An unordered message goes by its
// record key, as before.
func Record(m keylock.Message) *sarama.ProducerMessage {
	headers := rewriteHeaders(m.Headers, []headerEdit{
		{name: protocol.HeaderAt, mode: drop},
		{name: protocol.HeaderDelay, mode: drop},
		{name: protocol.HeaderSignature, mode: drop},
		{name: protocol.HeaderGated, mode: drop},
		{name: protocol.HeaderTarget, value: []byte(m.Target), mode: replace},
		{name: protocol.HeaderID, value: []byte(strconv.FormatInt(m.ID, 10))},
		{name: protocol.HeaderSeq, value: []byte(strconv.FormatInt(m.Seq, 10))},
		{name: protocol.HeaderAttempt, value: []byte(strconv.FormatInt(int64(m.Attempt)+1, 10))},
		{name: protocol.HeaderScheduledAt, value: []byte(m.NextRunAt.UTC().Format(time.RFC3339Nano))},
		redriveEdit(m.RedriveCount),
	})
	pm := record(m.Target, m.Key, m.Value, headers)
	if m.BusinessKey != "" {
		pm.Metadata = batchproducer.PartitionKey(m.BusinessKey)
	}
	return pm
}

// record assembles a producer message. A nil key must stay nil (no key,
// random partition); an empty key is a key and hashes like one.
func record(topic string, key, value []byte, headers []sarama.RecordHeader) *sarama.ProducerMessage {
	pm := &sarama.ProducerMessage{Topic: topic, Headers: headers}
	if key != nil {
		pm.Key = sarama.ByteEncoder(key)
	}
	if value != nil {
		pm.Value = sarama.ByteEncoder(value)
	}
	return pm
}

// Parked is a parked message whose dead-letter copy is due, as read by
// dlq_claim.sql.
type Parked struct {
	ID           int64
	Seq          int64
	Target       *string
	Attempt      int32
	RedriveCount int32
	DLQTopic     string
	Reason       *string
	ErrorClass   *string
	ErrorMessage *string
	ParkedAt     *time.Time
	// Source coordinates in the defer topic; nil for a row inserted by hand.
	SourceTopic     *string
	SourcePartition *int32
	SourceOffset    *int64
	Key, Value      []byte
	Headers         []keylock.Header
}

// DeadLetter builds the dead-letter copy of p for p.DLQTopic: the record key
// and value, the stored headers in order with the control headers made
// current (defer.target the row's target, defer.id, defer.seq, defer.attempt
// the stored attempt, not incremented: nothing was retried; defer.redrive-count
// as on output), the one-shot defer.at and defer.delay and, as on output,
// defer.signature removed, and the failure context: defer.dlq.reason,
// defer.error.class and defer.error.message (the row's values; removed
// where the row has none), defer.parked-at, and where it was read in the
// defer topic (defer.source.*, when known). A header of one of these names
// that the producer sent is replaced in place.
func DeadLetter(p Parked) *sarama.ProducerMessage {
	var parkedAt, partition, offset *string
	if p.ParkedAt != nil {
		s := p.ParkedAt.UTC().Format(time.RFC3339Nano)
		parkedAt = &s
	}
	if p.SourcePartition != nil {
		s := strconv.FormatInt(int64(*p.SourcePartition), 10)
		partition = &s
	}
	if p.SourceOffset != nil {
		s := strconv.FormatInt(*p.SourceOffset, 10)
		offset = &s
	}
	headers := rewriteHeaders(p.Headers, []headerEdit{
		{name: protocol.HeaderAt, mode: drop},
		{name: protocol.HeaderDelay, mode: drop},
		{name: protocol.HeaderSignature, mode: drop},
		setOrDrop(protocol.HeaderTarget, p.Target),
		{name: protocol.HeaderID, value: []byte(strconv.FormatInt(p.ID, 10))},
		{name: protocol.HeaderSeq, value: []byte(strconv.FormatInt(p.Seq, 10))},
		{name: protocol.HeaderAttempt, value: []byte(strconv.FormatInt(int64(p.Attempt), 10))},
		redriveEdit(p.RedriveCount),
		setOrDrop(HeaderDLQReason, p.Reason),
		setOrDrop(protocol.HeaderErrorClass, p.ErrorClass),
		setOrDrop(protocol.HeaderErrorMessage, p.ErrorMessage),
		setOrDrop(HeaderParkedAt, parkedAt),
		setOrDrop(HeaderSourceTopic, p.SourceTopic),
		setOrDrop(HeaderSourcePartition, partition),
		setOrDrop(HeaderSourceOffset, offset),
	})
	return record(p.DLQTopic, p.Key, p.Value, headers)
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
	code := PublishErrorCode(err)
	if code == "retriable" {
		return retriable, code
	}
	// The stored reason is "code: detail" like every other (package reason),
	// so that its code is the metric's kind and what --reason filters on.
	return permanent, reason.Format(code, err.Error())
}

// PublishErrorCode names a publish error for metrics and reasons: the code of
// a permanent error, or "retriable".
func PublishErrorCode(err error) string {
	var cfgErr sarama.ConfigurationError
	var encErr sarama.PacketEncodingError
	switch {
	case errors.As(err, &encErr):
		// The client cannot encode it: it would fail the same way again.
		return reason.InvalidRecord
	case errors.As(err, &cfgErr) && strings.Contains(string(cfgErr), "MaxMessageBytes"):
		// sarama checks the size before sending and reports it this way.
		return reason.TooLarge
	case errors.Is(err, sarama.ErrUnknownTopicOrPartition):
		return reason.UnknownTopic
	case errors.Is(err, sarama.ErrInvalidTopic):
		return reason.InvalidTopic
	case errors.Is(err, sarama.ErrTopicAuthorizationFailed):
		return reason.NotAuthorized
	case errors.Is(err, sarama.ErrMessageSizeTooLarge), errors.Is(err, sarama.ErrMessageSetSizeTooLarge):
		return reason.TooLarge
	case errors.Is(err, sarama.ErrInvalidRecord), errors.Is(err, sarama.ErrPolicyViolation):
		return reason.InvalidRecord
	}
	return "retriable"
}
