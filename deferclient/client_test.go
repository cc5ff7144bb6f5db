package deferclient_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/deferclient"
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

// TestDefer: Defer hands the record over as the client read it: key,
// value and headers byte for byte and in order, to the business key's
// partition of the defer topic. What Defer makes of the headers is
// gate's, tested there (gate's TestDefer).
func TestDefer(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{deferTopic}, Partitions: 8})
	client, err := deferclient.New(deferclient.Config{Brokers: []string{addr}, Group: "payment-service"})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	col := kafkatest.Collect(t, addr, deferTopic)
	rec := consumed("rec-2", "refund", "trace", "abc", "defer.target", "orders.retry", "defer.key", "order-42",
		"defer.id", "17", "defer.seq", "9", "defer.attempt", "2")
	if err := client.Defer(t.Context(), rec, deferclient.Deferral{ErrorClass: "ProviderTimeout"}); err != nil {
		t.Fatal(err)
	}
	got := col.Wait(t, 1, 10*time.Second)[0]
	if string(got.Key) != "rec-2" || string(got.Value) != "refund" {
		t.Errorf("key/value %q/%q, want rec-2/refund", got.Key, got.Value)
	}
	if want := deferclient.Partition("order-42", 8); got.Partition != want {
		t.Errorf("partition %d, want %d (the business key's)", got.Partition, want)
	}
	var headers []string
	for _, h := range got.Headers {
		headers = append(headers, string(h.Key)+"="+string(h.Value))
	}
	want := []string{"trace=abc", "defer.target=orders.retry", "defer.key=order-42", "defer.id=17", "defer.seq=9",
		"defer.attempt=2", "defer.group=payment-service", "defer.error.class=ProviderTimeout"}
	if !slices.Equal(headers, want) {
		t.Errorf("headers\n  %q\nwant\n  %q", headers, want)
	}
}

// TestNewRefuses: a configuration that cannot work is refused at once,
// the adapter's own checks and gate's alike (gate's TestNewRefuses has
// the rest).
func TestNewRefuses(t *testing.T) {
	tests := []struct {
		name string
		cfg  deferclient.Config
		want string
	}{
		{"no brokers", deferclient.Config{}, "no brokers"},
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
