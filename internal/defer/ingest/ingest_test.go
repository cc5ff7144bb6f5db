package ingest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/internal/policy"
)

const (
	ingestTopic      = "scheduler.defer"
	ingestPartitions = 3
)

func ingestRules() protocol.Rules {
	return protocol.Rules{Targets: protocol.TargetPatterns{"orders.*", "payments.retry"}, MaxDelay: 24 * time.Hour}
}

// kafkaEnv is an in-process broker with the defer topic, spoken to over TCP.
type kafkaEnv struct {
	addrs    []string
	producer sarama.SyncProducer
	admin    sarama.ClusterAdmin
}

func saramaConfig() *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	return cfg
}

func newKafka(t *testing.T) *kafkaEnv {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(ingestPartitions, ingestTopic))
	if err != nil {
		t.Fatalf("start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	k := &kafkaEnv{addrs: c.ListenAddrs()}

	pc := saramaConfig()
	pc.Producer.Return.Successes = true
	pc.Producer.RequiredAcks = sarama.WaitForAll
	pc.Producer.Partitioner = sarama.NewManualPartitioner
	k.producer, err = sarama.NewSyncProducer(k.addrs, pc)
	if err != nil {
		t.Fatalf("producer: %v", err)
	}
	t.Cleanup(func() { k.producer.Close() })

	k.admin, err = sarama.NewClusterAdmin(k.addrs, saramaConfig())
	if err != nil {
		t.Fatalf("cluster admin: %v", err)
	}
	t.Cleanup(func() { k.admin.Close() })
	return k
}

// rec builds a record for partition p; nil key or value are produced as null.
// kv are header key, value pairs.
func rec(p int32, key, value []byte, kv ...string) *sarama.ProducerMessage {
	m := &sarama.ProducerMessage{Topic: ingestTopic, Partition: p}
	if key != nil {
		m.Key = sarama.ByteEncoder(key)
	}
	if value != nil {
		m.Value = sarama.ByteEncoder(value)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(kv[i]), Value: []byte(kv[i+1])})
	}
	return m
}

// validRec is a record that schedules fine.
func validRec(p int32, key string, value string, kv ...string) *sarama.ProducerMessage {
	return rec(p, []byte(key), []byte(value), append([]string{protocol.HeaderTarget, "orders.created", protocol.HeaderDelay, "1h"}, kv...)...)
}

// produce sends msgs and fills in their offsets.
func (k *kafkaEnv) produce(t testing.TB, msgs ...*sarama.ProducerMessage) {
	t.Helper()
	if err := k.producer.SendMessages(msgs); err != nil {
		t.Fatalf("produce %d records: %v", len(msgs), err)
	}
}

// committed returns the group's committed offset per partition (-1: none).
func (k *kafkaEnv) committed(t testing.TB, group string) map[int32]int64 {
	t.Helper()
	parts := make([]int32, ingestPartitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	resp, err := k.admin.ListConsumerGroupOffsets(group, map[string][]int32{ingestTopic: parts})
	if err != nil {
		t.Fatalf("list offsets of group %s: %v", group, err)
	}
	out := map[int32]int64{}
	for _, p := range parts {
		b := resp.GetBlock(ingestTopic, p)
		if b == nil {
			t.Fatalf("no committed offset block for partition %d", p)
		}
		if b.Err != sarama.ErrNoError {
			t.Fatalf("committed offset of partition %d: %v", p, b.Err)
		}
		out[p] = b.Offset
	}
	return out
}

// checkCommittedStored fails unless every record below each committed offset
// is in the table: a committed offset must never run ahead of the rows.
func checkCommittedStored(t testing.TB, pool *pgxpool.Pool, committed map[int32]int64) {
	t.Helper()
	for p, c := range committed {
		if c <= 0 {
			continue
		}
		var n int64
		if err := pool.QueryRow(context.Background(),
			"SELECT count(*) FROM deferred_message WHERE source_topic = $1 AND source_partition = $2 AND source_offset < $3",
			ingestTopic, p, c).Scan(&n); err != nil {
			t.Fatalf("count stored: %v", err)
		}
		if n != c {
			t.Fatalf("partition %d: offset %d committed but only %d of the records below it are stored", p, c, n)
		}
	}
}

// waitFor polls cond until it holds or timeout passes; what describes the
// state for the failure message.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v still waiting for %s: %s", timeout, what, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// testLog collects the ingester's logs and prints them if the test fails.
// It never writes to t from another goroutine after the test ended.
type testLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *testLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *testLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// newTestLog returns a logger for the test and what it wrote, printed when
// the test fails.
func newTestLog(t *testing.T) (*slog.Logger, *testLog) {
	l := &testLog{}
	t.Cleanup(func() {
		if t.Failed() {
			l.mu.Lock()
			defer l.mu.Unlock()
			t.Logf("ingester logs:\n%s", l.buf.String())
		}
	})
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelInfo})), l
}

// runningIngester is an Ingester running on its own consumer group client.
type runningIngester struct {
	in       *Ingester
	consumer *Consumer
	log      *testLog
	cancel   context.CancelFunc
	done     chan error
	once     sync.Once
}

// startIngester runs an Ingester in group until ctx ends or stop is called.
// afterStore, if not nil, is installed as the test hook. cfg.Rules without
// targets means ingestRules().
func startIngester(ctx context.Context, t *testing.T, k *kafkaEnv, pool *pgxpool.Pool, groupID string, cfg IngestConfig, afterStore func() error) *runningIngester {
	t.Helper()
	return startIngesterWith(ctx, t, k, pool, groupID, cfg, func(in *Ingester) { in.afterStore = afterStore })
}

