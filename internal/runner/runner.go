// Package runner drives the dispatch loops under River: one job per loop
// slot, each running a dispatch.Dispatcher for a bounded time and inserting
// its successor in the transaction that completes it; heartbeats that tell
// live processes from dead ones, and the reaping of loops a dead process (or
// a rewound database) leaves behind; periodic maintenance (expired leases,
// throttled flags, history retention, missing slots); the statistics check
// of the queue tables; the dead-letter publisher; and the LISTEN waker that
// wakes loops when a head becomes due. See docs/design.md section 9.
package runner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/deferq/scheduler/internal/deadletter"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/sql/queries"
)

// River queues the service uses.
const (
	QueueDispatch    = "scheduler_dispatch"
	QueueMaintenance = "scheduler_maintenance"
)

// LoopArgs is the River job that runs one dispatch loop slot for a bounded
// time. Each run inserts its successor in the transaction that completes it,
// so a slot is always either running or waiting to run. If the process
// running it dies, the live processes notice within seconds (heartbeats in
// scheduler_instance), discard its job and re-create the slot, while the other
// slots keep claiming; River's rescuer remains the backstop. This is deliberately not one job per
// message: River's scheduled-job precision (5 s) and per-job overhead would
// cap both lateness and throughput.
type LoopArgs struct {
	// Slot numbers the loop, 0 to DISPATCH_LOOPS-1; one job per slot exists.
	Slot int `json:"slot"`
}

// Kind implements river.JobArgs.
func (LoopArgs) Kind() string { return "scheduler_dispatch_loop" }

// InsertOpts makes slots unique: inserting a slot that is already waiting or
// running does nothing, so every replica can ensure all slots at start-up.
func (LoopArgs) InsertOpts() river.InsertOpts {
	return river.InsertOpts{
		Queue:       QueueDispatch,
		MaxAttempts: 100,
		UniqueOpts: river.UniqueOpts{
			ByArgs: true,
			// Not completed: the finishing run must not block its successor.
			ByState: []rivertype.JobState{
				rivertype.JobStateAvailable, rivertype.JobStatePending, rivertype.JobStateRunning,
				rivertype.JobStateRetryable, rivertype.JobStateScheduled,
			},
		},
	}
}

// MaintenanceArgs is the periodic housekeeping job: sweep expired leases,
// repair stale throttled flags of key heads, forget long-dead processes,
// prune the attempt history past its retention,
// and re-create any loop slot that went missing (a run discarded after too
// many failures, say).
type MaintenanceArgs struct{}

// Kind implements river.JobArgs.
func (MaintenanceArgs) Kind() string { return "scheduler_maintenance" }

// InsertOpts implements river.JobArgsWithInsertOpts.
func (MaintenanceArgs) InsertOpts() river.InsertOpts {
	return river.InsertOpts{Queue: QueueMaintenance, MaxAttempts: 3}
}

// Config configures the dispatch runtime.
type Config struct {
	// Instance names this process in leases and logs.
	Instance string
	// Loops is the number of loop slots shared by all replicas on the database.
	Loops int
	// Workers caps how many loops this process runs at once.
	Workers int
	// Claims caps the main claims this process's loops run at once
	// (dispatch.Config.ClaimTurns); 0: no cap.
	Claims int
	// LoopDuration is how long one loop job runs before handing over to its
	// successor.
	LoopDuration time.Duration
	// Lease is how long a claim holds its keys.
	Lease time.Duration
	// PerKey caps the messages of one key published per claim.
	PerKey int
	// RoundBytes caps the bytes of messages (record keys, values and header
	// values) one loop's round reads and holds; zero means
	// keylock.DefaultMaxBytes. A round always takes at least one message.
	RoundBytes int
	// MaintenanceInterval is how often housekeeping runs.
	MaintenanceInterval time.Duration
	// PollOnly makes River poll instead of LISTEN (PgBouncer transaction mode).
	PollOnly bool
	// HistoryRetention is how long deferred_attempt rows are kept; zero keeps
	// them forever.
	HistoryRetention time.Duration
	// Dispatch configures each loop. Its Metrics also counts the outcomes of
	// the River jobs this process works.
	Dispatch dispatch.Config
}

