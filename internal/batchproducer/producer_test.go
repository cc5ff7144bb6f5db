package batchproducer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

const (
	topic = "orders"
	other = "billing"
)

// start runs a one-broker cluster with topic and other, 4 partitions each,
// and returns it with a Producer whose batches hold at most maxBatch bytes.
func start(t *testing.T, maxBatch int, opts ...func(*sarama.Config)) (*kfake.Cluster, *Producer, *sarama.Config) {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, topic, other))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	conf := sarama.NewConfig()
	conf.Version = sarama.V3_6_0_0
	conf.Net.DialTimeout, conf.Net.ReadTimeout, conf.Net.WriteTimeout = time.Second, time.Second, time.Second
	conf.Metadata.Timeout = time.Second
	conf.Metadata.Retry.Max = 1
	conf.Metadata.Retry.Backoff = 10 * time.Millisecond
	conf.Metadata.AllowAutoTopicCreation = false
	conf.Producer.RequiredAcks = sarama.WaitForAll
	conf.Producer.Retry.Max = 2
	conf.Producer.Retry.Backoff = 10 * time.Millisecond
	conf.Producer.MaxMessageBytes = maxBatch
	for _, o := range opts {
		o(conf)
	}
	p, err := New(c.ListenAddrs(), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return c, p, conf
}

// msg is message n of key (nil: no key) to topic.
func msg(topic string, key []byte, n int) *sarama.ProducerMessage {
	m := &sarama.ProducerMessage{
		Topic:   topic,
		Value:   sarama.StringEncoder(fmt.Sprintf("%s|%d|%s", key, n, strings.Repeat("v", 40))),
		Headers: []sarama.RecordHeader{{Key: []byte("n"), Value: fmt.Appendf(nil, "%d", n)}, {Key: []byte("dup"), Value: nil}},
	}
	if key != nil {
		m.Key = sarama.ByteEncoder(key)
	}
	return m
}

// read returns every record of topic, waiting until there are at least want.
func read(t *testing.T, c *kfake.Cluster, topic string, want int) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var recs []*kgo.Record
	for len(recs) < want {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %d records of %s, want %d", len(recs), topic, want)
		}
		recs = append(recs, fs.Records()...)
	}
	// Anything beyond want would be a defect too: look once more, briefly.
	short, cancel2 := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel2()
	recs = append(recs, cl.PollFetches(short).Records()...)
	return recs
}

// errorsOf maps each failed message to its error.
func errorsOf(t *testing.T, err error) map[*sarama.ProducerMessage]error {
	t.Helper()
	out := map[*sarama.ProducerMessage]error{}
	if err == nil {
		return out
	}
	var perrs sarama.ProducerErrors
	if !errors.As(err, &perrs) {
		t.Fatalf("SendMessages: %v, want sarama.ProducerErrors", err)
	}
	for _, pe := range perrs {
		if _, dup := out[pe.Msg]; dup {
			t.Fatalf("message reported twice: %v", pe)
		}
		out[pe.Msg] = pe.Err
	}
	return out
}

func TestOrderPartitionsAndBatches(t *testing.T) {
	for _, maxBatch := range []int{1 << 20, 600} { // one batch per partition; many
		t.Run(fmt.Sprint(maxBatch), func(t *testing.T) {
			c, p, _ := start(t, maxBatch)
			var msgs []*sarama.ProducerMessage
			for n := range 300 {
				msgs = append(msgs, msg(topic, fmt.Appendf(nil, "key-%d", n%17), n))
				if n%30 == 0 {
					msgs = append(msgs, msg(topic, nil, n))
				}
			}
			if err := p.SendMessages(msgs); err != nil {
				t.Fatal(err)
			}
			recs := read(t, c, topic, len(msgs))
			if len(recs) != len(msgs) {
				t.Fatalf("read %d records, sent %d", len(recs), len(msgs))
			}
			hash := sarama.NewMurmur2Partitioner(topic)
			byValue := map[string]*kgo.Record{}
			for _, r := range recs {
				byValue[string(r.Value)] = r
			}
			nilPartition := int32(-1)
			last := map[string]int64{} // key -> offset of its latest message
			for _, m := range msgs {
				v, _ := m.Value.Encode()
				r := byValue[string(v)]
				if r == nil {
					t.Fatalf("message %q not in the topic", v)
				}
				if r.Partition != m.Partition || r.Offset != m.Offset {
					t.Errorf("%q at %d/%d, message says %d/%d", v, r.Partition, r.Offset, m.Partition, m.Offset)
				}
				if len(r.Headers) != 2 || string(r.Headers[0].Value) != string(m.Headers[0].Value) || r.Headers[1].Key != "dup" {
					t.Errorf("%q headers %v", v, r.Headers)
				}
				if m.Key == nil {
					if nilPartition >= 0 && r.Partition != nilPartition {
						t.Errorf("messages without a key in partitions %d and %d", nilPartition, r.Partition)
					}
					nilPartition = r.Partition
					continue
				}
				if want, _ := hash.Partition(m, 4); r.Partition != want {
					t.Errorf("%q in partition %d, murmur2 says %d", v, r.Partition, want)
				}
				k := string(r.Key)
				if prev, ok := last[k]; ok && r.Offset <= prev {
					t.Errorf("%q at offset %d, before an earlier message of its key at %d", v, r.Offset, prev)
				}
				last[k] = r.Offset
			}
		})
	}
}

