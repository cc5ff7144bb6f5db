package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	deferral "github.com/deferq/scheduler/internal/defer"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/migrations"
)

// service is one running scheduler: ingest, dispatch and the HTTP server.
type service struct {
	cfg      config
	logger   *slog.Logger
	pool     *pgxpool.Pool
	producer sarama.SyncProducer
	group    sarama.ConsumerGroup
	ingester *deferral.Ingester
	runtime  *dispatch.Runtime
	waker    *dispatch.Waker
	http     *http.Server
	listener net.Listener
}

// newService connects to everything and checks the schema. With migrate set
// it applies pending migrations first; otherwise pending migrations stop
// start-up, since running on a schema the code does not expect corrupts data.
func newService(ctx context.Context, cfg config, logger *slog.Logger, migrate bool) (_ *service, err error) {
	s := &service{cfg: cfg, logger: logger}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	if s.pool, err = openPool(ctx, cfg); err != nil {
		return nil, err
	}
	if migrate {
		if _, err := migrations.Apply(ctx, s.pool, logger); err != nil {
			return nil, err
		}
	}
	pending, river, err := migrations.Pending(ctx, s.pool)
	if err != nil {
		return nil, err
	}
	if len(pending) > 0 || river > 0 {
		return nil, fmt.Errorf("the database lacks %d of the scheduler's migrations and %d of River's: run `scheduler migrate` or start with --migrate",
			len(pending), river)
	}

	brokers := make([]string, len(cfg.KafkaBrokers))
	for i, b := range cfg.KafkaBrokers {
		brokers[i] = strings.TrimSpace(b)
	}
	if err := s.connectKafka(ctx, brokers); err != nil {
		return nil, err
	}

	s.ingester, err = deferral.NewIngester(s.group, deferral.NewStore(s.pool), deferral.IngestConfig{
		Topic:       cfg.DeferTopic,
		Rules:       deferral.Rules{Targets: cfg.targets, MaxDelay: cfg.MaxDelay},
		BatchSize:   cfg.IngestBatchSize,
		BatchLinger: cfg.IngestBatchLinger,
	}, logger.With("component", "ingest"))
	if err != nil {
		return nil, err
	}
	if cfg.ListenNotify {
		s.waker = dispatch.NewWaker(s.pool, 5*time.Millisecond, logger.With("component", "notify"))
	}
	host, _ := os.Hostname()
	s.runtime, err = dispatch.NewRuntime(s.pool, s.producer, s.waker, dispatch.RuntimeConfig{
		Instance:            fmt.Sprintf("%s:%d", host, os.Getpid()),
		Loops:               cfg.DispatchLoops,
		Workers:             cfg.DispatchWorkers,
		LoopDuration:        cfg.DispatchLoopDuration,
		Lease:               cfg.LeaseDuration,
		PerKey:              cfg.DispatchKeyBatch,
		MaintenanceInterval: time.Minute,
		PollOnly:            !cfg.ListenNotify,
		Dispatch: dispatch.Config{
			BatchKeys:    cfg.DispatchBatchKeys,
			PollInterval: cfg.PollInterval,
			Targets:      cfg.targets,
		},
	}, logger.With("component", "dispatch"))
	if err != nil {
		return nil, err
	}
	if s.listener, err = net.Listen("tcp", cfg.HTTPAddr); err != nil {
		return nil, fmt.Errorf("HTTP_ADDR=%s: %w", cfg.HTTPAddr, err)
	}
	s.http = &http.Server{Handler: s.routes(), ReadHeaderTimeout: 5 * time.Second}
	return s, nil
}