// startIngesterWith is startIngester with hooks: set calls it on the
// Ingester before it runs.
func startIngesterWith(ctx context.Context, t *testing.T, k *kafkaEnv, pool *pgxpool.Pool, groupID string, cfg IngestConfig, set func(*Ingester)) *runningIngester {
	t.Helper()
	consumer, err := NewConsumer(k.addrs, groupID, saramaConfig(), cfg.Budget)
	if err != nil {
		t.Fatalf("consumer group: %v", err)
	}
	group := consumer.Group
	cfg.Topic = ingestTopic
	cfg.Group = groupID
	cfg.Log = consumer.Log()
	if cfg.Rules.Targets == nil {
		cfg.Rules = ingestRules()
	}
	logger, log := newTestLog(t)
	in, err := NewIngester(group, NewStore(pool, nil), cfg, logger)
	if err != nil {
		consumer.Close()
		t.Fatalf("NewIngester: %v", err)
	}
	set(in)
	ctx, cancel := context.WithCancel(ctx)
	r := &runningIngester{in: in, consumer: consumer, log: log, cancel: cancel, done: make(chan error, 1)}
	go func() {
		in.Run(ctx)
		r.done <- nil
	}()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// wait waits for Run to return, then leaves the group.
func (r *runningIngester) wait(t testing.TB) {
	t.Helper()
	r.once.Do(func() {
		select {
		case err := <-r.done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("Run did not return within 30s of its context ending")
		}
		if err := r.consumer.Close(); err != nil {
			t.Logf("close consumer group: %v", err)
		}
	})
}

// logs returns what the ingester logged so far.
func (r *runningIngester) logs() string { return r.log.String() }

// stop cancels Run and waits for it.
func (r *runningIngester) stop(t testing.TB) {
	t.Helper()
	r.cancel()
	r.wait(t)
}

func (r *runningIngester) waitJoined(t testing.TB) {
	t.Helper()
	waitFor(t, 20*time.Second, "the ingester to join its group", func() (bool, string) {
		return r.in.Joined(), "not joined"
	})
}

// waitRows waits until the table holds n rows.
func waitRows(t testing.TB, pool *pgxpool.Pool, n int64, timeout time.Duration) {
	t.Helper()
	waitFor(t, timeout, fmt.Sprintf("%d rows", n), func() (bool, string) {
		got := countRows(t, pool)
		return got == n, fmt.Sprintf("%d rows", got)
	})
}

// rowAt returns the row of partition p and offset off.
func rowAt(t *testing.T, pool *pgxpool.Pool, p int32, off int64) storedRow {
	t.Helper()
	rows := readRows(t, pool, "source_topic = $1 AND source_partition = $2 AND source_offset = $3", ingestTopic, p, off)
	if len(rows) != 1 {
		t.Fatalf("%d rows at %d/%d, want 1", len(rows), p, off)
	}
	return rows[0]
}

// TestIngestEndToEnd produces a mix of valid and invalid records over every
// partition, some before the group first starts and some after, and checks
// the rows and the committed offsets.
func TestIngestEndToEnd(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	const group = "ingest-e2e"

	binKey := []byte{0xff, 0x00, 0x01}
	// Within MaxDelay of now, in another zone, to the microsecond.
	atTime := time.Now().Add(2 * time.Hour).Truncate(time.Microsecond).UTC()
	at := atTime.In(time.FixedZone("", 2*3600)).Format("2006-01-02T15:04:05.000000Z07:00")
	target := "orders.created"
	pay := "payments.retry"

	withHeaders := rec(2, []byte("order-h"), []byte("v"), protocol.HeaderTarget, pay, "trace", "t1", protocol.HeaderDelay, "2500", "trace", "t2")
	withHeaders.Headers = append(withHeaders.Headers,
		sarama.RecordHeader{Key: []byte("bin"), Value: []byte{0xff, 0xfe, 0x00}},
		sarama.RecordHeader{Key: []byte("null"), Value: nil},
		sarama.RecordHeader{Key: []byte("empty"), Value: []byte{}})
	badHeaderKey := rec(2, []byte("order-x"), []byte("v"), protocol.HeaderTarget, target, protocol.HeaderDelay, "1s")
	badHeaderKey.Headers = append(badHeaderKey.Headers, sarama.RecordHeader{Key: []byte{0xc3, 0x28}, Value: []byte("v")})

	cases := []struct {
		name string
		msg  *sarama.ProducerMessage
		want rowWant
		// reasonPrefix replaces want.reason for rejected rows.
		reasonPrefix string
	}{
		{
			name: "valid, ordered by the record key",
			msg:  validRec(0, "order-1", "v1", "trace", "t"),
			want: rowWant{bizKey: ptr("order-1"), target: &target, delay: time.Hour, state: "pending", key: []byte("order-1"), value: []byte("v1"),
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay, "trace"}, headerValues: [][]byte{[]byte(target), []byte("1h"), []byte("t")}, head: true},
		},
		{
			name: "non-UTF-8 record key: business key in hex form",
			msg:  rec(0, binKey, []byte("v2"), protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"),
			want: rowWant{bizKey: ptr(`\xff0001`), target: &target, delay: time.Hour, state: "pending", key: binKey, value: []byte("v2"),
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay}, headerValues: [][]byte{[]byte(target), []byte("1h")}, head: true},
		},
		{
			name: "null value",
			msg:  rec(0, []byte("order-2"), nil, protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"),
			want: rowWant{bizKey: ptr("order-2"), target: &target, delay: time.Hour, state: "pending", key: []byte("order-2"),
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay}, headerValues: [][]byte{[]byte(target), []byte("1h")}, head: true},
		},
		{
			name: "empty value",
			msg:  rec(0, []byte("order-3"), []byte{}, protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"),
			want: rowWant{bizKey: ptr("order-3"), target: &target, delay: time.Hour, state: "pending", key: []byte("order-3"), value: []byte{},
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay}, headerValues: [][]byte{[]byte(target), []byte("1h")}, head: true},
		},
		{
			name: "missing defer.target",
			msg:  rec(1, []byte("order-4"), []byte("v4"), protocol.HeaderDelay, "1h"),
			want: rowWant{bizKey: ptr("order-4"), delay: 0, state: "rejected", key: []byte("order-4"), value: []byte("v4"),
				headerKeys: []string{protocol.HeaderDelay}, headerValues: [][]byte{[]byte("1h")}},
			reasonPrefix: "missing_target: ",
		},
		{
			name: "target not allowed",
			msg:  rec(1, []byte("order-5"), []byte("v5"), protocol.HeaderTarget, "secrets", protocol.HeaderDelay, "1h"),
			want: rowWant{bizKey: ptr("order-5"), target: ptr("secrets"), state: "rejected", key: []byte("order-5"), value: []byte("v5"),
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay}, headerValues: [][]byte{[]byte("secrets"), []byte("1h")}},
			reasonPrefix: "target_not_allowed: ",
		},
		{
			name: "defer.at with offset, re-deferral with seq and id",
			msg: rec(1, []byte("order-6"), []byte("v6"), protocol.HeaderTarget, target, protocol.HeaderAt, at, protocol.HeaderAttempt, "4",
				protocol.HeaderSeq, "99", protocol.HeaderID, "1234", protocol.HeaderErrorClass, "transient", protocol.HeaderErrorMessage, "timeout"),
			want: rowWant{bizKey: ptr("order-6"), seq: 99, target: &target, at: atTime, attempt: 4, state: "pending",
				class: ptr("transient"), msg: ptr("timeout"), origin: ptr[int64](1234), key: []byte("order-6"), value: []byte("v6"),
				headerKeys:   []string{protocol.HeaderTarget, protocol.HeaderAt, protocol.HeaderAttempt, protocol.HeaderSeq, protocol.HeaderID, protocol.HeaderErrorClass, protocol.HeaderErrorMessage},
				headerValues: [][]byte{[]byte(target), []byte(at), []byte("4"), []byte("99"), []byte("1234"), []byte("transient"), []byte("timeout")},
				head:         true},
		},
		{
			name: "null key: unordered",
			msg:  rec(1, nil, []byte("v7"), protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"),
			want: rowWant{target: &target, delay: time.Hour, state: "pending", value: []byte("v7"),
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay}, headerValues: [][]byte{[]byte(target), []byte("1h")}, head: true},
		},
		{
			name: "defer.key overrides the record key",
			msg:  rec(2, []byte("x"), []byte("v8"), protocol.HeaderTarget, target, protocol.HeaderDelay, "1h", protocol.HeaderKey, "acct-7"),
			want: rowWant{bizKey: ptr("acct-7"), target: &target, delay: time.Hour, state: "pending", key: []byte("x"), value: []byte("v8"),
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay, protocol.HeaderKey}, headerValues: [][]byte{[]byte(target), []byte("1h"), []byte("acct-7")}, head: true},
		},
		{
			name: "headers kept in order with duplicates, binary, null and empty values",
			msg:  withHeaders,
			want: rowWant{bizKey: ptr("order-h"), target: &pay, delay: 2500 * time.Millisecond, state: "pending", key: []byte("order-h"), value: []byte("v"),
				headerKeys:   []string{protocol.HeaderTarget, "trace", protocol.HeaderDelay, "trace", "bin", "null", "empty"},
				headerValues: [][]byte{[]byte(pay), []byte("t1"), []byte("2500"), []byte("t2"), {0xff, 0xfe, 0x00}, nil, {}}, head: true},
		},
		{
			name: "unparsable delay",
			msg:  rec(2, []byte("order-9"), []byte("v9"), protocol.HeaderTarget, target, protocol.HeaderDelay, "soon"),
			want: rowWant{bizKey: ptr("order-9"), target: &target, state: "rejected", key: []byte("order-9"), value: []byte("v9"),
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay}, headerValues: [][]byte{[]byte(target), []byte("soon")}},
			reasonPrefix: "invalid_delay: ",
		},
		{
			name: "header key not UTF-8",
			msg:  badHeaderKey,
			want: rowWant{bizKey: ptr("order-x"), target: &target, state: "rejected", key: []byte("order-x"), value: []byte("v"),
				headerKeys: []string{protocol.HeaderTarget, protocol.HeaderDelay, `\xc328`}, headerValues: [][]byte{[]byte(target), []byte("1s"), []byte("v")}},
			reasonPrefix: "invalid_encoding: ",
		},
	}
	var wantRejected int64
	produced := map[int32]int64{}
	for _, c := range cases {
		k.produce(t, c.msg) // one at a time, so offsets follow the table
		produced[c.msg.Partition]++
		if c.want.state == "rejected" {
			wantRejected++
		}
	}

	// Produced before the group ever started: read from the oldest.
	r := startIngester(t.Context(), t, k, db.Pool, group, IngestConfig{BatchSize: 10, BatchLinger: 20 * time.Millisecond}, nil)
	r.waitJoined(t)

	// More while it runs, in several batches per partition.
	var bulk []*sarama.ProducerMessage
	for i := range 90 {
		p := int32(i % ingestPartitions)
		bulk = append(bulk, validRec(p, fmt.Sprintf("bulk-%d", i%7), fmt.Sprintf("b%d", i)))
		produced[p]++
	}
	for i := 0; i < len(bulk); i += 9 {
		k.produce(t, bulk[i:i+9]...)
	}
	total := int64(len(cases) + len(bulk))

	// Until everything is stored and committed, a committed offset must
	// never be ahead of the rows.
	waitFor(t, 30*time.Second, "every record stored and its offset committed", func() (bool, string) {
		committed := k.committed(t, group)
		checkCommittedStored(t, db.Pool, committed)
		n := countRows(t, db.Pool)
		for p, want := range produced {
			if committed[p] != want {
				return false, fmt.Sprintf("%d rows; committed %v, want %v", n, committed, produced)
			}
		}
		return n == total, fmt.Sprintf("%d rows of %d", n, total)
	})

	stored, rejected, dups := r.in.Counts()
	if stored != total || rejected != wantRejected || dups != 0 {
		t.Errorf("Counts() = stored %d, rejected %d, duplicates %d; want %d, %d, 0", stored, rejected, dups, total, wantRejected)
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := rowAt(t, db.Pool, c.msg.Partition, c.msg.Offset)
			want := c.want
			// Read, batched and written within a second here: the delay
			// counts from the read.
			want.waited = time.Second
			if c.reasonPrefix != "" {
				if got.Reason == nil || !strings.HasPrefix(*got.Reason, c.reasonPrefix) {
					t.Errorf("reason %s, want it to start with %q", fmtPtr(got.Reason), c.reasonPrefix)
				}
				want.reason = got.Reason
			}
			checkRow(t, c.name, got, want)
		})
	}
	for _, m := range bulk {
		got := rowAt(t, db.Pool, m.Partition, m.Offset)
		if got.State != "pending" || string(got.Value) != string(m.Value.(sarama.ByteEncoder)) {
			t.Errorf("%d/%d: state %q value %q, want pending %q", m.Partition, m.Offset, got.State, got.Value, m.Value)
		}
	}
}

