package ingest

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/pgtest"
)

func budgetMsg(p int32, value int) *sarama.ConsumerMessage {
	return &sarama.ConsumerMessage{Topic: ingestTopic, Partition: p, Value: make([]byte, value)}
}

// consumeAsync runs OnConsume in a goroutine and returns a channel closed
// when it returns.
func consumeAsync(b *Budget, m *sarama.ConsumerMessage) chan struct{} {
	done := make(chan struct{})
	go func() {
		b.OnConsume(m)
		close(done)
	}()
	return done
}

func returned(done chan struct{}, within time.Duration) bool {
	select {
	case <-done:
		return true
	case <-time.After(within):
		return false
	}
}

// OnConsume waits while the budget is used up, and goes on when a claim
// releases bytes or ends; a record larger than the whole budget goes alone.
func TestBudget(t *testing.T) {
	const limit = 10_000
	small := 3000 - recordOverhead // counts for 3,000 bytes
	tests := []struct {
		name string
		run  func(t *testing.T, b *Budget)
	}{
		{"waits when full, goes on after a release", func(t *testing.T, b *Budget) {
			for range 3 {
				b.OnConsume(budgetMsg(0, small))
			}
			done := consumeAsync(b, budgetMsg(0, small))
			if returned(done, 50*time.Millisecond) {
				t.Fatal("a record past the budget was taken")
			}
			b.release(ingestTopic, 0, 3000)
			if !returned(done, time.Second) {
				t.Fatal("still waiting after a release made room")
			}
			if b.Used() != 9000 {
				t.Errorf("used %d, want 9000", b.Used())
			}
		}},
		{"a record larger than the budget goes alone", func(t *testing.T, b *Budget) {
			b.OnConsume(budgetMsg(0, small))
			done := consumeAsync(b, budgetMsg(0, 3*limit))
			if returned(done, 50*time.Millisecond) {
				t.Fatal("a record larger than the budget was taken beside another")
			}
			b.release(ingestTopic, 0, 3000)
			if !returned(done, time.Second) {
				t.Fatal("a record larger than the budget is never taken")
			}
			if b.Used() != 3*limit+recordOverhead {
				t.Errorf("used %d, want %d", b.Used(), 3*limit+recordOverhead)
			}
		}},
		{"a claim that ends gives back what it held and frees a waiter", func(t *testing.T, b *Budget) {
			b.open(ingestTopic, 1)
			for range 3 {
				b.OnConsume(budgetMsg(1, small))
			}
			waiting := consumeAsync(b, budgetMsg(1, small))
			other := consumeAsync(b, budgetMsg(0, small))
			if returned(waiting, 50*time.Millisecond) || returned(other, 0) {
				t.Fatal("records past the budget were taken")
			}
			b.close(ingestTopic, 1)
			if !returned(waiting, time.Second) || !returned(other, time.Second) {
				t.Fatal("still waiting after the claim holding the budget ended")
			}
			// The ended claim's waiter went on uncounted: sarama drains it.
			if b.Used() != 3000 {
				t.Errorf("used %d, want 3000 (partition 0's record only)", b.Used())
			}
		}},
		{"records of a partition with no claim are not counted", func(t *testing.T, b *Budget) {
			b.OnConsume(budgetMsg(7, small))
			if b.Used() != 0 {
				t.Errorf("used %d, want 0", b.Used())
			}
			b.release(ingestTopic, 7, 3000) // nothing to give back; no panic, no negative
			if b.Used() != 0 {
				t.Errorf("used %d after a release, want 0", b.Used())
			}
		}},
		{"a release of more than held gives back what was held", func(t *testing.T, b *Budget) {
			b.OnConsume(budgetMsg(0, small))
			b.release(ingestTopic, 0, 1_000_000)
			if b.Used() != 0 {
				t.Errorf("used %d, want 0", b.Used())
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := NewBudget(limit)
			b.open(ingestTopic, 0)
			tt.run(t, b)
		})
	}
}

// OnConsume copies a record out of the fetch response's buffer, keeping a
// null key null and an empty one empty.
func TestBudgetDetachesRecords(t *testing.T) {
	raw := []byte("keyvalueh1v1")
	m := &sarama.ConsumerMessage{Topic: ingestTopic, Key: raw[0:3], Value: raw[3:8],
		Headers: []*sarama.RecordHeader{{Key: raw[8:10], Value: raw[10:12]}, {Key: []byte("e"), Value: []byte{}}}}
	NewBudget(1 << 20).OnConsume(m)
	copy(raw, bytes.Repeat([]byte("x"), len(raw)))
	if string(m.Key) != "key" || string(m.Value) != "value" || string(m.Headers[0].Key) != "h1" || string(m.Headers[0].Value) != "v1" {
		t.Errorf("record changed with the fetch buffer: key %q value %q header %q=%q", m.Key, m.Value, m.Headers[0].Key, m.Headers[0].Value)
	}
	if m.Headers[1].Value == nil {
		t.Error("an empty header value became null")
	}
	null := &sarama.ConsumerMessage{Topic: ingestTopic}
	NewBudget(1 << 20).OnConsume(null)
	if null.Key != nil || null.Value != nil {
		t.Errorf("a null key or value became empty: %q %q", null.Key, null.Value)
	}
}

// Through the consumer, a backlog of large records is ingested whole while
// the bytes held never pass the budget by more than one record.
func TestIngestHoldsAtMostItsBudget(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	const (
		records = 40
		size    = 64 << 10
		limit   = 200 << 10
	)
	for i := range records {
		k.produce(t, validRec(int32(i%ingestPartitions), fmt.Sprint("k-", i), string(bytes.Repeat([]byte{'v'}, size))))
	}
	budget := NewBudget(limit)
	startIngester(t.Context(), t, k, db.Pool, "budget", IngestConfig{Budget: budget, BatchSize: 1000, BatchBytes: 1 << 20,
		BatchLinger: 20 * time.Millisecond}, nil)
	waitRows(t, db.Pool, records, 60*time.Second)
	budget.mu.Lock()
	peak := budget.peak
	budget.mu.Unlock()
	if one := int64(size + 1024); peak > limit+one {
		t.Errorf("peak %d bytes held, want at most the budget %d plus one record", peak, limit)
	}
	if peak < limit/2 {
		t.Errorf("peak %d bytes held: the budget was never near full, so this test shows nothing", peak)
	}
	waitFor(t, 10*time.Second, "every byte given back", func() (bool, string) {
		return budget.Used() == 0, fmt.Sprintf("%d bytes held", budget.Used())
	})
}
