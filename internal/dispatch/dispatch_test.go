package dispatch

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	deferral "github.com/deferq/scheduler/internal/defer"
	"github.com/deferq/scheduler/internal/keylock"
)

func TestRecordHeaders(t *testing.T) {
	due := time.Date(2026, 11, 21, 10, 0, 0, 123456000, time.UTC)
	h := func(k, v string) keylock.Header { return keylock.Header{Key: k, Value: []byte(v)} }
	type hv struct{ k, v string }
	tests := []struct {
		name    string
		in      []keylock.Header
		redrive int32
		want    []hv
	}{
		{
			name: "one-shot headers removed, scheduler headers appended, others kept in order",
			in: []keylock.Header{h("trace", "t1"), h("defer.target", "orders.retry"), h("defer.delay", "30s"),
				h("defer.at", "2026-11-21T10:00:00Z"), h("dup", "a"), h("dup", "b"), h("defer.key", "k")},
			want: []hv{{"trace", "t1"}, {"defer.target", "orders.retry"}, {"dup", "a"}, {"dup", "b"}, {"defer.key", "k"},
				{"defer.id", "42"}, {"defer.seq", "7"}, {"defer.attempt", "3"}, {"defer.scheduled-at", "2026-11-21T10:00:00.123456Z"}},
		},
		{
			name: "scheduler headers replaced in place, extra copies dropped",
			in: []keylock.Header{h("defer.attempt", "1"), h("x", "y"), h("defer.id", "9"), h("defer.seq", "7"),
				h("defer.attempt", "5"), h("defer.scheduled-at", "old")},
			want: []hv{{"defer.attempt", "3"}, {"x", "y"}, {"defer.id", "42"}, {"defer.seq", "7"},
				{"defer.scheduled-at", "2026-11-21T10:00:00.123456Z"}},
		},
		{
			name: "no headers",
			want: []hv{{"defer.id", "42"}, {"defer.seq", "7"}, {"defer.attempt", "3"}, {"defer.scheduled-at", "2026-11-21T10:00:00.123456Z"}},
		},
		{
			name: "target header follows the row after an operator edit",
			in:   []keylock.Header{h("defer.target", "old.topic")},
			want: []hv{{"defer.target", "orders.retry"}, {"defer.id", "42"}, {"defer.seq", "7"}, {"defer.attempt", "3"},
				{"defer.scheduled-at", "2026-11-21T10:00:00.123456Z"}},
		},
		{
			name:    "redrive count appended for a replayed message",
			in:      []keylock.Header{h("x", "y")},
			redrive: 2,
			want: []hv{{"x", "y"}, {"defer.id", "42"}, {"defer.seq", "7"}, {"defer.attempt", "3"},
				{"defer.scheduled-at", "2026-11-21T10:00:00.123456Z"}, {"defer.redrive-count", "2"}},
		},
		{
			name:    "redrive count replaced in place, extra copies dropped",
			in:      []keylock.Header{h("x", "y"), h("defer.redrive-count", "1"), h("z", ""), h("defer.redrive-count", "9")},
			redrive: 3,
			want: []hv{{"x", "y"}, {"defer.redrive-count", "3"}, {"z", ""}, {"defer.id", "42"}, {"defer.seq", "7"},
				{"defer.attempt", "3"}, {"defer.scheduled-at", "2026-11-21T10:00:00.123456Z"}},
		},
		{
			name: "stale redrive count dropped when the message was never replayed",
			in:   []keylock.Header{h("defer.redrive-count", "1"), h("x", "y")},
			want: []hv{{"x", "y"}, {"defer.id", "42"}, {"defer.seq", "7"}, {"defer.attempt", "3"},
				{"defer.scheduled-at", "2026-11-21T10:00:00.123456Z"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pm := Record(keylock.Message{ID: 42, Seq: 7, Attempt: 2, Target: "orders.retry", NextRunAt: due, Headers: tt.in,
				RedriveCount: tt.redrive})
			var got []hv
			for _, rh := range pm.Headers {
				got = append(got, hv{string(rh.Key), string(rh.Value)})
			}
			if !slices.Equal(got, tt.want) {
				t.Fatalf("headers\n got %v\nwant %v", got, tt.want)
			}
		})
	}

	t.Run("binary values, nil key and nil value kept", func(t *testing.T) {
		bin := []byte{0xff, 0x00, 0xfe}
		pm := Record(keylock.Message{ID: 1, Target: "t", Headers: []keylock.Header{{Key: "b", Value: bin}, {Key: "n", Value: nil}}})
		if pm.Key != nil || pm.Value != nil {
			t.Fatalf("nil key/value must stay nil, got %v / %v", pm.Key, pm.Value)
		}
		if !bytes.Equal(pm.Headers[0].Value, bin) || pm.Headers[1].Value != nil {
			t.Fatalf("header values changed: %v", pm.Headers[:2])
		}
		pm = Record(keylock.Message{ID: 1, Target: "t", Key: []byte{}, Value: []byte{}})
		if pm.Key == nil || pm.Value == nil {
			t.Fatal("empty key/value must stay empty, not become nil")
		}
	})
}

func TestClassify(t *testing.T) {
	tests := []struct {
		err  error
		kind errorKind
		code string
	}{
		{sarama.ErrUnknownTopicOrPartition, permanent, "unknown_topic"},
		{sarama.ErrTopicAuthorizationFailed, permanent, "not_authorized"},
		{sarama.ErrMessageSizeTooLarge, permanent, "too_large"},
		{sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 2 > 1"), permanent, "too_large"},
		{sarama.ConfigurationError("something else"), retriable, ""},
		{sarama.ErrInvalidTopic, permanent, "invalid_topic"},
		{fmt.Errorf("wrapped: %w", sarama.ErrMessageSizeTooLarge), permanent, "too_large"},
		{sarama.ErrNotLeaderForPartition, retriable, ""},
		{sarama.ErrOutOfBrokers, retriable, ""},
		{errors.New("connection refused"), retriable, ""},
	}
	for _, tt := range tests {
		kind, reason := classify(tt.err)
		if kind != tt.kind || (tt.code != "" && !strings.Contains(reason, tt.code)) {
			t.Errorf("classify(%v) = %v %q, want %v containing %q", tt.err, kind, reason, tt.kind, tt.code)
		}
	}
}

// Later messages of a key that are due earlier still go out after the
// earlier ones, with the output headers, on the key's partition.
func TestRoundPublishesInKeyOrder(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	var rows []msg
	const keys, perKey = 20, 5
	for k := range keys {
		for i := range perKey {
			// Message i is due earlier than message i-1.
			rows = append(rows, msg{key: str(fmt.Sprintf("order-%d", k)), target: topicA,
				in: -time.Duration(i) * time.Second, recKey: []byte(fmt.Sprintf("order-%d", k)),
				value: []byte(strconv.Itoa(i)), hkeys: []string{"defer.target", "defer.delay", "trace"},
				hvals: [][]byte{[]byte(topicA), []byte("1s"), {0xff, 0x01}}})
		}
	}
	ids := e.insert(rows...)
	d := e.dispatcher("t1", time.Minute, allowAll)
	e.drain(d, 10*time.Second)
	got := col.wait(t, keys*perKey, 5*time.Second)
	mustEqual(t, "rows left", e.count("true"), 0)

	next := map[string]int{}
	partition := map[string]int32{}
	for _, m := range got {
		k := string(m.Key)
		mustEqual(t, "value of "+k, string(m.Value), strconv.Itoa(next[k]))
		next[k]++
		if p, ok := partition[k]; ok && p != m.Partition {
			t.Fatalf("key %s on partitions %d and %d", k, p, m.Partition)
		}
		partition[k] = m.Partition
		if hdr(m, "defer.delay") != "" {
			t.Fatal("defer.delay must not be republished")
		}
		if !bytes.Equal([]byte(hdr(m, "trace")), []byte{0xff, 0x01}) {
			t.Fatalf("binary header changed: %q", hdr(m, "trace"))
		}
		mustEqual(t, "defer.attempt", hdr(m, "defer.attempt"), "1")
		if _, err := time.Parse(time.RFC3339Nano, hdr(m, "defer.scheduled-at")); err != nil {
			t.Fatalf("defer.scheduled-at: %v", err)
		}
	}
	// defer.id is the row id; the partition is the Java client's murmur2 pick.
	first := got[0]
	id, _ := strconv.ParseInt(hdr(first, "defer.id"), 10, 64)
	if !slices.Contains(ids, id) {
		t.Fatalf("defer.id %d is not a row id", id)
	}
	want, _ := sarama.NewMurmur2Partitioner(topicA).Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder(first.Key)}, 4)
	mustEqual(t, "partition of "+string(first.Key), first.Partition, want)
}

