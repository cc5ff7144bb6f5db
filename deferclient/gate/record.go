package gate

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/deferq/scheduler/internal/defer/protocol"
)

// Header is a record header.
type Header struct {
	Key   string
	Value []byte
}

// Record is a consumed record, whatever the Kafka client that read it. An
// adapter converts its client's records to it; the slices are shared, not
// copied, and the gate does not change them.
type Record struct {
	Topic      string
	Partition  int32
	Offset     int64
	Key, Value []byte
	Headers    []Header
}

// header returns the value of r's first header named name, "" if none.
func (r Record) header(name string) string {
	for _, h := range r.Headers {
		if h.Key == name {
			return string(h.Value)
		}
	}
	return ""
}

// BusinessKey returns the business key the scheduler gives r when nothing
// else names one: its defer.key header when present, else its record key
// as text (a key that is not UTF-8 becomes "\x" and hex), "" for none
// (unordered).
func BusinessKey(r Record) string {
	for _, h := range r.Headers {
		if h.Key == protocol.HeaderKey {
			return protocol.Text(h.Value)
		}
	}
	return protocol.Text(r.Key)
}

// Partition returns the partition, of partitions, a record of business key
// key goes to: in the defer topic when it is deferred, and in the retry
// topic when the scheduler republishes it. It is the Java client's default
// partitioner applied to the key's bytes.
func Partition(key string, partitions int32) int32 {
	return protocol.Partition([]byte(key), partitions)
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

// Out is a deferral built and not produced yet: the record a Producer
// writes to Topic, partition Partition. Key and Value are nil when the
// deferred record's were.
type Out struct {
	Topic      string
	Partition  int32
	Key, Value []byte
	Headers    []Header

	bkey  string // business key; "" unordered
	seq   int64  // the record's defer.seq, 0 for none
	gated bool
}

// Defer forwards rec to the scheduler as d says, and returns once the
// broker acknowledged it (acks=all): the deferral is then durable and
// rec's offset may be committed. Every header of rec is kept in order, but
// the one-shot and control headers Defer sets; the attempt is carried over
// from rec's defer.attempt, and a record the scheduler republished keeps
// its place among its key's messages (defer.id, defer.seq).
func (g *Gate) Defer(ctx context.Context, rec Record, d Deferral) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	o, err := g.build(ctx, rec, d, false)
	if err != nil {
		return err
	}
	return g.sendAll(ctx, []Out{o})
}

// sendAll produces deferrals in order, in as few requests as the producer
// can: a consumer gating many records of a batch pays one round trip, not
// one per record. Order within each partition is kept (idempotent
// producer). On error some may have been written: their records are not
// marked, so they are read and deferred again (at least once).
func (g *Gate) sendAll(ctx context.Context, outs []Out) error {
	if len(outs) == 0 {
		return nil
	}
	pos, err := g.p.Produce(ctx, outs)
	if err != nil && len(outs) == 1 {
		return fmt.Errorf("deferclient: produce to %s: %w", g.cfg.DeferTopic, err)
	}
	if err != nil {
		return fmt.Errorf("deferclient: produce %d records to %s: %w", len(outs), g.cfg.DeferTopic, err)
	}
	g.sent(outs, pos)
	return nil
}

// sent notes deferrals the broker acknowledged, where pos says they went.
func (g *Gate) sent(outs []Out, pos []Position) {
	for i, o := range outs {
		if o.bkey != "" {
			// A deferral the producer did not say where it went is covered
			// only by an answer that waited for the whole topic.
			p := Position{Partition: o.Partition, Offset: math.MaxInt64}
			if i < len(pos) {
				p = pos[i]
			}
			g.remember(o.bkey, o.seq, p.Partition, p.Offset)
		}
	}
	g.count(func(s *Stats) {
		for _, o := range outs {
			if o.gated {
				s.Gated++
			} else {
				s.Deferred++
			}
		}
	})
}

