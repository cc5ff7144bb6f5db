package dispatch_test

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
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/deferq/scheduler/internal/defer/protocol"
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
			pm := dispatch.Record(keylock.Message{ID: 42, Seq: 7, Attempt: 2, Target: "orders.retry", NextRunAt: due, Headers: tt.in,
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
		pm := dispatch.Record(keylock.Message{ID: 1, Target: "t", Headers: []keylock.Header{{Key: "b", Value: bin}, {Key: "n", Value: nil}}})
		if pm.Key != nil || pm.Value != nil {
			t.Fatalf("nil key/value must stay nil, got %v / %v", pm.Key, pm.Value)
		}
		if !bytes.Equal(pm.Headers[0].Value, bin) || pm.Headers[1].Value != nil {
			t.Fatalf("header values changed: %v", pm.Headers[:2])
		}
		pm = dispatch.Record(keylock.Message{ID: 1, Target: "t", Key: []byte{}, Value: []byte{}})
		if pm.Key == nil || pm.Value == nil {
			t.Fatal("empty key/value must stay empty, not become nil")
		}
	})
}

func TestClassify(t *testing.T) {
	tests := []struct {
		err  error
		kind dispatch.ErrorKind
		code string
	}{
		{sarama.ErrUnknownTopicOrPartition, dispatch.Permanent, "unknown_topic"},
		{sarama.ErrTopicAuthorizationFailed, dispatch.Permanent, "not_authorized"},
		{sarama.ErrMessageSizeTooLarge, dispatch.Permanent, "too_large"},
		{sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 2 > 1"), dispatch.Permanent, "too_large"},
		{sarama.ConfigurationError("something else"), dispatch.Retriable, ""},
		{sarama.ErrInvalidTopic, dispatch.Permanent, "invalid_topic"},
		{fmt.Errorf("wrapped: %w", sarama.ErrMessageSizeTooLarge), dispatch.Permanent, "too_large"},
		{sarama.ErrNotLeaderForPartition, dispatch.Retriable, ""},
		{sarama.ErrOutOfBrokers, dispatch.Retriable, ""},
		{errors.New("connection refused"), dispatch.Retriable, ""},
	}
	for _, tt := range tests {
		kind, reason := dispatch.Classify(tt.err)
		if kind != tt.kind || (tt.code != "" && !strings.Contains(reason, tt.code)) {
			t.Errorf("dispatch.Classify(%v) = %v %q, want %v containing %q", tt.err, kind, reason, tt.kind, tt.code)
		}
	}
}

// Later messages of a key that are due earlier still go out after the
// earlier ones, with the output headers, on the key's partition.
func TestRoundPublishesInKeyOrder(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	var rows []fixture.Message
	const keys, perKey = 20, 5
	for k := range keys {
		for i := range perKey {
			// Message i is due earlier than message i-1.
			rows = append(rows, fixture.Message{Key: fixture.Key(fmt.Sprintf("order-%d", k)), Target: dispatchtest.TopicA,
				In: -time.Duration(i) * time.Second, RecordKey: []byte(fmt.Sprintf("order-%d", k)),
				Value: []byte(strconv.Itoa(i)), HeaderKeys: []string{"defer.target", "defer.delay", "trace"},
				HeaderValues: [][]byte{[]byte(dispatchtest.TopicA), []byte("1s"), {0xff, 0x01}}})
		}
	}
	ids := e.Insert(rows...)
	d := e.Dispatcher("t1", time.Minute, dispatchtest.AllowAll)
	e.Drain(d, 10*time.Second)
	got := col.Wait(t, keys*perKey, 5*time.Second)
	dispatchtest.MustEqual(t, "rows left", e.Count("true"), 0)

	next := map[string]int{}
	partition := map[string]int32{}
	for _, m := range got {
		k := string(m.Key)
		dispatchtest.MustEqual(t, "value of "+k, string(m.Value), strconv.Itoa(next[k]))
		next[k]++
		if p, ok := partition[k]; ok && p != m.Partition {
			t.Fatalf("key %s on partitions %d and %d", k, p, m.Partition)
		}
		partition[k] = m.Partition
		if kafkatest.Header(m, "defer.delay") != "" {
			t.Fatal("defer.delay must not be republished")
		}
		if !bytes.Equal([]byte(kafkatest.Header(m, "trace")), []byte{0xff, 0x01}) {
			t.Fatalf("binary header changed: %q", kafkatest.Header(m, "trace"))
		}
		dispatchtest.MustEqual(t, "defer.attempt", kafkatest.Header(m, "defer.attempt"), "1")
		if _, err := time.Parse(time.RFC3339Nano, kafkatest.Header(m, "defer.scheduled-at")); err != nil {
			t.Fatalf("defer.scheduled-at: %v", err)
		}
	}
	// defer.id is the row id; the partition is the Java client's murmur2 pick.
	first := got[0]
	id, _ := strconv.ParseInt(kafkatest.Header(first, "defer.id"), 10, 64)
	if !slices.Contains(ids, id) {
		t.Fatalf("defer.id %d is not a row id", id)
	}
	want, _ := sarama.NewMurmur2Partitioner(dispatchtest.TopicA).Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder(first.Key)}, 4)
	dispatchtest.MustEqual(t, "partition of "+string(first.Key), first.Partition, want)
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
		allowed protocol.TargetPatterns
		reason  string // LIKE pattern of the parked row's reason
	}{
		{name: "unknown topic", target: "orders.nosuchtopic", value: []byte("bad"), allowed: dispatchtest.AllowAll,
			reason: "unknown_topic:%"},
		{name: "target outside TARGET_TOPICS", target: dispatchtest.TopicB, value: []byte("forbidden"), allowed: protocol.TargetPatterns{"orders.*"},
			reason: "target_not_allowed:%"},
		{name: "invalid target name", target: "orders retry", value: []byte("bad"), allowed: dispatchtest.AllowAll,
			reason: "invalid_target:%"},
		{name: "too large", target: dispatchtest.TopicA, value: bytes.Repeat([]byte("x"), 1_100_000), allowed: dispatchtest.AllowAll,
			reason: "too_large:%"},
	}
	for _, tc := range cases {
		for _, release := range []bool{false, true} {
			name := tc.name + ", holds its key"
			if release {
				name = tc.name + ", releases its key"
			}
			t.Run(name, func(t *testing.T) {
				e := dispatchtest.New(t)
				col := e.Collect(dispatchtest.TopicA, dispatchtest.TopicB)
				ids := e.Insert(
					fixture.Message{Key: fixture.Key("k"), Target: tc.target, RecordKey: []byte("k"), Value: tc.value, Release: release},
					fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), Value: []byte("after")},
					fixture.Message{Key: fixture.Key("o"), Target: dispatchtest.TopicA, RecordKey: []byte("o"), Value: []byte("other")},
				)
				d := e.Dispatcher("t1", time.Minute, tc.allowed)
				e.Drain(d, 20*time.Second)
				want := []string{"other"}
				if release {
					want = []string{"after", "other"}
				}
				col.Wait(t, len(want), 5*time.Second)
				time.Sleep(200 * time.Millisecond) // anything more would show by now
				got := col.Snapshot()
				var values []string
				for _, m := range got {
					values = append(values, string(m.Value))
					dispatchtest.MustEqual(t, "topic of "+string(m.Value), m.Topic, dispatchtest.TopicA)
				}
				slices.Sort(values)
				if !slices.Equal(values, want) {
					t.Fatalf("published %q, want %q", values, want)
				}
				dispatchtest.MustEqual(t, "parked with the reason", e.Count("id = $1 AND state = 'parked' AND reason LIKE $2", ids[0], tc.reason), 1)
				var held bool
				err := e.Pool.QueryRow(context.Background(),
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
				dispatchtest.MustEqual(t, "messages waiting behind the held key", e.Count("id = $1 AND state = 'pending'", ids[1]), 1)

				// The operator deletes the parked message: the key goes on.
				if _, err := e.Pool.Exec(context.Background(), "DELETE FROM deferred_message WHERE id = $1", ids[0]); err != nil {
					t.Fatal(err)
				}
				e.Drain(d, 10*time.Second)
				got = col.Wait(t, 2, 5*time.Second)
				dispatchtest.MustEqual(t, "published after the delete", string(got[1].Value), "after")
			})
		}
	}
}

