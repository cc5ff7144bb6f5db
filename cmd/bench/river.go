package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/deferq/scheduler/internal/defer/ingest"
	"github.com/deferq/scheduler/internal/defer/protocol"
)

// River's settings for the per-message contender, tuned for throughput and
// latency the way River's documentation describes (client.go, QueueConfig):
// many workers because each job waits on one broker round trip, a short
// FetchCooldown (default 100 ms) so that jobs are fetched as soon as
// notifications say they exist, and a short FetchPollInterval (default 1 s)
// as the fallback. Of 50, 200, 500 and 1,000 workers and cooldowns of 5 and
// 20 ms, this did best here. River's scheduler, which makes scheduled jobs
// available, runs every 5 s and has no public setting.
const (
	riverWorkers      = 200
	riverFetchCool    = 5 * time.Millisecond
	riverFetchPoll    = 50 * time.Millisecond
	riverIngestLinger = 20 * time.Millisecond // INGEST_BATCH_LINGER
)

// publishArgs is one deferred message as a River job.
type publishArgs struct {
	Target       string    `json:"target"`
	Key          []byte    `json:"key"`
	Value        []byte    `json:"value"`
	HeaderKeys   []string  `json:"header_keys"`
	HeaderValues [][]byte  `json:"header_values"`
	Attempt      int32     `json:"attempt"`
	ScheduledAt  time.Time `json:"scheduled_at"`
}

// Kind implements river.JobArgs.
func (publishArgs) Kind() string { return "bench_publish" }

// publishWorker republishes one message with a SyncProducer configured as the
// service's (idempotent, acks=all), and the same output headers.
type publishWorker struct {
	river.WorkerDefaults[publishArgs]
	producer sarama.SyncProducer
}

// Work implements river.Worker.
func (w *publishWorker) Work(ctx context.Context, job *river.Job[publishArgs]) error {
	a := job.Args
	hs := make([]sarama.RecordHeader, 0, len(a.HeaderKeys)+4)
	for i, k := range a.HeaderKeys {
		if k == protocol.HeaderAt || k == protocol.HeaderDelay {
			continue
		}
		hs = append(hs, sarama.RecordHeader{Key: []byte(k), Value: a.HeaderValues[i]})
	}
	hs = append(hs,
		sarama.RecordHeader{Key: []byte(protocol.HeaderID), Value: []byte(strconv.FormatInt(job.ID, 10))},
		sarama.RecordHeader{Key: []byte(protocol.HeaderAttempt), Value: []byte(strconv.FormatInt(int64(a.Attempt)+1, 10))},
		sarama.RecordHeader{Key: []byte(protocol.HeaderScheduledAt), Value: []byte(a.ScheduledAt.UTC().Format(time.RFC3339Nano))},
	)
	msg := &sarama.ProducerMessage{Topic: a.Target, Headers: hs}
	if a.Key != nil {
		msg.Key = sarama.ByteEncoder(a.Key)
	}
	if a.Value != nil {
		msg.Value = sarama.ByteEncoder(a.Value)
	}
	if _, _, err := w.producer.SendMessage(msg); err != nil {
		return fmt.Errorf("publish job %d to %s: %w", job.ID, a.Target, err)
	}
	return nil
}

// riverIngest is the consumer a River user writes: read scheduler.defer,
// parse the same headers, insert one job per record with InsertManyFast
// (COPY) per batch, mark offsets after the insert commits.
type riverIngest struct {
	client *river.Client[pgx.Tx]
	rules  protocol.Rules
}

func (h *riverIngest) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (h *riverIngest) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (h *riverIngest) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	batch := make([]*sarama.ConsumerMessage, 0, ingestBatch)
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		now := time.Now()
		params := make([]river.InsertManyParams, len(batch))
		for i, m := range batch {
			rec := protocol.Record{Key: m.Key, Value: m.Value}
			a := publishArgs{Key: m.Key, Value: m.Value}
			for _, hd := range m.Headers {
				rec.Headers = append(rec.Headers, protocol.Header{Key: hd.Key, Value: hd.Value})
				a.HeaderKeys = append(a.HeaderKeys, string(hd.Key))
				a.HeaderValues = append(a.HeaderValues, hd.Value)
			}
			sc, err := protocol.Parse(rec, h.rules, now)
			if err != nil {
				return fmt.Errorf("the River contender's ingest: offset %d: %w", m.Offset, err)
			}
			a.Target, a.Attempt = sc.Target, sc.Attempt
			a.ScheduledAt = now.Add(sc.Delay)
			if sc.HasAt {
				a.ScheduledAt = sc.At
			}
			params[i].Args = a
			// Due now: leave ScheduledAt unset, so the job is available at
			// once; River's scheduler only promotes scheduled jobs every 5 s.
			if a.ScheduledAt.After(now) {
				params[i].InsertOpts = &river.InsertOpts{ScheduledAt: a.ScheduledAt}
			}
		}
		if _, err := h.client.InsertManyFast(sess.Context(), params); err != nil {
			return fmt.Errorf("the River contender's ingest: insert %d jobs: %w", len(params), err)
		}
		sess.MarkMessage(batch[len(batch)-1], "")
		batch = batch[:0]
		return nil
	}
	for {
		select {
		case m, ok := <-claim.Messages():
			if !ok {
				return flush()
			}
			if len(batch) == 0 {
				linger.Reset(riverIngestLinger)
			}
			batch = append(batch, m)
			if len(batch) >= ingestBatch {
				linger.Stop()
				if err := flush(); err != nil {
					return err
				}
			}
		case <-linger.C:
			if err := flush(); err != nil {
				return err
			}
		case <-sess.Context().Done():
			return nil
		}
	}
}