// Runtime runs the dispatch loops and maintenance under River.
type Runtime struct {
	pool     *pgxpool.Pool
	producer dispatch.Producer
	waker    *Waker
	cfg      Config
	logger   *slog.Logger
	// dlqLogger is the dead-letter publisher's: component=dlq.
	dlqLogger *slog.Logger
	client    *river.Client[pgx.Tx]

	stop     chan struct{}
	stopOnce sync.Once
	// liveness stops the heartbeat and dead-letter goroutines; done says
	// both have returned.
	liveness     context.CancelFunc
	livenessDone chan struct{}
	// dlqWake makes the dead-letter publisher look at once (a loop parked
	// something). It holds one wake-up; more coalesce.
	dlqWake chan struct{}
	// loopWake is the one subscription to the waker that every loop of
	// this process sleeps on (nil: no waker). It holds one wake-up, so a
	// notification wakes one sleeping loop, not all of them: woken
	// together, every loop claimed and all but one found nothing, on every
	// ingest commit (docs/design.md section 10). unsubscribeLoops ends it.
	loopWake         <-chan struct{}
	unsubscribeLoops func()
	// unsubscribe ends the job-outcome subscription; eventsDone says its
	// reader has returned.
	unsubscribe func()
	eventsDone  chan struct{}

	// running holds the ids of the loop jobs this process runs, for reap;
	// runningMu guards it.
	runningMu sync.Mutex
	running   map[int64]struct{}
}

// New builds the River client with the dispatch and maintenance
// workers. waker may be nil (poll only). logger is the process's, without a
// component: New tags each line with one, component=dispatch for the loops
// and maintenance, river for River's own and dlq for the dead-letter
// publisher (slog's With adds an attribute, it does not replace one, so a
// component stacked on another would print twice).
func New(pool *pgxpool.Pool, producer dispatch.Producer, waker *Waker, cfg Config, logger *slog.Logger) (*Runtime, error) {
	switch {
	case cfg.Loops < 1:
		return nil, fmt.Errorf("dispatch: %d loops, need at least 1", cfg.Loops)
	case cfg.Workers < 1:
		return nil, fmt.Errorf("dispatch: %d workers, need at least 1", cfg.Workers)
	case cfg.LoopDuration <= 0:
		return nil, fmt.Errorf("dispatch: loop duration %v must be positive", cfg.LoopDuration)
	case cfg.MaintenanceInterval <= 0:
		return nil, fmt.Errorf("dispatch: maintenance interval %v must be positive", cfg.MaintenanceInterval)
	case cfg.Claims < 0:
		return nil, fmt.Errorf("dispatch: %d claims at once, need at least 0 (0: no cap)", cfg.Claims)
	}
	if cfg.Claims > 0 {
		// One set of turns for every loop this process runs: copied into
		// each loop's dispatch.Config, the channel stays the same.
		cfg.Dispatch.ClaimTurns = make(chan struct{}, cfg.Claims)
	}
	if cfg.Dispatch.ExpressHeads > 0 {
		// Shared the same way: the express loop reads what the loops count.
		cfg.Dispatch.Sleeping = new(atomic.Int32)
	}
	rt := &Runtime{pool: pool, producer: producer, waker: waker, cfg: cfg, logger: logger.With("component", "dispatch"),
		dlqLogger: logger.With("component", "dlq"), stop: make(chan struct{}), dlqWake: make(chan struct{}, 1),
		unsubscribeLoops: func() {}}

	workers := river.NewWorkers()
	if err := river.AddWorkerSafely(workers, &loopWorker{rt: rt}); err != nil {
		return nil, fmt.Errorf("register dispatch loop worker: %w", err)
	}
	if err := river.AddWorkerSafely(workers, &maintenanceWorker{rt: rt}); err != nil {
		return nil, fmt.Errorf("register maintenance worker: %w", err)
	}
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Queues: map[string]river.QueueConfig{
			QueueDispatch:    {MaxWorkers: cfg.Workers},
			QueueMaintenance: {MaxWorkers: 1},
		},
		Workers: workers,
		// River's daily REINDEX needs to own the indexes, which the
		// least-privilege service role (sql/roles) does not, and river_job
		// here holds a few hundred loop and maintenance jobs at most.
		ReindexerIndexNames: []string{},
		PeriodicJobs: []*river.PeriodicJob{
			river.NewPeriodicJob(river.PeriodicInterval(cfg.MaintenanceInterval),
				func() (river.JobArgs, *river.InsertOpts) { return MaintenanceArgs{}, nil },
				&river.PeriodicJobOpts{RunOnStart: true}),
		},
		// A loop whose process died is retried once it has been running
		// longer than any live loop can.
		JobTimeout:                  rt.loopTimeout(),
		RescueStuckJobsAfter:        rt.loopTimeout() + 15*time.Second,
		CompletedJobRetentionPeriod: time.Hour,
		FetchCooldown:               20 * time.Millisecond,
		PollOnly:                    cfg.PollOnly,
		Logger:                      logger.With("component", "river"),
	})
	if err != nil {
		return nil, fmt.Errorf("river client: %w", err)
	}
	rt.client = client
	if waker != nil {
		rt.loopWake, rt.unsubscribeLoops = waker.Subscribe()
	}
	return rt, nil
}