// A message the dispatcher parks (the broker refuses it for good, or its
// target may not be published to) holds its key when its park_holds_key
// says so: the rest of the key waits, other keys flow, and deleting the
// parked message lets the key go on. Otherwise the rest of the key goes on at
// once.
func TestDispatcherParksHoldOrReleaseKey(t *testing.T) {
	cases := []struct {
		name    string
		target  string
		value   []byte
		allowed deferral.TargetPatterns
		reason  string // LIKE pattern of the parked row's reason
	}{
		{name: "unknown topic", target: "orders.nosuchtopic", value: []byte("bad"), allowed: allowAll,
			reason: "publish_failed: unknown_topic:%"},
		{name: "target outside TARGET_TOPICS", target: topicB, value: []byte("forbidden"), allowed: deferral.TargetPatterns{"orders.*"},
			reason: "target_not_allowed:%"},
		{name: "invalid target name", target: "orders retry", value: []byte("bad"), allowed: allowAll,
			reason: "invalid_target:%"},
		{name: "too large", target: topicA, value: bytes.Repeat([]byte("x"), 1_100_000), allowed: allowAll,
			reason: "publish_failed: too_large:%"},
	}
	for _, tc := range cases {
		for _, release := range []bool{false, true} {
			name := tc.name + ", holds its key"
			if release {
				name = tc.name + ", releases its key"
			}
			t.Run(name, func(t *testing.T) {
				e := newEnv(t)
				col := e.collect(topicA, topicB)
				ids := e.insert(
					msg{key: str("k"), target: tc.target, recKey: []byte("k"), value: tc.value, release: release},
					msg{key: str("k"), target: topicA, recKey: []byte("k"), value: []byte("after")},
					msg{key: str("o"), target: topicA, recKey: []byte("o"), value: []byte("other")},
				)
				d := e.dispatcher("t1", time.Minute, tc.allowed)
				e.drain(d, 20*time.Second)
				want := []string{"other"}
				if release {
					want = []string{"after", "other"}
				}
				col.wait(t, len(want), 5*time.Second)
				time.Sleep(200 * time.Millisecond) // anything more would show by now
				got := col.snapshot()
				var values []string
				for _, m := range got {
					values = append(values, string(m.Value))
					mustEqual(t, "topic of "+string(m.Value), m.Topic, topicA)
				}
				slices.Sort(values)
				if !slices.Equal(values, want) {
					t.Fatalf("published %q, want %q", values, want)
				}
				mustEqual(t, "parked with the reason", e.count("id = $1 AND state = 'parked' AND reason LIKE $2", ids[0], tc.reason), 1)
				var held bool
				err := e.pool.QueryRow(context.Background(),
					"SELECT held FROM deferred_key WHERE business_key = 'k' AND head_id = $1", ids[0]).Scan(&held)
				if release {
					if !errors.Is(err, pgx.ErrNoRows) {
						t.Fatalf("key k still has a head after its parked message released it: held=%v err=%v", held, err)
					}
					return
				}
				if err != nil || !held {
					t.Fatalf("key k is not held by its parked message: held=%v err=%v", held, err)
				}
				mustEqual(t, "messages waiting behind the held key", e.count("id = $1 AND state = 'pending'", ids[1]), 1)

				// The operator deletes the parked message: the key goes on.
				if _, err := e.pool.Exec(context.Background(), "DELETE FROM deferred_message WHERE id = $1", ids[0]); err != nil {
					t.Fatal(err)
				}
				e.drain(d, 10*time.Second)
				got = col.wait(t, 2, 5*time.Second)
				mustEqual(t, "published after the delete", string(got[1].Value), "after")
			})
		}
	}
}