// faultFrom fails, with code, the produce requests for partition part of
// topic from the from-th (1-based) to the (from+n-1)-th; it returns a counter
// of the requests seen for that partition.
func faultFrom(c *kfake.Cluster, part int32, from, n int64, code *kerr.Error) *atomic.Int64 {
	var seen atomic.Int64
	c.Fault(kfake.Fault{
		Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{part}, Err: code, Count: -1,
		When: func(req kmsg.Request) bool {
			for _, tp := range req.(*kmsg.ProduceRequest).Topics {
				for _, pp := range tp.Partitions {
					if tp.Topic == topic && pp.Partition == part {
						k := seen.Add(1)
						return k >= from && k < from+n
					}
				}
			}
			return false
		},
	})
	return &seen
}

// faultPoison fails, with code, every produce request whose batch for
// topic holds the bytes marker; it returns a counter of those requests.
func faultPoison(c *kfake.Cluster, marker []byte, code *kerr.Error) *atomic.Int64 {
	var seen atomic.Int64
	c.Fault(kfake.Fault{
		Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: code, Count: -1,
		When: func(req kmsg.Request) bool {
			for _, tp := range req.(*kmsg.ProduceRequest).Topics {
				for _, pp := range tp.Partitions {
					if tp.Topic == topic && bytes.Contains(pp.Records, marker) {
						seen.Add(1)
						return true
					}
				}
			}
			return false
		},
	})
	return &seen
}

// TestFailStop is the guarantee: once a batch of a partition fails for good,
// nothing later of that partition is sent, and the other partitions go on.
// A batch refused for good is sent again one message per batch, so that the
// refusal lands on the message that caused it.
func TestFailStop(t *testing.T) {
	poison := []byte("POISON")
	for _, tc := range []struct {
		name string
		code *kerr.Error
		// fault installs the fault for the key's partition and returns a
		// counter of the requests it failed.
		fault func(c *kfake.Cluster, part int32) *atomic.Int64
		// Expected: messages acknowledged (0: some), requests failed.
		sent, faulted int
	}{
		// Exactly the failing batch's three tries fail: a producer that
		// went on after it would get the next batch through.
		{"retriable, retries run out", kerr.NotLeaderForPartition, func(c *kfake.Cluster, part int32) *atomic.Int64 {
			seen := faultFrom(c, part, 2, 3, kerr.NotLeaderForPartition)
			return seen
		}, 0, 0},
		// Message 10 is refused whenever it is sent: its batch fails, then
		// the messages of that batch go one by one, and 10 fails alone.
		{"one message refused", kerr.InvalidRecord, func(c *kfake.Cluster, part int32) *atomic.Int64 {
			return faultPoison(c, poison, kerr.InvalidRecord)
		}, 10, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, p, _ := start(t, 600) // about 4 messages per batch
			key := []byte("key-1")
			part, _ := sarama.NewMurmur2Partitioner(topic).Partition(msg(topic, key, 0), 4)
			seen := tc.fault(c, part)

			var msgs []*sarama.ProducerMessage
			for n := range 40 {
				m := msg(topic, key, n)
				if n == 10 {
					m.Value = sarama.StringEncoder(fmt.Sprintf("%s|%d|%s", poison, n, strings.Repeat("v", 34)))
				}
				msgs = append(msgs, m, msg(other, key, n))
			}
			errs := errorsOf(t, p.SendMessages(msgs))

			// A prefix went; then one batch (or message) failed with the
			// broker's error; everything after it was not sent.
			var sent, failed, notSent int
			for _, m := range msgs {
				err, bad := errs[m]
				switch {
				case m.Topic == other:
					if bad {
						t.Errorf("message to %s failed: %v", other, err)
					}
				case !bad:
					if failed+notSent > 0 {
						t.Errorf("message %d acknowledged after a failed one", sent+failed+notSent)
					}
					sent++
				case errors.Is(err, ErrNotSent):
					if failed == 0 {
						t.Error("ErrNotSent before the failed batch")
					}
					notSent++
				default:
					if !errors.Is(err, sarama.KError(tc.code.Code)) {
						t.Errorf("error %v, want %v", err, tc.code)
					}
					if notSent > 0 {
						t.Error("a failed message after ErrNotSent ones")
					}
					failed++
				}
			}
			if sent == 0 || failed == 0 || notSent == 0 || sent+failed+notSent != 40 {
				t.Fatalf("sent %d, failed %d, not sent %d; want each > 0, 40 in all", sent, failed, notSent)
			}
			if tc.sent > 0 && (sent != tc.sent || failed != 1) {
				t.Errorf("sent %d, failed %d; want %d sent and the refused message alone failed", sent, failed, tc.sent)
			}
			if tc.faulted > 0 && int(seen.Load()) != tc.faulted {
				t.Errorf("%d requests faulted, want %d", seen.Load(), tc.faulted)
			}
			if tc.faulted == 0 && seen.Load() != 1+3 {
				t.Errorf("%d produce requests for the partition, want 1 + 3", seen.Load())
			}
			if recs := read(t, c, topic, sent); len(recs) != sent {
				t.Errorf("%d records in %s, want the %d acknowledged", len(recs), topic, sent)
			}
			if recs := read(t, c, other, 40); len(recs) != 40 {
				t.Errorf("%d records in %s, want 40", len(recs), other)
			}
		})
	}
}

