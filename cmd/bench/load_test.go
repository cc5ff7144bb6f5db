package main

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// The read back survives a broker connection that drops under it: sarama
// closes a connection on a failed offset request, and every partition
// reader sharing it then fails with ErrNotConnected (a CI run once failed
// so). The broker here drops the connection on the first four ListOffsets
// requests, enough to fail one partition's read without openPartition's
// retries (sarama itself tries twice).
func TestReadBackRetriesDroppedConnection(t *testing.T) {
	const topic, parts, n = "readback", 4, 40
	c, addr := filledTopic(t, topic, parts, func(int32) int { return n / parts })

	var dropped atomic.Int32
	c.ControlKey(kmsg.ListOffsets.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		if dropped.Add(1) > 4 {
			return nil, nil, false
		}
		c.KeepControl()
		return nil, errors.New("connection dropped by the test"), true
	})
	ds, err := readBack(t.Context(), addr, topic)
	if err != nil {
		t.Fatalf("read back with the first ListOffsets requests dropped: %v", err)
	}
	if got := dropped.Load(); got < 4 {
		t.Fatalf("%d ListOffsets requests seen, want at least the 4 dropped", got)
	}
	if ch := verify(ds, n); ch.delivered != n || ch.duplicates != 0 {
		t.Fatalf("read back %d of %d records, %d duplicates", ch.delivered, n, ch.duplicates)
	}
}

// track polls past a few failed counts (a dropped broker connection) and
// gives up, saying so, when they keep failing.
func TestTrackPollsPastFailedCounts(t *testing.T) {
	for _, tc := range []struct {
		name    string
		fail    int // counts that fail before the first that answers
		wantErr bool
	}{
		{"no failure", 0, false},
		{"three failures", 3, false},
		{"failures that do not stop", 1 << 30, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls := 0
			count := func() (int64, error) {
				calls++
				if calls <= tc.fail {
					return 0, errors.New("kafka: broker not connected")
				}
				return int64(calls - tc.fail), nil
			}
			pr, err := track(t.Context(), "phase", count, 2, 5, time.Minute)
			if tc.wantErr {
				if err == nil || !strings.Contains(err.Error(), "counts in a row failed: kafka: broker not connected") {
					t.Fatalf("track: %v, want it to give up naming the failure", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("track: %v", err)
			}
			if pr.fromN != 1 || pr.doneAt.IsZero() {
				t.Fatalf("progress %+v: want the last sample below the mark (1) and a done time", pr)
			}
		})
	}
}

// The watcher counts a topic's records with one ListOffsets request per
// leader, whatever the partitions: track polls it every 10ms during a
// measured phase, and a request per partition made it a load on the
// broker that grew with them. The count is the sum of the high-water
// marks, and a partition's error in the answer fails the count, naming it.
func TestWatcherCountsWithOneRequest(t *testing.T) {
	const topic, parts = "watched", 64
	// Partition p holds p%3 records: some empty, the rest unequal.
	want := 0
	c, addr := filledTopic(t, topic, parts, func(p int32) int { want += int(p % 3); return int(p % 3) })
	w, err := newWatcher(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer w.close()
	if _, err := w.count(topic); err != nil { // metadata and the connection, before counting requests
		t.Fatalf("count: %v", err)
	}

	var requests, blocks atomic.Int32
	c.ControlKey(kmsg.ListOffsets.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		requests.Add(1)
		for _, rt := range req.(*kmsg.ListOffsetsRequest).Topics {
			blocks.Add(int32(len(rt.Partitions)))
		}
		return nil, nil, false
	})
	got, err := w.count(topic)
	if err != nil {
		t.Fatalf("count: %v", err)
	}
	if got != int64(want) {
		t.Fatalf("count = %d, want the %d records produced", got, want)
	}
	if r, b := requests.Load(), blocks.Load(); r != 1 || b != parts {
		t.Fatalf("count sent %d ListOffsets requests asking for %d partitions, want 1 asking for all %d", r, b, parts)
	}

	c.ControlKey(kmsg.ListOffsets.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		resp := req.ResponseKind().(*kmsg.ListOffsetsResponse)
		for _, rt := range req.(*kmsg.ListOffsetsRequest).Topics {
			st := kmsg.NewListOffsetsResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewListOffsetsResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.Offset = 10
				if rp.Partition == 7 {
					sp.ErrorCode = kerr.NotLeaderForPartition.Code
				}
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	if n, err := w.count(topic); err == nil || !strings.Contains(err.Error(), "high-water mark of watched/7") {
		t.Fatalf("count with partition 7 refused: %d, %v; want an error naming the partition", n, err)
	}
}

// filledTopic starts an in-process broker with topic on parts partitions,
// closed when the test ends, and produces records(p) records to each
// partition p, numbered from 0 across the topic (payload).
func filledTopic(t *testing.T, topic string, parts int32, records func(p int32) int) (*kfake.Cluster, string) {
	t.Helper()
	c, addr, err := startKafka(parts, topic)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	pc := kafkaConfig()
	pc.Producer.Return.Successes = true
	prod, err := sarama.NewSyncProducer([]string{addr}, pc)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	i := 0
	for p := range parts {
		for range records(p) {
			m := &sarama.ProducerMessage{Topic: topic, Partition: p, Value: sarama.ByteEncoder(payload(i))}
			if _, _, err := prod.SendMessage(m); err != nil {
				t.Fatal(err)
			}
			i++
		}
	}
	return c, addr
}
