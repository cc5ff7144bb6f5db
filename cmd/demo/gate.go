package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/deferclient"
)

// The key gate's topics: a consumer on the library reads both, and the
// scheduler republishes to the retry topic (TARGET_TOPICS=payments.*).
const (
	gateMain  = "payments.orders"
	gateRetry = "payments.orders.retry"
	gateGroup = "demo-payments"
	gateKey   = "order-99"
)

// gatePolicy makes the retry of a failed charge come two seconds later,
// so that the refund behind it visibly waits.
const gatePolicy = gateRetry + ": exponential 2s x1 forever jitter none"

// gateScenario shows the key gate: a consumer on deferclient fails the
// charge of an order once; the order's refund, which arrives meanwhile,
// waits behind the charge instead of being handled before it, and goes
// once the charge succeeded. schedulerAddr is the service's HTTP_ADDR.
func (d *demo) gateScenario(ctx context.Context, brokers, schedulerAddr string) error {
	client, err := deferclient.New(deferclient.Config{Brokers: []string{brokers}, Group: gateGroup,
		SchedulerURL: "http://" + schedulerAddr})
	if err != nil {
		return err
	}
	defer client.Close()

	type event struct{ value, outcome string }
	events := make(chan event, 16)
	var mu sync.Mutex
	charged := false
	handler := client.ConsumerGroupHandler(func(_ context.Context, m *sarama.ConsumerMessage) error {
		v := string(m.Value)
		mu.Lock()
		defer mu.Unlock()
		if v == "charge" && !charged {
			charged = true
			events <- event{v, "failed (card processor timeout): deferred, retried in 2s"}
			return errors.New("card processor timeout")
		}
		events <- event{v, "handled"}
		return nil
	}, deferclient.HandlerConfig{})

	cc := sarama.NewConfig()
	cc.Consumer.Offsets.Initial = sarama.OffsetOldest
	group, err := sarama.NewConsumerGroup([]string{brokers}, gateGroup, cc)
	if err != nil {
		return fmt.Errorf("demo consumer group: %w", err)
	}
	defer group.Close()
	gctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		for gctx.Err() == nil {
			if err := group.Consume(gctx, []string{gateMain, gateRetry}, handler); err != nil && gctx.Err() == nil {
				d.say("  (consumer: %v; joining again)", err)
				time.Sleep(100 * time.Millisecond)
			}
		}
	}()

	pc := sarama.NewConfig()
	pc.Producer.Return.Successes = true
	pc.Producer.Partitioner = sarama.NewHashPartitioner
	producer, err := sarama.NewSyncProducer([]string{brokers}, pc)
	if err != nil {
		return fmt.Errorf("demo producer: %w", err)
	}
	defer producer.Close()

	d.say("the key gate: a payments consumer on deferclient reads %s and %s (group %s);", gateMain, gateRetry, gateGroup)
	d.say("%s's charge fails once, and its refund is produced right after it:", gateKey)
	for _, v := range []string{"charge", "refund"} {
		if _, _, err := producer.SendMessage(&sarama.ProducerMessage{Topic: gateMain, Key: sarama.StringEncoder(gateKey),
			Value: sarama.StringEncoder(v)}); err != nil {
			return fmt.Errorf("produce %s: %w", v, err)
		}
		d.say("  produced %s to %s", v, gateMain)
	}
	var handled []string
	deadline := time.After(30 * time.Second)
	for len(handled) < 2 {
		select {
		case e := <-events:
			d.say("  consumer: %s %s", e.value, e.outcome)
			if e.outcome == "handled" {
				handled = append(handled, e.value)
			}
			if e.value == "charge" && e.outcome != "handled" {
				// The refund comes next on the partition: the gate asks the
				// scheduler, finds the key blocked and defers it behind.
				if err := waitFor(ctx, 10*time.Second, func() (bool, error) { return client.Stats().Gated > 0, nil }); err != nil {
					return fmt.Errorf("the refund was not gated: %w", err)
				}
				d.say("  consumer: refund not handled: %s is blocked by the charge, so the refund is deferred behind it (a gated deferral)", gateKey)
			}
		case <-deadline:
			return fmt.Errorf("the charge and the refund were not both handled within 30s (handled: %v)", handled)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if handled[0] != "charge" || handled[1] != "refund" {
		return fmt.Errorf("key order broken: handled %v, want the charge before the refund", handled)
	}
	d.say("done: the refund, which arrived while the charge waited, was handled only after the charge succeeded.")
	return nil
}
