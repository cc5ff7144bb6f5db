package deadletter

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/deferq/scheduler/internal/metrics"
)

const dlqTopic = "orders.dlq"

// newDLQEnv is newEnv with a dead-letter topic.
func newDLQEnv(t *testing.T) *dispatchtest.Env {
	return dispatchtest.New(t, kfake.SeedTopics(2, dlqTopic))
}

type hv struct{ k, v string }

func headerList(m *sarama.ConsumerMessage) []hv {
	var out []hv
	for _, h := range m.Headers {
		out = append(out, hv{string(h.Key), string(h.Value)})
	}
	return out
}

func deadLetters(e *dispatchtest.Env, m *metrics.Metrics) *Publisher {
	return NewPublisher(e.Pool, e.Producer, m, time.Minute, dispatchtest.Logger())
}

func publishDLQ(e *dispatchtest.Env, dl *Publisher) dlqResult {
	e.T.Helper()
	res, err := dl.publishOnce(context.Background())
	if err != nil {
		e.T.Fatalf("publish dead-letter copies: %v", err)
	}
	return res
}

// A message parked at ingest (an exhausted retry policy) gets one copy on its
// dead-letter topic: same key and value, its headers in order with the
// control headers made current and the failure context added.
func TestDeadLetterCopyOfIngestPark(t *testing.T) {
	e := newDLQEnv(t)
	col := e.Collect(dlqTopic)
	ctx := context.Background()
	var id int64
	var parkedAt time.Time
	err := e.Pool.QueryRow(ctx, `INSERT INTO deferred_message
		(business_key, seq, target_topic, next_run_at, attempt, state, reason, error_class, error_message, dlq_topic,
		 source_topic, source_partition, source_offset, redrive_count, key, value, header_keys, header_values)
		VALUES ('order-1', 77, 'orders.retry', now(), 5, 'parked', 'exhausted: 5 retries (policy 1s x2)',
		        'ProviderTimeout', 'timed out after 30s', $1, 'scheduler.defer', 3, 1234, 2, 'order-1'::bytea, '\x00ff'::bytea,
		        ARRAY['trace', 'defer.target', 'defer.delay', 'defer.error.class', 'defer.attempt', 'defer.dlq.reason', 'dup', 'dup', 'defer.key'],
		        ARRAY['\xfe01'::bytea, 'old.topic', '30s', 'Old', '4', 'stale', 'a', 'b', 'order-1'])
		RETURNING id, coalesce(parked_at, updated_at)`, dlqTopic).Scan(&id, &parkedAt)
	if err != nil {
		t.Fatal(err)
	}
	// Neither a parked row without a dead-letter topic nor a rejected one
	// gets a copy.
	if _, err := e.Pool.Exec(ctx, `INSERT INTO deferred_message (business_key, target_topic, next_run_at, state, reason) VALUES
		('order-2', 'orders.retry', now(), 'parked', 'exhausted: 5 retries'), (NULL, NULL, now(), 'rejected', 'missing_target: x')`); err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	dl := deadLetters(e, metrics.New(reg, "test"))
	res := publishDLQ(e, dl)
	if res.claimed != 1 || res.published != 1 || res.failed != 0 {
		t.Fatalf("publish = %+v, want one copy published", res)
	}
	got := col.Wait(t, 1, 5*time.Second)[0]
	dispatchtest.MustEqual(t, "key", string(got.Key), "order-1")
	dispatchtest.MustEqual(t, "value", string(got.Value), "\x00\xff")
	want := []hv{
		{"trace", "\xfe\x01"}, {"defer.target", "orders.retry"}, {"defer.error.class", "ProviderTimeout"},
		{"defer.attempt", "5"}, {"defer.dlq.reason", "exhausted: 5 retries (policy 1s x2)"}, {"dup", "a"}, {"dup", "b"},
		{"defer.key", "order-1"},
		{"defer.id", strconv.FormatInt(id, 10)}, {"defer.seq", "77"}, {"defer.redrive-count", "2"},
		{"defer.error.message", "timed out after 30s"}, {"defer.parked-at", parkedAt.UTC().Format(time.RFC3339Nano)},
		{"defer.source.topic", "scheduler.defer"}, {"defer.source.partition", "3"}, {"defer.source.offset", "1234"},
	}
	if h := headerList(got); !slices.Equal(h, want) {
		t.Errorf("headers\n got %q\nwant %q", h, want)
	}
	wantPartition, _ := sarama.NewMurmur2Partitioner(dlqTopic).Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder("order-1")}, 2)
	dispatchtest.MustEqual(t, "partition", got.Partition, wantPartition)
	dispatchtest.MustEqual(t, "marked published", e.Count("id = $1 AND dlq_published_at IS NOT NULL AND state = 'parked'", id), 1)

	// Once is enough.
	if res := publishDLQ(e, dl); res.claimed != 0 {
		t.Fatalf("second publish = %+v, want nothing to do", res)
	}
	time.Sleep(200 * time.Millisecond)
	dispatchtest.MustEqual(t, "copies", len(col.Snapshot()), 1)
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == metrics.DLQPublished {
			if v := f.GetMetric()[0].GetCounter().GetValue(); v != 1 {
				t.Errorf("%s = %v, want 1", metrics.DLQPublished, v)
			}
			return
		}
	}
	t.Errorf("%s not exported", metrics.DLQPublished)
}

