package deferkgo_test

import (
	"context"
	"errors"
	"log"
	"os"
	"os/signal"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/deferq/scheduler/deferclient/deferkgo"
	"github.com/deferq/scheduler/deferclient/gate"
)

// A consumer group on franz-go that handles its main topic and its retry
// topic through the library: failed records are deferred, and no record of
// a business key reaches the handler while an earlier one of the key is
// deferred, republished but not committed, or failed again.
func ExampleClient_Consume() {
	brokers := []string{"localhost:9092"}
	client, err := deferkgo.New(deferkgo.Config{
		Brokers:      brokers,
		Group:        "payment-service",
		SchedulerURL: "http://scheduler:8080",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	// The consuming client: the library's options, the group, and the main
	// topic with its retry topic.
	join := func() *kgo.Client {
		cl, err := kgo.NewClient(append(client.GroupOpts(),
			kgo.SeedBrokers(brokers...),
			kgo.ConsumerGroup("payment-service"),
			kgo.ConsumeTopics("payments", "payments.retry"),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		)...)
		if err != nil {
			log.Fatal(err)
		}
		return cl
	}
	cl := join()
	defer func() { cl.Close() }()

	charge := func(ctx context.Context, r *kgo.Record) error {
		// Call the payment provider. A returned error defers the record;
		// gate.Permanent(err) parks it instead.
		return nil
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	for ctx.Err() == nil {
		err := client.Consume(ctx, cl, charge, deferkgo.HandlerConfig{
			RetryTopic: func(string) string { return "payments.retry" },
		})
		if err == nil {
			continue
		}
		log.Print(err)
		if errors.Is(err, deferkgo.ErrLeftGroup) {
			// What it left unsettled is read again, from the committed
			// offsets, by the group: rejoin with a new client.
			cl.Close()
			cl = join()
		}
	}
}

// Deferring one record by hand, from a consumer that does not use
// Client.Consume.
func ExampleClient_Defer() {
	client, err := deferkgo.New(deferkgo.Config{Brokers: []string{"localhost:9092"}, Group: "payment-service"})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	var failed *kgo.Record // the record the consumer failed on
	err = client.Defer(context.Background(), failed, gate.Deferral{
		Target:       "payments.retry",
		Delay:        30 * time.Second,
		ErrorClass:   "ProviderTimeout",
		ErrorMessage: "the provider did not answer within 5s",
	})
	if err != nil {
		log.Print(err) // not deferred: do not commit the record's offset
	}
}