// TestIngestRedeliveryStoredOnce crashes an ingester after its rows are
// committed but before its offsets are marked; the next one is given the
// same records again and stores nothing twice.
func TestIngestRedeliveryStoredOnce(t *testing.T) {
	tests := []struct {
		name string
		// between runs between the crashed ingester and its successor.
		between string
		// redelivered: the successor reads the crashed one's records again
		// (and must store them once); otherwise it resumes after them.
		redelivered bool
	}{
		{name: "resumes after the rows stored before the crash"},
		{
			// The crash window that matters: rows committed, offsets not,
			// and the rows dispatched and deleted meanwhile. Unique source
			// coordinates cannot help once the rows are gone.
			name:    "rows already dispatched are not stored again",
			between: "DELETE FROM deferred_message",
		},
		{
			name:        "records delivered twice are stored once",
			between:     "DELETE FROM ingest_offset",
			redelivered: true,
		},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			testRedelivery(t, fmt.Sprintf("ingest-redeliver-%d", i), tt.between, tt.redelivered)
		})
	}
}

func testRedelivery(t *testing.T, group, between string, redelivered bool) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	const perPartition = 20

	var msgs []*sarama.ProducerMessage
	for p := range int32(ingestPartitions) {
		for i := range perPartition {
			if i%5 == 0 {
				// Some rejected records too: a replay of them is a
				// duplicate like any other.
				msgs = append(msgs, rec(p, fmt.Appendf(nil, "k-%d-%d", p, i), []byte("bad"), protocol.HeaderDelay, "1h"))
				continue
			}
			msgs = append(msgs, validRec(p, fmt.Sprintf("k-%d-%d", p, i%3), fmt.Sprintf("v-%d-%d", p, i)))
		}
	}
	k.produce(t, msgs...)
	total := int64(len(msgs))

	ctx1, crash := context.WithCancel(t.Context())
	var hookCalls atomic.Int64
	first := startIngester(ctx1, t, k, db.Pool, group, IngestConfig{BatchSize: 7, BatchLinger: 20 * time.Millisecond}, func() error {
		hookCalls.Add(1)
		crash()
		return errors.New("simulated crash after the database commit")
	})
	first.wait(t)
	if hookCalls.Load() == 0 {
		t.Fatal("the first ingester never reached afterStore")
	}
	firstRows := readRows(t, db.Pool, "true")
	if len(firstRows) == 0 {
		t.Fatal("the first ingester stored nothing before its crash")
	}
	committed := k.committed(t, group)
	for p, c := range committed {
		if c >= 0 {
			t.Errorf("partition %d: offset %d committed although afterStore failed on every batch", p, c)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	if between != "" {
		if _, err := db.Pool.Exec(context.Background(), between); err != nil {
			t.Fatal(err)
		}
	}

	expectRead := total - int64(len(firstRows))
	if redelivered {
		expectRead = total
	}
	second := startIngester(t.Context(), t, k, db.Pool, group, IngestConfig{BatchSize: 7, BatchLinger: 20 * time.Millisecond}, nil)
	waitFor(t, 30*time.Second, "the second ingester to read every record left", func() (bool, string) {
		s, _, d := second.in.Counts()
		return s+d >= expectRead, fmt.Sprintf("stored %d + duplicates %d of %d", s, d, expectRead)
	})
	wantRows := total
	if between == "DELETE FROM deferred_message" {
		wantRows = total - int64(len(firstRows))
	}
	if n := countRows(t, db.Pool); n != wantRows {
		t.Errorf("table holds %d rows, want %d", n, wantRows)
	}
	var distinct int64
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT count(DISTINCT (source_partition, source_offset)) FROM deferred_message").Scan(&distinct); err != nil {
		t.Fatal(err)
	}
	if distinct != wantRows {
		t.Errorf("%d distinct source offsets, want %d", distinct, wantRows)
	}
	stored, _, dups := second.in.Counts()
	wantDups := int64(0)
	if redelivered {
		wantDups = int64(len(firstRows))
	}
	if dups != wantDups || stored != total-int64(len(firstRows)) {
		t.Errorf("second ingester: stored %d, duplicates %d; want %d, %d",
			stored, dups, total-int64(len(firstRows)), wantDups)
	}
	if between != "DELETE FROM deferred_message" {
		// Rows the first ingester stored were left alone.
		for _, r := range firstRows {
			got := rowAt(t, db.Pool, r.Partition, r.Offset)
			if got.ID != r.ID || got.Seq != r.Seq || !got.CreatedAt.Equal(r.CreatedAt) {
				t.Errorf("%d/%d changed on replay: id %d seq %d, was id %d seq %d", r.Partition, r.Offset, got.ID, got.Seq, r.ID, r.Seq)
			}
		}
	}
	waitFor(t, 30*time.Second, "offsets committed", func() (bool, string) {
		c := k.committed(t, group)
		for p := range int32(ingestPartitions) {
			if c[p] != perPartition {
				return false, fmt.Sprintf("committed %v", c)
			}
		}
		return true, ""
	})
}