// TestRetriableRecovers: a batch that fails fewer times than Retry.Max goes
// out, once (NOT_LEADER_FOR_PARTITION means nothing was written).
func TestRetriableRecovers(t *testing.T) {
	c, p, _ := start(t, 1<<20)
	c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotLeaderForPartition, Count: 2})
	var msgs []*sarama.ProducerMessage
	for n := range 50 {
		msgs = append(msgs, msg(topic, fmt.Appendf(nil, "k%d", n%5), n))
	}
	if err := p.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	if recs := read(t, c, topic, 50); len(recs) != 50 {
		t.Fatalf("%d records, want 50", len(recs))
	}
}

// TestCannotSend: a message of an unknown topic fails with the metadata
// error; one too large for a batch fails as sarama's would, and stops its
// partition; the rest goes.
func TestCannotSend(t *testing.T) {
	c, p, _ := start(t, 2000)
	key := []byte("k")
	big := msg(topic, key, 99)
	big.Value = sarama.StringEncoder(strings.Repeat("x", 3000))
	msgs := []*sarama.ProducerMessage{
		msg(topic, key, 0), msg("no.such.topic", key, 1), msg(topic, key, 2), big, msg(topic, key, 3), msg(other, key, 4),
	}
	errs := errorsOf(t, p.SendMessages(msgs))
	var cfg sarama.ConfigurationError
	for i, want := range []func(error) bool{
		func(err error) bool { return err == nil },
		func(err error) bool { return errors.Is(err, sarama.ErrUnknownTopicOrPartition) },
		func(err error) bool { return err == nil },
		func(err error) bool { return errors.As(err, &cfg) && strings.Contains(string(cfg), "MaxMessageBytes") },
		func(err error) bool { return errors.Is(err, ErrNotSent) },
		func(err error) bool { return err == nil },
	} {
		if !want(errs[msgs[i]]) {
			t.Errorf("message %d: error %v", i, errs[msgs[i]])
		}
	}
	if recs := read(t, c, topic, 2); len(recs) != 2 {
		t.Errorf("%d records in %s, want 2", len(recs), topic)
	}
}

// TestBrokerGone: with the broker gone, a call fails every message,
// retriably, within MaxDuration.
func TestBrokerGone(t *testing.T) {
	c, p, conf := start(t, 1<<20, func(c *sarama.Config) {
		c.Net.DialTimeout, c.Net.ReadTimeout, c.Net.WriteTimeout = 200*time.Millisecond, 200*time.Millisecond, 200*time.Millisecond
		c.Metadata.Timeout = 400 * time.Millisecond
	})
	if err := p.SendMessages([]*sarama.ProducerMessage{msg(topic, []byte("k"), 0)}); err != nil {
		t.Fatal(err) // metadata is cached from here on
	}
	c.Close()
	var msgs []*sarama.ProducerMessage
	for n := range 10 {
		msgs = append(msgs, msg(topic, fmt.Appendf(nil, "k%d", n), n))
	}
	began := time.Now()
	errs := errorsOf(t, p.SendMessages(msgs))
	took := time.Since(began)
	if len(errs) != len(msgs) {
		t.Fatalf("%d of %d messages failed", len(errs), len(msgs))
	}
	for _, err := range errs {
		if !retriable(err) {
			t.Errorf("error %v is not retriable", err)
		}
	}
	if limit := MaxDuration(conf); took > limit {
		t.Errorf("took %v, more than MaxDuration %v", took, limit)
	}
}

func TestRetriable(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{sarama.ErrNotLeaderForPartition, true},
		{sarama.ErrRequestTimedOut, true},
		{sarama.ErrUnknownTopicOrPartition, true},
		{sarama.ErrTopicAuthorizationFailed, false},
		{sarama.ErrMessageSizeTooLarge, false},
		{sarama.ErrInvalidRecord, false},
		{sarama.ErrNotConnected, true},
		{fmt.Errorf("read tcp: %w", context.DeadlineExceeded), true},
		{sarama.ErrClosedClient, false},
	} {
		if got := retriable(tc.err); got != tc.want {
			t.Errorf("retriable(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
