package inflight

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const target = "orders.retry"

// kafka starts a broker with target in two partitions and returns its
// address and a sarama configuration for it.
func kafka(t *testing.T) (string, *sarama.Config) {
	t.Helper()
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{target}, Partitions: 2})
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	c.Consumer.Offsets.AutoCommit.Enable = false
	return addr, c
}

func newAdmin(t *testing.T, addr string, c *sarama.Config) sarama.ClusterAdmin {
	t.Helper()
	admin, err := sarama.NewClusterAdmin([]string{addr}, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	return admin
}

// commit commits offset for group on target's partition as a consumer
// does: it joins the group (alone, so it claims every partition), moves
// its position there and commits, then leaves.
func commit(t *testing.T, addr string, c *sarama.Config, group string, partition int32, offset int64) {
	t.Helper()
	cg, err := sarama.NewConsumerGroup([]string{addr}, group, c)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	h := &committer{partition: partition, offset: offset, done: make(chan struct{})}
	consumed := make(chan error, 1)
	go func() { consumed <- cg.Consume(ctx, []string{target}, h) }()
	select {
	case <-h.done:
	case err := <-consumed:
		t.Fatalf("consume as group %s: %v", group, err)
	case <-ctx.Done():
		t.Fatalf("group %s did not join", group)
	}
	cancel()
	<-consumed
}

// committer commits one partition's offset in its session's Setup.
type committer struct {
	partition int32
	offset    int64
	done      chan struct{}
	once      sync.Once
}

func (h *committer) Setup(s sarama.ConsumerGroupSession) error {
	// MarkOffset moves only forward and ResetOffset only back: one of
	// them moves the position to offset.
	s.MarkOffset(target, h.partition, h.offset, "")
	s.ResetOffset(target, h.partition, h.offset, "")
	s.Commit()
	h.once.Do(func() { close(h.done) })
	return nil
}

func (h *committer) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (h *committer) ConsumeClaim(s sarama.ConsumerGroupSession, _ sarama.ConsumerGroupClaim) error {
	<-s.Context().Done()
	return nil
}

// hold inserts an in-flight row: key was republished to target's
// partition at offset for group.
func hold(t *testing.T, pool *pgxpool.Pool, group, key string, partition int32, offset int64) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `INSERT INTO deferred_inflight
		(group_id, business_key, target_topic, partition, record_offset, message_id, seq)
		VALUES ($1, $2, $3, $4, $5, 1, 1)`, group, key, target, partition, offset); err != nil {
		t.Fatal(err)
	}
}