// loopTimeout bounds one loop run: its duration plus one last round, whose
// publish ends within a lease.
func (rt *Runtime) loopTimeout() time.Duration {
	return rt.cfg.LoopDuration + rt.cfg.Lease + 15*time.Second
}

// Liveness timing: a process heartbeats every heartbeatEvery; one silent for
// staleAfter is taken for dead and its dispatch loops are reaped.
const (
	heartbeatEvery = time.Second
	staleAfter     = 5 * time.Second
)

// Every analyzeEvery each process analyzes the queue tables if their
// statistics fell far behind (keylock.AnalyzeIfStale), once they hold
// analyzeMinRows rows: below that, even a plan that walks the table per key
// stays cheap. Not from the heartbeat: an ANALYZE of a large queue can take
// seconds, and a late heartbeat gets a live process's loops reaped. Every
// second, because until the analyze a refilling queue runs on plans made
// for an empty one (docs/design.md section 14); the check reads two rows
// of statistics.
const (
	analyzeEvery   = time.Second
	analyzeMinRows = 1000
)

// Start registers this process as alive, starts River, reaps loops of dead
// processes and makes sure every loop slot exists.
func (rt *Runtime) Start(ctx context.Context) error {
	if err := rt.beat(ctx); err != nil {
		return fmt.Errorf("register instance: %w", err)
	}
	rt.countJobOutcomes()
	if err := rt.client.Start(ctx); err != nil {
		rt.stopCountingJobOutcomes()
		return fmt.Errorf("start river: %w", err)
	}
	if err := errors.Join(rt.reap(ctx), rt.EnsureLoops(ctx)); err != nil {
		// Do not leave River working for a runtime the caller will not stop.
		stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		err = errors.Join(err, rt.client.Stop(stopCtx))
		rt.stopCountingJobOutcomes()
		return err
	}
	lctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	rt.liveness, rt.livenessDone = cancel, make(chan struct{})
	dlqDone := make(chan struct{})
	go func() {
		defer close(dlqDone)
		// The claim lease outlasts the longest publish (LEASE_DURATION is
		// checked against it), so it serves the copies' leases too.
		deadletter.NewPublisher(rt.pool, rt.producer, rt.cfg.Dispatch.Metrics, rt.cfg.Lease, rt.dlqLogger).
			Run(lctx, rt.dlqWake)
	}()
	analyzeDone := make(chan struct{})
	go func() {
		defer close(analyzeDone)
		rt.analyzeStale(lctx)
	}()
	expressDone := make(chan struct{})
	go func() {
		defer close(expressDone)
		rt.express(lctx)
	}()
	go func() {
		rt.heartbeat(lctx)
		<-dlqDone
		<-analyzeDone
		<-expressDone
		close(rt.livenessDone)
	}()
	return nil
}