// Retriable produce errors are retried by the producer and lose nothing.
func TestRetriableProduceErrorsLoseNothing(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	fault := e.Broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: dispatchtest.TopicA,
		Err: kerr.NotLeaderForPartition, Count: 3})
	defer fault.Remove()
	var rows []fixture.Message
	for i := range 50 {
		rows = append(rows, fixture.Message{Key: fixture.Key(fmt.Sprintf("k%d", i%5)), Target: dispatchtest.TopicA, RecordKey: []byte(fmt.Sprintf("k%d", i%5)), Value: []byte(strconv.Itoa(i))})
	}
	e.Insert(rows...)
	e.Drain(e.Dispatcher("t1", time.Minute, dispatchtest.AllowAll), 20*time.Second)
	got := col.Wait(t, 50, 5*time.Second)
	if fault.Hits() == 0 {
		t.Fatal("the fault never fired; the test tested nothing")
	}
	seen := map[string]bool{}
	for _, m := range got {
		seen[string(m.Value)] = true
	}
	dispatchtest.MustEqual(t, "distinct published", len(seen), 50)
	dispatchtest.MustEqual(t, "rows left", e.Count("true"), 0)
}

// With the broker refusing every produce, keys back off, stay pending and
// are not lost; when it recovers everything goes out in order.
func TestBrokerDownBacksOffAndResumes(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	fault := e.Broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	e.Insert(
		fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), Value: []byte("1")},
		fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), Value: []byte("2")},
	)
	d := e.Dispatcher("t1", time.Minute, dispatchtest.AllowAll)
	st, err := d.Round(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	dispatchtest.MustEqual(t, "keys backed off", st.Retry, 1)
	dispatchtest.MustEqual(t, "pending", e.Count("state = 'pending'"), 2)
	var leasedBy *string
	var blocked bool
	if err := e.Pool.QueryRow(context.Background(),
		"SELECT leased_by, leased_until > now() FROM deferred_key WHERE business_key = 'k'").Scan(&leasedBy, &blocked); err != nil {
		t.Fatal(err)
	}
	if leasedBy != nil || !blocked {
		t.Fatalf("after a retriable failure the key must be free of owner but blocked for the back-off; leased_by=%v blocked=%v", leasedBy, blocked)
	}
	fault.Remove()
	e.Drain(d, 20*time.Second)
	got := col.Wait(t, 2, 5*time.Second)
	dispatchtest.MustEqual(t, "first", string(got[0].Value), "1")
	dispatchtest.MustEqual(t, "second", string(got[1].Value), "2")
}