// build makes the record that defers rec as d says; gated marks a record
// deferred behind a blocked key rather than after a failure.
func (g *Gate) build(ctx context.Context, rec Record, d Deferral, gated bool) (Out, error) {
	fail := func(err error) (Out, error) { return Out{}, err }
	if !d.At.IsZero() && d.Delay != 0 {
		return fail(errors.New("deferclient: a deferral has a Delay or an At, not both"))
	}
	if d.Delay < 0 {
		return fail(fmt.Errorf("deferclient: negative delay %v", d.Delay))
	}
	target := d.Target
	if target == "" {
		target = rec.header(protocol.HeaderTarget)
	}
	if target == "" {
		return fail(fmt.Errorf("deferclient: no target for the record of %s/%d at offset %d: set Deferral.Target", rec.Topic, rec.Partition, rec.Offset))
	}
	key := d.BusinessKey
	if key == "" {
		key = BusinessKey(rec)
	}
	if len(key) > protocol.DefaultMaxKeyBytes {
		return fail(fmt.Errorf("deferclient: business key of %d bytes, more than the scheduler's limit of %d", len(key), protocol.DefaultMaxKeyBytes))
	}

	// Every header of the record, in order, but those Defer sets: one-shot
	// schedule headers, the signature (of another source, or stale), and
	// the control headers replaced below.
	set := map[string]string{protocol.HeaderTarget: target, protocol.HeaderKey: key}
	if g.cfg.Group != "" {
		set[protocol.HeaderGroup] = g.cfg.Group
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
		if a, err := strconv.Atoi(rec.header(protocol.HeaderAttempt)); err == nil && a > 0 {
			set[protocol.HeaderAttempt] = strconv.Itoa(a - 1)
		}
	case d.Delay > 0:
		set[protocol.HeaderDelay] = strconv.FormatInt(d.Delay.Milliseconds(), 10)
	case !d.At.IsZero():
		set[protocol.HeaderAt] = d.At.UTC().Format(time.RFC3339Nano)
	}
	if g.cfg.Source != "" {
		set[protocol.HeaderSource] = g.cfg.Source
	}
	drop := map[string]bool{protocol.HeaderDelay: true, protocol.HeaderAt: true, protocol.HeaderSignature: true,
		protocol.HeaderGated: true}
	headers := make([]Header, 0, len(rec.Headers)+len(set)+1)
	for _, h := range rec.Headers {
		if v, ok := set[h.Key]; ok {
			headers = append(headers, Header{Key: h.Key, Value: []byte(v)})
			delete(set, h.Key)
			continue
		}
		if drop[h.Key] {
			continue
		}
		headers = append(headers, h)
	}
	for _, name := range []string{protocol.HeaderTarget, protocol.HeaderKey, protocol.HeaderGroup, protocol.HeaderSource,
		protocol.HeaderAttempt, protocol.HeaderErrorClass, protocol.HeaderErrorMessage, protocol.HeaderGated,
		protocol.HeaderDelay, protocol.HeaderAt} {
		if v, ok := set[name]; ok {
			headers = append(headers, Header{Key: name, Value: []byte(v)})
		}
	}
	if len(g.cfg.SourceKey) > 0 {
		signed := protocol.Record{Key: rec.Key, Value: rec.Value}
		for _, h := range headers {
			signed.Headers = append(signed.Headers, protocol.Header{Key: []byte(h.Key), Value: h.Value})
		}
		sig, err := protocol.Sign(g.cfg.SourceKey, signed)
		if err != nil {
			return fail(fmt.Errorf("deferclient: sign the record: %w", err))
		}
		headers = append(headers, Header{Key: protocol.HeaderSignature, Value: []byte(sig)})
	}

	partition, err := g.partition(ctx, key, rec.Key)
	if err != nil {
		return fail(err)
	}
	seq, _ := strconv.ParseInt(rec.header(protocol.HeaderSeq), 10, 64)
	return Out{Topic: g.cfg.DeferTopic, Partition: partition, Key: rec.Key, Value: rec.Value, Headers: headers,
		bkey: key, seq: seq, gated: gated}, nil
}

// partition returns the partition of the defer topic a record of business
// key key goes to: the key's murmur2 partition, so that every record of the
// key is read in order, whatever its record key; an unordered record goes
// by its record key, as a Java producer would send it.
func (g *Gate) partition(ctx context.Context, key string, recordKey []byte) (int32, error) {
	n, err := g.p.Partitions(ctx, g.cfg.DeferTopic)
	if err != nil {
		return 0, fmt.Errorf("deferclient: partitions of %s: %w", g.cfg.DeferTopic, err)
	}
	if n <= 0 {
		return 0, fmt.Errorf("deferclient: %s has no partitions", g.cfg.DeferTopic)
	}
	if key != "" {
		return protocol.Partition([]byte(key), n), nil
	}
	if recordKey != nil {
		return protocol.Partition(recordKey, n), nil
	}
	return int32(time.Now().UnixNano() % int64(n)), nil
}

// permanentError marks an error not worth retrying.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent marks err as not worth retrying: DefaultClassify gives it the
// class "permanent", which the scheduler parks at once. Permanent(nil) is
// nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err}
}

// DefaultClassify is the classifier a handler configuration without one
// uses: class "permanent" for errors marked with Permanent, else the Go
// type of the innermost error (what the scheduler's NON_RETRIABLE_ERRORS
// patterns can match, e.g. "*net.OpError"); the message is the error's
// text, cut to 1 KB.
func DefaultClassify(err error) (class, message string) {
	var p permanentError
	if errors.As(err, &p) {
		class = "permanent"
	} else {
		inner := err
		for {
			next := errors.Unwrap(inner)
			if next == nil {
				break
			}
			inner = next
		}
		class = fmt.Sprintf("%T", inner)
	}
	message = err.Error()
	if len(message) > 1024 {
		message = strings.ToValidUTF8(message[:1024], "")
	}
	return class, message
}
