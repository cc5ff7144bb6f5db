package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/deferq/scheduler/deferclient"
	"github.com/deferq/scheduler/deferclient/deferkgo"
	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/internal/schedproc"
)

// The key-order tests run the scheduler binary and consumers built on the
// client library (deferclient on sarama, deferclient/deferkgo on franz-go),
// all against one in-process broker, and check what a consumer's handler
// saw, in order, per business key.

const mainTopic = "orders.main"

// keyOrderSetup is a broker with the defer, main and retry topics, and a
// scheduler on a fresh database whose retry policy for orders.* is a
// constant 500 ms.
type keyOrderSetup struct {
	brokers   string
	db        pgtest.DB
	scheduler *proc
	url       string
	env       []string // the scheduler's
}

func newKeyOrderSetup(t *testing.T) *keyOrderSetup {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, deferTopic, targetTopic, mainTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	s := &keyOrderSetup{brokers: c.ListenAddrs()[0], db: pgtest.NewDB(t)}
	env := append(serviceEnv(s.db.URL, s.brokers, "keyorder"),
		"RETRY_POLICIES=orders.*: exponential 500ms x1 forever jitter none")
	s.scheduler = start(t, env, "--migrate")
	s.url = "http://" + s.scheduler.HTTPAddr
	s.env = env
	return s
}

// restartScheduler starts the scheduler again, after it was stopped or
// killed, where its clients know it: on the same HTTP address.
func (s *keyOrderSetup) restartScheduler(t *testing.T) {
	t.Helper()
	sp, err := schedproc.StartReady(t.Context(), schedproc.Options{Bin: binary(t), Args: []string{"run"}, Env: s.env,
		HTTPAddr: s.scheduler.HTTPAddr}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	s.scheduler = own(t, sp)
}

// handled is what a test consumer's handler saw: "key=value" in order.
type handled struct {
	mu   sync.Mutex
	seen []string
}

func (h *handled) add(key, value string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.seen = append(h.seen, key+"="+value)
}

func (h *handled) snapshot() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.seen)
}

// waitFor waits until the handler saw n records.
func (h *handled) waitFor(t *testing.T, n int, within time.Duration) []string {
	t.Helper()
	waitUntil(t, within, fmt.Sprintf("the handler to see %d records", n), func() (bool, string) {
		got := h.snapshot()
		return len(got) >= n, fmt.Sprintf("saw %q", got)
	})
	return h.snapshot()
}

// kafkaClients are the Kafka client libraries a test consumer can run on:
// sarama through deferclient, franz-go through deferclient/deferkgo.
var kafkaClients = []string{"sarama", "franz"}

// gateClient is what the tests ask of a consumer's library client, of
// either package.
type gateClient interface {
	Stats() deferclient.Stats
	KeyStates(ctx context.Context, keys []string) (map[string]deferclient.KeyState, error)
}

// record is a consumed record as a test handler sees it, whatever the
// client that read it.
type record struct{ topic, key, value string }

// testHandler handles a record in a test consumer; an error defers it.
type testHandler func(ctx context.Context, r record) error

// consumeOpts says how a test consumer runs.
type consumeOpts struct {
	// client is one of kafkaClients; "" means sarama.
	client string
	// noGate sets the handler configuration's NoGate.
	noGate bool
	// topics are the topics consumed; nil means the main and the retry
	// topic.
	topics []string
}

// consumed returns the topics o says to consume.
func (o consumeOpts) consumed() []string {
	if o.topics == nil {
		return []string{mainTopic, targetTopic}
	}
	return o.topics
}

// testConsumer is one member of a consumer group that consumes the main and
// retry topics through the library.
type testConsumer struct {
	client gateClient
	stop   func()
}

// consume starts a member of group handling records with h (nil: record
// and succeed) through the library, on the Kafka client o names.
func (s *keyOrderSetup) consume(t *testing.T, group string, out *handled, h testHandler, o consumeOpts) *testConsumer {
	t.Helper()
	handle := func(ctx context.Context, r record) error {
		if h != nil {
			if err := h(ctx, r); err != nil {
				return err
			}
		}
		out.add(r.key, r.value)
		return nil
	}
	switch o.client {
	case "", "sarama":
		return s.consumeSarama(t, group, handle, o)
	case "franz":
		return s.consumeFranz(t, group, handle, o)
	}
	t.Fatalf("no Kafka client %q", o.client)
	return nil
}