// Retriable produce errors are retried by the producer and lose nothing.
func TestRetriableProduceErrorsLoseNothing(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	fault := e.broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicA,
		Err: kerr.NotLeaderForPartition, Count: 3})
	defer fault.Remove()
	var rows []msg
	for i := range 50 {
		rows = append(rows, msg{key: str(fmt.Sprintf("k%d", i%5)), target: topicA, recKey: []byte(fmt.Sprintf("k%d", i%5)), value: []byte(strconv.Itoa(i))})
	}
	e.insert(rows...)
	e.drain(e.dispatcher("t1", time.Minute, allowAll), 20*time.Second)
	got := col.wait(t, 50, 5*time.Second)
	if fault.Hits() == 0 {
		t.Fatal("the fault never fired; the test tested nothing")
	}
	seen := map[string]bool{}
	for _, m := range got {
		seen[string(m.Value)] = true
	}
	mustEqual(t, "distinct published", len(seen), 50)
	mustEqual(t, "rows left", e.count("true"), 0)
}

// With the broker refusing every produce, keys back off, stay pending and
// are not lost; when it recovers everything goes out in order.
func TestBrokerDownBacksOffAndResumes(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	fault := e.broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	e.insert(
		msg{key: str("k"), target: topicA, recKey: []byte("k"), value: []byte("1")},
		msg{key: str("k"), target: topicA, recKey: []byte("k"), value: []byte("2")},
	)
	d := e.dispatcher("t1", time.Minute, allowAll)
	st, err := d.Round(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "keys backed off", st.Retry, 1)
	mustEqual(t, "pending", e.count("state = 'pending'"), 2)
	var leasedBy *string
	var blocked bool
	if err := e.pool.QueryRow(context.Background(),
		"SELECT leased_by, leased_until > now() FROM deferred_key WHERE business_key = 'k'").Scan(&leasedBy, &blocked); err != nil {
		t.Fatal(err)
	}
	if leasedBy != nil || !blocked {
		t.Fatalf("after a retriable failure the key must be free of owner but blocked for the back-off; leased_by=%v blocked=%v", leasedBy, blocked)
	}
	fault.Remove()
	e.drain(d, 20*time.Second)
	got := col.wait(t, 2, 5*time.Second)
	mustEqual(t, "first", string(got[0].Value), "1")
	mustEqual(t, "second", string(got[1].Value), "2")
}

