package dispatch

import (
	"context"
	"testing"
	"time"

	schedsql "github.com/deferq/scheduler/sql"
)

// ageHistory makes the history rows of messages with these record values
// look recorded age ago, and returns how many it changed.
func (e *env) ageHistory(age time.Duration, values ...string) int64 {
	e.t.Helper()
	tag, err := e.pool.Exec(context.Background(), `UPDATE deferred_attempt a SET recorded_at = now() - $1::interval
		FROM deferred_message m WHERE m.id = a.message_id AND convert_from(m.value, 'UTF8') = ANY ($2::text[])`, age, values)
	if err != nil {
		e.t.Fatal(err)
	}
	return tag.RowsAffected()
}

func (e *env) historyRows() int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_attempt").Scan(&n); err != nil {
		e.t.Fatal(err)
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
			e := newEnv(t)
			var rows []msg
			for _, v := range []string{"o1", "o2", "o3", "o4", "o5", "new1", "new2"} {
				rows = append(rows, msg{key: str(v), target: topicA, value: []byte(v)})
			}
			e.insert(rows...)
			mustEqual(t, "history rows", e.historyRows(), 7)
			mustEqual(t, "aged", e.ageHistory(48*time.Hour, "o1", "o2", "o3", "o4", "o5"), int64(5))
			// Just inside the retention: kept.
			e.ageHistory(23*time.Hour, "new1")
			n, err := pruneHistory(context.Background(), e.pool, 24*time.Hour, tt.batch, tt.maxBatches)
			if err != nil {
				t.Fatal(err)
			}
			mustEqual(t, "pruned", n, tt.wantPruned)
			mustEqual(t, "left", e.historyRows(), tt.wantLeft)
			var newLeft int
			if err := e.pool.QueryRow(context.Background(), `SELECT count(*) FROM deferred_attempt a JOIN deferred_message m
				ON m.id = a.message_id WHERE convert_from(m.value, 'UTF8') LIKE 'new%'`).Scan(&newLeft); err != nil {
				t.Fatal(err)
			}
			mustEqual(t, "recent history kept", newLeft, 2)
		})
	}
}

// Maintenance prunes the history when HistoryRetention is set, and keeps it
// forever when it is zero.
func TestMaintenancePrunesHistory(t *testing.T) {
	for _, retention := range []time.Duration{0, time.Hour} {
		t.Run(retention.String(), func(t *testing.T) {
			e := newEnv(t)
			e.insert(msg{key: str("old"), target: "orders.elsewhere", value: []byte("old"), in: time.Hour},
				msg{key: str("new"), target: "orders.elsewhere", value: []byte("new"), in: time.Hour})
			e.ageHistory(2*time.Hour, "old")
			ctx := context.Background()
			rt, err := NewRuntime(e.pool, e.producer, nil, RuntimeConfig{
				Instance: "test", Loops: 1, Workers: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
				MaintenanceInterval: time.Hour, HistoryRetention: retention,
				Dispatch: Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: allowAll},
			}, testLogger(t))
			if err != nil {
				t.Fatal(err)
			}
			if err := rt.Start(ctx); err != nil {
				t.Fatal(err)
			}
			defer rt.Stop(ctx)
			// Maintenance runs on start; wait for it to complete.
			deadline := time.Now().Add(10 * time.Second)
			for {
				var done int
				if err := e.pool.QueryRow(ctx, "SELECT count(*) FROM river_job WHERE kind = $1 AND state = 'completed'",
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
			mustEqual(t, "history rows after maintenance", e.historyRows(), want)
		})
	}
}

// The republished record carries defer.redrive-count when an operator
// replayed the message out of the parking lot, and no such header otherwise.
func TestRedriveCountPublished(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	e.insert(
		msg{key: str("r"), target: topicA, recKey: []byte("r"), value: []byte("redriven"), redrive: 2,
			hkeys: []string{"defer.redrive-count", "x"}, hvals: [][]byte{[]byte("1"), []byte("y")}},
		msg{key: str("n"), target: topicA, recKey: []byte("n"), value: []byte("never"),
			hkeys: []string{"defer.redrive-count"}, hvals: [][]byte{[]byte("1")}},
	)
	e.drain(e.dispatcher("t1", time.Minute, allowAll), 10*time.Second)
	for _, m := range col.wait(t, 2, 5*time.Second) {
		switch string(m.Value) {
		case "redriven":
			mustEqual(t, "first header", string(m.Headers[0].Key)+"="+string(m.Headers[0].Value), "defer.redrive-count=2")
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
	e := newEnv(t)
	ctx := context.Background()
	ids := e.insert(
		msg{key: str("held"), target: topicA, in: -time.Hour},
		msg{key: str("held"), target: topicA, in: -time.Hour},
		msg{key: str("late"), target: topicA, in: -10 * time.Second},
		msg{key: str("backoff"), target: topicA, in: time.Hour},
		msg{key: str("dlq"), target: topicA, in: -time.Hour, dlq: "orders.dlq", release: true},
		msg{key: str("sent"), target: topicA, in: -time.Hour, dlq: "orders.dlq", release: true},
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
		if _, err := e.pool.Exec(ctx, st.sql, st.args...); err != nil {
			t.Fatalf("%s: %v", st.sql, err)
		}
	}
	rows, err := e.pool.Query(ctx, schedsql.MetricsBacklog)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	counts := map[string]int64{}
	var n int
	for rows.Next() {
		var (
			target, state                           *string
			messages, due, held, heldParked, unsent int64
			oldestDue, oldestXact                   float64
		)
		if err := rows.Scan(&target, &state, &messages, &due, &oldestDue, &held, &oldestXact, &heldParked, &unsent); err != nil {
			t.Fatal(err)
		}
		n++
		counts[*target+"/"+*state] = messages
		// The late key's head is ~10s late; the held key's head, an hour
		// overdue, does not count.
		if oldestDue < 9 || oldestDue > 60 {
			t.Errorf("oldest due %vs, want about 10s", oldestDue)
		}
		mustEqual(t, "keys backing off", held, int64(1))
		mustEqual(t, "keys held by a parked message", heldParked, int64(1))
		mustEqual(t, "dead-letter copies due", unsent, int64(1))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n == 0 || counts[topicA+"/parked"] != 3 || counts[topicA+"/pending"] != 3 {
		t.Errorf("counts %v, want 3 parked and 3 pending", counts)
	}
}

// Maintenance repairs a head's throttled flag that a race left stale: a
// head of a rate-limited target left unflagged is claimed under its limit
// only once flagged.
func TestMaintenanceRepairsThrottledFlags(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.exec(`INSERT INTO target_control (target_topic, rate_limit) VALUES ($1, 100)`, topicB)
	e.insert(msg{key: str("k"), target: topicB, value: []byte("v"), in: time.Hour})
	// As a head written while the limit was being set could be left.
	e.exec(`UPDATE deferred_key SET throttled = false`)
	rt, err := NewRuntime(e.pool, e.producer, nil, RuntimeConfig{
		Instance: "test", Loops: 1, Workers: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Hour,
		Dispatch:            Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: allowAll},
	}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer rt.Stop(ctx)
	// Maintenance runs on start.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var flagged bool
		if err := e.pool.QueryRow(ctx, "SELECT throttled FROM deferred_key WHERE business_key = 'k'").Scan(&flagged); err != nil {
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