// A crash between publish and finalize republishes after the lease
// expires, with the same defer.id.
func TestCrashAfterPublishRepublishesSameID(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	e.Insert(fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), Value: []byte("v")})

	crashing := e.Dispatcher("crashing", 500*time.Millisecond, dispatchtest.AllowAll)
	crashing.CrashAfterPublish(errors.New("crash"))
	if _, err := crashing.Round(context.Background()); !errors.Is(err, dispatch.ErrCrashed) {
		t.Fatalf("round: %v, want the crash", err)
	}
	first := col.Wait(t, 1, 5*time.Second)
	dispatchtest.MustEqual(t, "still pending", e.Count("state = 'pending'"), 1)

	other := e.Dispatcher("other", time.Minute, dispatchtest.AllowAll)
	st, err := other.Round(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	dispatchtest.MustEqual(t, "claimable while the lease holds", st.Keys, 0)
	time.Sleep(600 * time.Millisecond)
	e.Drain(other, 5*time.Second)
	got := col.Wait(t, 2, 5*time.Second)
	dispatchtest.MustEqual(t, "duplicate carries the same defer.id", kafkatest.Header(got[1], "defer.id"), kafkatest.Header(first[0], "defer.id"))
	dispatchtest.MustEqual(t, "rows left", e.Count("true"), 0)
}