// riverResult is the River contender's measurements.
type riverResult struct {
	e2e  rate
	late *latencies
	jobs int64 // river_job rows at the end (completed jobs are kept)
	// outOfOrder counts end-to-end messages published after a later one of
	// their key: River does not promise per-key order.
	outOfOrder int
}

// runRiver measures what a user would build with River alone: a consumer of
// scheduler.defer inserting one River job per record (ScheduledAt from the
// record's time), whose worker publishes the message with sarama. It runs
// the same end-to-end and lateness phases as the service, on a fresh
// database and broker, in this process.
func (b *bench) runRiver(ctx context.Context) (res riverResult, err error) {
	db, err := b.pg.fresh(ctx, "river")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	kc, addr, err := startKafka(b.cfg.Partitions, deferTopic, topicWarmup, topicE2E, topicLate)
	if err != nil {
		return res, err
	}
	defer kc.Close()

	producer, err := sarama.NewSyncProducer([]string{addr}, batchproducer.Config(kafkaConfig()))
	if err != nil {
		return res, fmt.Errorf("the River contender's producer: %w", err)
	}
	defer producer.Close()
	workers := river.NewWorkers()
	river.AddWorker(workers, &publishWorker{producer: producer})
	client, err := river.NewClient(riverpgxv5.New(db.pool), &river.Config{
		Logger:            slog.New(slog.DiscardHandler),
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: riverWorkers}},
		FetchCooldown:     riverFetchCool,
		FetchPollInterval: riverFetchPoll,
		Workers:           workers,
	})
	if err != nil {
		return res, fmt.Errorf("the River contender's client: %w", err)
	}
	rctx, stopRiver := context.WithCancel(ctx)
	defer stopRiver()
	if err := client.Start(rctx); err != nil {
		return res, fmt.Errorf("start River: %w", err)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if serr := client.Stop(sctx); serr != nil {
			err = errors.Join(err, fmt.Errorf("stop River: %w", serr))
		}
	}()

	group, err := sarama.NewConsumerGroup([]string{addr}, "bench-river", ingest.ConsumerConfig(kafkaConfig(), nil))
	if err != nil {
		return res, fmt.Errorf("the River contender's consumer: %w", err)
	}
	defer group.Close()
	ingest := &riverIngest{client: client, rules: protocol.Rules{Targets: protocol.TargetPatterns{"bench.*"}, MaxDelay: 720 * time.Hour}}
	consumed := make(chan error, 1)
	go func() {
		for rctx.Err() == nil {
			if err := group.Consume(rctx, []string{deferTopic}, ingest); err != nil && rctx.Err() == nil {
				consumed <- err
				return
			}
		}
		consumed <- nil
	}()
	defer func() {
		stopRiver()
		err = errors.Join(err, <-consumed)
	}()

	lp, w, err := newClients(addr)
	if err != nil {
		return res, err
	}
	defer lp.close()
	defer w.close()

	n, warm := b.cfg.N, b.cfg.Warmup
	if res.e2e, err = b.endToEnd(ctx, lp, w, db, "River", "river", "rw", "re"); err != nil {
		return res, err
	}

	lead := b.cfg.LateLead
	lstart := time.Now()
	lateSent, err := producePaced(ctx, lp, b.cfg.LateRate, b.cfg.LateFor, func(i int, now time.Time) *sarama.ProducerMessage {
		return deferRecord(ownKeys.key("rl", i), i, topicLate, when{at: now.Add(lead)})
	})
	if err != nil {
		return res, err
	}
	res.late = &latencies{offered: b.cfg.LateRate, sent: lateSent, sendFor: time.Since(lstart)}
	// River's scheduler promotes due jobs every 5 s; give it that on top.
	if _, err := track(ctx, "River lateness phase", func() (int64, error) { return w.count(topicLate) }, 0, int64(lateSent),
		timeoutFor(lateSent)+10*time.Second); err != nil {
		return res, err
	}

	for _, ph := range []phaseTopic{{topicWarmup, warm}, {topicE2E, n}, {topicLate, lateSent}} {
		ds, err := readBack(ctx, addr, ph.topic)
		if err != nil {
			return res, err
		}
		// River promises no per-key order, so only presence is checked.
		c := verify(ds, ph.n)
		if ph.topic == topicE2E {
			res.outOfOrder = c.outOfOrder
		}
		c.outOfOrder = 0
		if err := c.err("River, " + ph.topic); err != nil {
			return res, err
		}
		if ph.topic == topicLate {
			ls, err := lateness(ds)
			if err != nil {
				return res, err
			}
			res.late.p50, res.late.p99, res.late.max = percentile(ls, 0.50), percentile(ls, 0.99), percentile(ls, 1)
		}
	}
	if err := db.pool.QueryRow(ctx, "SELECT count(*) FROM river_job").Scan(&res.jobs); err != nil {
		return res, fmt.Errorf("count River jobs: %w", err)
	}
	return res, nil
}
