package deferkgo_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/deferq/scheduler/deferclient/deferkgo"
	"github.com/deferq/scheduler/deferclient/gate"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/kafkatest"
)

const deferTopic = "scheduler.defer"

// consumed is a record as a kgo consumer got it, for Defer to forward.
func consumed(key, value string, headers ...string) *kgo.Record {
	r := &kgo.Record{Topic: "orders", Partition: 1, Offset: 7, Key: []byte(key), Value: []byte(value)}
	for i := 0; i+1 < len(headers); i += 2 {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: headers[i], Value: []byte(headers[i+1])})
	}
	return r
}

// TestDefer: what Defer writes to the defer topic, read back from a real
// broker: the record's key, value and headers byte for byte and in order,
// the control headers set or replaced in place, stale one-shot headers
// dropped, the partition the business key's, and a signature the
// scheduler's check accepts.
func TestDefer(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{deferTopic}, Partitions: 8})
	key := []byte("0123456789abcdef0123456789abcdef")
	client, err := deferkgo.New(deferkgo.Config{Brokers: []string{addr}, Group: "payment-service",
		Source: "payments", SourceKey: key})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	col := kafkatest.Collect(t, addr, deferTopic)

	tests := []struct {
		name string
		rec  *kgo.Record
		d    deferkgo.Deferral
		want []string // headers, in order, without the signature
		bkey string
	}{
		{
			name: "first failure of a main-topic record",
			rec:  consumed("rec-1", "charge", "trace", "abc", "original.topic", "orders"),
			d:    deferkgo.Deferral{Target: "orders.retry", BusinessKey: "order-42", Delay: 1500 * time.Millisecond, ErrorClass: "ProviderTimeout", ErrorMessage: "no answer"},
			want: []string{"trace=abc", "original.topic=orders", "defer.target=orders.retry", "defer.key=order-42",
				"defer.group=payment-service", "defer.source=payments", "defer.error.class=ProviderTimeout",
				"defer.error.message=no answer", "defer.delay=1500"},
			bkey: "order-42",
		},
		{
			name: "a republished record fails again: keeps its place and attempt, replaces the one-shot and error headers in place",
			rec: consumed("rec-2", "refund", "defer.target", "orders.retry", "defer.key", "order-42", "defer.id", "17",
				"defer.seq", "9", "defer.attempt", "2", "defer.scheduled-at", "2026-11-25T10:00:00Z",
				"defer.error.class", "Old", "defer.source", "payments", "defer.signature", strings.Repeat("0", 64),
				"defer.group", "payment-service"),
			d: deferkgo.Deferral{At: time.Date(2026, 11, 25, 11, 0, 0, 0, time.UTC), ErrorClass: "ProviderTimeout"},
			want: []string{"defer.target=orders.retry", "defer.key=order-42", "defer.id=17", "defer.seq=9", "defer.attempt=2",
				"defer.scheduled-at=2026-11-25T10:00:00Z", "defer.error.class=ProviderTimeout", "defer.source=payments",
				"defer.group=payment-service", "defer.at=2026-11-25T11:00:00Z"},
			bkey: "order-42",
		},
		{
			name: "the record key is the business key when nothing names one",
			rec:  consumed("order-7", "ship"),
			d:    deferkgo.Deferral{Target: "orders.retry"},
			want: []string{"defer.target=orders.retry", "defer.key=order-7", "defer.group=payment-service", "defer.source=payments"},
			bkey: "order-7",
		},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := client.Defer(t.Context(), tt.rec, tt.d); err != nil {
				t.Fatal(err)
			}
			got := col.Wait(t, i+1, 10*time.Second)[i]
			if string(got.Key) != string(tt.rec.Key) || string(got.Value) != string(tt.rec.Value) {
				t.Errorf("key/value %q/%q, want %q/%q", got.Key, got.Value, tt.rec.Key, tt.rec.Value)
			}
			if want := gate.Partition(tt.bkey, 8); got.Partition != want {
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
	client, err := deferkgo.New(deferkgo.Config{Brokers: []string{addr}})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	tests := []struct {
		name string
		rec  *kgo.Record
		d    deferkgo.Deferral
		want string
	}{
		{"no target", consumed("k", "v"), deferkgo.Deferral{}, "no target"},
		{"delay and at", consumed("k", "v"), deferkgo.Deferral{Target: "t", Delay: time.Second, At: time.Now()}, "not both"},
		{"negative delay", consumed("k", "v"), deferkgo.Deferral{Target: "t", Delay: -time.Second}, "negative delay"},
		{"key too long", consumed("k", "v"), deferkgo.Deferral{Target: "t", BusinessKey: strings.Repeat("k", 1025)}, "business key of 1025 bytes"},
		{"no record", nil, deferkgo.Deferral{Target: "t"}, "nil record"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := client.Defer(t.Context(), tt.rec, tt.d)
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
		cfg  deferkgo.Config
		want string
	}{
		{"no brokers", deferkgo.Config{}, "no brokers"},
		{"bad source", deferkgo.Config{Brokers: []string{"x:1"}, Source: "bad source"}, "source"},
		{"short key", deferkgo.Config{Brokers: []string{"x:1"}, Source: "s", SourceKey: []byte("short")}, "at least"},
		{"long group", deferkgo.Config{Brokers: []string{"x:1"}, Group: strings.Repeat("g", 256)}, "group of 256 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := deferkgo.New(tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("New = %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

// TestConsumeRefusesClient: Consume refuses a consuming kgo.Client without
// the options the gate needs, naming what is missing, before it polls.
func TestConsumeRefusesClient(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{deferTopic, "orders"}})
	client, err := deferkgo.New(deferkgo.Config{Brokers: []string{addr}, Group: "payments"})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	tests := []struct {
		name string
		opts []kgo.Opt
		want []string
	}{
		{"without GroupOpts", []kgo.Opt{kgo.ConsumerGroup("payments")},
			[]string{"BlockRebalanceOnPoll", "AutoCommitMarks"}},
		{"another group", append(client.GroupOpts(), kgo.ConsumerGroup("billing")), []string{`group "billing"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cl, err := kgo.NewClient(append(tt.opts, kgo.SeedBrokers(addr), kgo.ConsumeTopics("orders"))...)
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			err = client.Consume(t.Context(), cl, func(context.Context, *kgo.Record) error { return nil }, deferkgo.HandlerConfig{})
			for _, w := range tt.want {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("Consume = %v, want an error naming %q", err, w)
				}
			}
		})
	}
}

// TestConsumeFailedDeferralIsReadAgain: when a record the handler failed
// cannot be deferred (here: it has no target), Consume stops with it
// unsettled. What came before it is committed; it and what follows are
// not, and the client leaves the group; a new member reads from the
// failed record on, and hands nothing after it to the handler first. No
// scheduler: the gate is off, the deferrals are what is tested.
func TestConsumeFailedDeferralIsReadAgain(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{deferTopic, "orders"}})
	client, err := deferkgo.New(deferkgo.Config{Brokers: []string{addr}, Group: "payments"})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	p, err := kgo.NewClient(kgo.SeedBrokers(addr))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, v := range []string{"a", "b", "fail", "c"} {
		if err := p.ProduceSync(t.Context(), &kgo.Record{Topic: "orders", Key: []byte("order-1"), Value: []byte(v)}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	member := func() *kgo.Client {
		cl, err := kgo.NewClient(append(client.GroupOpts(), kgo.SeedBrokers(addr), kgo.ConsumerGroup("payments"),
			kgo.ConsumeTopics("orders"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))...)
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}
	var seen []string
	handler := func(_ context.Context, r *kgo.Record) error {
		seen = append(seen, string(r.Value))
		if string(r.Value) == "fail" {
			return errors.New("provider timeout")
		}
		return nil
	}

	// First member: "fail" cannot be deferred, for want of a target.
	first := member()
	defer first.Close()
	err = client.Consume(t.Context(), first, handler, deferkgo.HandlerConfig{NoGate: true,
		RetryTopic: func(string) string { return "" }})
	if !errors.Is(err, deferkgo.ErrLeftGroup) || !strings.Contains(err.Error(), "no target") {
		t.Fatalf("Consume = %v, want ErrLeftGroup for a deferral without a target", err)
	}
	if want := []string{"a", "b", "fail"}; !slices.Equal(seen, want) {
		t.Fatalf("the first member handled %q, want %q: nothing after the record it could not defer", seen, want)
	}
	if err := client.Consume(t.Context(), first, handler, deferkgo.HandlerConfig{}); !errors.Is(err, deferkgo.ErrLeftGroup) {
		t.Errorf("Consume again on the client that left = %v, want ErrLeftGroup", err)
	}

	// A new member reads from "fail" on, defers it this time and goes on.
	seen = nil
	second := member()
	defer second.Close()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- client.Consume(ctx, second, func(ctx context.Context, r *kgo.Record) error {
			err := handler(ctx, r)
			if string(r.Value) == "c" {
				cancel() // the last record: stop after it
			}
			return err
		}, deferkgo.HandlerConfig{NoGate: true, RetryTopic: func(string) string { return "orders.retry" }})
	}()
	if err := <-done; err != nil {
		t.Fatalf("Consume of the second member = %v", err)
	}
	if want := []string{"fail", "c"}; !slices.Equal(seen, want) {
		t.Errorf("the second member handled %q, want %q: from the record not deferred on", seen, want)
	}
	col := kafkatest.Collect(t, addr, deferTopic)
	got := col.Wait(t, 1, 10*time.Second)
	if len(got) != 1 || string(got[0].Value) != "fail" || kafkatest.Header(got[0], protocol.HeaderTarget) != "orders.retry" {
		t.Errorf("deferred %d records, want fail once, to orders.retry", len(got))
	}
	if st := client.Stats(); st.Deferred != 1 || st.Handled != 3 {
		t.Errorf("stats %+v, want 1 deferred and 3 handled (a, b, c)", st)
	}
}
