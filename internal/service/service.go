// Package service wires the scheduler's parts into the process `scheduler
// run` is: the configuration, the Postgres pool, the Kafka clients, ingest,
// the dispatch runtime, the in-flight release, the HTTP server of /healthz,
// /readyz, /metrics and the key-state query, the backlog gauges, and a
// shutdown bounded by SHUTDOWN_TIMEOUT. It also
// holds the run and migrate commands, which parse their flags and call it.
package service

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/deferq/scheduler/internal/config"
	"github.com/deferq/scheduler/internal/console"
	"github.com/deferq/scheduler/internal/defer/ingest"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/highwater"
	"github.com/deferq/scheduler/internal/inflight"
	"github.com/deferq/scheduler/internal/keygate"
	"github.com/deferq/scheduler/internal/keystate"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgconnect"
	"github.com/deferq/scheduler/internal/runner"
	"github.com/deferq/scheduler/migrations"
	"github.com/deferq/scheduler/sql/queries"
)

// Service is one running scheduler: ingest, dispatch and the HTTP server.
type Service struct {
	cfg      config.Config
	logger   *slog.Logger
	pool     *pgxpool.Pool
	producer *batchproducer.Producer
	consumer *ingest.Consumer
	budget   *ingest.Budget
	// marks is the highest message id and seq this process has seen, which
	// ingest and the heartbeat keep a rewound database's sequences past.
	marks    *highwater.Marks
	ingester *ingest.Ingester
	runtime  *runner.Runtime
	waker    *runner.Waker
	// releaseListen closes the waker's pool when it is not pool, the
	// one on DIRECT_DATABASE_URL; nil without a waker.
	releaseListen func()
	http          *http.Server
	listener      net.Listener
	// pprof serves net/http/pprof on PPROF_ADDR; nil when it is unset.
	pprof *http.Server
	// console serves the operator console on CONSOLE_ADDR; nil when it
	// is unset.
	console  *console.Server
	registry *prometheus.Registry
	metrics  *metrics.Metrics
	brokers  *brokerCheck
	// admin reads consumer groups' committed offsets for inflight, which
	// releases the keys the groups have committed past.
	admin    sarama.ClusterAdmin
	inflight *inflight.Releaser
	// keyStates answers POST /v1/key-state; offsets is the Kafka client it
	// reads the defer topic's high-water marks with, nil until Kafka is
	// connected (it answers 503 "kafka: connecting" meanwhile).
	keyStates *keygate.Server
	offsets   sarama.Client
	// httpErr receives what the HTTP server's Serve returns.
	httpErr chan error
	// connected is set once the Kafka clients, ingest and dispatch exist.
	// The HTTP server starts before that (see newService), so readiness
	// reads the fields it guards only after loading it.
	connected atomic.Bool
	// kafkaAddrs names the brokers for readiness while connecting.
	kafkaAddrs string
	// stopBy is when a graceful stop must be over (SHUTDOWN_TIMEOUT after
	// it began); zero until run begins one.
	stopBy time.Time
}

// Options are what a command adds to the configuration.
type Options struct {
	// Migrate applies pending migrations before starting; without it, a
	// database with pending migrations stops start-up.
	Migrate bool
	// Version is the binary's version, reported by scheduler_build_info.
	Version string
}

