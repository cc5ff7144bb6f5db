package deferclient_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"os/signal"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/deferclient"
)

// A record of business key "order-42" goes to the same partition of the
// defer topic and of the retry topic, whatever its record key: the one the
// Java client's default partitioner gives the key's bytes.
func ExamplePartition() {
	fmt.Println(deferclient.Partition("order-42", 12))
	fmt.Println(deferclient.Partition("order-43", 12))
	// Output:
	// 0
	// 10
}

// Errors marked Permanent are parked by the scheduler at once; any other
// error is classified by its innermost type, which NON_RETRIABLE_ERRORS
// patterns can match.
func ExampleDefaultClassify() {
	class, msg := deferclient.DefaultClassify(deferclient.Permanent(errors.New("card declined")))
	fmt.Println(class, "|", msg)
	class, msg = deferclient.DefaultClassify(fmt.Errorf("charge: %w", context.DeadlineExceeded))
	fmt.Println(class, "|", msg)
	// Output:
	// permanent | card declined
	// context.deadlineExceededError | charge: context deadline exceeded
}

// A consumer group that handles its main topic and its retry topic through
// the library: failed records are deferred, and no record of a business key
// reaches the handler while an earlier one of the key is deferred,
// republished but not committed, or failed again.
func ExampleClient_ConsumerGroupHandler() {
	brokers := []string{"localhost:9092"}
	client, err := deferclient.New(deferclient.Config{
		Brokers:      brokers,
		Group:        "payment-service",
		SchedulerURL: "http://scheduler:8080",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	charge := func(ctx context.Context, m *sarama.ConsumerMessage) error {
		// Call the payment provider. A returned error defers the record;
		// deferclient.Permanent(err) parks it instead.
		return nil
	}
	handler := client.ConsumerGroupHandler(charge, deferclient.HandlerConfig{
		RetryTopic: func(string) string { return "payments.retry" },
	})

	kc := sarama.NewConfig()
	kc.Version = sarama.V3_6_0_0
	kc.Consumer.Offsets.Initial = sarama.OffsetOldest
	group, err := sarama.NewConsumerGroup(brokers, "payment-service", kc)
	if err != nil {
		log.Fatal(err)
	}
	defer group.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	for ctx.Err() == nil {
		// The main topic and its retry topic, in one group, one handler.
		if err := group.Consume(ctx, []string{"payments", "payments.retry"}, handler); err != nil {
			log.Print(err)
		}
	}
}

// Deferring one record by hand, from a consumer that does not use the
// handler wrapper.
func ExampleClient_Defer() {
	client, err := deferclient.New(deferclient.Config{Brokers: []string{"localhost:9092"}, Group: "payment-service"})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	var failed *sarama.ConsumerMessage // the record the consumer failed on
	err = client.Defer(context.Background(), failed, deferclient.Deferral{
		Target:       "payments.retry",
		Delay:        30 * time.Second,
		ErrorClass:   "ProviderTimeout",
		ErrorMessage: "the provider did not answer within 5s",
	})
	if err != nil {
		log.Print(err) // not deferred: do not commit the record's offset
	}
}
