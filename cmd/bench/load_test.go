package main

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
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
	c, addr, err := startKafka(parts, topic)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pc := kafkaConfig()
	pc.Producer.Return.Successes = true
	prod, err := sarama.NewSyncProducer([]string{addr}, pc)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	for i := range n {
		m := &sarama.ProducerMessage{Topic: topic, Partition: int32(i % parts), Value: sarama.ByteEncoder(payload(i))}
		if _, _, err := prod.SendMessage(m); err != nil {
			t.Fatal(err)
		}
	}

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
