package deferclient_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/deferclient"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/kafkatest"
)

const deferTopic = "scheduler.defer"

// consumed is a record as a consumer got it, for Defer to forward.
func consumed(key, value string, headers ...string) *sarama.ConsumerMessage {
	m := &sarama.ConsumerMessage{Topic: "orders", Partition: 1, Offset: 7, Key: []byte(key), Value: []byte(value)}
	for i := 0; i+1 < len(headers); i += 2 {
		m.Headers = append(m.Headers, &sarama.RecordHeader{Key: []byte(headers[i]), Value: []byte(headers[i+1])})
	}
	return m
}

// TestDefer: what Defer writes to the defer topic, read back from a real
// broker: the record's key, value and headers byte for byte and in order,
// the control headers set or replaced in place, stale one-shot headers
// dropped, the partition the business key's, and a signature the
// scheduler's check accepts.
func TestDefer(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{deferTopic}, Partitions: 8})
	key := []byte("0123456789abcdef0123456789abcdef")
	client, err := deferclient.New(deferclient.Config{Brokers: []string{addr}, Group: "payment-service",
		Source: "payments", SourceKey: key})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	col := kafkatest.Collect(t, addr, deferTopic)

	tests := []struct {
		name string
		msg  *sarama.ConsumerMessage
		d    deferclient.Deferral
		want []string // headers, in order, without the signature
		bkey string
	}{
		{
			name: "first failure of a main-topic record",
			msg:  consumed("rec-1", "charge", "trace", "abc", "original.topic", "orders"),
			d:    deferclient.Deferral{Target: "orders.retry", BusinessKey: "order-42", Delay: 1500 * time.Millisecond, ErrorClass: "ProviderTimeout", ErrorMessage: "no answer"},
			want: []string{"trace=abc", "original.topic=orders", "defer.target=orders.retry", "defer.key=order-42",
				"defer.group=payment-service", "defer.source=payments", "defer.error.class=ProviderTimeout",
				"defer.error.message=no answer", "defer.delay=1500"},
			bkey: "order-42",
		},
		{
			name: "a republished record fails again: keeps its place and attempt, replaces the one-shot and error headers in place",
			msg: consumed("rec-2", "refund", "defer.target", "orders.retry", "defer.key", "order-42", "defer.id", "17",
				"defer.seq", "9", "defer.attempt", "2", "defer.scheduled-at", "2026-11-25T10:00:00Z",
				"defer.error.class", "Old", "defer.source", "payments", "defer.signature", strings.Repeat("0", 64),
				"defer.group", "payment-service"),
			d: deferclient.Deferral{At: time.Date(2026, 11, 25, 11, 0, 0, 0, time.UTC), ErrorClass: "ProviderTimeout"},
			want: []string{"defer.target=orders.retry", "defer.key=order-42", "defer.id=17", "defer.seq=9", "defer.attempt=2",
				"defer.scheduled-at=2026-11-25T10:00:00Z", "defer.error.class=ProviderTimeout", "defer.source=payments",
				"defer.group=payment-service", "defer.at=2026-11-25T11:00:00Z"},
			bkey: "order-42",
		},
		{
			name: "the record key is the business key when nothing names one",
			msg:  consumed("order-7", "ship"),
			d:    deferclient.Deferral{Target: "orders.retry"},
			want: []string{"defer.target=orders.retry", "defer.key=order-7", "defer.group=payment-service", "defer.source=payments"},
			bkey: "order-7",
		},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := client.Defer(t.Context(), tt.msg, tt.d); err != nil {
				t.Fatal(err)
			}
			got := col.Wait(t, i+1, 10*time.Second)[i]
			if string(got.Key) != string(tt.msg.Key) || string(got.Value) != string(tt.msg.Value) {
				t.Errorf("key/value %q/%q, want %q/%q", got.Key, got.Value, tt.msg.Key, tt.msg.Value)
			}
			if want := deferclient.Partition(tt.bkey, 8); got.Partition != want {
				t.Errorf("partition %d, want %d (the business key %q's)", got.Partition, want, tt.bkey)
			}
			var rec protocol.Record
			rec.Key, rec.Value = got.Key, got.Value
			var headers []string
			for _, h := range got.Headers {
				rec.Headers = append(rec.Headers, protocol.Header{Key: h.Key, Value: h.Value})
				if string(h.Key) != protocol.HeaderSignature {
					headers = append(headers, string(h.Key)+"="+string(h.Value))
				}
			}
			if !slices.Equal(headers, tt.want) {
				t.Errorf("headers\n  %q\nwant\n  %q", headers, tt.want)
			}
			if err := protocol.Verify(key, rec); err != nil {
				t.Errorf("the scheduler would refuse the signature: %v", err)
			}
		})
	}
	if st := client.Stats(); st.Deferred != int64(len(tests)) {
		t.Errorf("stats %+v, want %d deferred", st, len(tests))
	}
}

