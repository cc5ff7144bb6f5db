package main

import (
	"context"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/pgtest"
)

// rawConsumer hands every record of a topic, headers in order, to handle.
func rawConsumer(t *testing.T, brokers, topic string, handle func(*sarama.ConsumerMessage)) {
	t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	consumer, err := sarama.NewConsumer([]string{brokers}, c)
	if err != nil {
		t.Fatal(err)
	}
	parts, err := consumer.Partitions(topic)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var pcs []sarama.PartitionConsumer
	for _, p := range parts {
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			t.Fatal(err)
		}
		pcs = append(pcs, pc)
		wg.Go(func() {
			for m := range pc.Messages() {
				handle(m)
			}
		})
	}
	t.Cleanup(func() {
		for _, pc := range pcs {
			pc.AsyncClose()
		}
		wg.Wait()
		consumer.Close()
	})
}

func hdr(m *sarama.ConsumerMessage, name string) string {
	for _, h := range m.Headers {
		if string(h.Key) == name {
			return string(h.Value)
		}
	}
	return ""
}

// TestPolicyWalksLadderToParkingLotAndBack is the whole retry story: a
// consumer that keeps failing forwards the records it gets, unchanged but
// for its error headers, back to the defer topic; the policy of the target
// walks them up the ladder, parks them when the ladder is exhausted (holding
// their key and sending a dead-letter copy), and `scheduler replay` brings
// them back out in order once the downstream has recovered.
func TestPolicyWalksLadderToParkingLotAndBack(t *testing.T) {
	const dlqTopic = targetTopic + ".dlq"
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, deferTopic, targetTopic, dlqTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	brokers := cluster.ListenAddrs()[0]
	db := pgtest.NewDB(t)
	ctx := context.Background()
	steps := []time.Duration{300 * time.Millisecond, 600 * time.Millisecond, 900 * time.Millisecond}
	env := append(serviceEnv(db.URL, brokers, "e2e-policy"),
		"RETRY_POLICIES=orders.*: ladder 300ms,600ms,900ms dlq {target}.dlq",
		"NON_RETRIABLE_ERRORS=*ValidationError")
	start(t, env)
	prod := producer(t, brokers)

	// The consumer of orders.retry: while the downstream is broken it fails
	// every record and forwards it, headers and all, to the defer topic.
	var (
		broken    atomic.Bool
		mu        sync.Mutex
		delivered []*sarama.ConsumerMessage
		fwdErr    error
	)
	broken.Store(true)
	rawConsumer(t, brokers, targetTopic, func(m *sarama.ConsumerMessage) {
		mu.Lock()
		delivered = append(delivered, m)
		mu.Unlock()
		if !broken.Load() {
			return
		}
		out := &sarama.ProducerMessage{Topic: deferTopic, Key: sarama.ByteEncoder(m.Key), Value: sarama.ByteEncoder(m.Value)}
		for _, h := range m.Headers {
			switch string(h.Key) {
			case "defer.error.class", "defer.error.message":
				continue
			}
			out.Headers = append(out.Headers, *h)
		}
		out.Headers = append(out.Headers,
			sarama.RecordHeader{Key: []byte("defer.error.class"), Value: []byte("java.net.SocketTimeoutException")},
			sarama.RecordHeader{Key: []byte("defer.error.message"), Value: []byte("downstream timed out, attempt " + hdr(m, "defer.attempt"))})
		if _, _, err := prod.SendMessage(out); err != nil {
			mu.Lock()
			fwdErr = err
			mu.Unlock()
		}
	})
	var dlq []*sarama.ConsumerMessage
	rawConsumer(t, brokers, dlqTopic, func(m *sarama.ConsumerMessage) {
		mu.Lock()
		dlq = append(dlq, m)
		mu.Unlock()
	})
	snapshot := func() (d, q []*sarama.ConsumerMessage) {
		mu.Lock()
		defer mu.Unlock()
		if fwdErr != nil {
			t.Fatalf("forwarding to the defer topic: %v", fwdErr)
		}
		return append([]*sarama.ConsumerMessage(nil), delivered...), append([]*sarama.ConsumerMessage(nil), dlq...)
	}
	waitFor := func(within time.Duration, what string, cond func(d, q []*sarama.ConsumerMessage) bool) {
		t.Helper()
		deadline := time.Now().Add(within)
		for {
			d, q := snapshot()
			if cond(d, q) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within %v (%d deliveries, %d dead letters)", what, within, len(d), len(q))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	send := func(key, value string, headers ...string) {
		t.Helper()
		if _, _, err := prod.SendMessage(deferRecord(key, value, append([]string{"defer.target", targetTopic}, headers...)...)); err != nil {
			t.Fatal(err)
		}
	}
	values := func(d []*sarama.ConsumerMessage, key string) []string {
		var out []string
		for _, m := range d {
			if string(m.Key) == key {
				out = append(out, string(m.Value)+"@"+hdr(m, "defer.attempt"))
			}
		}
		return out
	}

	// No defer.delay: the first delay comes from the policy too.
	send("order-1", "m1", "defer.error.class", "java.net.SocketTimeoutException")
	// A validation error is not worth retrying: straight to the parking lot.
	send("order-2", "bad", "defer.error.class", "com.example.OrderValidationError")

	waitRows(t, db.Pool, 20*time.Second,
		"SELECT count(*) FROM deferred_message WHERE business_key = 'order-1' AND state = 'parked' AND reason LIKE 'exhausted:%'", 1)
	d, _ := snapshot()
	if got := strings.Join(values(d, "order-1"), ","); got != "m1@1,m1@2,m1@3" {
		t.Fatalf("order-1 deliveries = %s, want m1@1,m1@2,m1@3 (the ladder's three retries)", got)
	}
	// Each retry waited at least its step of the ladder after the failure
	// before it (scheduled-at minus the failed delivery's arrival).
	for i := 1; i < len(d); i++ {
		sched, err := time.Parse(time.RFC3339Nano, hdr(d[i], "defer.scheduled-at"))
		if err != nil {
			t.Fatalf("delivery %d: defer.scheduled-at %q: %v", i, hdr(d[i], "defer.scheduled-at"), err)
		}
		if gap := d[i].Timestamp.Sub(d[i-1].Timestamp); gap < steps[i]-50*time.Millisecond {
			t.Errorf("retry %d came %v after the previous delivery, want at least the ladder step %v (scheduled-at %v)",
				i+1, gap, steps[i], sched)
		}
	}

	// Parked m1 holds order-1: a later message of the key waits behind it.
	send("order-1", "m2", "defer.delay", "0")
	waitRows(t, db.Pool, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE business_key = 'order-1' AND state = 'pending'", 1)
	waitRows(t, db.Pool, 5*time.Second, "SELECT count(*) FROM deferred_key WHERE business_key = 'order-1' AND held", 1)
	waitRows(t, db.Pool, 5*time.Second,
		"SELECT count(*) FROM deferred_message WHERE business_key = 'order-2' AND state = 'parked' AND reason LIKE 'non_retriable:%'", 1)

	// The dead-letter copies carry the failure context.
	waitFor(10*time.Second, "dead-letter copies of m1 and bad", func(_, q []*sarama.ConsumerMessage) bool { return len(q) >= 2 })
	_, q := snapshot()
	for _, m := range q {
		switch string(m.Value) {
		case "m1":
			if r := hdr(m, "defer.dlq.reason"); !strings.HasPrefix(r, "exhausted:") {
				t.Errorf("dead letter of m1: defer.dlq.reason = %q, want exhausted: ...", r)
			}
			if c := hdr(m, "defer.error.class"); c != "java.net.SocketTimeoutException" {
				t.Errorf("dead letter of m1: defer.error.class = %q", c)
			}
			if a := hdr(m, "defer.attempt"); a != "3" {
				t.Errorf("dead letter of m1: defer.attempt = %q, want 3", a)
			}
			if hdr(m, "defer.parked-at") == "" || hdr(m, "defer.source.offset") == "" {
				t.Errorf("dead letter of m1 lacks defer.parked-at or defer.source.offset: %v", m.Headers)
			}
		case "bad":
			if r := hdr(m, "defer.dlq.reason"); !strings.HasPrefix(r, "non_retriable:") {
				t.Errorf("dead letter of bad: defer.dlq.reason = %q, want non_retriable: ...", r)
			}
		default:
			t.Errorf("unexpected dead letter %q", m.Value)
		}
	}

	// The lineage's story is in SQL: three deferrals, each ended by its
	// delivery (published, with the attempt the record carried; the
	// deferral folded into the delivery's row), and the park.
	var story string
	if err := db.Pool.QueryRow(ctx, `
		SELECT string_agg(h.event || '@' || h.attempt || ':' || coalesce(h.error_class, '-'), ','
		                  ORDER BY h.recorded_at, h.id NULLS LAST, h.event <> 'deferred')
		FROM deferred_lineage_history(deferred_lineage((SELECT id FROM deferred_message WHERE value = 'm1'))) h`).Scan(&story); err != nil {
		t.Fatal(err)
	}
	const cls = "java.net.SocketTimeoutException"
	if want := "deferred@0:" + cls + ",published@1:-,deferred@1:" + cls + ",published@2:-,deferred@2:" + cls +
		",published@3:-,parked@3:" + cls; story != want {
		t.Errorf("history of m1 = %s\nwant %s", story, want)
	}

	time.Sleep(time.Second)
	d, _ = snapshot()
	if got := strings.Join(values(d, "order-1"), ","); got != "m1@1,m1@2,m1@3" {
		t.Fatalf("order-1 deliveries while m1 is parked = %s: m2 overtook its parked predecessor", got)
	}

	// The downstream recovers; an operator replays order-1 with fresh
	// attempts. m1 goes first, then m2.
	broken.Store(false)
	replay := exec.Command(binary(t), "replay", "--key", "order-1", "--reset-attempts", "--yes")
	replay.Env = env
	if out, err := replay.CombinedOutput(); err != nil {
		t.Fatalf("scheduler replay: %v\n%s", err, out)
	}
	waitFor(10*time.Second, "m1 and m2 after the replay", func(d, _ []*sarama.ConsumerMessage) bool {
		return len(values(d, "order-1")) >= 5
	})
	d, _ = snapshot()
	if got := strings.Join(values(d, "order-1"), ","); got != "m1@1,m1@2,m1@3,m1@1,m2@1" {
		t.Fatalf("order-1 deliveries after replay = %s, want m1@1,m1@2,m1@3,m1@1,m2@1", got)
	}
	for _, m := range d[len(d)-2:] {
		want := map[string]string{"m1": "1", "m2": ""}[string(m.Value)]
		if got := hdr(m, "defer.redrive-count"); got != want {
			t.Errorf("%s: defer.redrive-count = %q, want %q", m.Value, got, want)
		}
	}
	waitRows(t, db.Pool, 5*time.Second, "SELECT count(*) FROM deferred_message WHERE business_key = 'order-1'", 0)
	waitRows(t, db.Pool, 5*time.Second, "SELECT count(*) FROM deferred_key WHERE business_key = 'order-1'", 0)
	// The validation failure stays parked: the replay's filter did not match it.
	waitRows(t, db.Pool, time.Second, "SELECT count(*) FROM deferred_message WHERE business_key = 'order-2' AND state = 'parked'", 1)
}

// TestReplayRateAgainstTheClock: `scheduler replay --rate` paces a redrive.
// The pace is measured where it matters, on the target topic, from the
// broker timestamps of the republished records.
func TestReplayRateAgainstTheClock(t *testing.T) {
	const (
		n    = 40
		rate = 20.0 // messages per second
	)
	brokers := broker(t)
	db := pgtest.NewDB(t)
	env := serviceEnv(db.URL, brokers, "e2e-replay-rate")
	start(t, env)
	if _, err := db.Pool.Exec(context.Background(), `
		INSERT INTO deferred_message (business_key, target_topic, next_run_at, state, reason, key, value)
		SELECT 'k' || i, $1, now(), 'parked', 'exhausted: test', convert_to('k' || i, 'UTF8'), convert_to('v' || i, 'UTF8')
		FROM generate_series(1, $2) AS i`, targetTopic, n); err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		times []time.Time
	)
	rawConsumer(t, brokers, targetTopic, func(m *sarama.ConsumerMessage) {
		mu.Lock()
		times = append(times, m.Timestamp)
		mu.Unlock()
	})
	replay := exec.Command(binary(t), "replay", "--target", "orders.*", "--rate", "20", "--yes")
	replay.Env = env
	if out, err := replay.CombinedOutput(); err != nil {
		t.Fatalf("scheduler replay: %v\n%s", err, out)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		mu.Lock()
		got := len(times)
		mu.Unlock()
		if got >= n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d replayed messages arrived within 20s", got, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	mu.Lock()
	ts := append([]time.Time(nil), times...)
	mu.Unlock()
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	// n messages at 20/s span (n-1)/rate = 1.95 s. Allow for the dispatcher's
	// poll and wake-up delays, not for a burst.
	span := ts[len(ts)-1].Sub(ts[0])
	want := time.Duration(float64(n-1) / rate * float64(time.Second))
	if span < want-300*time.Millisecond || span > want+time.Second {
		t.Errorf("%d replayed messages went out over %v, want about %v at %v/s", n, span, want, rate)
	}
	// No second holds much more than the rate. The due times are staggered,
	// so a dispatcher that stalls (a loaded 2-core machine running the
	// suite at -race) catches up on what fell due meanwhile: a stall of d
	// seconds puts rate*(1+d) in one second. Allow half a second of it;
	// an unpaced replay puts all n (twice the rate) in one.
	for i := range ts {
		j := i
		for j < len(ts) && ts[j].Sub(ts[i]) < time.Second {
			j++
		}
		if j-i > int(1.5*rate) {
			t.Fatalf("%d messages within one second from %v, want at most %v at %v/s", j-i, ts[i], int(1.5*rate), rate)
		}
	}
	waitRows(t, db.Pool, 5*time.Second, "SELECT count(*) FROM deferred_message", 0)
}