// A crash between publish and finalize republishes after the lease
// expires, with the same defer.id.
func TestCrashAfterPublishRepublishesSameID(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	e.insert(msg{key: str("k"), target: topicA, recKey: []byte("k"), value: []byte("v")})

	crashing := e.dispatcher("crashing", 500*time.Millisecond, allowAll)
	crashing.afterPublish = func() error { return errors.New("crash") }
	if _, err := crashing.Round(context.Background()); !errors.Is(err, errCrashed) {
		t.Fatalf("round: %v, want the crash", err)
	}
	first := col.wait(t, 1, 5*time.Second)
	mustEqual(t, "still pending", e.count("state = 'pending'"), 1)

	other := e.dispatcher("other", time.Minute, allowAll)
	st, err := other.Round(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "claimable while the lease holds", st.Keys, 0)
	time.Sleep(600 * time.Millisecond)
	e.drain(other, 5*time.Second)
	got := col.wait(t, 2, 5*time.Second)
	mustEqual(t, "duplicate carries the same defer.id", hdr(got[1], "defer.id"), hdr(first[0], "defer.id"))
	mustEqual(t, "rows left", e.count("true"), 0)
}

// The River runtime runs the loops, publishes, and hands over to successors.
func TestRuntimeDispatchesAndHandsOver(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	waker := NewWaker(e.pool, 5*time.Millisecond, testLogger(t))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go waker.Run(ctx)
	rt, err := NewRuntime(e.pool, e.producer, waker, RuntimeConfig{
		Instance: "test", Loops: 2, Workers: 2, LoopDuration: time.Second, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Minute,
		Dispatch:            Config{BatchKeys: 50, PollInterval: 5 * time.Second, Targets: allowAll},
	}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer rt.Stop(context.Background())

	// The poll interval is 5 s: arriving within a second proves the
	// notification woke a loop.
	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	e.insert(msg{key: str("k"), target: topicA, recKey: []byte("k"), value: []byte("now")})
	col.wait(t, 1, 5*time.Second)
	if took := time.Since(start); took > time.Second {
		t.Fatalf("due message published after %v; the notification did not wake a loop", took)
	}
	// Run across several hand-overs (LoopDuration 1 s).
	e.insert(msg{key: str("k2"), target: topicA, recKey: []byte("k2"), in: 2500 * time.Millisecond, value: []byte("later")})
	col.wait(t, 2, 6*time.Second)

	var completed int
	if err := e.pool.QueryRow(ctx, "SELECT count(*) FROM river_job WHERE kind = $1 AND state = 'completed'",
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
	if err := e.pool.QueryRow(ctx, "SELECT count(DISTINCT args->>'slot') FROM river_job WHERE kind = $1 AND state IN ('available', 'scheduled', 'retryable')",
		LoopArgs{}.Kind()).Scan(&waiting); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "slots waiting for the next start", waiting, 2)
}

// Without notifications, polling alone publishes on time.
func TestPollingAloneIsCorrect(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	d := e.dispatcher("poller", time.Minute, allowAll)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx, time.Now().Add(time.Minute), nil) }()
	e.insert(
		msg{key: str("k"), target: topicA, recKey: []byte("k"), in: 300 * time.Millisecond, value: []byte("1")},
		msg{target: topicA, recKey: []byte("u"), in: 100 * time.Millisecond, value: []byte("unordered")},
	)
	got := col.wait(t, 2, 3*time.Second)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "first out", string(got[0].Value), "unordered")
}