// A message the dispatcher parks gets a copy too; replaying it and having
// it parked again sends a second copy, with the same defer.id.
func TestDeadLetterCopyOfDispatcherPark(t *testing.T) {
	e := newDLQEnv(t)
	col := e.Collect(dlqTopic)
	ids := e.Insert(
		fixture.Message{Key: fixture.Key("k"), Target: dispatchtest.TopicB, Attempt: 2, RecordKey: []byte("k"), Value: []byte("v"), DLQ: dlqTopic,
			HeaderKeys: []string{"defer.target", "defer.delay"}, HeaderValues: [][]byte{[]byte(dispatchtest.TopicB), []byte("5s")}},
		// dispatch.Parked too, but without a dead-letter topic: no copy.
		fixture.Message{Key: fixture.Key("n"), Target: dispatchtest.TopicB, RecordKey: []byte("n"), Value: []byte("n")},
	)
	d := e.Dispatcher("t1", time.Minute, protocol.TargetPatterns{"orders.*"})
	e.Drain(d, 10*time.Second)
	dispatchtest.MustEqual(t, "parked", e.Count("state = 'parked' AND reason LIKE 'target_not_allowed:%'"), 2)

	dl := deadLetters(e, nil)
	if res := publishDLQ(e, dl); res.published != 1 {
		t.Fatalf("publish = %+v, want one copy", res)
	}
	first := col.Wait(t, 1, 5*time.Second)[0]
	dispatchtest.MustEqual(t, "value", string(first.Value), "v")
	dispatchtest.MustEqual(t, "defer.id", kafkatest.Header(first, "defer.id"), strconv.FormatInt(ids[0], 10))
	dispatchtest.MustEqual(t, "defer.attempt (not incremented: nothing was retried)", kafkatest.Header(first, "defer.attempt"), "2")
	dispatchtest.MustEqual(t, "defer.target", kafkatest.Header(first, "defer.target"), dispatchtest.TopicB)
	if !strings.HasPrefix(kafkatest.Header(first, dispatch.HeaderDLQReason), "target_not_allowed: ") {
		t.Errorf("defer.dlq.reason = %q, want the park's reason", kafkatest.Header(first, dispatch.HeaderDLQReason))
	}
	for _, absent := range []string{"defer.delay", dispatch.HeaderSourceTopic, dispatch.HeaderSourcePartition, dispatch.HeaderSourceOffset,
		"defer.error.class", "defer.error.message", "defer.redrive-count"} {
		for _, h := range first.Headers {
			if string(h.Key) == absent {
				t.Errorf("header %s present on a copy of a row that has none", absent)
			}
		}
	}
	if _, err := time.Parse(time.RFC3339Nano, kafkatest.Header(first, dispatch.HeaderParkedAt)); err != nil {
		t.Errorf("defer.parked-at: %v", err)
	}

	// Replay: the target is still not allowed, so it is parked again.
	if _, err := e.Pool.Exec(context.Background(),
		"UPDATE deferred_message SET state = 'pending', next_run_at = now() WHERE id = $1", ids[0]); err != nil {
		t.Fatal(err)
	}
	dispatchtest.MustEqual(t, "copy forgotten on replay", e.Count("id = $1 AND dlq_published_at IS NULL", ids[0]), 1)
	e.Drain(d, 10*time.Second)
	if res := publishDLQ(e, dl); res.published != 1 {
		t.Fatalf("publish after the second park = %+v, want one copy", res)
	}
	got := col.Wait(t, 2, 5*time.Second)
	dispatchtest.MustEqual(t, "second copy's defer.id", kafkatest.Header(got[1], "defer.id"), kafkatest.Header(first, "defer.id"))
	if kafkatest.Header(got[1], dispatch.HeaderParkedAt) == kafkatest.Header(first, dispatch.HeaderParkedAt) {
		t.Errorf("second copy has the first park's time %s", kafkatest.Header(first, dispatch.HeaderParkedAt))
	}
	time.Sleep(200 * time.Millisecond)
	dispatchtest.MustEqual(t, "copies", len(col.Snapshot()), 2)
}

