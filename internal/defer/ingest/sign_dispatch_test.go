package ingest_test

// An external test package: it runs ingest and dispatch together, and
// internal/dispatch imports this package.

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/deferq/scheduler/internal/defer/ingest"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// headerValues returns the values of the headers named name, in order.
func headerValues(hs []sarama.RecordHeader, name string) []string {
	var out []string
	for _, h := range hs {
		if string(h.Key) == name {
			out = append(out, string(h.Value))
		}
	}
	return out
}

// TestDispatchDropsSignature ingests a signed record from a source with a
// key and dispatches it: the republished record keeps defer.source and
// carries no defer.signature, since the headers it covered were rewritten.
func TestDispatchDropsSignature(t *testing.T) {
	const (
		deferTopic = "scheduler.defer"
		target     = "orders.created"
	)
	ctx := t.Context()
	db := pgtest.NewDB(t)
	broker, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, deferTopic, target))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(broker.Close)
	addrs := broker.ListenAddrs()
	config := func() *sarama.Config {
		c := sarama.NewConfig()
		c.Version = sarama.V3_6_0_0
		return c
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))

	key := []byte(strings.Repeat("k", protocol.MinKeyBytes))
	signing, err := protocol.NewSigning(map[string][]byte{"billing": key}, true)
	if err != nil {
		t.Fatal(err)
	}
	rec := protocol.Record{Key: []byte("order-42"), Value: []byte(`{"order":42}`), Headers: []protocol.Header{
		{Key: []byte(protocol.HeaderSource), Value: []byte("billing")},
		{Key: []byte(protocol.HeaderTarget), Value: []byte(target)},
		{Key: []byte(protocol.HeaderDelay), Value: []byte("0s")},
		{Key: []byte("trace"), Value: []byte("t-1")},
	}}
	sig, err := protocol.Sign(key, rec)
	if err != nil {
		t.Fatal(err)
	}
	msg := &sarama.ProducerMessage{Topic: deferTopic, Key: sarama.ByteEncoder(rec.Key), Value: sarama.ByteEncoder(rec.Value)}
	for _, h := range rec.Headers {
		msg.Headers = append(msg.Headers, sarama.RecordHeader{Key: h.Key, Value: h.Value})
	}
	msg.Headers = append(msg.Headers, sarama.RecordHeader{Key: []byte(protocol.HeaderSignature), Value: []byte(sig)})
	pc := config()
	pc.Producer.Return.Successes = true
	producer, err := sarama.NewSyncProducer(addrs, batchproducer.Config(pc))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { producer.Close() })
	if _, _, err := producer.SendMessage(msg); err != nil {
		t.Fatalf("produce: %v", err)
	}

	consumer, err := ingest.NewConsumer(addrs, "sign-dispatch", config(), nil)
	if err != nil {
		t.Fatal(err)
	}
	group := consumer.Group
	in, err := ingest.NewIngester(group, ingest.NewStore(db.Pool, nil), ingest.IngestConfig{
		Topic:       deferTopic,
		Group:       "sign-dispatch",
		Log:         consumer.Log(),
		Rules:       protocol.Rules{Targets: protocol.TargetPatterns{target}, MaxDelay: time.Hour, Signing: signing},
		BatchSize:   10,
		BatchLinger: 10 * time.Millisecond,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	ictx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		in.Run(ictx)
	}()
	t.Cleanup(func() {
		stop()
		<-done
		consumer.Close()
	})
	deadline := time.Now().Add(30 * time.Second)
	for stored, rejected, _ := in.Counts(); stored == 0; stored, rejected, _ = in.Counts() {
		if time.Now().After(deadline) {
			t.Fatal("the record was not ingested within 30s")
		}
		if rejected > 0 {
			t.Fatal("the signed record was rejected")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, rejected, _ := in.Counts(); rejected != 0 {
		var reason string
		_ = db.Pool.QueryRow(ctx, "SELECT reason FROM deferred_message").Scan(&reason)
		t.Fatalf("the signed record was rejected: %s", reason)
	}

	locker, err := keylock.New(db.Pool, keylock.Config{Owner: "sign-test", Lease: time.Minute, PerKey: 10})
	if err != nil {
		t.Fatal(err)
	}
	d, err := dispatch.New(locker, producer, nil, dispatch.Config{BatchKeys: 10, PollInterval: 50 * time.Millisecond,
		Targets: protocol.TargetPatterns{target}}, logger)
	if err != nil {
		t.Fatal(err)
	}
	stats, err := d.Round(ctx)
	if err != nil || stats.Published != 1 {
		t.Fatalf("dispatch round: %+v, %v; want 1 published", stats, err)
	}

	reader, err := sarama.NewConsumer(addrs, config())
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	part, err := reader.ConsumePartition(target, 0, sarama.OffsetOldest)
	if err != nil {
		t.Fatal(err)
	}
	defer part.Close()
	var out *sarama.ConsumerMessage
	select {
	case out = <-part.Messages():
	case <-time.After(30 * time.Second):
		t.Fatal("nothing republished to the target within 30s")
	}
	var outHeaders []sarama.RecordHeader
	for _, h := range out.Headers {
		outHeaders = append(outHeaders, *h)
	}
	if got := headerValues(outHeaders, protocol.HeaderSignature); got != nil {
		t.Errorf("the output carries defer.signature %q", got)
	}
	if got := headerValues(outHeaders, protocol.HeaderSource); !slices.Equal(got, []string{"billing"}) {
		t.Errorf("the output's defer.source is %q, want [billing]", got)
	}
	if got := headerValues(outHeaders, "trace"); !slices.Equal(got, []string{"t-1"}) || string(out.Value) != `{"order":42}` {
		t.Errorf("the output's trace header %q, value %q: not carried through", got, out.Value)
	}
	// Without its signature, the output would be refused if forwarded
	// unchanged: the consumer must sign it again.
	back := protocol.Record{Key: out.Key, Value: out.Value}
	for _, h := range outHeaders {
		back.Headers = append(back.Headers, protocol.Header{Key: h.Key, Value: h.Value})
	}
	if err := protocol.Verify(key, back); err == nil {
		t.Error("the output verifies without a signature")
	}
}

// TestRecordDropsSignature checks the output and dead-letter header rewrites
// directly: every copy of defer.signature goes, defer.source stays in place.
func TestRecordDropsSignature(t *testing.T) {
	headers := []keylock.Header{
		{Key: protocol.HeaderSignature, Value: []byte("aa")},
		{Key: protocol.HeaderSource, Value: []byte("billing")},
		{Key: protocol.HeaderTarget, Value: []byte("orders.created")},
		{Key: protocol.HeaderSignature, Value: []byte("bb")},
		{Key: "trace", Value: []byte("t")},
	}
	out := dispatch.Record(keylock.Message{ID: 1, Seq: 1, Target: "orders.created", NextRunAt: time.Now(), Headers: headers})
	dlq := dispatch.DeadLetter(dispatch.Parked{ID: 1, Seq: 1, DLQTopic: "orders.created.dlq", Headers: headers})
	for name, hs := range map[string][]sarama.RecordHeader{"output": out.Headers, "dead-letter copy": dlq.Headers} {
		if got := headerValues(hs, protocol.HeaderSignature); got != nil {
			t.Errorf("%s keeps defer.signature %q", name, got)
		}
		if len(hs) == 0 || string(hs[0].Key) != protocol.HeaderSource || string(hs[0].Value) != "billing" {
			t.Errorf("%s: first header %q, want defer.source billing, in place", name, hs)
		}
	}
}