// connectKafka creates the producer and the consumer group, retrying while
// the brokers are not up yet (they often start after the scheduler).
func (s *service) connectKafka(ctx context.Context, brokers []string) error {
	for attempt := 1; ; attempt++ {
		pc, err := s.cfg.kafka().Config()
		if err != nil {
			return err
		}
		cc, err := s.cfg.kafka().Config()
		if err != nil {
			return err
		}
		s.producer, err = sarama.NewSyncProducer(brokers, dispatch.ProducerConfig(pc))
		if err == nil {
			s.group, err = sarama.NewConsumerGroup(brokers, s.cfg.ConsumerGroup, deferral.ConsumerConfig(cc))
			if err != nil {
				s.producer.Close()
				s.producer = nil
			}
		}
		if err == nil {
			return nil
		}
		if attempt == 1 || attempt%10 == 0 {
			s.logger.Warn("waiting for Kafka", "brokers", strings.Join(brokers, ","), "error", err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("connect to Kafka at %s: %w", strings.Join(brokers, ","), err)
		case <-time.After(time.Second):
		}
	}
}

// run serves until ctx is done, then shuts down in order: stop consuming
// (the last batches are stored and their offsets committed), let dispatch
// loops finish their round and hand over, then close connections.
func (s *service) run(ctx context.Context) error {
	defer s.close()
	var wg sync.WaitGroup
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()

	if s.waker != nil {
		wg.Go(func() { s.waker.Run(runCtx) })
	}
	if err := s.runtime.Start(runCtx); err != nil {
		return err
	}
	ingestCtx, stopIngest := context.WithCancel(ctx)
	defer stopIngest()
	ingestDone := make(chan struct{})
	go func() {
		defer close(ingestDone)
		s.ingester.Run(ingestCtx)
	}()
	httpErr := make(chan error, 1)
	go func() { httpErr <- s.http.Serve(s.listener) }()
	s.logger.Info("scheduler running", "defer_topic", s.cfg.DeferTopic, "group", s.cfg.ConsumerGroup,
		"http", s.listener.Addr().String(), "targets", s.cfg.TargetTopics)

	var err error
	select {
	case <-ctx.Done():
	case err = <-httpErr:
		err = fmt.Errorf("HTTP server: %w", err)
	}
	s.logger.Info("shutting down")
	stopIngest()
	stopCtx, stopCancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.ShutdownTimeout)
	defer stopCancel()
	select {
	case <-ingestDone:
	case <-stopCtx.Done():
		s.logger.Warn("ingest did not stop in time")
	}
	if stopErr := s.runtime.Stop(stopCtx); stopErr != nil {
		// A loop is still publishing: closing the producer under it would
		// crash it. Leave both to the process exit; its leases expire and the
		// round is republished (at-least-once).
		s.logger.Error("dispatch did not stop within SHUTDOWN_TIMEOUT; exiting with leases held", "error", stopErr)
		s.producer = nil
		err = errors.Join(err, stopErr)
	}
	if stopErr := s.http.Shutdown(stopCtx); stopErr != nil {
		err = errors.Join(err, fmt.Errorf("HTTP shutdown: %w", stopErr))
	}
	cancel()
	wg.Wait()
	stored, rejected, dups := s.ingester.Counts()
	s.logger.Info("stopped", "stored", stored, "rejected", rejected, "duplicates", dups)
	return err
}

func (s *service) close() {
	if s.group != nil {
		if err := s.group.Close(); err != nil {
			s.logger.Warn("close consumer group", "error", err)
		}
	}
	if s.producer != nil {
		if err := s.producer.Close(); err != nil {
			s.logger.Warn("close producer", "error", err)
		}
	}
	if s.pool != nil {
		s.pool.Close()
	}
}

func (s *service) routes() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	for _, m := range []struct {
		result string
		read   func() int64
	}{
		{"stored", func() int64 { n, _, _ := s.ingester.Counts(); return n }},
		{"rejected", func() int64 { _, n, _ := s.ingester.Counts(); return n }},
		{"duplicate", func() int64 { _, _, n := s.ingester.Counts(); return n }},
	} {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "scheduler_ingested_records_total",
			Help:        "Records read from the defer topic, by result.",
			ConstLabels: prometheus.Labels{"result": m.result},
		}, func() float64 { return float64(m.read()) }))
	}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", s.readyz)
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return mux
}

// readyz answers 200 when the database answers with the expected schema and
// ingest holds a consumer-group session (which needs the brokers); 503 with
// the failing checks otherwise.
func (s *service) readyz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	checks := map[string]string{}
	if err := s.pool.Ping(ctx); err != nil {
		checks["postgres"] = err.Error()
	} else if pending, river, err := migrations.Pending(ctx, s.pool); err != nil {
		checks["migrations"] = err.Error()
	} else if len(pending) > 0 || river > 0 {
		checks["migrations"] = fmt.Sprintf("%d of the scheduler's and %d of River's pending", len(pending), river)
	}
	if !s.ingester.Joined() {
		checks["ingest"] = "not joined to consumer group " + s.cfg.ConsumerGroup
	}
	status := http.StatusOK
	body := map[string]any{"status": "ready"}
	if len(checks) > 0 {
		status = http.StatusServiceUnavailable
		body = map[string]any{"status": "not ready", "failing": checks}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}