// consumeSarama is consume on sarama, through deferclient.
func (s *keyOrderSetup) consumeSarama(t *testing.T, group string, handle testHandler, o consumeOpts) *testConsumer {
	t.Helper()
	client, err := deferclient.New(deferclient.Config{Brokers: []string{s.brokers}, Group: group, SchedulerURL: s.url,
		KeyStateWait: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	kc := sarama.NewConfig()
	kc.Version = sarama.V3_6_0_0
	kc.Consumer.Offsets.Initial = sarama.OffsetOldest
	kc.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	kc.Consumer.Group.Heartbeat.Interval = 200 * time.Millisecond
	kc.Consumer.Group.Session.Timeout = 6 * time.Second
	kc.Consumer.Group.Rebalance.Timeout = 6 * time.Second
	cg, err := sarama.NewConsumerGroup([]string{s.brokers}, group, kc)
	if err != nil {
		t.Fatal(err)
	}
	gh := client.ConsumerGroupHandler(func(ctx context.Context, m *sarama.ConsumerMessage) error {
		return handle(ctx, record{topic: m.Topic, key: string(m.Key), value: string(m.Value)})
	}, deferclient.HandlerConfig{RetryTopic: func(string) string { return targetTopic }, NoGate: o.noGate})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if err := cg.Consume(ctx, o.consumed(), gh); err != nil && ctx.Err() == nil {
				t.Logf("consumer of %s: %v", group, err)
				time.Sleep(100 * time.Millisecond)
			}
		}
	}()
	var once sync.Once
	c := &testConsumer{client: client, stop: func() {
		once.Do(func() {
			cancel()
			<-done
			cg.Close()
			client.Close()
		})
	}}
	t.Cleanup(c.stop)
	return c
}

// consumeFranz is consume on franz-go, through deferkgo: a kgo group
// consumer with the options the library asks for and the group timings of
// consumeSarama.
func (s *keyOrderSetup) consumeFranz(t *testing.T, group string, handle testHandler, o consumeOpts) *testConsumer {
	t.Helper()
	client, err := deferkgo.New(deferkgo.Config{Brokers: []string{s.brokers}, Group: group, SchedulerURL: s.url,
		KeyStateWait: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	join := func() *kgo.Client {
		cl, err := kgo.NewClient(append(client.GroupOpts(),
			kgo.SeedBrokers(s.brokers),
			kgo.ConsumerGroup(group),
			kgo.ConsumeTopics(o.consumed()...),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
			kgo.AutoCommitInterval(100*time.Millisecond),
			kgo.HeartbeatInterval(200*time.Millisecond),
			kgo.SessionTimeout(6*time.Second),
			kgo.RebalanceTimeout(6*time.Second),
		)...)
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}
	cl := join()
	h := func(ctx context.Context, r *kgo.Record) error {
		return handle(ctx, record{topic: r.Topic, key: string(r.Key), value: string(r.Value)})
	}
	hc := deferkgo.HandlerConfig{RetryTopic: func(string) string { return targetTopic }, NoGate: o.noGate}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			err := client.Consume(ctx, cl, h, hc)
			if err == nil || ctx.Err() != nil {
				continue
			}
			t.Logf("consumer of %s: %v", group, err)
			if errors.Is(err, deferkgo.ErrLeftGroup) {
				cl.Close()
				cl = join()
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	var once sync.Once
	c := &testConsumer{client: client, stop: func() {
		once.Do(func() {
			cancel()
			<-done
			cl.Close() // leaves the group, committing what was settled
			client.Close()
		})
	}}
	t.Cleanup(c.stop)
	return c
}

// produceMain produces key=value to the main topic, keyed by key.
func produceMain(t *testing.T, p sarama.SyncProducer, key, value string) {
	t.Helper()
	if _, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: mainTopic, Key: sarama.StringEncoder(key),
		Value: sarama.StringEncoder(value)}); err != nil {
		t.Fatal(err)
	}
}

// failing returns a handler that fails the first n handlings of value.
func failing(value string, n int) testHandler {
	var mu sync.Mutex
	left := n
	return func(_ context.Context, r record) error {
		if r.value != value {
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		if left > 0 {
			left--
			return errors.New("provider timeout")
		}
		return nil
	}
}

// TestKeyOrderLaterMainRecordWaits is the first scenario: payment-service
// fails on charge for order 42 and defers it; refund for order 42 arrives
// on the main topic a moment later. Without the gate refund is handled at
// once, before charge (the NoGate case shows it); with it, refund is
// deferred behind charge and handled after it.
func TestKeyOrderLaterMainRecordWaits(t *testing.T) {
	for _, client := range kafkaClients {
		for _, gate := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/gate=%v", client, gate), func(t *testing.T) {
				testLaterMainRecordWaits(t, client, gate)
			})
		}
	}
}