// New connects to everything and checks the schema. With opts.Migrate set
// it applies pending migrations first; otherwise pending migrations stop
// start-up, since running on a schema the code does not expect corrupts data.
func New(ctx context.Context, cfg config.Config, logger *slog.Logger, opts Options) (_ *Service, err error) {
	s := &Service{cfg: cfg, logger: logger, registry: prometheus.NewRegistry(), marks: &highwater.Marks{}}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	s.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	s.metrics = metrics.New(s.registry, opts.Version)
	if limit, set := memoryLimit(cfg, os.Getenv("GOMEMLIMIT")); set {
		debug.SetMemoryLimit(limit)
		logger.Info("memory limit", "bytes", limit, "from", "INGEST_BUFFER_BYTES, DISPATCH_LOOPS and DISPATCH_ROUND_BYTES (GOMEMLIMIT overrides)")
		if pct, set := gcPercent(os.Getenv("GOGC")); set {
			debug.SetGCPercent(pct)
			logger.Info("garbage collection", "gogc", pct, "bounded by", "the memory limit (GOGC overrides)")
		}
	}
	main, err := openPool(ctx, cfg)
	if err != nil {
		return nil, err
	}
	s.pool = main.Pool
	s.metrics.WatchPool(s.pool)
	if main.TransactionPooled {
		logger.Info("DATABASE_URL reaches PostgreSQL through a pooler in transaction mode: River polls, and statements are not prepared by name unless the URL's default_query_exec_mode says otherwise")
	}
	if opts.Migrate {
		if _, err := migrate(ctx, cfg, main, logger); err != nil {
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
	s.kafkaAddrs = strings.Join(brokers, ",")
	s.keyStates = keygate.NewServer(keygate.Config{DB: s.pool, Topic: cfg.DeferTopic, Keys: cfg.Signing().Keys(),
		Metrics: s.metrics, Logger: logger.With("component", "key-state")})
	// Serve before connecting to Kafka, which waits as long as the brokers
	// are away: an orchestrator probing /readyz meanwhile should read "not
	// ready: kafka connecting", not a refused connection that looks like a
	// dead process.
	if s.listener, err = net.Listen("tcp", cfg.HTTPAddr); err != nil {
		return nil, fmt.Errorf("HTTP_ADDR=%s: %w", cfg.HTTPAddr, err)
	}
	s.http = &http.Server{Handler: s.routes(), ReadHeaderTimeout: 5 * time.Second}
	s.httpErr = make(chan error, 1)
	go func() { s.httpErr <- s.http.Serve(s.listener) }()
	if cfg.PprofAddr != "" {
		// Its own listener, so that profiles are never reachable where
		// metrics are scraped.
		l, err := net.Listen("tcp", cfg.PprofAddr)
		if err != nil {
			return nil, fmt.Errorf("PPROF_ADDR=%s: %w", cfg.PprofAddr, err)
		}
		s.pprof = &http.Server{Handler: pprofRoutes(), ReadHeaderTimeout: 5 * time.Second}
		go s.pprof.Serve(l) // ends with Close in close()
		logger.Info("serving pprof", "addr", l.Addr().String())
	}
	if cfg.ConsoleAddr != "" {
		if err := s.startConsole(ctx); err != nil {
			return nil, err
		}
	}
	if err := s.connectKafka(ctx, brokers); err != nil {
		return nil, err
	}
	probe, err := s.cfg.Kafka().Config()
	if err != nil {
		return nil, err
	}
	s.brokers = newBrokerCheck(brokers, probe)
	adminConf, err := s.cfg.Kafka().Config()
	if err != nil {
		return nil, err
	}
	if s.admin, err = sarama.NewClusterAdmin(brokers, adminConf); err != nil {
		return nil, fmt.Errorf("connect the Kafka admin client to %s: %w", s.kafkaAddrs, err)
	}
	s.inflight = inflight.New(s.pool, inflight.NewAdminOffsets(s.admin), s.keyStates, inflight.DefaultInterval, s.metrics,
		logger.With("component", "inflight"))
	// A client of its own: the consumer's waits out rebalances, and a
	// key-state request must not.
	oc, err := s.cfg.Kafka().Config()
	if err != nil {
		return nil, err
	}
	if s.offsets, err = sarama.NewClient(brokers, oc); err != nil {
		return nil, fmt.Errorf("connect to Kafka at %s: %w", s.kafkaAddrs, err)
	}
	s.keyStates.SetOffsets(keygate.KafkaOffsets{Client: s.offsets})

	cfg.LogPolicies(logger)
	s.ingester, err = ingest.NewIngester(s.consumer.Group, ingest.NewStore(s.pool, s.marks), ingest.IngestConfig{
		Topic: cfg.DeferTopic,
		Group: cfg.ConsumerGroup,
		Rules: protocol.Rules{Targets: cfg.Targets(), MaxDelay: cfg.MaxDelay,
			Policies: cfg.Policies(), Classifier: cfg.Classifier(), Signing: cfg.Signing()},
		BatchSize:    cfg.IngestBatchSize,
		BatchBytes:   cfg.IngestBatchBytes,
		BatchLinger:  cfg.IngestBatchLinger,
		FutureLinger: cfg.IngestFutureLinger,
		Writers:      cfg.IngestWriters,
		Budget:       s.budget,
		Log:          s.consumer.Log(),
		Metrics:      s.metrics,
	}, logger.With("component", "ingest"))
	if err != nil {
		return nil, err
	}
	if cfg.ListenNotify {
		listen, release, err := sessionPool(ctx, cfg, main, "LISTEN_NOTIFY=true (it listens for notifications on a session)",
			", or set LISTEN_NOTIFY=false to poll instead")
		if err != nil {
			return nil, err
		}
		s.releaseListen = release
		s.waker = runner.NewWaker(listen, 5*time.Millisecond, logger.With("component", "notify"))
		// A key-state query that waits for ingest asks every process to
		// write what it lingers on (docs/design.md section 23.2).
		s.waker.On(queries.IngestFlushChannel, s.ingester.Flush)
	}
	host, _ := os.Hostname()
	s.runtime, err = runner.New(s.pool, s.producer, s.waker, runner.Config{
		Instance:            fmt.Sprintf("%s:%d", host, os.Getpid()),
		Loops:               cfg.DispatchLoops,
		Workers:             cfg.DispatchWorkers,
		Claims:              cfg.DispatchClaims,
		LoopDuration:        cfg.DispatchLoopDuration,
		Lease:               cfg.LeaseDuration,
		PerKey:              cfg.DispatchKeyBatch,
		MaintenanceInterval: time.Minute,
		// River listens on its own pool, the service's.
		PollOnly:         !cfg.ListenNotify || main.TransactionPooled,
		HistoryRetention: cfg.HistoryRetention,
		Dispatch: dispatch.Config{
			BatchKeys:       cfg.DispatchBatchKeys,
			ExpressHeads:    cfg.DispatchExpressHeads,
			RoundMessages:   cfg.DispatchRoundMessages,
			PollInterval:    cfg.PollInterval,
			Targets:         cfg.Targets(),
			MaxMessageBytes: cfg.KafkaMaxMessageBytes,
			Metrics:         s.metrics,
			Marks:           s.marks,
		},
	}, logger) // runner tags its lines: dispatch, river, dlq
	if err != nil {
		return nil, err
	}
	s.connected.Store(true)
	return s, nil
}

// HTTPAddr is where the service serves HTTP_ADDR's endpoints (the port
// chosen when HTTP_ADDR asked for any).
func (s *Service) HTTPAddr() string { return s.listener.Addr().String() }

// memoryLimit returns the soft memory limit the service sets for Go's
// garbage collector, and false when GOMEMLIMIT (gomemlimit) is set: the
// runtime has read it, and the operator's word stands.
//
// The byte budgets bound what the service holds live (records ingest holds,
// their statement's encoding, each dispatch round and its produce requests);
// the collector, left to GOGC alone, lets the heap grow to twice that before
// collecting, which with large records is what takes a process past a
// container's limit. The limit makes it collect sooner instead: a fixed
// allowance for the rest of the process, one and a half times the ingest
// budget (records held, and the batch being encoded), twice each loop's
// round (rows read, and the produce requests built from them). Measured
// with records near 1 MB (TestIngestPeakRSSBoundedByBytes), the live heap
// stays under it and the process's peak RSS about 30 MB over it. It is
// soft: with more live than that, the collector runs often but the process
// does not fail.
func memoryLimit(cfg config.Config, gomemlimit string) (int64, bool) {
	if gomemlimit != "" {
		return 0, false
	}
	const rest = 48 << 20
	return rest + 3*int64(cfg.IngestBufferBytes)/2 + 2*int64(cfg.DispatchLoops)*int64(cfg.DispatchRoundBytes), true
}

// gcPercent returns the GOGC the service sets under its own memory limit,
// and false when GOGC (gogc) is set: the runtime has read it, and the
// operator's word stands.
//
// The service's live heap is small, a few MB, and each dispatch round
// allocates about that much again (rows read, records and produce
// requests built from them); with Go's default of 100 the collector ran
// about once per round, and took over a quarter of the service's CPU
// while a backlog drained (docs/benchmarks.md, "The collector once per
// round"). At 200 the heap may grow to three times the live bytes before
// a collection, twice the allocation between two, but never past the
// soft memory limit, which stays what bounds the process's memory:
// gcPercent is applied only beside it. 400 saved little more CPU and
// raised the peak RSS of small records from about 92 MB to 160 MB, past
// the 150 MB the bench holds it to.
func gcPercent(gogc string) (int, bool) {
	if gogc != "" {
		return 0, false
	}
	return 200, true
}

// connectKafka creates the producer and the consumer group, retrying while
// the brokers are not up yet (they often start after the scheduler).
func (s *Service) connectKafka(ctx context.Context, brokers []string) error {
	for attempt := 1; ; attempt++ {
		pc, err := s.cfg.Kafka().Config()
		if err != nil {
			return err
		}
		cc, err := s.cfg.Kafka().Config()
		if err != nil {
			return err
		}
		pc.Producer.MaxMessageBytes = s.cfg.KafkaMaxMessageBytes
		s.budget = ingest.NewBudget(int64(s.cfg.IngestBufferBytes))
		s.producer, err = batchproducer.New(brokers, batchproducer.Config(pc))
		if err == nil {
			s.consumer, err = ingest.NewConsumer(brokers, s.cfg.ConsumerGroup, cc, s.budget)
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
			return fmt.Errorf("stopped before connecting to Kafka at %s (last error: %v): %w",
				strings.Join(brokers, ","), err, ctx.Err())
		case <-time.After(time.Second):
		}
	}
}

// Run serves until ctx is done, then shuts down in order: stop consuming
// (the last batches are stored and their offsets committed), let dispatch
// loops finish their round and hand over, then close connections.
func (s *Service) Run(ctx context.Context) error {
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
	wg.Go(func() { s.refreshGauges(runCtx) })
	wg.Go(func() { s.inflight.Run(runCtx) })
	ingestCtx, stopIngest := context.WithCancel(ctx)
	defer stopIngest()
	ingestDone := make(chan struct{})
	go func() {
		defer close(ingestDone)
		s.ingester.Run(ingestCtx)
	}()
	s.logger.Info("scheduler running", "defer_topic", s.cfg.DeferTopic, "group", s.cfg.ConsumerGroup,
		"http", s.listener.Addr().String(), "targets", s.cfg.TargetTopics)

	var err error
	select {
	case <-ctx.Done():
	case err = <-s.httpErr:
		err = fmt.Errorf("HTTP server: %w", err)
	}
	s.logger.Info("shutting down")
	stopIngest()
	stopCtx, stopCancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.ShutdownTimeout)
	defer stopCancel()
	s.stopBy, _ = stopCtx.Deadline()
	// Ingest and dispatch stop side by side, each within SHUTDOWN_TIMEOUT:
	// ingest can be stuck in a consumer-group join for up to its read
	// timeout (25 s or more, see ingest.ConsumerConfig), which must not
	// eat the time dispatch loops have to finish their round.
	dispatchStopped := make(chan error, 1)
	go func() { dispatchStopped <- s.runtime.Stop(stopCtx) }()
	select {
	case <-ingestDone:
	case <-stopCtx.Done():
		// Nothing is lost: what a session read is stored before its
		// offsets are marked, and a join holds no records.
		s.logger.Warn("ingest did not stop in time")
	}
	if stopErr := <-dispatchStopped; stopErr != nil {
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
	// As the metrics count: stored are the valid rows, rejected ones apart.
	s.logger.Info("stopped", "stored", stored-rejected, "rejected", rejected, "parked", s.ingester.Parked(), "duplicates", dups)
	return err
}

func (s *Service) close() {
	if s.pprof != nil {
		s.pprof.Close()
	}
	if s.console != nil {
		s.console.Close(time.Second)
	}
	if s.http != nil {
		// After run's Shutdown this does nothing; after a failed start it
		// stops the server that newService started.
		s.http.Close()
	}
	if s.consumer != nil {
		s.closeGroup()
	}
	if s.producer != nil {
		if err := s.producer.Close(); err != nil {
			s.logger.Warn("close producer", "error", err)
		}
	}
	if s.offsets != nil {
		_ = s.offsets.Close()
	}
	if s.admin != nil {
		if err := s.admin.Close(); err != nil {
			s.logger.Warn("close Kafka admin client", "error", err)
		}
	}
	if s.releaseListen != nil {
		s.releaseListen()
	}
	if s.pool != nil {
		s.pool.Close()
	}
}

// closeGroup leaves the consumer group, waiting at most for what is left of
// SHUTDOWN_TIMEOUT (at least minGroupClose). sarama's Close waits for
// Consume to return, then asks the coordinator to let the member go: with a
// broker that does not answer, each can take the consumer's read timeout
// (25 s or more, see ingest.ConsumerConfig). Not waiting loses nothing:
// every batch's next offset is stored with its rows and ingest resumes from
// there, and the broker drops a member that never left after its session
// timeout, when the group rebalances without it.
func (s *Service) closeGroup() {
	budget := s.cfg.ShutdownTimeout
	if !s.stopBy.IsZero() {
		budget = time.Until(s.stopBy)
	}
	closed := make(chan error, 1)
	go func() { closed <- s.consumer.Close() }()
	timer := time.NewTimer(max(budget, minGroupClose))
	defer timer.Stop()
	select {
	case err := <-closed:
		if err != nil {
			s.logger.Warn("close consumer group", "error", err)
		}
	case <-timer.C:
		s.logger.Warn("consumer group did not close within SHUTDOWN_TIMEOUT; exiting without leaving it: the broker drops the member after its session timeout, and ingest resumes from the offsets stored in the database")
	}
}

// minGroupClose is how long closeGroup waits when SHUTDOWN_TIMEOUT is
// already spent: enough to leave the group cleanly when the broker answers.
const minGroupClose = time.Second

func (s *Service) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", s.readyz)
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.registry, promhttp.HandlerOpts{}))
	// Every method, so that the server itself answers a wrong one with its
	// JSON refusal (405) rather than the mux's plain text.
	mux.Handle(keystate.Path, s.keyStates)
	mux.HandleFunc(keystate.SetPath, s.keyStates.ServeSet)
	mux.HandleFunc(keystate.ChangesPath, s.keyStates.ServeChanges)
	return mux
}