// Without notifications, polling alone publishes on time: the loop wakes
// for the earlier due time, not only for the later one. The two due times
// are far apart so that a loaded machine cannot claim both in one round,
// where the two keys' records (two partitions) would arrive in either order.
func TestPollingAloneIsCorrect(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	d := e.Dispatcher("poller", time.Minute, dispatchtest.AllowAll)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx, time.Now().Add(time.Minute), nil) }()
	e.Insert(
		fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), In: 1500 * time.Millisecond, Value: []byte("1")},
		fixture.Message{Target: dispatchtest.TopicA, RecordKey: []byte("u"), In: 100 * time.Millisecond, Value: []byte("unordered")},
	)
	got := col.Wait(t, 2, 10*time.Second)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	dispatchtest.MustEqual(t, "first out", string(got[0].Value), "unordered")
}

// A due head that someone holds locked (an operator's open transaction) can
// be neither claimed nor slept past; the loop must still not spin.
func TestLockedDueHeadDoesNotSpin(t *testing.T) {
	e := dispatchtest.New(t)
	e.Insert(fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), Value: []byte("v")})
	ctx := context.Background()
	tx, err := e.Pool.Begin(ctx)
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
	d := e.Dispatcher("t1", time.Minute, dispatchtest.AllowAll)
	if err := d.Run(ctx, time.Now().Add(time.Second), nil); err != nil {
		t.Fatal(err)
	}
	// At most one round per dispatch.MinIdle, and then some slack.
	if limit := int(time.Second/dispatch.MinIdle) + 10; d.Rounds() > limit {
		t.Fatalf("%d rounds in 1s with the due head locked; want at most %d (the loop spins)", d.Rounds(), limit)
	}
	if d.Rounds() < 2 {
		t.Fatalf("%d rounds in 1s; the loop must keep looking", d.Rounds())
	}
}

// A target that keeps failing retriably backs off by itself: keys of other
// targets flow at full speed meanwhile.
func TestFailingTargetDoesNotSlowOthers(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	fault := e.Broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: dispatchtest.TopicB, Err: kerr.NotEnoughReplicas, Count: -1})
	defer fault.Remove()
	e.Insert(fixture.Message{Key: fixture.Key("stuck"), Target: dispatchtest.TopicB, RecordKey: []byte("stuck"), Value: []byte("x")})
	d := e.Dispatcher("t1", time.Minute, dispatchtest.AllowAll)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx, time.Now().Add(time.Minute), nil) }()

	// Feed the healthy target in waves while the stuck key keeps failing.
	for wave := range 10 {
		var rows []fixture.Message
		for i := range 20 {
			k := fmt.Sprintf("w%d-%d", wave, i)
			rows = append(rows, fixture.Message{Key: fixture.Key(k), Target: dispatchtest.TopicA, RecordKey: []byte(k), Value: []byte(k)})
		}
		e.Insert(rows...)
		time.Sleep(100 * time.Millisecond)
	}
	col.Wait(t, 200, 3*time.Second)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if fault.Hits() < 2 {
		t.Fatalf("the stuck key was tried %d times; it must keep being retried", fault.Hits())
	}
	var failures int
	if err := e.Pool.QueryRow(context.Background(), "SELECT failures FROM deferred_key WHERE business_key = 'stuck'").Scan(&failures); err != nil {
		t.Fatal(err)
	}
	if failures < 2 {
		t.Fatalf("the stuck key's failure count is %d; its back-off must grow", failures)
	}
}

