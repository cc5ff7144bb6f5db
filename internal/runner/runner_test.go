package runner

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/twmb/franz-go/pkg/kfake"
)

// startWaker runs a notification listener on e's database until the test
// ends.
func startWaker(t *testing.T, e *dispatchtest.Env) *Waker {
	t.Helper()
	waker := NewWaker(e.Pool, 5*time.Millisecond, dispatchtest.Logger())
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go waker.Run(ctx)
	return waker
}

// newRuntime makes a Runtime of cfg on e's database and broker.
func newRuntime(t *testing.T, e *dispatchtest.Env, waker *Waker, cfg Config) *Runtime {
	t.Helper()
	rt, err := New(e.Pool, e.Producer, waker, cfg, dispatchtest.Logger())
	if err != nil {
		t.Fatal(err)
	}
	return rt
}

// startRuntime starts rt; the test's cleanup stops it (a test may stop it first
// to check what stopping does).
func startRuntime(t *testing.T, rt *Runtime) {
	t.Helper()
	if err := rt.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rt.Stop(context.Background()) })
}

// The River runtime runs the loops, publishes, and hands over to successors.
func TestRuntimeDispatchesAndHandsOver(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	ctx := context.Background()
	rt := newRuntime(t, e, startWaker(t, e), Config{
		Instance: "test", Loops: 2, Workers: 2, LoopDuration: time.Second, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Minute,
		Dispatch:            dispatch.Config{BatchKeys: 50, PollInterval: 5 * time.Second, Targets: dispatchtest.AllowAll},
	})
	startRuntime(t, rt)

	// The poll interval is 5 s: arriving within a second proves the
	// notification woke a loop.
	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	e.Insert(fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), Value: []byte("now")})
	col.Wait(t, 1, 5*time.Second)
	if took := time.Since(start); took > time.Second {
		t.Fatalf("due message published after %v; the notification did not wake a loop", took)
	}
	// Run across several hand-overs (LoopDuration 1 s).
	e.Insert(fixture.Message{Key: fixture.Key("k2"), Target: dispatchtest.TopicA, RecordKey: []byte("k2"), In: 2500 * time.Millisecond, Value: []byte("later")})
	col.Wait(t, 2, 6*time.Second)

	var completed int
	if err := e.Pool.QueryRow(ctx, "SELECT count(*) FROM river_job WHERE kind = $1 AND state = 'completed'",
		LoopArgs{}.Kind()).Scan(&completed); err != nil {
		t.Fatal(err)
	}
	if completed < 2 {
		t.Fatalf("%d loop runs completed; loops are not handing over", completed)
	}
	if err := rt.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	var waiting int
	if err := e.Pool.QueryRow(ctx, "SELECT count(DISTINCT args->>'slot') FROM river_job WHERE kind = $1 AND state IN ('available', 'scheduled', 'retryable')",
		LoopArgs{}.Kind()).Scan(&waiting); err != nil {
		t.Fatal(err)
	}
	dispatchtest.MustEqual(t, "slots waiting for the next start", waiting, 2)
}