// TestIngestCountsOnReplay reads records that are all stored already, as a
// new group would: Counts says rows stored, of which rejected, and records
// skipped as already stored, so a replay is all duplicates and no rejections.
func TestIngestCountsOnReplay(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	msgs := []*sarama.ProducerMessage{
		validRec(0, "k-1", "v1"),
		rec(0, []byte("k-2"), []byte("bad"), protocol.HeaderDelay, "1h"),
		validRec(1, "k-3", "v3"),
		rec(2, []byte("k-4"), []byte("bad"), protocol.HeaderTarget, "secrets", protocol.HeaderDelay, "1h"),
	}
	k.produce(t, msgs...)
	total := int64(len(msgs))
	cfg := IngestConfig{BatchSize: 10, BatchLinger: 10 * time.Millisecond}

	first := startIngester(t.Context(), t, k, db.Pool, "ingest-counts-1", cfg, nil)
	waitFor(t, 30*time.Second, "the first ingester to read every record", func() (bool, string) {
		s, _, d := first.in.Counts()
		return s+d >= total, fmt.Sprintf("stored %d + duplicates %d of %d", s, d, total)
	})
	if s, rj, d := first.in.Counts(); s != total || rj != 2 || d != 0 {
		t.Errorf("first ingester: Counts() = %d, %d, %d; want %d, 2, 0", s, rj, d, total)
	}
	first.stop(t)

	// Another group starts from the oldest record. Ingest positions live in
	// the database (ingest_offset), so a new group would resume after the
	// stored rows; forget them to make this one read everything again.
	if _, err := db.Pool.Exec(context.Background(), "DELETE FROM ingest_offset"); err != nil {
		t.Fatal(err)
	}
	second := startIngester(t.Context(), t, k, db.Pool, "ingest-counts-2", cfg, nil)
	waitFor(t, 30*time.Second, "the second ingester to read every record", func() (bool, string) {
		s, _, d := second.in.Counts()
		return s+d >= total, fmt.Sprintf("stored %d + duplicates %d of %d", s, d, total)
	})
	if s, rj, d := second.in.Counts(); s != 0 || rj != 0 || d != total {
		t.Errorf("replay: Counts() = stored %d, rejected %d, duplicates %d; want 0, 0, %d (rejected must count rows stored, not records parsed)",
			s, rj, d, total)
	}
	if n := countRows(t, db.Pool); n != total {
		t.Errorf("table holds %d rows, want %d", n, total)
	}
}