// pprofRoutes serves the runtime profiles of net/http/pprof under
// /debug/pprof/.
func pprofRoutes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}

// readyz answers 200 when the database answers with the expected schema, the
// brokers answer and ingest holds a consumer-group session; 503 with the
// failing checks otherwise. While start-up waits for Kafka, kafka fails with
// "connecting".
func (s *Service) readyz(w http.ResponseWriter, r *http.Request) {
	checks := s.readiness(r.Context())
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

// readiness runs the readiness checks, each bounded by 2 s, and returns the
// failing ones by name (postgres, migrations, kafka, ingest). It also sets
// scheduler_ready.
func (s *Service) readiness(ctx context.Context) map[string]string {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	checks := map[string]string{}
	var mu sync.Mutex
	fail := func(name, why string) {
		mu.Lock()
		defer mu.Unlock()
		checks[name] = why
	}
	var wg sync.WaitGroup
	// The database and the brokers are probed at once, so that both being
	// down costs one timeout, not two.
	wg.Go(func() {
		if err := s.pool.Ping(ctx); err != nil {
			fail("postgres", err.Error())
		} else if err := pgconnect.ReconnectIfReadOnly(ctx, s.pool, "DATABASE_URL", s.logger); err != nil {
			fail("postgres", err.Error())
		} else if pending, river, err := migrations.Pending(ctx, s.pool); err != nil {
			fail("migrations", err.Error())
		} else if len(pending) > 0 || river > 0 {
			fail("migrations", fmt.Sprintf("%d of the scheduler's and %d of River's pending", len(pending), river))
		}
	})
	connected := s.connected.Load()
	if connected {
		wg.Go(func() {
			if err := s.brokers.check(ctx); err != nil {
				fail("kafka", err.Error())
			}
		})
	} else {
		fail("kafka", "connecting to "+s.kafkaAddrs)
	}
	wg.Wait()
	if connected {
		switch err := s.ingester.StoreError(); {
		case err != nil:
			checks["ingest"] = "storing a batch fails: " + err.Error()
		case !s.ingester.Joined():
			checks["ingest"] = "not joined to consumer group " + s.cfg.ConsumerGroup
		}
	}
	s.metrics.SetReady(len(checks) == 0)
	return checks
}

// refreshGauges keeps the gauges that cost a query fresh: it evaluates
// readiness every METRICS_INTERVAL, so that scheduler_ready is right even
// when nobody calls /readyz, and reads the backlog (one statement, see
// sql/queries/metrics_backlog.sql) in a loop of its own (refreshBacklog),
// so that a slow count never holds readiness back. Scrapes only read the
// results.
func (s *Service) refreshGauges(ctx context.Context) {
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { s.refreshBacklog(ctx) })
	t := time.NewTicker(s.cfg.MetricsInterval)
	defer t.Stop()
	for {
		s.readiness(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// backlogDuty bounds the share of time the backlog statement runs: the
// next read starts no sooner than backlogDuty times the last one's duration
// after it started. The statement counts every row of deferred_message
// (and Postgres runs it on up to three processes), so on a large backlog a
// fixed interval would keep a core busy: 10,000,000 rows took 2.6-4.1 s to
// count on the benchmark machine, every 15 s, in every replica.
const backlogDuty = 20

// backlogTimeout bounds one read of the backlog; a read that takes longer
// fails (and is logged), and the gauges keep their last values.
const backlogTimeout = 2 * time.Minute

// backlogWait is how long after a backlog read started the next one starts:
// the interval, or backlogDuty times what the read took if that is longer.
func backlogWait(interval, took time.Duration) time.Duration {
	return max(interval, backlogDuty*took)
}

// refreshBacklog reads the backlog gauges every METRICS_INTERVAL, or less
// often while a read that answers takes more than a backlogDuty-th of it
// (backlogWait), and says so in the log when that starts and when it ends.
func (s *Service) refreshBacklog(ctx context.Context) {
	failing, stretched := false, false
	for {
		start := time.Now()
		qctx, cancel := context.WithTimeout(ctx, max(s.cfg.MetricsInterval, backlogTimeout))
		b, err := s.backlog(qctx)
		cancel()
		took := time.Since(start)
		switch {
		case err != nil && ctx.Err() == nil:
			// Once per outage: the interval may be short, and /readyz says
			// the rest. The gauges keep their last values meanwhile.
			if !failing {
				s.logger.Warn("reading the backlog for metrics failed; gauges keep their last values", "error", err, "took", took)
			}
			failing = true
		case err == nil:
			if failing {
				s.logger.Info("reading the backlog for metrics works again")
			}
			failing = false
			s.metrics.SetBacklog(b)
		}
		// Only a read that answered says what counting costs: a failed one
		// may have waited out the timeout for a database that did not
		// answer, and is tried again after the interval.
		wait := s.cfg.MetricsInterval
		if err == nil {
			wait = backlogWait(s.cfg.MetricsInterval, took)
		}
		if long := wait > s.cfg.MetricsInterval; long != stretched {
			stretched = long
			if long {
				s.logger.Info("reading the backlog for metrics takes long; its gauges refresh less often than METRICS_INTERVAL, so that counting never takes more than a 20th of the time",
					"took", took, "refresh_every", wait, "metrics_interval", s.cfg.MetricsInterval)
			} else {
				s.logger.Info("the backlog gauges refresh every METRICS_INTERVAL again", "took", took, "metrics_interval", s.cfg.MetricsInterval)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(max(wait-took, 0)):
		}
	}
}

// backlog runs the backlog query. Targets that TARGET_TOPICS does not allow
// (or none, or an invalid name) come from producers or operators, not from
// configuration, so they are summed under metrics.OtherTarget to keep the
// target label bounded.
func (s *Service) backlog(ctx context.Context) (metrics.Backlog, error) {
	b := metrics.Backlog{Messages: map[string]map[string]int64{}, Due: map[string]int64{}}
	rows, err := queries.MetricsBacklog(ctx, s.pool)
	if err != nil {
		return b, fmt.Errorf("read backlog: %w", err)
	}
	for _, r := range rows {
		b.OldestDue = time.Duration(r.OldestDueSeconds * float64(time.Second))
		b.HeldKeys = r.HeldKeys
		b.KeysHeldParked, b.DLQUnsent = r.HeldParked, r.DLQUnsent
		b.OldestTransaction = time.Duration(r.OldestXactSeconds * float64(time.Second))
		b.InflightKeys = r.InflightKeys
		b.InflightOldest = time.Duration(r.InflightOldest * float64(time.Second))
		if r.State == nil {
			continue // no message at all
		}
		label := metrics.OtherTarget
		if r.Target != nil && protocol.ValidTopic(*r.Target) && s.cfg.Targets().Allows(*r.Target) {
			label = s.metrics.Target(*r.Target)
		}
		if b.Messages[label] == nil {
			b.Messages[label] = map[string]int64{}
		}
		b.Messages[label][*r.State] += r.Messages
		b.Due[label] += r.Due
	}
	return b, nil
}

// brokerCheck tells /readyz whether the brokers answer. It opens a fresh
// connection to each bootstrap broker (with the service's TLS and SASL, so a
// credential problem shows too) and sends ApiVersions, the cheapest request,
// which needs no topic; one answer is enough. The producer's and consumer's
// own connections are no evidence: they are reused and reconnected lazily. The
// result is kept for brokerCheckEvery, so probes cost a connection every few
// seconds at most however often /readyz is called.
type brokerCheck struct {
	addrs []string
	conf  *sarama.Config

	mu   sync.Mutex
	at   time.Time
	last error
}

const (
	brokerCheckEvery   = 2 * time.Second
	brokerCheckTimeout = 2 * time.Second
)

// newBrokerCheck probes addrs with conf, which it keeps and changes.
func newBrokerCheck(addrs []string, conf *sarama.Config) *brokerCheck {
	// Each network step is bounded by the probe's timeout; KAFKA_TIMEOUT may
	// be longer, and readiness must answer fast.
	conf.Net.DialTimeout = min(conf.Net.DialTimeout, brokerCheckTimeout)
	conf.Net.ReadTimeout = min(conf.Net.ReadTimeout, brokerCheckTimeout)
	conf.Net.WriteTimeout = min(conf.Net.WriteTimeout, brokerCheckTimeout)
	return &brokerCheck{addrs: addrs, conf: conf}
}

// check returns the result of the last probe, probing again if it is older
// than brokerCheckEvery.
func (c *brokerCheck) check(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && time.Since(c.at) < brokerCheckEvery {
		return c.last
	}
	// Not the caller's cancellation: a client that hung up must not leave a
	// failed probe in the cache for the next caller.
	c.last = c.probe(context.WithoutCancel(ctx))
	c.at = time.Now()
	return c.last
}

// probe asks every bootstrap broker at once and returns nil as soon as one
// answers, or why none did within brokerCheckTimeout.
func (c *brokerCheck) probe(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, brokerCheckTimeout)
	defer cancel()
	// Buffered: probes still running when we return finish on their own
	// (their network steps are bounded) and must not block.
	results := make(chan error, len(c.addrs))
	for _, addr := range c.addrs {
		go func() { results <- probeBroker(addr, c.conf) }()
	}
	var errs []error
	for range c.addrs {
		select {
		case err := <-results:
			if err == nil {
				return nil
			}
			errs = append(errs, err)
		case <-ctx.Done():
			return fmt.Errorf("no broker of %s answered within %v", strings.Join(c.addrs, ","), brokerCheckTimeout)
		}
	}
	return fmt.Errorf("no broker answered: %w", errors.Join(errs...))
}

func probeBroker(addr string, conf *sarama.Config) error {
	b := sarama.NewBroker(addr)
	if err := b.Open(conf); err != nil {
		return fmt.Errorf("%s: %w", addr, err)
	}
	defer b.Close()
	if _, err := b.ApiVersions(&sarama.ApiVersionsRequest{}); err != nil {
		return fmt.Errorf("%s: %w", addr, err)
	}
	return nil
}
