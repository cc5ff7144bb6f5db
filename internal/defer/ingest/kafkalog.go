package ingest

import (
	"errors"
	"fmt"

	"github.com/IBM/sarama"
)

// PartitionLog tells ingest what Kafka holds of the defer topic, so that a
// claim can start where the database says (see Ingester.Setup) and tell the
// cases apart: records Kafka no longer has, a partition re-created with
// offsets reused, a group offset committed past what the database holds.
type PartitionLog interface {
	// Bounds returns the partition's log start offset (the oldest record
	// Kafka still has) and its high-water mark (the offset the next record
	// will take).
	Bounds(topic string, partition int32) (start, end int64, err error)
	// TopicID returns the topic's id as the broker reports it, "" when the
	// broker reports none (before Kafka 2.8, or KAFKA_VERSION set lower).
	TopicID(topic string) (string, error)
	// Committed returns group's committed offsets, with the metadata
	// committed with them, for every partition of topic; a partition with
	// none is absent.
	Committed(group, topic string) (map[int32]CommittedOffset, error)
	// Partitions returns how many partitions topic has.
	Partitions(topic string) (int32, error)
}

// CommittedOffset is a consumer group's committed offset of one partition
// and the metadata string committed with it.
type CommittedOffset struct {
	Offset   int64
	Metadata string
}

// NewPartitionLog returns a PartitionLog that asks the brokers through
// client.
func NewPartitionLog(client sarama.Client) PartitionLog { return kafkaLog{client} }

type kafkaLog struct{ client sarama.Client }

func (l kafkaLog) Bounds(topic string, partition int32) (start, end int64, err error) {
	if start, err = l.client.GetOffset(topic, partition, sarama.OffsetOldest); err != nil {
		return 0, 0, fmt.Errorf("log start offset of %s/%d: %w", topic, partition, err)
	}
	if end, err = l.client.GetOffset(topic, partition, sarama.OffsetNewest); err != nil {
		return 0, 0, fmt.Errorf("high-water mark of %s/%d: %w", topic, partition, err)
	}
	return start, end, nil
}

func (l kafkaLog) TopicID(topic string) (string, error) {
	// The client keeps topic ids to itself, so ask a broker: the
	// controller, which the client connects to on demand.
	b, err := l.client.Controller()
	if err != nil {
		return "", fmt.Errorf("topic id of %s: %w", topic, err)
	}
	resp, err := b.GetMetadata(sarama.NewMetadataRequest(l.client.Config().Version, []string{topic}))
	if err != nil {
		return "", fmt.Errorf("topic id of %s: %w", topic, err)
	}
	for _, t := range resp.Topics {
		if t.Name != topic {
			continue
		}
		if !errors.Is(t.Err, sarama.ErrNoError) {
			return "", fmt.Errorf("topic id of %s: %w", topic, t.Err)
		}
		if t.Uuid == (sarama.Uuid{}) {
			return "", nil
		}
		return t.Uuid.String(), nil
	}
	return "", fmt.Errorf("topic id of %s: the broker's metadata does not list the topic", topic)
}

func (l kafkaLog) Partitions(topic string) (int32, error) {
	if l.client == nil {
		return 0, errors.New("no Kafka client")
	}
	parts, err := l.client.Partitions(topic)
	if err != nil {
		return 0, fmt.Errorf("partitions of %s: %w", topic, err)
	}
	return int32(len(parts)), nil
}

func (l kafkaLog) Committed(group, topic string) (map[int32]CommittedOffset, error) {
	partitions, err := l.client.Partitions(topic)
	if err != nil {
		return nil, fmt.Errorf("partitions of %s: %w", topic, err)
	}
	coord, err := l.client.Coordinator(group)
	if err != nil {
		return nil, fmt.Errorf("committed offsets of group %s: %w", group, err)
	}
	resp, err := coord.FetchOffset(sarama.NewOffsetFetchRequest(l.client.Config().Version, group, map[string][]int32{topic: partitions}))
	if err != nil {
		return nil, fmt.Errorf("committed offsets of group %s: %w", group, err)
	}
	out := map[int32]CommittedOffset{}
	for _, p := range partitions {
		b := resp.GetBlock(topic, p)
		if b == nil || b.Offset < 0 {
			continue
		}
		if !errors.Is(b.Err, sarama.ErrNoError) {
			return nil, fmt.Errorf("committed offset of group %s on %s/%d: %w", group, topic, p, b.Err)
		}
		out[p] = CommittedOffset{Offset: b.Offset, Metadata: b.Metadata}
	}
	return out, nil
}

// Consumer is the consumer group ingest reads with and the client it is
// made from, which its PartitionLog asks.
type Consumer struct {
	Group  sarama.ConsumerGroup
	Client sarama.Client
}

// NewConsumer connects a consumer group for ingest: base made into
// ConsumerConfig(base, budget), on a client of its own.
func NewConsumer(brokers []string, group string, base *sarama.Config, budget *Budget) (*Consumer, error) {
	client, err := sarama.NewClient(brokers, ConsumerConfig(base, budget))
	if err != nil {
		return nil, err
	}
	g, err := sarama.NewConsumerGroupFromClient(group, client)
	if err != nil {
		client.Close()
		return nil, err
	}
	return &Consumer{Group: g, Client: client}, nil
}

// Log returns the PartitionLog over the consumer's client.
func (c *Consumer) Log() PartitionLog { return NewPartitionLog(c.Client) }

// Close leaves the group, then closes the client (a group made from a
// client leaves it open).
func (c *Consumer) Close() error {
	err := c.Group.Close()
	if cerr := c.Client.Close(); cerr != nil && err == nil {
		err = cerr
	}
	return err
}