// TestIngestBatching checks that a batch is written when it is full and
// when its first record has waited BatchLinger, whichever comes first, and
// at once when nothing else is read or written; and that a batch of records
// due later than FutureLinger plus FutureMargin waits FutureLinger unless a
// record due sooner joins it or Flush is called.
func TestIngestBatching(t *testing.T) {
	tests := []struct {
		name   string
		size   int
		linger time.Duration
		always bool          // AlwaysLinger
		future time.Duration // FutureLinger
		n      int
		// delays are the records' defer.delay, in turn (default 1h).
		delays []string
		// flushAfter, when set, calls Flush that long after the produce;
		// flushBefore calls it before.
		flushAfter  time.Duration
		flushBefore bool
		// The records are stored within within of their produce and no
		// sooner than notBefore.
		within, notBefore time.Duration
	}{
		{name: "linger flushes a small batch", size: 1000, linger: 50 * time.Millisecond, always: true, n: 10, within: time.Second},
		{name: "a small batch waits for the linger", size: 1000, linger: 3 * time.Second, always: true, n: 10, within: 10 * time.Second, notBefore: 3 * time.Second},
		{name: "a full batch does not wait for the linger", size: 5, linger: 10 * time.Second, n: 5, within: 2 * time.Second},
		{name: "a lone record does not wait for the linger", size: 1000, linger: 10 * time.Second, n: 1, within: 2 * time.Second},
		{name: "far records wait for the future linger", size: 1000, linger: 20 * time.Millisecond, future: 3 * time.Second,
			n: 10, within: 10 * time.Second, notBefore: 3 * time.Second},
		{name: "a far record alone waits for the future linger", size: 1000, linger: 20 * time.Millisecond, future: 3 * time.Second,
			n: 1, within: 10 * time.Second, notBefore: 3 * time.Second},
		{name: "a record due within the future linger and its margin does not wait", size: 1000, linger: 20 * time.Millisecond,
			future: 3 * time.Second, n: 1, delays: []string{"3900ms"}, within: 2 * time.Second},
		{name: "a record due at once takes far ones with it", size: 1000, linger: 20 * time.Millisecond, future: 10 * time.Second,
			n: 10, delays: []string{"1h", "1h", "1h", "1h", "1h", "1h", "1h", "1h", "1h", "0s"}, within: 2 * time.Second},
		{name: "a record defer.at far ahead waits", size: 1000, linger: 20 * time.Millisecond, future: 3 * time.Second,
			n: 1, delays: []string{"at+1h"}, within: 10 * time.Second, notBefore: 3 * time.Second},
		{name: "Flush writes a lingering batch", size: 1000, linger: 20 * time.Millisecond, future: 10 * time.Second,
			n: 10, flushAfter: 500 * time.Millisecond, within: 3 * time.Second, notBefore: 500 * time.Millisecond},
		// A Flush is for what is held when it comes, not a standing order.
		{name: "Flush with nothing read leaves later records to linger", size: 1000, linger: 20 * time.Millisecond,
			future: 3 * time.Second, n: 1, flushBefore: true, within: 10 * time.Second, notBefore: 3 * time.Second},
		{name: "a full batch of far records does not wait", size: 5, linger: 20 * time.Millisecond, future: 10 * time.Second,
			n: 5, within: 2 * time.Second},
		{name: "a record rejected at ingest takes far ones with it", size: 1000, linger: 20 * time.Millisecond, future: 10 * time.Second,
			n: 5, delays: []string{"1h", "1h", "1h", "1h", "forever"}, within: 2 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			k := newKafka(t)
			r := startIngester(t.Context(), t, k, db.Pool, "ingest-batching",
				IngestConfig{BatchSize: tt.size, BatchLinger: tt.linger, AlwaysLinger: tt.always, FutureLinger: tt.future}, nil)
			r.waitJoined(t)

			msgs := make([]*sarama.ProducerMessage, tt.n)
			for i := range msgs {
				delay := "1h"
				if len(tt.delays) > 0 {
					delay = tt.delays[i%len(tt.delays)]
				}
				if at, ok := strings.CutPrefix(delay, "at+"); ok {
					d, err := time.ParseDuration(at)
					if err != nil {
						t.Fatal(err)
					}
					msgs[i] = rec(0, fmt.Appendf(nil, "k-%d", i), []byte("v"), protocol.HeaderTarget, "orders.created",
						protocol.HeaderAt, time.Now().Add(d).UTC().Format(time.RFC3339Nano))
					continue
				}
				msgs[i] = rec(0, fmt.Appendf(nil, "k-%d", i), []byte("v"), protocol.HeaderTarget, "orders.created", protocol.HeaderDelay, delay)
			}
			if tt.flushBefore {
				r.in.Flush()
			}
			start := time.Now()
			k.produce(t, msgs...)
			if tt.flushAfter > 0 {
				time.Sleep(tt.flushAfter)
				r.in.Flush()
			}
			waitRows(t, db.Pool, int64(tt.n), tt.within+5*time.Second)
			if took := time.Since(start); took > tt.within || took < tt.notBefore {
				t.Errorf("%d records stored %v after produce, want within %v and not before %v (batch size %d, linger %v, always linger %v, future linger %v, delays %v)",
					tt.n, took, tt.within, tt.notBefore, tt.size, tt.linger, tt.always, tt.future, tt.delays)
			} else {
				t.Logf("%d records stored %v after produce", tt.n, took)
			}
		})
	}
}