// A loop job left running by a process that died (no heartbeat) is reaped
// at start-up and its slot re-created, instead of blocking the slot until
// River's rescuer gets to it.
func TestRuntimeReapsLoopsOfDeadProcess(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	ctx := context.Background()
	newRuntime := func() *Runtime {
		rt, err := NewRuntime(e.pool, e.producer, nil, RuntimeConfig{
			Instance: "test", Loops: 1, Workers: 1, LoopDuration: time.Minute, Lease: time.Minute, PerKey: 10,
			MaintenanceInterval: time.Hour,
			Dispatch:            Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: allowAll},
		}, testLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		return rt
	}
	// The slot's job, as a process that then died would have left it.
	if _, err := newRuntime().client.Insert(ctx, LoopArgs{Slot: 0}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now(),
		attempted_by = ARRAY['dead-process'] WHERE kind = $1`, LoopArgs{}.Kind()); err != nil {
		t.Fatal(err)
	}
	e.insert(msg{key: str("k"), target: topicA, recKey: []byte("k"), value: []byte("v")})

	rt := newRuntime()
	if err := rt.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer rt.Stop(ctx)
	col.wait(t, 1, 10*time.Second)
	var state string
	if err := e.pool.QueryRow(ctx, "SELECT state FROM river_job WHERE 'dead-process' = ANY (attempted_by)").Scan(&state); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "state of the dead process's loop", state, "discarded")
	var alive bool
	if err := e.pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM scheduler_instance WHERE id = $1)", rt.client.ID()).Scan(&alive); err != nil {
		t.Fatal(err)
	}
	if !alive {
		t.Fatal("a running process must be registered in scheduler_instance")
	}
	if err := rt.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM scheduler_instance WHERE id = $1)", rt.client.ID()).Scan(&alive); err != nil {
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
	e := newEnv(t)
	ctx := context.Background()
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
	kind := LoopArgs{}.Kind()
	var running int64
	eventually(t, 10*time.Second, "the loop running", func() bool {
		return e.pool.QueryRow(ctx, "SELECT id FROM river_job WHERE kind = $1 AND state = 'running'", kind).Scan(&running) == nil
	})
	// The rewound database: the running job unknown, an older run of the
	// slot running on this process since a minute.
	if _, err := e.pool.Exec(ctx, "DELETE FROM river_job WHERE id = $1", running); err != nil {
		t.Fatal(err)
	}
	old, err := rt.client.Insert(ctx, LoopArgs{Slot: 0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1,
		attempted_at = now() - interval '1 minute', attempted_by = ARRAY[$2::text] WHERE id = $1`,
		old.Job.ID, rt.client.ID()); err != nil {
		t.Fatal(err)
	}
	var state string
	eventually(t, 10*time.Second, "the stale run reaped", func() bool {
		return e.pool.QueryRow(ctx, "SELECT state FROM river_job WHERE id = $1", old.Job.ID).Scan(&state) == nil &&
			state == "discarded"
	})
	var waiting int
	eventually(t, 10*time.Second, "the slot re-created", func() bool {
		return e.pool.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE kind = $1 AND id <> $2
			AND state IN ('available', 'running')`, kind, old.Job.ID).Scan(&waiting) == nil && waiting == 1
	})
	if ids := rt.runningLoops(); len(ids) != 1 || ids[0] != running {
		t.Errorf("running loops %v, want the one that was running, %d", ids, running)
	}
}

// A due head that someone holds locked (an operator's open transaction) can
// be neither claimed nor slept past; the loop must still not spin.
func TestLockedDueHeadDoesNotSpin(t *testing.T) {
	e := newEnv(t)
	e.insert(msg{key: str("k"), target: topicA, recKey: []byte("k"), value: []byte("v")})
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "UPDATE deferred_message SET error_message = 'looking' WHERE business_key = 'k'"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT FROM deferred_key WHERE business_key = 'k' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	d := e.dispatcher("t1", time.Minute, allowAll)
	if err := d.Run(ctx, time.Now().Add(time.Second), nil); err != nil {
		t.Fatal(err)
	}
	// At most one round per minIdle, and then some slack.
	if limit := int(time.Second/minIdle) + 10; d.rounds > limit {
		t.Fatalf("%d rounds in 1s with the due head locked; want at most %d (the loop spins)", d.rounds, limit)
	}
	if d.rounds < 2 {
		t.Fatalf("%d rounds in 1s; the loop must keep looking", d.rounds)
	}
}

// A target that keeps failing retriably backs off by itself: keys of other
// targets flow at full speed meanwhile.
func TestFailingTargetDoesNotSlowOthers(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	fault := e.broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicB, Err: kerr.NotEnoughReplicas, Count: -1})
	defer fault.Remove()
	e.insert(msg{key: str("stuck"), target: topicB, recKey: []byte("stuck"), value: []byte("x")})
	d := e.dispatcher("t1", time.Minute, allowAll)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx, time.Now().Add(time.Minute), nil) }()

	// Feed the healthy target in waves while the stuck key keeps failing.
	for wave := range 10 {
		var rows []msg
		for i := range 20 {
			k := fmt.Sprintf("w%d-%d", wave, i)
			rows = append(rows, msg{key: str(k), target: topicA, recKey: []byte(k), value: []byte(k)})
		}
		e.insert(rows...)
		time.Sleep(100 * time.Millisecond)
	}
	col.wait(t, 200, 3*time.Second)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if fault.Hits() < 2 {
		t.Fatalf("the stuck key was tried %d times; it must keep being retried", fault.Hits())
	}
	var failures int
	if err := e.pool.QueryRow(context.Background(), "SELECT failures FROM deferred_key WHERE business_key = 'stuck'").Scan(&failures); err != nil {
		t.Fatal(err)
	}
	if failures < 2 {
		t.Fatalf("the stuck key's failure count is %d; its back-off must grow", failures)
	}
}

// Lowering DISPATCH_LOOPS retires the slots above it.
func TestLoweredLoopsRetire(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	rt, err := NewRuntime(e.pool, e.producer, nil, RuntimeConfig{
		Instance: "test", Loops: 1, Workers: 3, LoopDuration: 300 * time.Millisecond, Lease: time.Minute, PerKey: 10,
		MaintenanceInterval: time.Hour,
		Dispatch:            Config{BatchKeys: 50, PollInterval: 50 * time.Millisecond, Targets: allowAll},
	}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	// Slots 1 and 2 were created by an earlier configuration.
	for _, slot := range []int{1, 2} {
		if _, err := rt.client.Insert(ctx, LoopArgs{Slot: slot}, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := rt.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer rt.Stop(ctx)
	deadline := time.Now().Add(10 * time.Second)
	for {
		var live []int
		rows, err := e.pool.Query(ctx, `SELECT DISTINCT (args->>'slot')::int FROM river_job
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

// A paused target's messages wait, in order, while other targets flow; the
// loop does not spin on them; resuming sends them within a poll interval.
func TestPausedTargetWaitsOthersFlow(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA, topicB)
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, "INSERT INTO target_control (target_topic, paused) VALUES ($1, true)", topicB); err != nil {
		t.Fatal(err)
	}
	e.insert(
		msg{key: str("p"), target: topicB, recKey: []byte("p"), value: []byte("p1")},
		msg{key: str("p"), target: topicB, recKey: []byte("p"), value: []byte("p2")},
		msg{key: str("a"), target: topicA, recKey: []byte("a"), value: []byte("a1")},
	)
	d := e.dispatcher("t1", time.Minute, allowAll)
	d.cfg.PollInterval = 500 * time.Millisecond
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx, time.Now().Add(time.Minute), nil) }()

	col.wait(t, 1, 5*time.Second)
	time.Sleep(time.Second)
	if got := col.snapshot(); len(got) != 1 || string(got[0].Value) != "a1" {
		t.Fatalf("published %s while %s is paused; want only a1", fmtIDs(got), topicB)
	}
	mustEqual(t, "paused target's messages pending", e.count("target_topic = $1 AND state = 'pending'", topicB), 2)

	resumed := time.Now()
	if _, err := e.pool.Exec(ctx, "UPDATE target_control SET paused = false WHERE target_topic = $1", topicB); err != nil {
		t.Fatal(err)
	}
	got := col.wait(t, 3, 3*time.Second)
	if took := time.Since(resumed); took > time.Second {
		t.Fatalf("resumed target published after %v, want within a second", took)
	}
	mustEqual(t, "first after resume", string(got[1].Value), "p1")
	mustEqual(t, "second after resume", string(got[2].Value), "p2")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// While paused the loop slept between polls instead of spinning on the
	// paused heads (NextDue skips them): a handful of rounds, not thousands.
	if d.rounds > 40 {
		t.Fatalf("%d rounds in ~2s; the loop spins on a paused target", d.rounds)
	}
}

