package gate

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// waitFor waits, at most a minute, until ok holds; what describes the
// state for the failure message.
func waitFor(t *testing.T, what string, ok func() (bool, string)) {
	t.Helper()
	var last string
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		var done bool
		if done, last = ok(); done {
			return
		}
	}
	t.Fatalf("%s: not within a minute (%s)", what, last)
}

// trusted says whether a fresh claim's batch would take the set's word.
func trusted(g *Gate) bool {
	_, ok := g.setStates([]string{"any"}, &ClaimState{})
	return ok
}

// TestKeySetFollowsTheScheduler: the gate's copy of its group's blocked
// keys, against a real scheduler: loaded at the assignment; the gate's own
// deferral blocked locally until the feed's answer covers it, then in the
// set; an operator's cancel and INSERT followed; a TRUNCATE makes it load
// again; a change held back by an open transaction, and a scheduler that
// stopped answering, make the set untrusted, and batches ask again.
func TestKeySetFollowsTheScheduler(t *testing.T) {
	db, p, g := startScheduler(t, "1s")
	ctx := context.Background()
	exec := func(sql string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	blocked := func(key string, want bool) {
		t.Helper()
		waitFor(t, fmt.Sprintf("%s blocked=%v in the set", key, want), func() (bool, string) {
			claim := &ClaimState{}
			states, ok := g.setStates([]string{key}, claim)
			return ok && states[key].Blocked == want, fmt.Sprintf("trusted %v, %+v, stats %+v", ok, states[key], g.Stats())
		})
	}

	if err := g.Assigned(ctx); err != nil {
		t.Fatal(err)
	}
	if st := g.Stats(); st.SetLoads != 1 || st.BlockedKeys != 0 || !trusted(g) {
		t.Fatalf("after the assignment: stats %+v, trusted %v; want one load, nothing blocked, trusted", st, trusted(g))
	}

	// The gate's own deferral: blocked at once, locally, then by the set.
	rec := Record{Topic: "orders", Key: []byte("order-1"), Value: []byte("charge")}
	if err := g.Defer(ctx, rec, Deferral{Target: "orders.retry", BusinessKey: "order-1", Delay: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if states, ok := g.setStates([]string{"order-1"}, &ClaimState{}); !ok || !states["order-1"].Blocked {
		t.Fatalf("order-1 right after its deferral: %+v (trusted %v), want blocked", states, ok)
	}
	waitFor(t, "the feed to cover the deferral", func() (bool, string) {
		g.pendingMu.Lock()
		defer g.pendingMu.Unlock()
		return len(g.pending) == 0 && g.Stats().BlockedKeys == 1, fmt.Sprintf("pending %v, stats %+v", g.pending, g.Stats())
	})
	blocked("order-1", true)

	// An operator's cancel, and an operator's INSERT for the group.
	exec("DELETE FROM deferred_message WHERE business_key = 'order-1'")
	blocked("order-1", false)
	exec(`INSERT INTO deferred_message (business_key, target_topic, next_run_at, header_keys, header_values, group_id)
		VALUES ('order-2', 'orders.retry', now() + interval '1 hour', '{}', '{}', 'payments')`)
	blocked("order-2", true)

	// A TRUNCATE names no key: the feed says to load again.
	loads := g.Stats().SetLoads
	exec("TRUNCATE deferred_inflight")
	waitFor(t, "a load after the TRUNCATE", func() (bool, string) {
		return g.Stats().SetLoads > loads, fmt.Sprintf("%+v", g.Stats())
	})
	blocked("order-2", true)

	// A transaction left open holds a later change back: once it has
	// waited longer than staleAfter, the set is not trusted.
	open, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Rollback(ctx)
	if _, err := open.Exec(ctx, `INSERT INTO deferred_message (business_key, target_topic, next_run_at, header_keys, header_values, group_id)
		VALUES ('order-3', 'orders.retry', now() + interval '1 hour', '{}', '{}', 'payments')`); err != nil {
		t.Fatal(err)
	}
	exec("DELETE FROM deferred_message WHERE business_key = 'order-2'")
	waitFor(t, "the set untrusted while a change waits", func() (bool, string) { return !trusted(g), fmt.Sprintf("%+v", g.Stats()) })
	if err := open.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	blocked("order-2", false)
	blocked("order-3", true)

	// The scheduler stops answering: the set goes untrusted, and a batch
	// asks, and counts the keys unknown.
	p.Kill()
	waitFor(t, "the set untrusted without the scheduler", func() (bool, string) { return !trusted(g), fmt.Sprintf("%+v", g.Stats()) })
	states, err := g.batchStates(ctx, []Record{{Topic: "orders", Key: []byte("order-9")}}, []string{"order-9"}, &ClaimState{})
	if !errors.Is(err, ErrUnsure) || states["order-9"].Reason != ReasonUnknown {
		t.Errorf("a batch without the scheduler: %+v, %v; want order-9 unknown", states, err)
	}
}

// TestKeySetUnsupported: a scheduler of an earlier release answers 404 to
// the set's requests; the gate then asks about every batch, as it did.
func TestKeySetUnsupported(t *testing.T) {
	asked := make(chan struct{}, 100)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/key-state" {
			asked <- struct{}{}
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"keys":[{"key":"order-1"}]}`)
			return
		}
		http.NotFound(w, r)
	}))
	t.Cleanup(srv.Close)
	g, err := New(Config{Group: "payments", SchedulerURL: srv.URL}, &testProducer{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	if err := g.Assigned(context.Background()); !errors.Is(err, errUnsupported) {
		t.Fatalf("Assigned: %v, want %v", err, errUnsupported)
	}
	g.set.mu.Lock()
	following := g.set.following
	g.set.mu.Unlock()
	if following || trusted(g) {
		t.Errorf("following %v, trusted %v: want neither", following, trusted(g))
	}
	states, err := g.batchStates(context.Background(), []Record{{Topic: "orders", Key: []byte("order-1")}}, []string{"order-1"}, &ClaimState{})
	if err != nil || states["order-1"].Blocked || len(asked) != 1 {
		t.Errorf("a batch: %+v, %v, %d questions; want order-1 free after one question", states, err, len(asked))
	}
}

// TestKeySetKeepsOwnDeferralUntilTheFeedHasIt: while the gate follows a
// set, a question that covers the gate's own deferral (asked for a
// republished record of the key) must not forget it: the set may not hold
// the key yet, and forgetting it would leave the key free until the feed
// caught up. TestKeyOrderEndToEnd found this: a main-topic record handled
// before an earlier one of its key that was deferred. Here the feed is
// held still (stopped, the gate still marked as following it) so that
// the question comes first.
func TestKeySetKeepsOwnDeferralUntilTheFeedHasIt(t *testing.T) {
	db, _, g := startScheduler(t, "0s")
	ctx := context.Background()
	if err := g.Assigned(ctx); err != nil {
		t.Fatal(err)
	}
	g.Close()
	g.set.mu.Lock()
	g.set.following = true
	g.set.mu.Unlock()

	rec := Record{Topic: "orders", Key: []byte("order-1"), Value: []byte("charge")}
	if err := g.Defer(ctx, rec, Deferral{Target: "orders.retry", BusinessKey: "order-1", Delay: time.Hour}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "ingest to store the deferral", func() (bool, string) {
		var n int
		err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM deferred_message WHERE business_key = 'order-1'").Scan(&n)
		return err == nil && n == 1, fmt.Sprintf("%d rows, %v", n, err)
	})
	states, err := g.keyStates(ctx, []string{"order-1"}, false)
	if err != nil || !states["order-1"].Blocked {
		t.Fatalf("the question: %+v, %v; want order-1 blocked", states, err)
	}
	if got, ok := g.setStates([]string{"order-1"}, &ClaimState{}); ok && !got["order-1"].Blocked {
		t.Errorf("after a question covered the deferral, the set's answer is %+v: the key reads free", got)
	}
	g.pendingMu.Lock()
	_, kept := g.pending["order-1"]
	g.pendingMu.Unlock()
	if !kept {
		t.Error("the question forgot the gate's own deferral while the set does not hold its key")
	}
}