func testLaterMainRecordWaits(t *testing.T, client string, gate bool) {
	s := newKeyOrderSetup(t)
	out := &handled{}
	c := s.consume(t, "payment-service", out, failing("charge", 1), consumeOpts{client: client, noGate: !gate})
	p := producer(t, s.brokers)
	produceMain(t, p, "order-42", "charge")
	waitStat(t, c, func(st deferclient.Stats) bool { return st.Deferred == 1 })
	produceMain(t, p, "order-42", "refund")
	got := out.waitFor(t, 2, 20*time.Second)
	want := []string{"order-42=charge", "order-42=refund"}
	if !gate {
		// The control: what every consumer without the gate does.
		want = []string{"order-42=refund", "order-42=charge"}
	}
	if !slices.Equal(got, want) {
		t.Fatalf("handled %q, want %q", got, want)
	}
	if st := c.client.Stats(); gate && st.Gated < 1 {
		// Once at least: it may be gated again when it comes back
		// before the scheduler's finalize of charge committed.
		t.Errorf("stats %+v, want refund gated", st)
	}
}

// TestKeyOrderInFlightKeyStaysBlocked is the second scenario: the
// scheduler republished charge, the key's last pending message, to the
// retry topic, and the consumer has not handled it yet (its handler is
// slow) when refund arrives on the main topic. The key must still be
// blocked: released only once the group committed past charge.
func TestKeyOrderInFlightKeyStaysBlocked(t *testing.T) {
	s := newKeyOrderSetup(t)
	out := &handled{}
	retried := make(chan struct{})
	var once sync.Once
	slowRetry := func(ctx context.Context, r record) error {
		if r.value == "charge" && r.topic == targetTopic {
			once.Do(func() { close(retried) })
			select { // the slow handling refund must not overtake
			case <-time.After(1500 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	}
	first := failing("charge", 1)
	c := s.consume(t, "payment-service", out, func(ctx context.Context, r record) error {
		if err := first(ctx, r); err != nil {
			return err
		}
		return slowRetry(ctx, r)
	}, consumeOpts{})
	p := producer(t, s.brokers)
	produceMain(t, p, "order-42", "charge")
	select {
	case <-retried:
	case <-time.After(20 * time.Second):
		t.Fatal("charge never came back on the retry topic")
	}
	// charge is republished and being handled, not committed: no message
	// of the key waits in the scheduler any more once the finalize that
	// published it has committed (the record reaches the consumer before
	// that commit, so the row may still be there for a moment).
	waitUntil(t, 10*time.Second, "charge's row deleted by the finalize", func() (bool, string) {
		var pending int
		if err := s.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_message`).Scan(&pending); err != nil {
			t.Fatal(err)
		}
		return pending == 0, fmt.Sprintf("%d messages still wait in the scheduler; the test needs charge republished", pending)
	})
	produceMain(t, p, "order-42", "refund")
	got := out.waitFor(t, 2, 20*time.Second)
	if want := []string{"order-42=charge", "order-42=refund"}; !slices.Equal(got, want) {
		t.Fatalf("handled %q, want %q", got, want)
	}
	if st := c.client.Stats(); st.Gated < 1 {
		t.Errorf("stats %+v, want refund gated", st)
	}
	// Once everything is handled and committed, nothing stays blocked.
	waitBlocked(t, c, "order-42", false)
}

// TestKeyOrderRetriedRecordFailsAgain is the third scenario: charge (n)
// fails, refund (n+1) is deferred behind it, both are republished in one
// round, and the consumer fails on charge again. refund must not be handled
// before charge finally succeeds.
func TestKeyOrderRetriedRecordFailsAgain(t *testing.T) {
	s := newKeyOrderSetup(t)
	out := &handled{}
	c := s.consume(t, "payment-service", out, failing("charge", 3), consumeOpts{})
	p := producer(t, s.brokers)
	produceMain(t, p, "order-42", "charge")
	produceMain(t, p, "order-42", "refund")
	got := out.waitFor(t, 2, 30*time.Second)
	if want := []string{"order-42=charge", "order-42=refund"}; !slices.Equal(got, want) {
		t.Fatalf("handled %q, want %q", got, want)
	}
	st := c.client.Stats()
	if st.Deferred != 3 || st.Gated < 2 {
		t.Errorf("stats %+v, want charge deferred 3 times and refund gated behind it each time", st)
	}
	// History tells the failures from the gated deferrals (the view has
	// the deferrals folded into their deliveries too).
	var deferred, gated int
	if err := s.db.Pool.QueryRow(t.Context(), `SELECT count(*) FILTER (WHERE event = 'deferred'),
		count(*) FILTER (WHERE event = 'gated') FROM deferred_history`).Scan(&deferred, &gated); err != nil {
		t.Fatal(err)
	}
	if deferred != 3 || gated != int(st.Gated) {
		t.Errorf("history has %d deferred and %d gated events, want 3 and %d", deferred, gated, st.Gated)
	}
	// Gated is not a failure: refund, never tried, keeps attempt 0 however
	// often it comes back and is gated again.
	var tried int
	if err := s.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM deferred_attempt
		WHERE event = 'gated' AND attempt <> 0`).Scan(&tried); err != nil {
		t.Fatal(err)
	}
	if tried != 0 {
		t.Errorf("%d gated events count attempts, want none", tried)
	}
}

// TestKeyOrderRebalance: a partition moves to another member right after
// its previous owner deferred a record; the new owner, which never saw the
// deferral, still gates the key's next record (the scheduler's answer is
// read-your-writes with respect to the defer topic).
func TestKeyOrderRebalance(t *testing.T) {
	for _, client := range kafkaClients {
		t.Run(client, func(t *testing.T) { testRebalance(t, client) })
	}
}

func testRebalance(t *testing.T, client string) {
	s := newKeyOrderSetup(t)
	out := &handled{}
	a := s.consume(t, "payment-service", out, failing("charge", 1), consumeOpts{client: client})
	p := producer(t, s.brokers)
	produceMain(t, p, "order-42", "charge")
	waitStat(t, a, func(st deferclient.Stats) bool { return st.Deferred == 1 })
	a.stop() // leaves the group; b takes every partition
	b := s.consume(t, "payment-service", out, nil, consumeOpts{client: client})
	produceMain(t, p, "order-42", "refund")
	got := out.waitFor(t, 2, 30*time.Second)
	if want := []string{"order-42=charge", "order-42=refund"}; !slices.Equal(got, want) {
		t.Fatalf("handled %q, want %q", got, want)
	}
	if st := b.client.Stats(); st.Gated < 1 {
		t.Errorf("the new owner's stats %+v, want refund gated", st)
	}
}

// waitStat waits until c's stats satisfy ok.
func waitStat(t *testing.T, c *testConsumer, ok func(deferclient.Stats) bool) {
	t.Helper()
	waitUntil(t, 20*time.Second, "the client's stats", func() (bool, string) {
		st := c.client.Stats()
		return ok(st), fmt.Sprintf("%+v", st)
	})
}

// waitBlocked waits until the scheduler says key is blocked (or free) for
// c's group, and returns its state then.
func waitBlocked(t *testing.T, c *testConsumer, key string, blocked bool) deferclient.KeyState {
	t.Helper()
	var st deferclient.KeyState
	waitUntil(t, 20*time.Second, fmt.Sprintf("key %s blocked=%v", key, blocked), func() (bool, string) {
		states, err := c.client.KeyStates(t.Context(), []string{key})
		st = states[key]
		return err == nil && st.Blocked == blocked, fmt.Sprintf("%+v, %v", st, err)
	})
	return st
}

// TestBusinessKeyPartition: records of one business key (defer.key) with
// different record keys, produced by kcat to one partition of the defer
// topic chosen by hand and by the client library, all come out on the
// retry topic's partition of the business key, in order, each with its own
// record key byte for byte; the library's land on the defer topic's
// partition of the business key. A record kcat put on a partition other
// than its business key's is counted as misrouted.
func TestBusinessKeyPartition(t *testing.T) {
	s := newKeyOrderSetup(t)
	const bkey = "order-7"
	want := deferclient.Partition(bkey, 4)
	kc := kcat(t)
	produce := func(partition int32, key, value string) {
		t.Helper()
		cmd := exec.Command(kc, "-b", s.brokers, "-P", "-t", deferTopic, "-p", strconv.Itoa(int(partition)), "-k", key,
			"-H", "defer.target="+targetTopic, "-H", "defer.key="+bkey, "-H", "defer.delay=0")
		cmd.Stdin = strings.NewReader(value + "\n")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("kcat produce: %v\n%s", err, out)
		}
	}
	// Its own partition first, in order; then one on another partition.
	for i, k := range []string{"rec-a", "rec-b", "rec-c"} {
		produce(want, k, "v"+strconv.Itoa(i))
	}
	retry := read(t, s.brokers, targetTopic)
	retry.until(t, 20*time.Second, "the first three", atLeast(3))
	other := (want + 1) % 4
	produce(other, "rec-x", "elsewhere")

	// No Group: a deferral that names one keeps the key blocked after each
	// republish until that group commits past it (TestKeyOrderAckGating),
	// and nothing here consumes the retry topic. The test once passed with
	// a group only because both deferrals were stored in one statement
	// and went out in one round.
	client, err := deferclient.New(deferclient.Config{Brokers: []string{s.brokers}})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	in := kafkatest.Collect(t, s.brokers, deferTopic)
	for _, k := range []string{"rec-d", "rec-e"} {
		m := &sarama.ConsumerMessage{Topic: mainTopic, Key: []byte(k), Value: []byte(k)}
		if err := client.Defer(t.Context(), m, deferclient.Deferral{Target: targetTopic, BusinessKey: bkey}); err != nil {
			t.Fatal(err)
		}
	}
	got := retry.until(t, 20*time.Second, "all six", atLeast(6))
	var keys []string
	for _, d := range got {
		keys = append(keys, d.key)
		if d.partition != want {
			t.Errorf("%s came out on partition %d of %s, want %d (the business key's)", d.key, d.partition, targetTopic, want)
		}
	}
	if !slices.Equal(keys[:3], []string{"rec-a", "rec-b", "rec-c"}) || !slices.Contains(keys, "rec-x") ||
		!slices.Equal(slices.DeleteFunc(slices.Clone(keys[3:]), func(k string) bool { return k == "rec-x" }), []string{"rec-d", "rec-e"}) {
		t.Errorf("record keys out in the order %q, want rec-a, rec-b, rec-c, then rec-d before rec-e and rec-x anywhere", keys)
	}
	for _, m := range in.Snapshot() {
		if k := string(m.Key); (k == "rec-d" || k == "rec-e") && m.Partition != want {
			t.Errorf("the library produced %s to partition %d of %s, want %d", k, m.Partition, deferTopic, want)
		}
	}
	waitMetrics(t, s.scheduler, 10*time.Second, "rec-x counted as misrouted", func(m metricsSnapshot) bool {
		return m.is(1, "scheduler_ingest_misrouted_total")
	})
}

// TestKeyOrderAckGating: a key the scheduler republished for a group stays
// blocked, and its next message unpublished, while the group has not
// committed past the record; it flows once the group commits; and an
// operator's `scheduler release` lets a key go whose group never commits.
func TestKeyOrderAckGating(t *testing.T) {
	s := newKeyOrderSetup(t)
	client, err := deferclient.New(deferclient.Config{Brokers: []string{s.brokers}, Group: "billing",
		SchedulerURL: s.url})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	retry := read(t, s.brokers, targetTopic)
	// The two keys' records land on different partitions of the retry
	// topic, so that committing past one commits nothing of the other.
	if deferclient.Partition("order-1", 4) == deferclient.Partition("order-2", 4) {
		t.Fatal("order-1 and order-2 share a partition; pick other keys")
	}
	group := commitOnDemand(t, s.brokers, "billing", targetTopic)
	for _, k := range []string{"order-1", "order-2"} {
		m := &sarama.ConsumerMessage{Topic: mainTopic, Key: []byte(k), Value: []byte("first")}
		if err := client.Defer(t.Context(), m, deferclient.Deferral{Target: targetTopic}); err != nil {
			t.Fatal(err)
		}
	}
	retry.until(t, 20*time.Second, "both republished", atLeast(2))
	// The keys' next messages, due at once, wait while the first are in
	// flight.
	for _, k := range []string{"order-1", "order-2"} {
		m := &sarama.ConsumerMessage{Topic: mainTopic, Key: []byte(k), Value: []byte("second")}
		if err := client.Defer(t.Context(), m, deferclient.Deferral{Target: targetTopic}); err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range []string{"order-1", "order-2"} {
		st := waitBlocked(t, &testConsumer{client: client}, k, true)
		if st.Reason != deferclient.ReasonPending {
			t.Errorf("%s: %+v, want blocked by its pending second message", k, st)
		}
	}
	time.Sleep(2 * time.Second) // a few release ticks: nothing committed, nothing may move
	if got := retry.all(); len(got) != 2 {
		t.Fatalf("%d records republished while the group had committed nothing, want 2", len(got))
	}

	// The group commits past order-1's record: order-1 flows.
	group.commitPast(t, "order-1")
	retry.until(t, 10*time.Second, "order-1's second message after the commit", func(ds []delivery) bool {
		for _, d := range ds {
			if d.key == "order-1" && d.value == "second" {
				return true
			}
		}
		return false
	})
	if got := retry.all(); len(got) != 3 {
		t.Errorf("%d records republished, want 3: order-2 must still wait", len(got))
	}

	// billing never commits past order-2: an operator releases it.
	cmd := exec.Command(binary(t), "release", "--group", "billing", "--key", "order-2")
	cmd.Env = []string{"DATABASE_URL=" + s.db.URL, "PATH=" + os.Getenv("PATH")}
	if b, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(b), "released 1 key") {
		t.Fatalf("scheduler release: %v\n%s", err, b)
	}
	retry.until(t, 10*time.Second, "order-2's second message after the release", atLeast(4))
}

// committer is a member of a consumer group that reads a topic and
// commits past a record only when told to, as a consumer that handled it.
type committer struct {
	mu   sync.Mutex
	sess sarama.ConsumerGroupSession
	seen map[string]*sarama.ConsumerMessage // by record key
}

func (c *committer) Setup(s sarama.ConsumerGroupSession) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sess = s
	return nil
}
func (c *committer) Cleanup(sarama.ConsumerGroupSession) error { return nil }
func (c *committer) ConsumeClaim(_ sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	for m := range claim.Messages() {
		c.mu.Lock()
		c.seen[string(m.Key)] = m
		c.mu.Unlock()
	}
	return nil
}

// commitPast commits the group's offset past the record of key it read.
func (c *committer) commitPast(t *testing.T, key string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c.mu.Lock()
		m, sess := c.seen[key], c.sess
		c.mu.Unlock()
		if m != nil && sess != nil {
			sess.MarkMessage(m, "")
			sess.Commit()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the committer never read %s", key)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// commitOnDemand joins group on topic with a committer.
func commitOnDemand(t *testing.T, brokers, group, topic string) *committer {
	t.Helper()
	kc := sarama.NewConfig()
	kc.Version = sarama.V3_6_0_0
	kc.Consumer.Offsets.Initial = sarama.OffsetOldest
	kc.Consumer.Offsets.AutoCommit.Enable = false
	cg, err := sarama.NewConsumerGroup([]string{brokers}, group, kc)
	if err != nil {
		t.Fatal(err)
	}
	c := &committer{seen: map[string]*sarama.ConsumerMessage{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			_ = cg.Consume(ctx, []string{topic}, c)
		}
	}()
	t.Cleanup(func() { cancel(); <-done; cg.Close() })
	return c
}