// A paused target's messages wait, in order, while other targets flow; the
// loop does not spin on them; resuming sends them within a poll interval.
func TestPausedTargetWaitsOthersFlow(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA, dispatchtest.TopicB)
	ctx := context.Background()
	if _, err := e.Pool.Exec(ctx, "INSERT INTO target_control (target_topic, paused) VALUES ($1, true)", dispatchtest.TopicB); err != nil {
		t.Fatal(err)
	}
	e.Insert(
		fixture.Message{Key: fixture.Key("p"), Target: dispatchtest.TopicB, RecordKey: []byte("p"), Value: []byte("p1")},
		fixture.Message{Key: fixture.Key("p"), Target: dispatchtest.TopicB, RecordKey: []byte("p"), Value: []byte("p2")},
		fixture.Message{Key: fixture.Key("a"), Target: dispatchtest.TopicA, RecordKey: []byte("a"), Value: []byte("a1")},
	)
	d := e.Dispatcher("t1", time.Minute, dispatchtest.AllowAll)
	d.SetPollInterval(500 * time.Millisecond)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx, time.Now().Add(time.Minute), nil) }()

	col.Wait(t, 1, 5*time.Second)
	time.Sleep(time.Second)
	if got := col.Snapshot(); len(got) != 1 || string(got[0].Value) != "a1" {
		t.Fatalf("published %s while %s is paused; want only a1", fmtIDs(got), dispatchtest.TopicB)
	}
	dispatchtest.MustEqual(t, "paused target's messages pending", e.Count("target_topic = $1 AND state = 'pending'", dispatchtest.TopicB), 2)

	resumed := time.Now()
	if _, err := e.Pool.Exec(ctx, "UPDATE target_control SET paused = false WHERE target_topic = $1", dispatchtest.TopicB); err != nil {
		t.Fatal(err)
	}
	got := col.Wait(t, 3, 3*time.Second)
	if took := time.Since(resumed); took > time.Second {
		t.Fatalf("resumed target published after %v, want within a second", took)
	}
	dispatchtest.MustEqual(t, "first after resume", string(got[1].Value), "p1")
	dispatchtest.MustEqual(t, "second after resume", string(got[2].Value), "p2")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// While paused the loop slept between polls instead of spinning on the
	// paused heads (NextDue skips them): a handful of rounds, not thousands.
	if d.Rounds() > 40 {
		t.Fatalf("%d rounds in ~2s; the loop spins on a paused target", d.Rounds())
	}
}

// A key's run that spans several produce requests, one of which fails until
// its retries run out: nothing of the key after it goes out before it, so
// first deliveries keep the key's order (chaos finding 3, where sarama's
// producer gave up on message n and then delivered n+1).
func TestFailedBatchMidRunKeepsKeyOrder(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	c = batchproducer.Config(c)
	c.Producer.MaxMessageBytes = 700 // a few messages per record batch
	c.Producer.Retry.Backoff = 10 * time.Millisecond
	p, err := batchproducer.New([]string{e.Addr}, c)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	// Requests 2 to 4 fail: the second batch of the first round uses up its
	// three tries; a producer that went on would deliver the third.
	var requests atomic.Int64
	fault := e.Broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: dispatchtest.TopicA, Err: kerr.NotLeaderForPartition, Count: -1,
		When: func(kmsg.Request) bool { n := requests.Add(1); return n >= 2 && n <= 4 }})
	defer fault.Remove()

	const n = 60
	var rows []fixture.Message
	for i := range n {
		rows = append(rows, fixture.Message{Key: fixture.Key("order-1"), Target: dispatchtest.TopicA, RecordKey: []byte("order-1"), Value: []byte(strconv.Itoa(i))})
	}
	e.Insert(rows...)
	l, err := keylock.New(e.Pool, keylock.Config{Owner: "t1", Lease: time.Minute, PerKey: 100})
	if err != nil {
		t.Fatal(err)
	}
	d, err := dispatch.New(l, p, nil, dispatch.Config{BatchKeys: 100, PollInterval: 50 * time.Millisecond,
		MaxBackoff: 200 * time.Millisecond, Targets: dispatchtest.AllowAll, MaxMessageBytes: 700}, dispatchtest.Logger())
	if err != nil {
		t.Fatal(err)
	}
	e.Drain(d, 20*time.Second)
	got := col.Wait(t, n, 5*time.Second)
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
	dispatchtest.MustEqual(t, "messages delivered", next, n)
	dispatchtest.MustEqual(t, "rows left", e.Count("true"), 0)
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
			e := dispatchtest.New(t)
			col := e.Collect(dispatchtest.TopicA)
			var rows []fixture.Message
			for k := range tc.keys {
				for i := range tc.perKey {
					key := fmt.Sprintf("k%d", k)
					rows = append(rows, fixture.Message{Key: fixture.Key(key), Target: dispatchtest.TopicA, RecordKey: []byte(key), Value: []byte(fmt.Sprintf("%s|%d", key, i))})
				}
			}
			e.Insert(rows...)
			l, err := keylock.New(e.Pool, keylock.Config{Owner: "t1", Lease: time.Minute, PerKey: 10})
			if err != nil {
				t.Fatal(err)
			}
			limit := cmp.Or(tc.limit, 20)
			d, err := dispatch.New(l, e.Producer, nil, dispatch.Config{BatchKeys: 10, RoundMessages: limit, PollInterval: 50 * time.Millisecond,
				MaxBackoff: 200 * time.Millisecond, Targets: dispatchtest.AllowAll}, dispatchtest.Logger())
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
			got := col.Wait(t, total, 5*time.Second)
			next := map[string]int{}
			for _, m := range got {
				key, i, _ := strings.Cut(string(m.Value), "|")
				dispatchtest.MustEqual(t, "message of "+key, i, strconv.Itoa(next[key]))
				next[key]++
			}
			dispatchtest.MustEqual(t, "rows left", e.Count("true"), 0)
		})
	}
}