// express runs this process's express rounds (dispatch.RunExpress) until
// ctx ends or Stop: the due heads of targets without a backlog, claimed
// beside another target's backlog when a notification says a head became
// due and every loop is busy. One per process, beside the
// loops and outside River: it holds no slot, and a process without
// notifications (no waker) or with express claims off runs none.
func (rt *Runtime) express(ctx context.Context) {
	if rt.waker == nil || rt.cfg.Dispatch.ExpressHeads <= 0 {
		return
	}
	wake, unsubscribe := rt.waker.Subscribe()
	defer unsubscribe()
	// Express rounds take no turn: waiting for one is what they avoid.
	d, err := rt.dispatcher(rt.cfg.Instance+"/express", wake, false, rt.logger.With("loop", "express"))
	if err != nil {
		rt.logger.Error("express claims off", "error", err)
		return
	}
	d.RunExpress(ctx, rt.stop)
}

// dispatcher returns a dispatcher of this process whose claims lease keys
// to owner, woken by wake, taking turns at the claim with the process's
// other loops (Config.Dispatch.ClaimTurns) if inTurn.
func (rt *Runtime) dispatcher(owner string, wake <-chan struct{}, inTurn bool, logger *slog.Logger) (*dispatch.Dispatcher, error) {
	locker, err := keylock.New(rt.pool, keylock.Config{
		Owner:    owner,
		Lease:    rt.cfg.Lease,
		PerKey:   rt.cfg.PerKey,
		MaxBytes: rt.cfg.RoundBytes,
	})
	if err != nil {
		return nil, err
	}
	cfg := rt.cfg.Dispatch
	cfg.OnParked = rt.parked
	if !inTurn {
		cfg.ClaimTurns = nil
	}
	return dispatch.New(locker, rt.producer, wake, cfg, logger)
}

// analyzeStale checks the queue tables' statistics every analyzeEvery until
// ctx ends. A failure is logged once until a check works again: the
// heartbeat already reports a database that does not answer.
func (rt *Runtime) analyzeStale(ctx context.Context) {
	t := time.NewTicker(analyzeEvery)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		analyzed, err := keylock.AnalyzeIfStale(ctx, rt.pool, analyzeMinRows)
		switch {
		case err != nil:
			if !failing && ctx.Err() == nil {
				rt.logger.Warn("checking the queue tables' statistics failed", "error", err)
			}
			failing = true
		default:
			if failing {
				rt.logger.Info("checking the queue tables' statistics works again")
			}
			failing = false
			if len(analyzed) > 0 {
				rt.logger.Info("analyzed queue tables whose statistics had fallen behind", "tables", analyzed)
			}
		}
	}
}

// parked wakes the dead-letter publisher.
func (rt *Runtime) parked() {
	select {
	case rt.dlqWake <- struct{}{}:
	default:
	}
}

// heartbeat keeps this process marked alive and, every few beats, reaps the
// loops of processes that stopped beating.
func (rt *Runtime) heartbeat(ctx context.Context) {
	t := time.NewTicker(heartbeatEvery)
	defer t.Stop()
	for beat := 1; ; beat++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := rt.beat(ctx); err != nil && ctx.Err() == nil {
			rt.logger.Warn("heartbeat failed", "error", err)
			continue
		}
		if beat%2 == 0 {
			if err := rt.reap(ctx); err != nil && ctx.Err() == nil {
				rt.logger.Warn("reaping loops of dead processes failed", "error", err)
			}
		}
	}
}