// A key's run that spans several produce requests, one of which fails until
// its retries run out: nothing of the key after it goes out before it, so
// first deliveries keep the key's order (chaos finding 3, where sarama's
// producer gave up on message n and then delivered n+1).
func TestFailedBatchMidRunKeepsKeyOrder(t *testing.T) {
	e := newEnv(t)
	col := e.collect(topicA)
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	c = ProducerConfig(c)
	c.Producer.MaxMessageBytes = 700 // a few messages per record batch
	c.Producer.Retry.Backoff = 10 * time.Millisecond
	p, err := batchproducer.New([]string{e.addr}, c)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	// Requests 2 to 4 fail: the second batch of the first round uses up its
	// three tries; a producer that went on would deliver the third.
	var requests atomic.Int64
	fault := e.broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicA, Err: kerr.NotLeaderForPartition, Count: -1,
		When: func(kmsg.Request) bool { n := requests.Add(1); return n >= 2 && n <= 4 }})
	defer fault.Remove()

	const n = 60
	var rows []msg
	for i := range n {
		rows = append(rows, msg{key: str("order-1"), target: topicA, recKey: []byte("order-1"), value: []byte(strconv.Itoa(i))})
	}
	e.insert(rows...)
	l, err := keylock.New(e.pool, keylock.Config{Owner: "t1", Lease: time.Minute, PerKey: 100})
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(l, p, nil, Config{BatchKeys: 100, PollInterval: 50 * time.Millisecond,
		MaxBackoff: 200 * time.Millisecond, Targets: allowAll, MaxMessageBytes: 700}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	e.drain(d, 20*time.Second)
	got := col.wait(t, n, 5*time.Second)
	if requests.Load() < 5 {
		t.Fatalf("%d produce requests; the fault did not play out", requests.Load())
	}
	next := 0
	for _, m := range got {
		v, _ := strconv.Atoi(string(m.Value))
		switch {
		case v == next:
			next++
		case v > next:
			t.Fatalf("message %d delivered before message %d", v, next)
		}
		// v < next: a copy of a delivered message, allowed.
	}
	mustEqual(t, "messages delivered", next, n)
	mustEqual(t, "rows left", e.count("true"), 0)
}