// A round whose claim could not give back the keys the byte budget cut
// (here a trigger the test adds refuses it) still publishes and finalizes
// what the claim leased, and reports the error; before, the claim's keys
// were dropped and their messages waited out the lease.
func TestRoundPublishesWhatItClaimedWhenGivingBackFails(t *testing.T) {
	e := dispatchtest.New(t)
	col := e.Collect(dispatchtest.TopicA)
	value := bytes.Repeat([]byte{'v'}, 100)
	var rows []fixture.Message
	for _, k := range []string{"a", "a", "b", "c"} {
		rows = append(rows, fixture.Message{Key: fixture.Key(k), Target: dispatchtest.TopicA, RecordKey: []byte(k), Value: value})
	}
	e.Insert(rows...)
	for _, q := range []string{
		`CREATE FUNCTION refuse_release() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN RAISE EXCEPTION 'injected: release of key % refused', OLD.business_key; END $$`,
		`CREATE TRIGGER refuse_release BEFORE UPDATE ON deferred_key FOR EACH ROW
			WHEN (OLD.business_key = 'b' AND OLD.leased_by IS NOT NULL AND NEW.leased_by IS NULL)
			EXECUTE FUNCTION refuse_release()`,
	} {
		if _, err := e.Pool.Exec(t.Context(), q); err != nil {
			t.Fatal(err)
		}
	}
	// 101 bytes a message: within 150, a's two, and b and c are cut.
	l, err := keylock.New(e.Pool, keylock.Config{Owner: "t1", Lease: time.Minute, PerKey: 10, MaxBytes: 150})
	if err != nil {
		t.Fatal(err)
	}
	d, err := dispatch.New(l, e.Producer, nil, dispatch.Config{BatchKeys: 10, PollInterval: 50 * time.Millisecond,
		MaxBackoff: 200 * time.Millisecond, Targets: dispatchtest.AllowAll}, dispatchtest.Logger())
	if err != nil {
		t.Fatal(err)
	}
	st, err := d.Round(t.Context())
	if err == nil || !strings.Contains(err.Error(), "injected: release of key b refused") {
		t.Errorf("round error = %v, want the refused release", err)
	}
	if st.Published != 2 {
		t.Errorf("round published %d, want a's 2", st.Published)
	}
	got := col.Wait(t, 2, 5*time.Second)
	for _, m := range got {
		dispatchtest.MustEqual(t, "record key", string(m.Key), "a")
	}
	dispatchtest.MustEqual(t, "messages of a left", e.Count("business_key = 'a'"), 0)
	var keyRows int
	if err := e.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_key WHERE business_key = 'a'`).Scan(&keyRows); err != nil {
		t.Fatal(err)
	}
	dispatchtest.MustEqual(t, "key rows of a, released once empty", keyRows, 0)
}

// fmtIDs lists messages as key:defer.id, for failure messages.
func fmtIDs(ms []*sarama.ConsumerMessage) string {
	s := ""
	for _, m := range ms {
		s += fmt.Sprintf("%s:%s ", m.Key, kafkatest.Header(m, "defer.id"))
	}
	return s
}