// beat marks this process alive, moves the database's id and seq sequences
// past the highest this process has seen if they went back (a rewound
// database), and remembers their values.
func (rt *Runtime) beat(ctx context.Context) error {
	marks := rt.cfg.Dispatch.Marks
	minID, minSeq := marks.Get()
	row, err := queries.InstanceHeartbeat(ctx, rt.pool, queries.InstanceHeartbeatParams{ID: rt.client.ID(), MinID: minID, MinSeq: minSeq})
	if err != nil {
		return err
	}
	marks.Observe(row.IDHigh, row.SeqHigh)
	return nil
}

// orphanAfter is how long a loop job the database says runs on this process
// may go without this process running it before it is reaped: River starts a
// job it fetched at once, so this only spares the instant in between.
const orphanAfter = 10 * time.Second

// runningLoops returns the ids of the loop jobs this process runs.
func (rt *Runtime) runningLoops() []int64 {
	rt.runningMu.Lock()
	defer rt.runningMu.Unlock()
	ids := make([]int64, 0, len(rt.running))
	for id := range rt.running {
		ids = append(ids, id)
	}
	return ids
}

// loopRunning records that this process runs loop job id until the returned
// func is called.
func (rt *Runtime) loopRunning(id int64) func() {
	rt.runningMu.Lock()
	defer rt.runningMu.Unlock()
	if rt.running == nil {
		rt.running = map[int64]struct{}{}
	}
	rt.running[id] = struct{}{}
	return func() {
		rt.runningMu.Lock()
		defer rt.runningMu.Unlock()
		delete(rt.running, id)
	}
}

// reap discards loop jobs held by processes that stopped heartbeating, and
// loop jobs the database says run here that do not (see
// dispatch_reap_loops.sql) and, if there were any, re-creates their slots.
func (rt *Runtime) reap(ctx context.Context) error {
	reaped, err := queries.DispatchReapLoops(ctx, rt.pool, queries.DispatchReapLoopsParams{Kind: LoopArgs{}.Kind(),
		StaleAfter: staleAfter, Self: rt.client.ID(), OrphanAfter: orphanAfter, Running: rt.runningLoops()})
	if err != nil {
		return fmt.Errorf("reap dispatch loops: %w", err)
	}
	for _, r := range reaped {
		if r.Ours {
			rt.logger.Warn("reaped dispatch loop the database says runs here, which does not: the database went back in time",
				"job", r.ID)
			continue
		}
		rt.logger.Warn("reaped dispatch loop of a process that stopped heartbeating", "job", r.ID, "holder", r.Holder)
	}
	if len(reaped) == 0 {
		return nil
	}
	return rt.EnsureLoops(ctx)
}

// EnsureLoops inserts the loop slots that do not exist yet.
func (rt *Runtime) EnsureLoops(ctx context.Context) error {
	params := make([]river.InsertManyParams, rt.cfg.Loops)
	for i := range params {
		params[i] = river.InsertManyParams{Args: LoopArgs{Slot: i}}
	}
	if _, err := rt.client.InsertMany(ctx, params); err != nil {
		return fmt.Errorf("ensure %d dispatch loops: %w", rt.cfg.Loops, err)
	}
	return nil
}

