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

// TestDefer: Defer hands the record over as the client read it: key,
// value and headers byte for byte and in order, to the business key's
// partition of the defer topic. What Defer makes of the headers is
// gate's, tested there (gate's TestDefer).
func TestDefer(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{deferTopic}, Partitions: 8})
	client, err := deferkgo.New(deferkgo.Config{Brokers: []string{addr}, Group: "payment-service"})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	col := kafkatest.Collect(t, addr, deferTopic)
	rec := consumed("rec-2", "refund", "trace", "abc", "defer.target", "orders.retry", "defer.key", "order-42",
		"defer.id", "17", "defer.seq", "9", "defer.attempt", "2")
	if err := client.Defer(t.Context(), rec, deferkgo.Deferral{ErrorClass: "ProviderTimeout"}); err != nil {
		t.Fatal(err)
	}
	got := col.Wait(t, 1, 10*time.Second)[0]
	if string(got.Key) != "rec-2" || string(got.Value) != "refund" {
		t.Errorf("key/value %q/%q, want rec-2/refund", got.Key, got.Value)
	}
	if want := gate.Partition("order-42", 8); got.Partition != want {
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
		cfg  deferkgo.Config
		want string
	}{
		{"no brokers", deferkgo.Config{}, "no brokers"},
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

// TestDeferRefusesNil: a nil record is refused, saying so.
func TestDeferRefusesNil(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{deferTopic}})
	client, err := deferkgo.New(deferkgo.Config{Brokers: []string{addr}})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if err := client.Defer(t.Context(), nil, deferkgo.Deferral{Target: "t"}); err == nil || !strings.Contains(err.Error(), "nil record") {
		t.Errorf("Defer(nil) = %v, want an error naming the nil record", err)
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