// RoundMessages bounds every round, and a round still takes whole runs of a
// hot key once it has seen one: many keys with short runs, then few keys with
// long runs, and back.
func TestRoundMessagesBoundsRounds(t *testing.T) {
	for _, tc := range []struct {
		name      string
		keys      int // keys with due messages
		perKey    int // due messages per key
		wantFirst int // messages of the first round
		wantLater int // messages of the second round
		limit     int // RoundMessages; 0: 20
	}{
		// BatchKeys 10 × limit 10 > 20: first round 10 keys × 2; the keys
		// had more, so then 2 keys × 10.
		{"one hot key", 1, 50, 2, 10, 0},
		{"many hot keys", 12, 30, 20, 20, 0},
		// Keys with one message each: 10 keys × 1 per round.
		{"own keys", 40, 1, 10, 10, 0},
		// A cap below BatchKeys and below the per-key limit still holds:
		// 2 keys × 2 (two, so that a run shows), then 1 key × 5.
		{"cap below both limits, own keys", 40, 1, 2, 2, 5},
		{"cap below both limits, one hot key", 1, 30, 2, 5, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			col := e.collect(topicA)
			var rows []msg
			for k := range tc.keys {
				for i := range tc.perKey {
					key := fmt.Sprintf("k%d", k)
					rows = append(rows, msg{key: str(key), target: topicA, recKey: []byte(key), value: []byte(fmt.Sprintf("%s|%d", key, i))})
				}
			}
			e.insert(rows...)
			l, err := keylock.New(e.pool, keylock.Config{Owner: "t1", Lease: time.Minute, PerKey: 10})
			if err != nil {
				t.Fatal(err)
			}
			limit := cmp.Or(tc.limit, 20)
			d, err := New(l, e.producer, nil, Config{BatchKeys: 10, RoundMessages: limit, PollInterval: 50 * time.Millisecond,
				MaxBackoff: 200 * time.Millisecond, Targets: allowAll}, testLogger(t))
			if err != nil {
				t.Fatal(err)
			}
			total := tc.keys * tc.perKey
			var sent []int
			for n := 0; n < total; {
				st, err := d.Round(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				if st.Published == 0 || st.Published > limit {
					t.Fatalf("round %d published %d, want 1..%d", len(sent)+1, st.Published, limit)
				}
				sent = append(sent, st.Published)
				n += st.Published
			}
			if sent[0] != tc.wantFirst || len(sent) > 1 && sent[1] != tc.wantLater {
				t.Errorf("rounds published %v, want %d then %d", sent, tc.wantFirst, tc.wantLater)
			}
			got := col.wait(t, total, 5*time.Second)
			next := map[string]int{}
			for _, m := range got {
				key, i, _ := strings.Cut(string(m.Value), "|")
				mustEqual(t, "message of "+key, i, strconv.Itoa(next[key]))
				next[key]++
			}
			mustEqual(t, "rows left", e.count("true"), 0)
		})
	}
}
