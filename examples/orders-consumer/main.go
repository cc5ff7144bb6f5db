// Command orders-consumer is a consumer built on the client library: it
// consumes a main topic and its retry topic as one consumer group, and
// keeps the order of each business key end to end while some handlings
// fail and are deferred to the scheduler. It runs on sarama
// (deferclient.ConsumerGroupHandler) or on franz-go (deferkgo's
// Client.Consume), as KAFKA_CLIENT says; both behave alike.
//
// Configuration, from the environment:
//
//	KAFKA_CLIENT    the Kafka client library: sarama (default) or franz
//	KAFKA_BROKERS   comma-separated host:port list (required)
//	MAIN_TOPIC      the topic the orders arrive on (required)
//	RETRY_TOPIC     where the scheduler republishes deferred orders (required)
//	GROUP           the consumer group (required)
//	SCHEDULER_URL   the scheduler's HTTP address, e.g. http://localhost:8080, or several
//	                separated by commas, tried in turn (required)
//	OUT_FILE        where handled records go (required)
//	FAIL_RATE       probability, 0..1, that a handling fails transiently (default 0.1)
//	DEFER_TOPIC     the scheduler's input topic (default scheduler.defer)
//
// Handling a record appends one line, "<record key>\t<record value>\n", to
// OUT_FILE, opened with O_APPEND and written with one write per line, so
// that several instances can share one file; the line is written before
// the record's offset is committed, so a crash can repeat it, never lose
// it. With probability FAIL_RATE a handling fails instead, on every
// handling, not only the first: the record is deferred and comes back on
// the retry topic, and may fail again. SIGTERM or SIGINT stops it cleanly:
// the batch in hand is finished and the offsets committed.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/deferq/scheduler/deferclient"
	"github.com/deferq/scheduler/deferclient/deferkgo"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(ctx, os.Getenv, logger); err != nil {
		logger.Error("orders-consumer stopped", "error", err)
		os.Exit(1)
	}
}

// config is the environment, checked.
type config struct {
	kafkaClient           string
	brokers               []string
	mainTopic, retryTopic string
	group, schedulerURL   string
	outFile, deferTopic   string
	failRate              float64
}

func loadConfig(getenv func(string) string) (config, error) {
	c := config{
		kafkaClient: getenv("KAFKA_CLIENT"),
		mainTopic:   getenv("MAIN_TOPIC"), retryTopic: getenv("RETRY_TOPIC"), group: getenv("GROUP"),
		schedulerURL: getenv("SCHEDULER_URL"), outFile: getenv("OUT_FILE"), deferTopic: getenv("DEFER_TOPIC"),
		failRate: 0.1,
	}
	var errs []error
	switch c.kafkaClient {
	case "":
		c.kafkaClient = "sarama"
	case "sarama", "franz":
	default:
		errs = append(errs, fmt.Errorf("KAFKA_CLIENT=%q: want sarama or franz", c.kafkaClient))
	}
	if b := getenv("KAFKA_BROKERS"); b != "" {
		c.brokers = strings.Split(b, ",")
	}
	for name, v := range map[string]string{"KAFKA_BROKERS": getenv("KAFKA_BROKERS"), "MAIN_TOPIC": c.mainTopic,
		"RETRY_TOPIC": c.retryTopic, "GROUP": c.group, "SCHEDULER_URL": c.schedulerURL, "OUT_FILE": c.outFile} {
		if v == "" {
			errs = append(errs, fmt.Errorf("%s is not set", name))
		}
	}
	if v := getenv("FAIL_RATE"); v != "" {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || f < 0 || f > 1 {
			errs = append(errs, fmt.Errorf("FAIL_RATE=%q: want a number from 0 to 1", v))
		}
		c.failRate = f
	}
	return c, errors.Join(errs...)
}

// errFlaky is the transient failure FAIL_RATE injects.
var errFlaky = errors.New("flaky downstream: try again later")

func run(ctx context.Context, getenv func(string) string, logger *slog.Logger) error {
	cfg, err := loadConfig(getenv)
	if err != nil {
		return err
	}
	out, err := os.OpenFile(cfg.outFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("OUT_FILE: %w", err)
	}
	defer out.Close()

	// handle is the application, whatever the Kafka client.
	handle := func(key, value []byte) error {
		if rand.Float64() < cfg.failRate {
			return errFlaky
		}
		line := make([]byte, 0, len(key)+len(value)+2)
		line = append(append(append(append(line, key...), '\t'), value...), '\n')
		_, err := out.Write(line) // one write: lines of several instances never interleave
		return err
	}
	logger.Info("orders-consumer running", "kafka_client", cfg.kafkaClient, "main_topic", cfg.mainTopic,
		"retry_topic", cfg.retryTopic, "group", cfg.group)
	if cfg.kafkaClient == "franz" {
		return runFranz(ctx, cfg, handle, logger)
	}
	return runSarama(ctx, cfg, handle, logger)
}