// TestIngestFlushDuringAWrite checks that a Flush that comes while a claim
// is writing a batch is not lost: the records read after that write,
// which a key-state query may be waiting for, go at once, not after
// FutureLinger. The write of a record due now is held in afterStore while
// a far record is produced behind it and Flush is called.
func TestIngestFlushDuringAWrite(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	inStore, release := make(chan struct{}, 1), make(chan struct{})
	var held atomic.Bool
	afterStore := func() error {
		if held.CompareAndSwap(false, true) {
			inStore <- struct{}{}
			<-release
		}
		return nil
	}
	// The budget counts a record when the consumer queues it for the
	// claim: how the test knows the far record waits behind the write.
	budget := NewBudget(1 << 20)
	r := startIngester(t.Context(), t, k, db.Pool, "ingest-flush-write",
		IngestConfig{BatchSize: 1000, BatchLinger: 20 * time.Millisecond, FutureLinger: 10 * time.Second, Budget: budget}, afterStore)
	r.waitJoined(t)

	k.produce(t, rec(0, []byte("k-now"), []byte("v"), protocol.HeaderTarget, "orders.created", protocol.HeaderDelay, "0s"))
	select {
	case <-inStore:
	case <-time.After(10 * time.Second):
		t.Fatal("the record due now was not written within 10s")
	}
	writing := budget.Used()
	k.produce(t, rec(0, []byte("k-far"), []byte("v"), protocol.HeaderTarget, "orders.created", protocol.HeaderDelay, "1h"))
	for deadline := time.Now().Add(10 * time.Second); budget.Used() == writing; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the far record was not queued for the claim within 10s")
		}
	}
	time.Sleep(20 * time.Millisecond) // from the budget's count to the claim's queue
	r.in.Flush()
	start := time.Now()
	close(release)
	waitRows(t, db.Pool, 2, 15*time.Second)
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("the far record was stored %v after the write ended, want well within the 10s future linger: the Flush was lost", took)
	}
}