// A loop job left running by a process that died (no heartbeat) is reaped
// at start-up and its slot re-created, instead of blocking the slot until
// River's rescuer gets to it.
func TestRuntimeReapsLoopsOfDeadProcess(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	ctx := context.Background()
	cfg := Config{
		Instance: "test", Loops: 1, Workers: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Hour,
		Dispatch:            dispatch.Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: dispatchtest.AllowAll},
	}
	// The slot's job, as a process that then died would have left it.
	if _, err := newRuntime(t, e, nil, cfg).client.Insert(ctx, LoopArgs{Slot: 0}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now(),
		attempted_by = ARRAY['dead-process'] WHERE kind = $1`, LoopArgs{}.Kind()); err != nil {
		t.Fatal(err)
	}
	e.Insert(fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), Value: []byte("v")})

	rt := newRuntime(t, e, nil, cfg)
	startRuntime(t, rt)
	col.Wait(t, 1, 10*time.Second)
	var state string
	if err := e.Pool.QueryRow(ctx, "SELECT state FROM river_job WHERE 'dead-process' = ANY (attempted_by)").Scan(&state); err != nil {
		t.Fatal(err)
	}
	dispatchtest.MustEqual(t, "state of the dead process's loop", state, "discarded")
	var alive bool
	if err := e.Pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM scheduler_instance WHERE id = $1)", rt.client.ID()).Scan(&alive); err != nil {
		t.Fatal(err)
	}
	if !alive {
		t.Fatal("a running process must be registered in scheduler_instance")
	}
	if err := rt.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.Pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM scheduler_instance WHERE id = $1)", rt.client.ID()).Scan(&alive); err != nil {
		t.Fatal(err)
	}
	if alive {
		t.Fatal("a stopped process must leave scheduler_instance")
	}
}

// A database that went back in time brings back the running row of a loop
// run that has ended since, attributed to a process that is alive: the
// heartbeat alone would never reap it, and the slot would wait for River's
// rescuer. The process reaps what the database says runs on it and does
// not, and re-creates the slot; the loop it does run is left alone.
func TestRuntimeReapsLoopsTheDatabaseSaysRunHere(t *testing.T) {
	e := dispatchtest.New(t)
	ctx := context.Background()
	rt := newRuntime(t, e, nil, Config{
		Instance: "test", Loops: 1, Workers: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Hour,
		Dispatch:            dispatch.Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: dispatchtest.AllowAll},
	})
	startRuntime(t, rt)
	kind := LoopArgs{}.Kind()
	var running int64
	dispatchtest.Eventually(t, 10*time.Second, "the loop running", func() bool {
		return e.Pool.QueryRow(ctx, "SELECT id FROM river_job WHERE kind = $1 AND state = 'running'", kind).Scan(&running) == nil
	})
	// The rewound database: the running job unknown, an older run of the
	// slot running on this process since a minute.
	if _, err := e.Pool.Exec(ctx, "DELETE FROM river_job WHERE id = $1", running); err != nil {
		t.Fatal(err)
	}
	old, err := rt.client.Insert(ctx, LoopArgs{Slot: 0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1,
		attempted_at = now() - interval '1 minute', attempted_by = ARRAY[$2::text] WHERE id = $1`,
		old.Job.ID, rt.client.ID()); err != nil {
		t.Fatal(err)
	}
	var state string
	dispatchtest.Eventually(t, 10*time.Second, "the stale run reaped", func() bool {
		return e.Pool.QueryRow(ctx, "SELECT state FROM river_job WHERE id = $1", old.Job.ID).Scan(&state) == nil &&
			state == "discarded"
	})
	var waiting int
	dispatchtest.Eventually(t, 10*time.Second, "the slot re-created", func() bool {
		return e.Pool.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE kind = $1 AND id <> $2
			AND state IN ('available', 'running')`, kind, old.Job.ID).Scan(&waiting) == nil && waiting == 1
	})
	if ids := rt.runningLoops(); len(ids) != 1 || ids[0] != running {
		t.Errorf("running loops %v, want the one that was running, %d", ids, running)
	}
}

// Lowering DISPATCH_LOOPS retires the slots above it.
func TestLoweredLoopsRetire(t *testing.T) {
	e := dispatchtest.New(t)
	ctx := context.Background()
	rt := newRuntime(t, e, nil, Config{
		Instance: "test", Loops: 1, Workers: 3, LoopDuration: 300 * time.Millisecond, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Hour,
		Dispatch:            dispatch.Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: dispatchtest.AllowAll},
	})
	// Slots 1 and 2 were created by an earlier configuration.
	for _, slot := range []int{1, 2} {
		if _, err := rt.client.Insert(ctx, LoopArgs{Slot: slot}, nil); err != nil {
			t.Fatal(err)
		}
	}
	startRuntime(t, rt)
	deadline := time.Now().Add(10 * time.Second)
	for {
		var live []int
		rows, err := e.Pool.Query(ctx, `SELECT DISTINCT (args->>'slot')::int FROM river_job
			WHERE kind = $1 AND state NOT IN ('completed', 'discarded', 'cancelled') ORDER BY 1`, LoopArgs{}.Kind())
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var s int
			rows.Scan(&s)
			live = append(live, s)
		}
		rows.Close()
		if slices.Equal(live, []int{0}) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("live slots %v, want only [0]", live)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestJobOutcome(t *testing.T) {
	for _, c := range []struct {
		kind  river.EventKind
		state rivertype.JobState
		want  string
	}{
		{river.EventKindJobCompleted, rivertype.JobStateCompleted, "completed"},
		{river.EventKindJobFailed, rivertype.JobStateRetryable, "failed"},
		{river.EventKindJobFailed, rivertype.JobStateDiscarded, "discarded"},
		{river.EventKindJobCancelled, rivertype.JobStateCancelled, "cancelled"},
		{river.EventKindJobSnoozed, rivertype.JobStateScheduled, "snoozed"},
		{river.EventKindJobInterrupted, rivertype.JobStateAvailable, "interrupted"},
	} {
		ev := &river.Event{Kind: c.kind, Job: &rivertype.JobRow{Kind: "k", State: c.state}}
		if got := jobOutcome(ev); got != c.want {
			t.Errorf("%s in state %s: %q, want %q", c.kind, c.state, got, c.want)
		}
	}
}

// The Runtime publishes the copy of a message one of its loops parked.
func TestRuntimePublishesDeadLetters(t *testing.T) {
	const dlqTopic = "orders.dlq"
	e := dispatchtest.New(t, kfake.SeedTopics(2, dlqTopic))
	col := e.Collect(dlqTopic)
	ctx := context.Background()
	rt := newRuntime(t, e, nil, Config{
		Instance: "test", Loops: 1, Workers: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Hour,
		Dispatch:            dispatch.Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: protocol.TargetPatterns{"orders.*"}},
	})
	startRuntime(t, rt)
	e.Insert(fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicB, RecordKey: []byte("k"), Value: []byte("v"), DLQ: dlqTopic})
	got := col.Wait(t, 1, 10*time.Second)
	dispatchtest.MustEqual(t, "copy", string(got[0].Value), "v")
	if err := rt.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	dispatchtest.MustEqual(t, "marked published", e.Count("dlq_published_at IS NOT NULL"), 1)
}

// The runtime runs express rounds beside its loops when notifications are
// on: a message due at a target without a backlog, beside another's
// backlog, goes out while every loop waits for the turn to claim. With
// DISPATCH_EXPRESS_HEADS 0 it waits for the turn.
func TestRuntimeExpressRounds(t *testing.T) {
	for _, tt := range []struct {
		name  string
		heads int
	}{{"express on", 5}, {"express off", 0}} {
		t.Run(tt.name, func(t *testing.T) {
			e := dispatchtest.New(t)
			col := e.Collect(dispatchtest.TopicA)
			rt := newRuntime(t, e, startWaker(t, e), Config{
				Instance: "test", Loops: 2, Workers: 2, Claims: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
				MaintenanceInterval: time.Minute,
				Dispatch: dispatch.Config{BatchKeys: 50, PollInterval: 5 * time.Second, Targets: dispatchtest.AllowAll,
					ExpressHeads: tt.heads},
			})
			turns := rt.cfg.Dispatch.ClaimTurns
			turns <- struct{}{} // as if a main claim ran all along
			startRuntime(t, rt)
			// Another target's backlog, which express rounds leave alone.
			var backlog []fixture.Message
			for i := range 20 {
				k := fmt.Sprintf("backlog-%d", i)
				backlog = append(backlog, fixture.Message{Key: fixture.Key(k), Target: dispatchtest.TopicB, RecordKey: []byte(k)})
			}
			e.Insert(backlog...)
			time.Sleep(300 * time.Millisecond)
			e.Insert(fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), Value: []byte("now")})
			if tt.heads > 0 {
				col.Wait(t, 1, 5*time.Second)
				<-turns // the loops waiting for it stop then
				return
			}
			time.Sleep(time.Second)
			dispatchtest.MustEqual(t, "published while the turn was held", len(col.Snapshot()), 0)
			<-turns
			col.Wait(t, 1, 5*time.Second)
		})
	}
}

// A notification wakes one sleeping loop of the process, not every one:
// woken together, each loop claimed and all but one found nothing, on
// every ingest commit. The main claims are counted by the claim-turn wait
// each one records.
func TestNotificationWakesOneLoop(t *testing.T) {
	e := dispatchtest.New(t)
	claims := idleLoops(t, e)
	before := claims()
	e.Exec("NOTIFY " + NotifyChannel)
	time.Sleep(time.Second)
	if got := claims() - before; got != 1 {
		t.Fatalf("one notification, %d claims; want one loop woken", got)
	}
}

// idleLoops starts a runtime of four loops on e, with a notification
// listener and a poll interval of 5 s, and returns once every loop has
// claimed once and sleeps. It returns a function that reads how many main
// claims the loops have made (each records its claim-turn wait).
func idleLoops(t *testing.T, e *dispatchtest.Env) func() uint64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	startRuntime(t, newRuntime(t, e, startWaker(t, e), Config{
		Instance: "test", Loops: 4, Workers: 4, Claims: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Minute,
		Dispatch: dispatch.Config{BatchKeys: 50, PollInterval: 5 * time.Second, Targets: dispatchtest.AllowAll,
			Metrics: metrics.New(reg, "test")},
	}))
	claims := func() uint64 {
		t.Helper()
		fams, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range fams {
			if f.GetName() == metrics.DispatchClaimWait {
				return f.GetMetric()[0].GetHistogram().GetSampleCount()
			}
		}
		return 0
	}
	deadline := time.Now().Add(10 * time.Second)
	for claims() < 4 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 4 loops claimed", claims())
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	return claims
}
