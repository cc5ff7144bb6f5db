package dispatch_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/metrics"
)

// Loops sharing ClaimTurns claim one at a time: a round without a turn
// claims nothing (and gives up when its context ends), claims once it gets
// one, and gives the turn back when its claim returns, so another loop
// claims while it publishes and finalizes. The waits are in the metrics.
func TestClaimsTakeTurns(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	const keys = 15
	var rows []fixture.Message
	for i := range keys {
		k := fmt.Sprintf("turn-%d", i)
		rows = append(rows, fixture.Message{Key: fixture.Key(k), Target: dispatchtest.TopicA, RecordKey: []byte(k)})
	}
	e.Insert(rows...)
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "test")
	turns := make(chan struct{}, 1)
	loop := func(owner string) *dispatch.Dispatcher {
		l, err := keylock.New(e.Pool, keylock.Config{Owner: owner, Lease: time.Minute, PerKey: 100})
		if err != nil {
			t.Fatal(err)
		}
		d, err := dispatch.New(l, e.Producer, nil, dispatch.Config{BatchKeys: 5, PollInterval: 50 * time.Millisecond,
			Targets: dispatchtest.AllowAll, Metrics: m, ClaimTurns: turns}, dispatchtest.Logger())
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	d1, d2 := loop("turns-1"), loop("turns-2")
	leased := func() int {
		var n int
		if err := e.Pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_key WHERE leased_until > now()").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	// Another holds the only turn: a round whose context ends meanwhile
	// claims nothing and says why.
	turns <- struct{}{}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	st, err := d1.Round(ctx)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || st.Keys != 0 {
		t.Fatalf("round without a turn: %+v, %v; want no keys and the context's deadline", st, err)
	}
	dispatchtest.MustEqual(t, "keys leased without a turn", leased(), 0)

	// A round waits for the turn, then claims.
	type result struct {
		st  dispatch.RoundStats
		err error
	}
	done := make(chan result, 1)
	go func() {
		st, err := d1.Round(context.Background())
		done <- result{st, err}
	}()
	select {
	case r := <-done:
		t.Fatalf("round ran while another held the turn: %+v, %v", r.st, r.err)
	case <-time.After(150 * time.Millisecond):
	}
	dispatchtest.MustEqual(t, "keys leased while waiting for the turn", leased(), 0)
	<-turns
	r := <-done
	if r.err != nil || r.st.Published != 5 {
		t.Fatalf("round once the turn was free: %+v, %v; want 5 published", r.st, r.err)
	}

	// The turn is free while a round publishes and finalizes: another loop
	// claims then.
	var during dispatch.RoundStats
	d2.AfterPublish(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var err error
		during, err = d1.Round(ctx)
		return err
	})
	st, err = d2.Round(context.Background())
	if err != nil || st.Published != 5 {
		t.Fatalf("round whose finalize waited for another loop's round: %+v, %v; want 5 published", st, err)
	}
	dispatchtest.MustEqual(t, "published by the loop that claimed during another's finalize", during.Published, 5)
	dispatchtest.MustEqual(t, "turns held after the rounds", len(turns), 0)
	col.Wait(t, keys, 5*time.Second)
	dispatchtest.MustEqual(t, "rows left", e.Count("true"), 0)

	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != metrics.DispatchClaimWait {
			continue
		}
		h := f.GetMetric()[0].GetHistogram()
		// Three rounds got a turn; the second waited about 150 ms for it.
		if h.GetSampleCount() != 3 || h.GetSampleSum() < 0.15 {
			t.Errorf("claim waits: %d summing %vs, want 3 summing at least 0.15s", h.GetSampleCount(), h.GetSampleSum())
		}
		return
	}
	t.Errorf("no %s in the metrics", metrics.DispatchClaimWait)
}