// A copy that cannot be published stays due, is counted and backs off on
// its own while other copies go out, and is retried later.
func TestDeadLetterErrorsRetryLater(t *testing.T) {
	e := newDLQEnv(t)
	col := e.Collect(dlqTopic)
	ids := e.Insert(
		fixture.Message{Key: fixture.Key("a"), Target: dispatchtest.TopicA, RecordKey: []byte("a"), Value: []byte("unknown"), DLQ: "orders.nosuchdlq"},
		fixture.Message{Key: fixture.Key("b"), Target: dispatchtest.TopicA, RecordKey: []byte("b"), Value: []byte("invalid"), DLQ: "orders dlq"},
		fixture.Message{Key: fixture.Key("c"), Target: dispatchtest.TopicA, RecordKey: []byte("c"), Value: []byte("good"), DLQ: dlqTopic},
	)
	if _, err := e.Pool.Exec(context.Background(), "UPDATE deferred_message SET state = 'parked', reason = 'permanent: x'"); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	dl := deadLetters(e, metrics.New(reg, "test"))
	res := publishDLQ(e, dl)
	if res.claimed != 3 || res.published != 1 || res.failed != 2 {
		t.Fatalf("publish = %+v, want 1 published and 2 failed", res)
	}
	dispatchtest.MustEqual(t, "published", string(col.Wait(t, 1, 5*time.Second)[0].Value), "good")
	dispatchtest.MustEqual(t, "copies still due", e.Count("dlq_published_at IS NULL AND state = 'parked'"), 2)
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var errs map[string]float64
	for _, f := range fams {
		if f.GetName() == metrics.DLQPublishErrors {
			errs = map[string]float64{
				"unknown": dispatchtest.Counter(f.GetMetric(), map[string]string{"kind": "unknown_topic"}),
				"invalid": dispatchtest.Counter(f.GetMetric(), map[string]string{"kind": "invalid_topic"}),
			}
		}
	}
	if errs["unknown"] != 1 || errs["invalid"] != 1 {
		t.Errorf("%s = %v, want one unknown_topic and one invalid_topic", metrics.DLQPublishErrors, errs)
	}

	// Backing off, in the rows' leases: not tried again at once, by this
	// publisher or any other.
	if res := publishDLQ(e, dl); res.claimed != 0 {
		t.Fatalf("publish right after the failure = %+v, want the failed copies skipped", res)
	}
	if res := publishDLQ(e, deadLetters(e, nil)); res.claimed != 0 {
		t.Fatalf("another publisher right after the failure = %+v, want the failed copies skipped", res)
	}
	dispatchtest.MustEqual(t, "copies backing off about 1s", e.Count(`dlq_leased_until BETWEEN now() + interval '0.5 seconds'
		AND now() + interval '1.5 seconds'`), 2)
	// An operator fixes one; once its back-off passes it goes out. The other
	// fails again and backs off twice as long.
	e.Exec("UPDATE deferred_message SET dlq_topic = $1 WHERE id = $2", dlqTopic, ids[0])
	e.Exec("UPDATE deferred_message SET dlq_leased_until = now() WHERE dlq_published_at IS NULL")
	if res := publishDLQ(e, dl); res.claimed != 2 || res.published != 1 {
		t.Fatalf("publish after the back-off = %+v, want 2 tried, 1 published", res)
	}
	dispatchtest.MustEqual(t, "retried copy", string(col.Wait(t, 2, 5*time.Second)[1].Value), "unknown")
	dispatchtest.MustEqual(t, "still due", e.Count("dlq_published_at IS NULL AND state = 'parked'"), 1)
	dispatchtest.MustEqual(t, "second back-off about 2s", e.Count(`id = $1 AND dlq_leased_until BETWEEN now() + interval '1.5 seconds'
		AND now() + interval '2.5 seconds'`, ids[1]), 1)
	dispatchtest.MustEqual(t, "lease of the published copy ended", e.Count("id = $1 AND dlq_leased_until IS NULL", ids[0]), 1)
}