// TestIngestDelayCountsFromRead checks that the time a record waits in
// ingest for its batch comes off its defer.delay and off its retry
// policy's delay, and not off a defer.at: a record is due its delay after
// ingest read it, however long its batch lingered.
func TestIngestDelayCountsFromRead(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	set, err := policy.Parse("orders.*: exponential 1m x2 cap 1h max 5", 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	rules := ingestRules()
	rules.Policies = set
	r := startIngester(t.Context(), t, k, db.Pool, "ingest-delay-read",
		IngestConfig{Rules: rules, BatchSize: 1000, BatchLinger: 20 * time.Millisecond, FutureLinger: 2 * time.Second}, nil)
	r.waitJoined(t)

	at := time.Now().Add(time.Hour).UTC().Truncate(time.Microsecond)
	delayed := rec(0, []byte("k-delay"), []byte("v"), protocol.HeaderTarget, "orders.created", protocol.HeaderDelay, "1m")
	byPolicy := rec(0, []byte("k-policy"), []byte("v"), protocol.HeaderTarget, "orders.created")
	fixed := rec(0, []byte("k-at"), []byte("v"), protocol.HeaderTarget, "orders.created", protocol.HeaderAt, at.Format(time.RFC3339Nano))
	start := time.Now()
	k.produce(t, delayed, byPolicy, fixed)
	waitRows(t, db.Pool, 3, 10*time.Second)
	stored := time.Since(start)
	if stored < 2*time.Second {
		t.Fatalf("stored %v after produce; the batch should have lingered 2s", stored)
	}

	for _, m := range []*sarama.ProducerMessage{delayed, byPolicy} {
		d := rowAt(t, db.Pool, 0, m.Offset)
		// Due a minute after the read, which was at most a few hundred
		// milliseconds after the produce; counted from the write, it
		// would be due two seconds later than that.
		if got := d.NextRunAt.Sub(start); got < time.Minute || got > time.Minute+500*time.Millisecond {
			t.Errorf("offset %d, delay 1m, batch lingered %v: due %v after produce, want 1m to 1m0.5s", m.Offset, stored, got)
		}
		if got := d.NextRunAt.Sub(d.CreatedAt); got > time.Minute-time.Second {
			t.Errorf("offset %d: due %v after the row was written, want the linger's time (about 2s) taken off the minute", m.Offset, got)
		}
	}
	if f := rowAt(t, db.Pool, 0, fixed.Offset); !f.NextRunAt.Equal(at) {
		t.Errorf("defer.at %v stored as %v, want it unchanged", at, f.NextRunAt)
	}
}

// TestIngestRejectedFlood checks that many bad records do not hold up the
// good one behind them.
func TestIngestRejectedFlood(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	const bad = 500
	msgs := make([]*sarama.ProducerMessage, 0, bad+1)
	for i := range bad {
		msgs = append(msgs, rec(0, fmt.Appendf(nil, "k-%d", i%10), []byte("bad"), protocol.HeaderDelay, "1s"))
	}
	good := validRec(0, "k-1", "good")
	msgs = append(msgs, good)
	k.produce(t, msgs...)

	r := startIngester(t.Context(), t, k, db.Pool, "ingest-flood", IngestConfig{BatchSize: 100, BatchLinger: 20 * time.Millisecond}, nil)
	waitRows(t, db.Pool, bad+1, 30*time.Second)

	got := rowAt(t, db.Pool, 0, good.Offset)
	if got.State != "pending" || !got.Head || string(got.Value) != "good" {
		t.Errorf("the valid record: state %q, head %v, value %q; want a pending head with value good", got.State, got.Head, got.Value)
	}
	var rejected, heads int64
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT count(*) FILTER (WHERE state = 'rejected' AND reason LIKE 'missing_target: %'), (SELECT count(*) FROM deferred_key) FROM deferred_message").
		Scan(&rejected, &heads); err != nil {
		t.Fatal(err)
	}
	if rejected != bad || heads != 1 {
		t.Errorf("%d rows rejected for missing_target and %d heads, want %d and 1", rejected, heads, bad)
	}
	waitFor(t, 10*time.Second, "the offset committed past the valid record", func() (bool, string) {
		c := k.committed(t, "ingest-flood")
		return c[0] == bad+1, fmt.Sprintf("committed %v", c)
	})
	if s, rj, d := r.in.Counts(); s != bad+1 || rj != bad || d != 0 {
		t.Errorf("Counts() = %d, %d, %d; want %d, %d, 0", s, rj, d, bad+1, bad)
	}
}

// TestIngestShutdown stops an ingester while records flow and checks that no
// committed record is missing and that a restart stores the rest once.
func TestIngestShutdown(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	const (
		group  = "ingest-shutdown"
		chunks = 100
		chunk  = 30
		quiet  = 7 // records on each of partitions 1 and 2
		total  = chunks*chunk + 2*quiet

		stopAfter = 2 // batches
	)
	// Partitions 1 and 2 get a few records, fewer than a batch: with a long
	// linger the ingester still holds them when it stops. They must be
	// stored before their offsets are committed, or not committed at all.
	var quietMsgs []*sarama.ProducerMessage
	for p := int32(1); p <= 2; p++ {
		for i := range quiet {
			quietMsgs = append(quietMsgs, validRec(p, fmt.Sprintf("q-%d", i), fmt.Sprintf("q-%d-%d", p, i)))
		}
	}
	k.produce(t, quietMsgs...)
	counts := map[int32]int64{0: chunks * chunk, 1: quiet, 2: quiet}

	// Partition 0 gets a stream that starts once the first ingester has
	// joined and goes on while it stops.
	joined := make(chan struct{})
	producerDone := make(chan struct{})
	t.Cleanup(func() { <-producerDone }) // before the producer is closed
	var producing atomic.Bool
	producing.Store(true)
	go func() {
		defer close(producerDone)
		defer producing.Store(false)
		select {
		case <-joined:
		case <-t.Context().Done():
			return
		}
		for c := range chunks {
			msgs := make([]*sarama.ProducerMessage, chunk)
			for i := range msgs {
				n := c*chunk + i
				msgs[i] = validRec(0, fmt.Sprintf("k-%d", n%50), fmt.Sprintf("v-%d", n))
			}
			if err := k.producer.SendMessages(msgs); err != nil {
				t.Errorf("produce: %v", err)
				return
			}
		}
	}()

	// Stop from inside the flow, once partition 0 has stored a few batches.
	ctx1, stop1 := context.WithCancel(t.Context())
	var batches atomic.Int64
	var stillProducing atomic.Bool
	first := startIngester(ctx1, t, k, db.Pool, group, IngestConfig{BatchSize: 50, BatchLinger: time.Minute, AlwaysLinger: true}, func() error {
		if batches.Add(1) == stopAfter {
			stillProducing.Store(producing.Load())
			stop1()
		}
		return nil
	})
	first.waitJoined(t)
	close(joined)
	first.wait(t)
	if batches.Load() < stopAfter {
		t.Fatalf("the first ingester stopped after %d batches", batches.Load())
	}

	// No loss: everything below a committed offset is in the table.
	committed := k.committed(t, group)
	checkCommittedStored(t, db.Pool, committed)
	rows1 := readRows(t, db.Pool, "true")
	var behind int64 // stored but not committed: the next ingester reads them again
	for _, r := range rows1 {
		if r.Offset >= committed[r.Partition] {
			behind++
		}
	}
	var sumCommitted int64
	for _, c := range committed {
		sumCommitted += max(c, 0)
	}
	t.Logf("first ingester: %d rows, committed %v (producer still running: %v), %d stored beyond the committed offsets",
		len(rows1), committed, stillProducing.Load(), behind)

	select {
	case <-producerDone:
	case <-time.After(60 * time.Second):
		t.Fatal("producer did not finish")
	}

	// A restart reads from the committed offsets and stores the rest once.
	second := startIngester(t.Context(), t, k, db.Pool, group, IngestConfig{BatchSize: 50, BatchLinger: 10 * time.Millisecond}, nil)
	waitFor(t, 60*time.Second, "every record stored", func() (bool, string) {
		n := countRows(t, db.Pool)
		s, _, d := second.in.Counts()
		return n == total && s+d >= total-sumCommitted, fmt.Sprintf("%d rows of %d; second stored %d duplicates %d", n, total, s, d)
	})
	stored, _, dups := second.in.Counts()
	if stored != total-int64(len(rows1)) || dups != behind {
		t.Errorf("second ingester: stored %d, duplicates %d; want %d, %d", stored, dups, total-int64(len(rows1)), behind)
	}
	for p, want := range counts {
		var n, maxOff int64
		if err := db.Pool.QueryRow(context.Background(),
			"SELECT count(*), coalesce(max(source_offset), -1) FROM deferred_message WHERE source_partition = $1", p).Scan(&n, &maxOff); err != nil {
			t.Fatal(err)
		}
		if n != want || maxOff != want-1 {
			t.Errorf("partition %d: %d rows up to offset %d, want offsets 0..%d once each", p, n, maxOff, want-1)
		}
	}
	waitFor(t, 10*time.Second, "all offsets committed", func() (bool, string) {
		c := k.committed(t, group)
		checkCommittedStored(t, db.Pool, c)
		for p, want := range counts {
			if c[p] != want {
				return false, fmt.Sprintf("committed %v, want %v", c, counts)
			}
		}
		return true, ""
	})
}

// TestIngestBatchesFillWhileWriting checks that writing a batch before its
// linger (nothing else read or written) does not turn a burst into a
// statement per record: records that come while a statement runs wait for
// it and go together.
func TestIngestBatchesFillWhileWriting(t *testing.T) {
	const n = 3000
	db := pgtest.NewDB(t)
	k := newKafka(t)
	r := startIngester(t.Context(), t, k, db.Pool, "ingest-burst", IngestConfig{BatchSize: 1000, BatchLinger: 20 * time.Millisecond}, nil)
	r.waitJoined(t)

	msgs := make([]*sarama.ProducerMessage, n)
	for i := range msgs {
		msgs[i] = validRec(int32(i%2), fmt.Sprintf("k-%d", i), "v")
	}
	k.produce(t, msgs...)
	waitRows(t, db.Pool, n, 30*time.Second)
	statements := r.in.writer.statements.Load()
	t.Logf("%d records in %d statements", n, statements)
	if statements > n/20 {
		t.Errorf("%d records took %d insert statements, want at most %d (batches of 20 records on average)", n, statements, n/20)
	}
}
