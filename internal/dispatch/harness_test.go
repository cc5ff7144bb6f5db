package dispatch

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	deferral "github.com/deferq/scheduler/internal/defer"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// env is one test's database and broker.
type env struct {
	t        *testing.T
	pool     *pgxpool.Pool
	broker   *kfake.Cluster
	addr     string
	producer *batchproducer.Producer
}

const (
	topicA = "orders.retry"
	topicB = "payments.retry"
)

func newEnv(t *testing.T, opts ...kfake.Opt) *env {
	t.Helper()
	db := pgtest.NewDB(t)
	broker, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1), kfake.SeedTopics(4, topicA, topicB)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(broker.Close)
	e := &env{t: t, pool: db.Pool, broker: broker, addr: broker.ListenAddrs()[0]}
	e.producer = e.newProducer()
	return e
}

// newProducer returns the producer the service dispatches with.
func (e *env) newProducer() *batchproducer.Producer {
	e.t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	p, err := batchproducer.New([]string{e.addr}, ProducerConfig(c))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { p.Close() })
	return p
}

func testLogger(t *testing.T) *slog.Logger {
	if testing.Verbose() && os.Getenv("TEST_LOGS") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

var allowAll = deferral.TargetPatterns{"*"}

func (e *env) dispatcher(owner string, lease time.Duration, targets deferral.TargetPatterns) *Dispatcher {
	e.t.Helper()
	l, err := keylock.New(e.pool, keylock.Config{Owner: owner, Lease: lease, PerKey: 100})
	if err != nil {
		e.t.Fatal(err)
	}
	d, err := New(l, e.producer, nil, Config{BatchKeys: 100, PollInterval: 50 * time.Millisecond,
		MaxBackoff: 200 * time.Millisecond, Targets: targets}, testLogger(e.t))
	if err != nil {
		e.t.Fatal(err)
	}
	return d
}

// msg is a row to insert straight into deferred_message.
type msg struct {
	key     *string // business key; nil: unordered
	seq     int64   // 0: from the sequence
	target  string
	in      time.Duration // due in (negative: overdue)
	attempt int
	recKey  []byte
	value   []byte
	hkeys   []string
	hvals   [][]byte
	// release: once parked, the message releases its key (park_holds_key
	// false) instead of holding it.
	release bool
	redrive int    // redrive_count
	dlq     string // dlq_topic; "": none
}

func str(s string) *string { return &s }

// insert stores rows, one statement each so seq follows the slice order,
// and returns their ids.
func (e *env) insert(rows ...msg) []int64 {
	e.t.Helper()
	ids := make([]int64, len(rows))
	for i, r := range rows {
		if r.hkeys == nil {
			r.hkeys, r.hvals = []string{}, [][]byte{}
		}
		var seq *int64
		if r.seq > 0 {
			seq = &r.seq
		}
		err := e.pool.QueryRow(context.Background(), `
			INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, attempt, key, value, header_keys, header_values,
				park_holds_key, redrive_count, dlq_topic)
			VALUES ($1, coalesce($2, nextval('deferred_message_seq')), $3, now() + $4::interval, $5, $6, $7, $8, $9,
				$10, $11, nullif($12, ''))
			RETURNING id`,
			r.key, seq, r.target, r.in, r.attempt, r.recKey, r.value, r.hkeys, r.hvals, !r.release, r.redrive, r.dlq).Scan(&ids[i])
		if err != nil {
			e.t.Fatalf("insert %+v: %v", r, err)
		}
	}
	return ids
}

func (e *env) count(where string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_message WHERE "+where, args...).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// drain runs rounds until nothing is due, or fails after the timeout.
// Messages waiting behind a key held by a parked message do not count: they
// are not due to go.
func (e *env) drain(d *Dispatcher, within time.Duration) {
	e.t.Helper()
	deadline := time.Now().Add(within)
	for {
		st, err := d.Round(context.Background())
		if err != nil {
			e.t.Fatalf("round: %v", err)
		}
		if st.Keys == 0 && e.count(dueNotHeld) == 0 {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("still %d due messages after %v", e.count(dueNotHeld), within)
		}
		if st.Keys == 0 {
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// dueNotHeld selects the pending due messages of keys not held by a parked
// message.
const dueNotHeld = `state = 'pending' AND next_run_at <= now() AND (business_key IS NULL OR NOT EXISTS (
	SELECT FROM deferred_key k WHERE k.business_key = deferred_message.business_key AND k.held))`

// collector reads every partition of some topics from the oldest offset.
type collector struct {
	mu   sync.Mutex
	msgs []*sarama.ConsumerMessage
}

func (e *env) collect(topics ...string) *collector {
	e.t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	consumer, err := sarama.NewConsumer([]string{e.addr}, c)
	if err != nil {
		e.t.Fatal(err)
	}
	col := &collector{}
	var wg sync.WaitGroup
	var pcs []sarama.PartitionConsumer
	for _, topic := range topics {
		parts, err := consumer.Partitions(topic)
		if err != nil {
			e.t.Fatal(err)
		}
		for _, p := range parts {
			pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
			if err != nil {
				e.t.Fatal(err)
			}
			pcs = append(pcs, pc)
			wg.Go(func() {
				for m := range pc.Messages() {
					col.mu.Lock()
					col.msgs = append(col.msgs, m)
					col.mu.Unlock()
				}
			})
		}
	}
	e.t.Cleanup(func() {
		// sarama wants partition consumers closed before their consumer.
		for _, pc := range pcs {
			pc.AsyncClose()
		}
		wg.Wait()
		consumer.Close()
	})
	return col
}

// wait returns the collected messages once there are at least n.
func (c *collector) wait(t *testing.T, n int, within time.Duration) []*sarama.ConsumerMessage {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		c.mu.Lock()
		got := append([]*sarama.ConsumerMessage(nil), c.msgs...)
		c.mu.Unlock()
		if len(got) >= n {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("got %d messages, want %d, within %v", len(got), n, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (c *collector) snapshot() []*sarama.ConsumerMessage {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*sarama.ConsumerMessage(nil), c.msgs...)
}

func hdr(m *sarama.ConsumerMessage, key string) string {
	for _, h := range m.Headers {
		if string(h.Key) == key {
			return string(h.Value)
		}
	}
	return ""
}

func mustEqual[T comparable](t *testing.T, what string, got, want T) {
	t.Helper()
	if got != want {
		t.Fatalf("%s = %v, want %v", what, got, want)
	}
}

func fmtIDs(ms []*sarama.ConsumerMessage) string {
	s := ""
	for _, m := range ms {
		s += fmt.Sprintf("%s:%s ", m.Key, hdr(m, "defer.id"))
	}
	return s
}

// eventually calls cond until it returns true, failing the test after
// within.
func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