// Stop ends the loops after their current round (each hands over to a
// successor that another replica, or the next start, picks up) and stops
// River, waiting until ctx is done at most.
//
// If River does not stop in time (a loop is stuck publishing), Stop returns
// its error and keeps heartbeating (and publishing dead-letter copies), since
// that loop still holds leases and uses the producer: the caller must not
// close the producer then.
func (rt *Runtime) Stop(ctx context.Context) error {
	rt.stopOnce.Do(func() { close(rt.stop) })
	if err := rt.client.Stop(ctx); err != nil {
		return fmt.Errorf("stop river: %w", err)
	}
	rt.unsubscribeLoops()
	rt.stopCountingJobOutcomes()
	if rt.liveness != nil {
		rt.liveness()
		// The dead-letter publisher may be inside a publish that cannot be
		// cancelled; the caller's deadline wins over waiting for it.
		select {
		case <-rt.livenessDone:
		case <-ctx.Done():
			return fmt.Errorf("stop heartbeat and dead-letter publisher: %w", ctx.Err())
		}
	}
	if err := queries.InstanceLeave(context.WithoutCancel(ctx), rt.pool, queries.InstanceLeaveParams{ID: rt.client.ID()}); err != nil {
		return fmt.Errorf("deregister instance: %w", err)
	}
	return nil
}

// countJobOutcomes subscribes to River's job events and counts them by kind
// and outcome until stopCountingJobOutcomes, or until River stops (which
// closes the channel). Events are River's own account of every run this
// client finished, so failures that never reach our code (a timeout, a
// panic) are counted too.
func (rt *Runtime) countJobOutcomes() {
	m := rt.cfg.Dispatch.Metrics
	if m == nil {
		return
	}
	events, unsubscribe := rt.client.Subscribe(river.EventKindJobCompleted, river.EventKindJobFailed,
		river.EventKindJobCancelled, river.EventKindJobSnoozed, river.EventKindJobInterrupted)
	rt.unsubscribe, rt.eventsDone = unsubscribe, make(chan struct{})
	go func() {
		defer close(rt.eventsDone)
		for ev := range events {
			if ev.Job != nil {
				m.RiverJob(ev.Job.Kind, jobOutcome(ev))
			}
		}
	}()
}

func (rt *Runtime) stopCountingJobOutcomes() {
	if rt.unsubscribe == nil {
		return
	}
	rt.unsubscribe()
	<-rt.eventsDone
	rt.unsubscribe = nil
}

// jobOutcome names what happened to a job run. A failed run is "failed"
// when it will be retried and "discarded" when it was its last attempt.
func jobOutcome(ev *river.Event) string {
	switch ev.Kind {
	case river.EventKindJobCompleted:
		return "completed"
	case river.EventKindJobFailed:
		if ev.Job.State == rivertype.JobStateDiscarded {
			return "discarded"
		}
		return "failed"
	case river.EventKindJobCancelled:
		return "cancelled"
	case river.EventKindJobSnoozed:
		return "snoozed"
	case river.EventKindJobInterrupted:
		return "interrupted"
	}
	return string(ev.Kind)
}

type loopWorker struct {
	river.WorkerDefaults[LoopArgs]
	rt *Runtime
}

// NextRetry retries a failed loop soon: a loop is the service, not a task
// that benefits from long back-offs.
func (w *loopWorker) NextRetry(*river.Job[LoopArgs]) time.Time { return time.Now().Add(time.Second) }

func (w *loopWorker) Work(ctx context.Context, job *river.Job[LoopArgs]) error {
	rt := w.rt
	defer rt.loopRunning(job.ID)()
	d, err := rt.dispatcher(fmt.Sprintf("%s/loop-%d/job-%d", rt.cfg.Instance, job.Args.Slot, job.ID), rt.loopWake, true,
		rt.logger.With("loop", job.Args.Slot))
	if err != nil {
		return err
	}
	if err := d.Run(ctx, time.Now().Add(rt.cfg.LoopDuration), rt.stop); err != nil {
		return err
	}

	// Hand over even while shutting down, so another replica continues. A
	// slot beyond DISPATCH_LOOPS (it was lowered) ends here.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	return pgx.BeginFunc(ctx, rt.pool, func(tx pgx.Tx) error {
		if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
			return fmt.Errorf("complete dispatch loop %d: %w", job.Args.Slot, err)
		}
		if job.Args.Slot >= rt.cfg.Loops {
			rt.logger.Info("dispatch loop retired: DISPATCH_LOOPS is lower than its slot", "slot", job.Args.Slot)
			return nil
		}
		if _, err := rt.client.InsertTx(ctx, tx, LoopArgs{Slot: job.Args.Slot}, nil); err != nil {
			return fmt.Errorf("insert successor of dispatch loop %d: %w", job.Args.Slot, err)
		}
		return nil
	})
}