// held lists the in-flight rows as group/key/partition.
func held(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(group_id || '/' || business_key || '/' || partition, ' '
		ORDER BY group_id, business_key, partition), '') FROM deferred_inflight`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// counting counts the fetches of each group, so that a test can wait for
// ticks to have happened, and fails those of the groups in fail.
type counting struct {
	Offsets
	fail  map[string]bool
	mu    sync.Mutex
	calls map[string]int
}

func (c *counting) Committed(ctx context.Context, group string, partitions map[string][]int32) (map[string]map[int32]int64, error) {
	c.mu.Lock()
	c.calls[group]++
	c.mu.Unlock()
	if c.fail[group] {
		return nil, errors.New("coordinator not available")
	}
	return c.Offsets.Committed(ctx, group, partitions)
}

func (c *counting) count(group string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[group]
}

// ticks waits for n more fetches of group: every fetch is followed by the
// release statement of its tick before the next fetch begins, so after n+1
// fetches at least n ticks have finished.
func (c *counting) ticks(t *testing.T, group string, n int) {
	t.Helper()
	want := c.count(group) + n + 1
	deadline := time.Now().Add(10 * time.Second)
	for c.count(group) < want {
		if time.Now().After(deadline) {
			t.Fatalf("%d fetches of group %s, want %d", c.count(group), group, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// lockedBuffer is a log destination the test reads while Run writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == name {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// start runs a Releaser over db and offsets every 20 ms until the test ends.
func start(t *testing.T, pool *pgxpool.Pool, offsets Offsets) (*prometheus.Registry, *lockedBuffer) {
	t.Helper()
	reg := prometheus.NewRegistry()
	logs := &lockedBuffer{}
	r := New(pool, offsets, nil, 20*time.Millisecond, metrics.New(reg, "test"), slog.New(slog.NewTextHandler(logs, nil)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("Run did not return after its context was cancelled")
		}
	})
	return reg, logs
}

// TestReleaseAfterCommit: a key republished at offset 5 stays in flight
// while its group has committed nothing or not past it, and is released
// once the group commits 6; the key's record at 6, rows of another
// partition and those of another group stay.
func TestReleaseAfterCommit(t *testing.T) {
	db := pgtest.NewDB(t)
	addr, conf := kafka(t)
	hold(t, db.Pool, "G", "order-1", 1, 5)
	hold(t, db.Pool, "G", "order-2", 0, 5) // another partition, never committed
	hold(t, db.Pool, "G", "order-3", 1, 6) // the partition's next record once G commits 6
	hold(t, db.Pool, "H", "order-1", 1, 5) // another group, never committed
	const all = "G/order-1/1 G/order-2/0 G/order-3/1 H/order-1/1"
	const after = "G/order-2/0 G/order-3/1 H/order-1/1"
	offsets := &counting{Offsets: NewAdminOffsets(newAdmin(t, addr, conf)), calls: map[string]int{}}
	reg, _ := start(t, db.Pool, offsets)

	offsets.ticks(t, "G", 3)
	if got := held(t, db.Pool); got != all {
		t.Fatalf("without a commit: held %q, want %q", got, all)
	}
	commit(t, addr, conf, "G", 1, 5) // the record at 5 is the next to read
	offsets.ticks(t, "G", 3)
	if got := held(t, db.Pool); got != all {
		t.Fatalf("committed 5: held %q, want %q", got, all)
	}

	commit(t, addr, conf, "G", 1, 6)
	deadline := time.Now().Add(5 * time.Second)
	for held(t, db.Pool) != after {
		if time.Now().After(deadline) {
			t.Fatalf("committed 6: held %q, want G/order-1/1 released", held(t, db.Pool))
		}
		time.Sleep(10 * time.Millisecond)
	}
	offsets.ticks(t, "G", 2)
	if got := held(t, db.Pool); got != after {
		t.Errorf("after more ticks: held %q, want %q", got, after)
	}
	if n := counter(t, reg, metrics.InflightReleased); n != 1 {
		t.Errorf("%s = %v, want 1", metrics.InflightReleased, n)
	}
	if n := counter(t, reg, metrics.InflightErrors); n != 0 {
		t.Errorf("%s = %v, want 0", metrics.InflightErrors, n)
	}
}

// TestFetchFailure: a group whose offsets cannot be read keeps its rows and
// counts an error per failed fetch, logged once with the group; the other
// groups are released in the same ticks.
func TestFetchFailure(t *testing.T) {
	db := pgtest.NewDB(t)
	addr, conf := kafka(t)
	hold(t, db.Pool, "broken", "order-1", 0, 5)
	hold(t, db.Pool, "G", "order-1", 0, 5)
	commit(t, addr, conf, "broken", 0, 9)
	commit(t, addr, conf, "G", 0, 9)
	offsets := &counting{Offsets: NewAdminOffsets(newAdmin(t, addr, conf)), calls: map[string]int{}, fail: map[string]bool{"broken": true}}
	reg, logs := start(t, db.Pool, offsets)

	offsets.ticks(t, "broken", 3)
	if got := held(t, db.Pool); got != "broken/order-1/0" {
		t.Errorf("held %q, want only broken's row", got)
	}
	if n := counter(t, reg, metrics.InflightErrors); n < 3 {
		t.Errorf("%s = %v, want one per failed fetch (at least 3)", metrics.InflightErrors, n)
	}
	if n := counter(t, reg, metrics.InflightReleased); n != 1 {
		t.Errorf("%s = %v, want 1", metrics.InflightReleased, n)
	}
	out := logs.String()
	if strings.Count(out, "committed offsets failed") != 1 || !strings.Contains(out, "group=broken") ||
		!strings.Contains(out, "coordinator not available") {
		t.Errorf("want one warning naming the group and the error:\n%s", out)
	}
}

// TestAdminOffsets reads committed offsets from a real broker: -1 where the
// group committed nothing, the offset where it did, and nothing, without an
// error, for a group the broker does not know.
func TestAdminOffsets(t *testing.T) {
	addr, conf := kafka(t)
	commit(t, addr, conf, "G", 1, 42)
	got, err := NewAdminOffsets(newAdmin(t, addr, conf)).Committed(context.Background(), "G", map[string][]int32{target: {0, 1}})
	if err != nil {
		t.Fatal(err)
	}
	if got[target][0] != -1 || got[target][1] != 42 {
		t.Errorf("committed %v, want partition 0 at -1 and 1 at 42", got)
	}
	got, err = NewAdminOffsets(newAdmin(t, addr, conf)).Committed(context.Background(), "never-seen", map[string][]int32{target: {0}})
	// Brokers answer for an unknown group with offsets of -1 or, newer
	// ones and kfake, GROUP_ID_NOT_FOUND: both mean nothing committed.
	if c, ok := got[target][0]; err != nil || ok && c != -1 {
		t.Errorf("a group that never committed: %v, %v; want no offset", got, err)
	}
}

// TestAdminOffsetsCancel: a fetch that does not answer returns when its
// context is cancelled.
func TestAdminOffsetsCancel(t *testing.T) {
	stuck := stuckAdmin{release: make(chan struct{})}
	defer close(stuck.release)
	a := NewAdminOffsets(stuck)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := a.Committed(ctx, "G", map[string][]int32{target: {0}}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err %v, want the context's", err)
	}
}

// stuckAdmin's ListConsumerGroupOffsets answers nothing until release is
// closed.
type stuckAdmin struct {
	sarama.ClusterAdmin
	release chan struct{}
}

func (s stuckAdmin) ListConsumerGroupOffsets(string, map[string][]int32) (*sarama.OffsetFetchResponse, error) {
	<-s.release
	return nil, errors.New("released")
}