// Copies are leased, not locked: a copy another publisher holds is skipped,
// not waited for nor sent twice, and one whose publisher died (its lease
// passed) is taken again.
func TestDeadLetterLeases(t *testing.T) {
	e := newDLQEnv(t)
	col := e.Collect(dlqTopic)
	ids := e.Insert(
		fixture.Message{Key: fixture.Key("a"), Target: dispatchtest.TopicA, RecordKey: []byte("a"), Value: []byte("a"), DLQ: dlqTopic},
		fixture.Message{Key: fixture.Key("b"), Target: dispatchtest.TopicA, RecordKey: []byte("b"), Value: []byte("b"), DLQ: dlqTopic},
	)
	e.Exec("UPDATE deferred_message SET state = 'parked', reason = 'permanent: x'")
	// A publisher that claims one copy and dies before publishing it.
	crashed, err := claimDeadLetters(context.Background(), e.Pool, 1, dlqBatchBytes, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if len(crashed) != 1 || crashed[0].ID != ids[0] {
		t.Fatalf("claimed %+v, want the oldest copy, %d", crashed, ids[0])
	}
	dl := deadLetters(e, nil)
	if res := publishDLQ(e, dl); res.claimed != 1 || res.published != 1 {
		t.Fatalf("publish while another publisher holds one copy = %+v, want the other copy only", res)
	}
	dispatchtest.MustEqual(t, "published", string(col.Wait(t, 1, 5*time.Second)[0].Value), "b")
	dispatchtest.MustEqual(t, "leased copy still due", e.Count("id = $1 AND dlq_published_at IS NULL", ids[0]), 1)
	if res := publishDLQ(e, dl); res.claimed != 0 {
		t.Fatalf("publish while the lease holds = %+v, want nothing", res)
	}

	// The lease passes: the copy is taken again.
	e.Exec("UPDATE deferred_message SET dlq_leased_until = now() - interval '1 second' WHERE id = $1", ids[0])
	if res := publishDLQ(e, dl); res.claimed != 1 || res.published != 1 {
		t.Fatalf("publish after the lease passed = %+v, want the abandoned copy", res)
	}
	dispatchtest.MustEqual(t, "abandoned copy", string(col.Wait(t, 2, 5*time.Second)[1].Value), "a")
	dispatchtest.MustEqual(t, "all marked", e.Count("dlq_published_at IS NOT NULL AND dlq_leased_until IS NULL"), 2)
}

// blockingProducer holds every SendMessages until released, so a test can
// look at the database while a publish is in flight.
type blockingProducer struct {
	dispatch.Producer
	inFlight chan struct{}
	release  chan struct{}
}

func (p *blockingProducer) SendMessages(msgs []*sarama.ProducerMessage) error {
	p.inFlight <- struct{}{}
	<-p.release
	return p.Producer.SendMessages(msgs)
}

// While dead-letter copies are being published, the publisher holds no
// transaction open (vacuum goes on) and no lock: an operator replays one of
// the rows at once. A row replayed meanwhile is not marked published, nor
// is one replayed and parked again, whose new stay gets a copy of its own.
func TestDeadLetterPublishHoldsNoTransaction(t *testing.T) {
	e := newDLQEnv(t)
	col := e.Collect(dlqTopic)
	ids := e.Insert(
		fixture.Message{Key: fixture.Key("replayed"), Target: dispatchtest.TopicA, RecordKey: []byte("r"), Value: []byte("replayed"), DLQ: dlqTopic},
		fixture.Message{Key: fixture.Key("reparked"), Target: dispatchtest.TopicA, RecordKey: []byte("p"), Value: []byte("reparked"), DLQ: dlqTopic},
		fixture.Message{Key: fixture.Key("kept"), Target: dispatchtest.TopicA, RecordKey: []byte("k"), Value: []byte("kept"), DLQ: dlqTopic},
	)
	e.Exec("UPDATE deferred_message SET state = 'parked', reason = 'permanent: x'")
	bp := &blockingProducer{Producer: e.Producer, inFlight: make(chan struct{}), release: make(chan struct{})}
	dl := NewPublisher(e.Pool, bp, nil, time.Minute, dispatchtest.Logger())
	type outcome struct {
		res dlqResult
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := dl.publishOnce(context.Background())
		done <- outcome{res, err}
	}()
	select {
	case <-bp.inFlight:
	case o := <-done:
		t.Fatalf("publish ended without publishing: %+v, %v", o.res, o.err)
	case <-time.After(10 * time.Second):
		t.Fatal("publish did not start")
	}

	// Every other session of this test's database is the publisher's pool
	// or idle; none may be inside a transaction.
	var open int
	var states []string
	if err := e.Pool.QueryRow(context.Background(), `SELECT count(*), coalesce(array_agg(state), '{}')
		FROM pg_stat_activity
		WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid()
		  AND (xact_start IS NOT NULL OR state LIKE 'idle in transaction%')`).Scan(&open, &states); err != nil {
		t.Fatal(err)
	}
	if open != 0 {
		t.Errorf("%d sessions in a transaction while the copies are published (%q)", open, states)
	}
	// The operator's statements must not wait for the publish.
	octx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	for _, st := range []struct {
		sql string
		id  int64
	}{
		{"UPDATE deferred_message SET state = 'pending', next_run_at = now() + interval '1 hour' WHERE id = $1", ids[0]},
		{"UPDATE deferred_message SET state = 'pending', next_run_at = now() + interval '1 hour' WHERE id = $1", ids[1]},
		{"UPDATE deferred_message SET state = 'parked', reason = 'permanent: again' WHERE id = $1", ids[1]},
	} {
		if _, err := e.Pool.Exec(octx, st.sql, st.id); err != nil {
			t.Fatalf("operator's %q during the publish: %v", st.sql, err)
		}
	}
	close(bp.release)
	o := <-done
	if o.err != nil || o.res.claimed != 3 || o.res.published != 3 {
		t.Fatalf("publish = %+v, %v; want 3 copies published", o.res, o.err)
	}
	col.Wait(t, 3, 5*time.Second)
	dispatchtest.MustEqual(t, "untouched row marked", e.Count("id = $1 AND dlq_published_at IS NOT NULL", ids[2]), 1)
	dispatchtest.MustEqual(t, "replayed row not marked", e.Count("id = $1 AND state = 'pending' AND dlq_published_at IS NULL", ids[0]), 1)
	dispatchtest.MustEqual(t, "re-parked row not marked", e.Count(
		"id = $1 AND state = 'parked' AND dlq_published_at IS NULL AND dlq_leased_until IS NULL", ids[1]), 1)

	// The re-parked row's new stay gets its copy, with the new park's reason.
	dl.producer = e.Producer
	if res := publishDLQ(e, dl); res.claimed != 1 || res.published != 1 {
		t.Fatalf("publish after the re-park = %+v, want the new stay's copy", res)
	}
	got := col.Wait(t, 4, 5*time.Second)
	dispatchtest.MustEqual(t, "new copy", string(got[3].Value), "reparked")
	dispatchtest.MustEqual(t, "new copy's reason", kafkatest.Header(got[3], dispatch.HeaderDLQReason), "permanent: again")
	dispatchtest.MustEqual(t, "re-parked row marked", e.Count("id = $1 AND dlq_published_at IS NOT NULL", ids[1]), 1)
}
