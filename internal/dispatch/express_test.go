package dispatch_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/metrics"
)

// Express rounds publish the due messages of a target without a backlog
// while the main loops' only turn is held (a main claim running), leave a
// target with a backlog to the main loops, and run on wake-ups when no loop
// sleeps: a message stored while RunExpress waits goes out on the next
// one. Their keys are counted apart from the main rounds'.
func TestExpressRounds(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicB)
	backlog := e.Collect(dispatchtest.TopicA)
	var rows []fixture.Message
	for i := range 20 {
		k := fmt.Sprintf("backlog-%d", i)
		rows = append(rows, fixture.Message{Key: fixture.Key(k), Target: dispatchtest.TopicA, RecordKey: []byte(k), In: -time.Minute})
	}
	for i := range 2 {
		k := fmt.Sprintf("quiet-%d", i)
		rows = append(rows, fixture.Message{Key: fixture.Key(k), Target: dispatchtest.TopicB, RecordKey: []byte(k)})
	}
	e.Insert(rows...)

	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "test")
	turns := make(chan struct{}, 1)
	turns <- struct{}{} // held throughout: no main claim may run
	l, err := keylock.New(e.Pool, keylock.Config{Owner: "express", Lease: time.Minute, PerKey: 100})
	if err != nil {
		t.Fatal(err)
	}
	wake := make(chan struct{}, 1)
	var sleeping atomic.Int32
	d, err := dispatch.New(l, e.Producer, wake, dispatch.Config{BatchKeys: 50, PollInterval: time.Second,
		Targets: dispatchtest.AllowAll, Metrics: m, ClaimTurns: turns, ExpressHeads: 5, Sleeping: &sleeping}, dispatchtest.Logger())
	if err != nil {
		t.Fatal(err)
	}

	st, err := d.ExpressRound(t.Context())
	if err != nil || st.Keys != 2 || st.Published != 2 {
		t.Fatalf("express round: %+v, %v; want the light target's 2 keys published", st, err)
	}
	col.Wait(t, 2, 5*time.Second)
	dispatchtest.MustEqual(t, "backlog left to the main loops", e.Count("target_topic = $1", dispatchtest.TopicA), 20)

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		d.RunExpress(ctx, nil)
	}()
	e.Insert(fixture.Message{Key: fixture.Key("quiet-2"), Target: dispatchtest.TopicB, RecordKey: []byte("quiet-2")})
	// While a loop sleeps, the same wake-up wakes it: no express round.
	sleeping.Store(1)
	wake <- struct{}{}
	time.Sleep(300 * time.Millisecond)
	dispatchtest.MustEqual(t, "published on a wake-up while a loop slept", len(col.Snapshot()), 2)
	sleeping.Store(0)
	wake <- struct{}{}
	col.Wait(t, 3, 5*time.Second)
	// Wake-ups with only the backlog due publish nothing of it.
	for range 3 {
		wake <- struct{}{}
		time.Sleep(60 * time.Millisecond)
	}
	dispatchtest.MustEqual(t, "backlog left after wake-ups", e.Count("target_topic = $1", dispatchtest.TopicA), 20)
	dispatchtest.MustEqual(t, "backlog records published", len(backlog.Snapshot()), 0)
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("RunExpress did not return after its context ended")
	}
	dispatchtest.MustEqual(t, "turns held", len(turns), 1)

	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var express, rounds float64 = -1, 0
	for _, f := range fams {
		switch f.GetName() {
		case metrics.DispatchExpressKeys:
			express = f.GetMetric()[0].GetCounter().GetValue()
		case metrics.DispatchRoundDuration:
			rounds = float64(f.GetMetric()[0].GetHistogram().GetSampleCount())
		}
	}
	dispatchtest.MustEqual(t, "keys counted as express", express, 3)
	dispatchtest.MustEqual(t, "express rounds in the round duration", rounds, 0)
}
