package runner

import (
	"context"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/sql/queries"
)

// ageHistory makes the history rows of messages with these record values
// look recorded age ago, and returns how many it changed.
func ageHistory(e *dispatchtest.Env, age time.Duration, values ...string) int64 {
	e.T.Helper()
	tag, err := e.Pool.Exec(context.Background(), `UPDATE deferred_attempt a SET recorded_at = now() - $1::interval
		FROM deferred_message m WHERE m.id = a.message_id AND convert_from(m.value, 'UTF8') = ANY ($2::text[])`, age, values)
	if err != nil {
		e.T.Fatal(err)
	}
	return tag.RowsAffected()
}

func historyRows(e *dispatchtest.Env) int {
	e.T.Helper()
	var n int
	if err := e.Pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_attempt").Scan(&n); err != nil {
		e.T.Fatal(err)
	}
	return n
}

// pruneHistory deletes history older than the retention in batches, and
// stops after maxBatches.
func TestPruneHistory(t *testing.T) {
	tests := []struct {
		name              string
		batch, maxBatches int
		wantPruned        int64
		wantLeft          int
	}{
		{name: "several batches until done", batch: 2, maxBatches: 100, wantPruned: 5, wantLeft: 2},
		{name: "one batch larger than the backlog", batch: 100, maxBatches: 1, wantPruned: 5, wantLeft: 2},
		{name: "bounded number of batches", batch: 2, maxBatches: 2, wantPruned: 4, wantLeft: 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := dispatchtest.New(t)
			// Stored parked, each message has its history row at once (one
			// stored pending has none until something else happens to it).
			var rows []fixture.Message
			for _, v := range []string{"o1", "o2", "o3", "o4", "o5", "new1", "new2"} {
				rows = append(rows, fixture.Message{Key: fixture.Key(v), Target: dispatchtest.TopicA, Value: []byte(v),
					State: "parked", Reason: "operator: kept for the test"})
			}
			e.Insert(rows...)
			dispatchtest.MustEqual(t, "history rows", historyRows(e), 7)
			dispatchtest.MustEqual(t, "aged", ageHistory(e, 48*time.Hour, "o1", "o2", "o3", "o4", "o5"), int64(5))
			// Just inside the retention: kept.
			ageHistory(e, 23*time.Hour, "new1")
			n, err := pruneHistory(context.Background(), e.Pool, 24*time.Hour, tt.batch, tt.maxBatches)
			if err != nil {
				t.Fatal(err)
			}
			dispatchtest.MustEqual(t, "pruned", n, tt.wantPruned)
			dispatchtest.MustEqual(t, "left", historyRows(e), tt.wantLeft)
			var newLeft int
			if err := e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM deferred_attempt a JOIN deferred_message m
				ON m.id = a.message_id WHERE convert_from(m.value, 'UTF8') LIKE 'new%'`).Scan(&newLeft); err != nil {
				t.Fatal(err)
			}
			dispatchtest.MustEqual(t, "recent history kept", newLeft, 2)
		})
	}
}

// Maintenance prunes the history when HistoryRetention is set, and keeps it
// forever when it is zero.
func TestMaintenancePrunesHistory(t *testing.T) {
	for _, retention := range []time.Duration{0, time.Hour} {
		t.Run(retention.String(), func(t *testing.T) {
			e := dispatchtest.New(t)
			// Stored parked: each has its history row at once.
			e.Insert(fixture.Message{Key: fixture.Key("old"), Target: "orders.elsewhere", Value: []byte("old"), In: time.Hour,
				State: "parked", Reason: "operator: kept for the test"},
				fixture.Message{Key: fixture.Key("new"), Target: "orders.elsewhere", Value: []byte("new"), In: time.Hour,
					State: "parked", Reason: "operator: kept for the test"})
			ageHistory(e, 2*time.Hour, "old")
			ctx := context.Background()
			startRuntime(t, newRuntime(t, e, nil, Config{
				Instance: "test", Loops: 1, Workers: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
				MaintenanceInterval: time.Hour, HistoryRetention: retention,
				Dispatch: dispatch.Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: dispatchtest.AllowAll},
			}))
			// Maintenance runs on start; wait for it to complete.
			deadline := time.Now().Add(10 * time.Second)
			for {
				var done int
				if err := e.Pool.QueryRow(ctx, "SELECT count(*) FROM river_job WHERE kind = $1 AND state = 'completed'",
					MaintenanceArgs{}.Kind()).Scan(&done); err != nil {
					t.Fatal(err)
				}
				if done > 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("maintenance did not run")
				}
				time.Sleep(50 * time.Millisecond)
			}
			want := 1
			if retention == 0 {
				want = 2
			}
			dispatchtest.MustEqual(t, "history rows after maintenance", historyRows(e), want)
		})
	}
}

// The republished record carries defer.redrive-count when an operator
// replayed the message out of the parking lot, and no such header otherwise.
func TestRedriveCountPublished(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	e.Insert(
		fixture.Message{Key: fixture.Key("r"), Target: dispatchtest.TopicA, RecordKey: []byte("r"), Value: []byte("redriven"), Redrive: 2,
			HeaderKeys: []string{"defer.redrive-count", "x"}, HeaderValues: [][]byte{[]byte("1"), []byte("y")}},
		fixture.Message{Key: fixture.Key("n"), Target: dispatchtest.TopicA, RecordKey: []byte("n"), Value: []byte("never"),
			HeaderKeys: []string{"defer.redrive-count"}, HeaderValues: [][]byte{[]byte("1")}},
	)
	e.Drain(e.Dispatcher("t1", time.Minute, dispatchtest.AllowAll), 10*time.Second)
	for _, m := range col.Wait(t, 2, 5*time.Second) {
		switch string(m.Value) {
		case "redriven":
			dispatchtest.MustEqual(t, "first header", string(m.Headers[0].Key)+"="+string(m.Headers[0].Value), "defer.redrive-count=2")
		case "never":
			for _, h := range m.Headers {
				if string(h.Key) == "defer.redrive-count" {
					t.Errorf("stale defer.redrive-count %q republished for a message never replayed", h.Value)
				}
			}
		}
	}
}

// The backlog query behind the gauges: keys held by a parked message are
// counted apart and are not lateness; dead-letter copies still due are
// counted.
func TestMetricsBacklogQuery(t *testing.T) {
	e := dispatchtest.New(t)
	ctx := context.Background()
	ids := e.Insert(
		fixture.Message{Key: fixture.Key("held"), Target: dispatchtest.TopicA, In: -time.Hour},
		fixture.Message{Key: fixture.Key("held"), Target: dispatchtest.TopicA, In: -time.Hour},
		fixture.Message{Key: fixture.Key("late"), Target: dispatchtest.TopicA, In: -10 * time.Second},
		fixture.Message{Key: fixture.Key("backoff"), Target: dispatchtest.TopicA, In: time.Hour},
		fixture.Message{Key: fixture.Key("dlq"), Target: dispatchtest.TopicA, In: -time.Hour, DLQ: "orders.dlq", Release: true},
		fixture.Message{Key: fixture.Key("sent"), Target: dispatchtest.TopicA, In: -time.Hour, DLQ: "orders.dlq", Release: true},
	)
	for _, st := range []struct {
		sql  string
		args []any
	}{
		{`UPDATE deferred_message SET state = 'parked', reason = 'permanent: x' WHERE id = ANY ($1::bigint[])`,
			[]any{[]int64{ids[0], ids[4], ids[5]}}},
		{`UPDATE deferred_message SET dlq_published_at = now() WHERE id = $1`, []any{ids[5]}},
		{`UPDATE deferred_key SET failures = 2, leased_until = now() + interval '1 minute' WHERE business_key = 'backoff'`, nil},
	} {
		if _, err := e.Pool.Exec(ctx, st.sql, st.args...); err != nil {
			t.Fatalf("%s: %v", st.sql, err)
		}
	}
	rows, err := queries.MetricsBacklog(ctx, e.Pool)
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]int64{}
	var n int
	for _, r := range rows {
		target, state, messages, oldestDue := r.Target, r.State, r.Messages, r.OldestDueSeconds
		held, heldParked, unsent := r.HeldKeys, r.HeldParked, r.DLQUnsent
		n++
		counts[*target+"/"+*state] = messages
		// The late key's head is ~10s late; the held key's head, an hour
		// overdue, does not count.
		if oldestDue < 9 || oldestDue > 60 {
			t.Errorf("oldest due %vs, want about 10s", oldestDue)
		}
		dispatchtest.MustEqual(t, "keys backing off", held, int64(1))
		dispatchtest.MustEqual(t, "keys held by a parked message", heldParked, int64(1))
		dispatchtest.MustEqual(t, "dead-letter copies due", unsent, int64(1))
	}
	if n == 0 || counts[dispatchtest.TopicA+"/parked"] != 3 || counts[dispatchtest.TopicA+"/pending"] != 3 {
		t.Errorf("counts %v, want 3 parked and 3 pending", counts)
	}
}

// Maintenance repairs a head's throttled flag that a race left stale: a
// head of a rate-limited target left unflagged is claimed under its limit
// only once flagged.
func TestMaintenanceRepairsThrottledFlags(t *testing.T) {
	e := dispatchtest.New(t)
	ctx := context.Background()
	e.Exec(`INSERT INTO target_control (target_topic, rate_limit) VALUES ($1, 100)`, dispatchtest.TopicB)
	e.Insert(fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicB, Value: []byte("v"), In: time.Hour})
	// As a head written while the limit was being set could be left.
	e.Exec(`UPDATE deferred_key SET throttled = false`)
	startRuntime(t, newRuntime(t, e, nil, Config{
		Instance: "test", Loops: 1, Workers: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Hour,
		Dispatch:            dispatch.Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: dispatchtest.AllowAll},
	}))
	// Maintenance runs on start.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var flagged bool
		if err := e.Pool.QueryRow(ctx, "SELECT throttled FROM deferred_key WHERE business_key = 'k'").Scan(&flagged); err != nil {
			t.Fatal(err)
		}
		if flagged {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("maintenance did not flag the head of the rate-limited target")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
