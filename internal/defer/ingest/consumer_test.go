package ingest

import (
	"bytes"
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
)

// stallHandler consumes every claim but partition 0's, which reads nothing
// until release is closed, as an ingest claim waiting for a writer does.
type stallHandler struct {
	release  chan struct{}
	stalled  chan struct{} // closed when partition 0's claim starts
	once     sync.Once
	others   atomic.Int64 // records of the other partitions read
	received atomic.Int64 // records of every partition read
}

func (*stallHandler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (*stallHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (h *stallHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	if claim.Partition() == 0 {
		h.once.Do(func() { close(h.stalled) })
		select {
		case <-h.release:
		case <-sess.Context().Done():
			return nil
		}
	}
	for range claim.Messages() {
		if claim.Partition() != 0 {
			h.others.Add(1)
		}
		h.received.Add(1)
	}
	return nil
}

// A claim that stops reading holds back its broker connection's fetching
// (consumerMaxProcessingTime), so the consumer holds one fetch response at a
// time, not one per stalled claim. With sarama's default of 100 ms the
// connection went on fetching for the other partitions, and a 64-partition
// ingest held four times its byte budget (make bench, BENCH_ONLY=partitions).
// Measured here as records: while partition 0's claim reads nothing for
// 1.5 s, with its queue full, the other partitions' records produced
// meanwhile are not fetched (sarama's default fetched them all); released,
// every record arrives.
func TestStalledClaimHoldsBackFetching(t *testing.T) {
	const (
		topic   = "stall"
		parts   = 16
		perPart = 4000
	)
	k := newKafka(t)
	if err := k.admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: parts, ReplicationFactor: 1}, false); err != nil {
		t.Fatalf("create topic %s: %v", topic, err)
	}
	addrs, prod := k.addrs, k.producer
	value := bytes.Repeat([]byte("v"), 200)
	produce := func(p int32) {
		t.Helper()
		msgs := make([]*sarama.ProducerMessage, perPart)
		for i := range msgs {
			msgs[i] = &sarama.ProducerMessage{Topic: topic, Partition: p, Value: sarama.ByteEncoder(value)}
		}
		if err := prod.SendMessages(msgs); err != nil {
			t.Fatalf("produce to partition %d: %v", p, err)
		}
	}
	// Partition 0's records first, alone: its queue fills with the first
	// response, and the other partitions' records come after that.
	produce(0)

	cfg := ConsumerConfig(saramaConfig(), nil)
	// Small queues and responses: partition 0's queue fills with the
	// first response, and the other partitions' records take many.
	cfg.ChannelBufferSize = 16
	cfg.Consumer.Fetch.MaxBytes = 64 << 10
	cfg.Consumer.Fetch.Default = 16 << 10
	group, err := sarama.NewConsumerGroup(addrs, "stall", cfg)
	if err != nil {
		t.Fatalf("consumer group: %v", err)
	}
	defer group.Close()

	h := &stallHandler{release: make(chan struct{}), stalled: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- group.Consume(ctx, []string{topic}, h) }()

	select {
	case <-h.stalled:
	case err := <-done:
		t.Fatalf("consume ended before partition 0 was claimed: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("partition 0 not claimed within 30 s")
	}
	time.Sleep(300 * time.Millisecond)
	for p := int32(1); p < parts; p++ {
		produce(p)
	}
	// Long past sarama's default (a partition given up after 100-200 ms),
	// well within consumerMaxProcessingTime.
	time.Sleep(1500 * time.Millisecond)
	others, want := h.others.Load(), int64((parts-1)*perPart)
	t.Logf("while partition 0 read nothing for 1.5 s, the other %d partitions got %d of their %d records", parts-1, others, want)
	if others > want/10 {
		t.Errorf("the other partitions got %d of %d records while partition 0 read nothing: the connection went on fetching past the stalled claim", others, want)
	}

	close(h.release)
	deadline := time.Now().Add(30 * time.Second)
	for h.received.Load() < parts*perPart {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d records received 30 s after the release", h.received.Load(), parts*perPart)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("consume: %v", err)
	}
}