// TestDeferRefuses: deferrals that cannot be right fail before anything is
// produced, saying why.
func TestDeferRefuses(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{deferTopic}})
	client, err := deferclient.New(deferclient.Config{Brokers: []string{addr}})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	tests := []struct {
		name string
		msg  *sarama.ConsumerMessage
		d    deferclient.Deferral
		want string
	}{
		{"no target", consumed("k", "v"), deferclient.Deferral{}, "no target"},
		{"delay and at", consumed("k", "v"), deferclient.Deferral{Target: "t", Delay: time.Second, At: time.Now()}, "not both"},
		{"negative delay", consumed("k", "v"), deferclient.Deferral{Target: "t", Delay: -time.Second}, "negative delay"},
		{"key too long", consumed("k", "v"), deferclient.Deferral{Target: "t", BusinessKey: strings.Repeat("k", 1025)}, "business key of 1025 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := client.Defer(t.Context(), tt.msg, tt.d)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Defer = %v, want an error containing %q", err, tt.want)
			}
		})
	}
	if st := client.Stats(); st.Deferred != 0 {
		t.Errorf("stats %+v after refusals, want nothing deferred", st)
	}
}

// TestNewRefuses: a configuration that cannot work is refused at once.
func TestNewRefuses(t *testing.T) {
	tests := []struct {
		name string
		cfg  deferclient.Config
		want string
	}{
		{"no brokers", deferclient.Config{}, "no brokers"},
		{"bad source", deferclient.Config{Brokers: []string{"x:1"}, Source: "bad source"}, "source"},
		{"short key", deferclient.Config{Brokers: []string{"x:1"}, Source: "s", SourceKey: []byte("short")}, "at least"},
		{"key without source", deferclient.Config{Brokers: []string{"x:1"}, SourceKey: []byte(strings.Repeat("k", 32))}, "needs a source name"},
		{"long group", deferclient.Config{Brokers: []string{"x:1"}, Group: strings.Repeat("g", 256)}, "group of 256 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := deferclient.New(tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("New = %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

// TestKeyStatesNeverGuessFree: with no scheduler answering, every key is
// blocked, for an unknown reason, and the error says the scheduler could
// not vouch for them.
func TestKeyStatesNeverGuessFree(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{deferTopic}})
	client, err := deferclient.New(deferclient.Config{Brokers: []string{addr}, Group: "g",
		SchedulerURL: "http://127.0.0.1:1", KeyStateWait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	states, err := client.KeyStates(t.Context(), []string{"a", "b", "a"})
	if !errors.Is(err, deferclient.ErrUnsure) {
		t.Errorf("KeyStates error = %v, want ErrUnsure", err)
	}
	if len(states) != 2 {
		t.Errorf("states %v, want a and b once each", states)
	}
	for k, st := range states {
		if !st.Blocked || st.Reason != deferclient.ReasonUnknown {
			t.Errorf("key %s: %+v, want blocked for an unknown reason", k, st)
		}
	}
	if st := client.Stats(); st.QueryFailures != 1 || st.Queries != 0 {
		t.Errorf("stats %+v, want one failed query", st)
	}
}