// runSarama consumes with sarama through deferclient.
func runSarama(ctx context.Context, cfg config, handle func(key, value []byte) error, logger *slog.Logger) error {
	client, err := deferclient.New(deferclient.Config{Brokers: cfg.brokers, DeferTopic: cfg.deferTopic,
		Group: cfg.group, SchedulerURL: cfg.schedulerURL})
	if err != nil {
		return err
	}
	defer client.Close()

	kc := sarama.NewConfig()
	kc.Version = sarama.V3_6_0_0
	kc.Consumer.Offsets.Initial = sarama.OffsetOldest
	kc.Consumer.Offsets.AutoCommit.Interval = 200 * time.Millisecond
	group, err := sarama.NewConsumerGroup(cfg.brokers, cfg.group, kc)
	if err != nil {
		return fmt.Errorf("consumer group %s: %w", cfg.group, err)
	}
	defer group.Close()
	go func() {
		for err := range group.Errors() {
			logger.Warn("consumer error", "error", err)
		}
	}()

	h := client.ConsumerGroupHandler(func(_ context.Context, m *sarama.ConsumerMessage) error {
		return handle(m.Key, m.Value)
	}, deferclient.HandlerConfig{
		RetryTopic: func(string) string { return cfg.retryTopic },
	})
	for ctx.Err() == nil {
		if err := group.Consume(ctx, []string{cfg.mainTopic, cfg.retryTopic}, h); err != nil && ctx.Err() == nil {
			logger.Warn("consumer session ended", "error", err)
			time.Sleep(time.Second)
		}
	}
	st := client.Stats()
	logger.Info("orders-consumer stopped", "handled", st.Handled, "deferred", st.Deferred, "gated", st.Gated)
	return nil
}

// runFranz consumes with franz-go through deferkgo.
func runFranz(ctx context.Context, cfg config, handle func(key, value []byte) error, logger *slog.Logger) error {
	client, err := deferkgo.New(deferkgo.Config{Brokers: cfg.brokers, DeferTopic: cfg.deferTopic,
		Group: cfg.group, SchedulerURL: cfg.schedulerURL})
	if err != nil {
		return err
	}
	defer client.Close()

	// The consuming client: the options the library needs, the group and
	// both topics.
	join := func() (*kgo.Client, error) {
		cl, err := kgo.NewClient(append(client.GroupOpts(),
			kgo.SeedBrokers(cfg.brokers...),
			kgo.ConsumerGroup(cfg.group),
			kgo.ConsumeTopics(cfg.mainTopic, cfg.retryTopic),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
			kgo.AutoCommitInterval(200*time.Millisecond),
			// sarama's default (kgo's is 45 s): the partitions of an
			// instance that died move as soon on either client.
			kgo.SessionTimeout(10*time.Second),
		)...)
		if err != nil {
			return nil, fmt.Errorf("consumer group %s: %w", cfg.group, err)
		}
		return cl, nil
	}
	cl, err := join()
	if err != nil {
		return err
	}
	// Closing leaves the group, which commits what was settled.
	defer func() { cl.Close() }()

	h := func(_ context.Context, r *kgo.Record) error { return handle(r.Key, r.Value) }
	hc := deferkgo.HandlerConfig{RetryTopic: func(string) string { return cfg.retryTopic }}
	for ctx.Err() == nil {
		err := client.Consume(ctx, cl, h, hc)
		if err == nil || ctx.Err() != nil {
			continue
		}
		logger.Warn("consumer stopped", "error", err)
		if errors.Is(err, deferkgo.ErrLeftGroup) || errors.Is(err, kgo.ErrClientClosed) {
			// The records it left unsettled are read again from the
			// committed offsets, by a new member.
			cl.Close()
			if cl, err = join(); err != nil {
				return err
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
	st := client.Stats()
	logger.Info("orders-consumer stopped", "handled", st.Handled, "deferred", st.Deferred, "gated", st.Gated)
	return nil
}