type maintenanceWorker struct {
	river.WorkerDefaults[MaintenanceArgs]
	rt *Runtime
}

func (w *maintenanceWorker) Work(ctx context.Context, _ *river.Job[MaintenanceArgs]) error {
	swept, err := keylock.SweepExpired(ctx, w.rt.pool)
	if swept > 0 {
		w.rt.logger.Info("released expired leases", "keys", swept)
	}
	repaired, rerr := keylock.SweepThrottled(ctx, w.rt.pool)
	if repaired > 0 {
		// Only a race between an operator's change to target_control and a
		// head write leaves a flag stale; worth seeing if it is frequent.
		w.rt.logger.Info("repaired throttled flags of key heads", "keys", repaired)
	}
	err = errors.Join(err, rerr)
	if perr := queries.InstancePrune(ctx, w.rt.pool); perr != nil {
		err = errors.Join(err, fmt.Errorf("prune instances: %w", perr))
	}
	pruned, perr := pruneKeyChanges(ctx, w.rt.pool)
	if pruned > 0 {
		w.rt.logger.Debug("pruned the blocked-key feed", "rows", pruned, "older_than", keyChangeRetention)
	}
	err = errors.Join(err, perr)
	if retention := w.rt.cfg.HistoryRetention; retention > 0 {
		pruned, perr := pruneHistory(ctx, w.rt.pool, retention, historyPruneBatch, historyPruneBatches)
		if pruned > 0 {
			w.rt.logger.Info("pruned attempt history", "rows", pruned, "older_than", retention)
		}
		err = errors.Join(err, perr)
	}
	return errors.Join(err, w.rt.EnsureLoops(ctx))
}

// History pruning deletes this many rows per statement, and at most this
// many statements per maintenance run; a backlog larger than that (the
// retention was just lowered) goes over the next runs.
const (
	historyPruneBatch   = 10000
	historyPruneBatches = 1000
)

// keyChangeRetention is how long the blocked-key feed (deferred_key_change)
// keeps a change. A client polls it several times a second; one that has
// not for this long loads its set again, as the prune tells it to.
const keyChangeRetention = 10 * time.Minute

// pruneKeyChanges deletes the blocked-key feed's rows older than
// keyChangeRetention, in batches as pruneHistory does, and returns how
// many went.
func pruneKeyChanges(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var total int64
	for range historyPruneBatches {
		row, err := queries.KeyChangePrune(ctx, pool, queries.KeyChangePruneParams{Retention: keyChangeRetention, Batch: historyPruneBatch})
		if err != nil {
			return total, fmt.Errorf("prune the blocked-key feed (%d rows pruned so far): %w", total, err)
		}
		total += row.Pruned
		if row.Pruned < int64(historyPruneBatch) {
			break
		}
	}
	return total, nil
}

// pruneHistory deletes deferred_attempt rows older than retention, batch
// rows per statement (each its own transaction), until a statement deletes
// fewer than batch or maxBatches ran. It returns how many rows went.
func pruneHistory(ctx context.Context, pool *pgxpool.Pool, retention time.Duration, batch, maxBatches int) (int64, error) {
	var total int64
	for range maxBatches {
		row, err := queries.HistoryPrune(ctx, pool, queries.HistoryPruneParams{Retention: retention, Batch: batch})
		if err != nil {
			return total, fmt.Errorf("prune attempt history older than %v (%d rows pruned so far): %w", retention, total, err)
		}
		total += row.Pruned
		if row.Pruned < int64(batch) {
			break
		}
	}
	return total, nil
}
