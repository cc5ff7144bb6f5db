// Package dispatchtest is what the tests of dispatch, its runner and the
// dead-letter publisher share: a database of their own (internal/pgtest),
// an in-process broker with two target topics, and the producer the service
// publishes with. Rows come from internal/fixture and what reaches the
// broker is read with internal/kafkatest.
package dispatchtest

import (
	"context"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// The target topics every Env has, with 4 partitions each.
const (
	TopicA = "orders.retry"
	TopicB = "payments.retry"
)

// Env is one test's database and broker.
type Env struct {
	T        testing.TB
	Pool     *pgxpool.Pool
	Broker   *kfake.Cluster
	Addr     string
	Producer *batchproducer.Producer
}

// New returns an Env whose database and broker go when the test ends. opts
// add to the broker's options (faults, say).
func New(t testing.TB, opts ...kfake.Opt) *Env {
	t.Helper()
	db := pgtest.NewDB(t)
	broker, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1), kfake.SeedTopics(4, TopicA, TopicB)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(broker.Close)
	e := &Env{T: t, Pool: db.Pool, Broker: broker, Addr: broker.ListenAddrs()[0]}
	e.Producer = e.NewProducer()
	return e
}

// NewProducer returns a producer configured as the service's.
func (e *Env) NewProducer() *batchproducer.Producer {
	e.T.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	p, err := batchproducer.New([]string{e.Addr}, batchproducer.Config(c))
	if err != nil {
		e.T.Fatal(err)
	}
	e.T.Cleanup(func() { p.Close() })
	return p
}

// Collect reads topics of the broker from their oldest offset.
func (e *Env) Collect(topics ...string) *kafkatest.Collector {
	e.T.Helper()
	return kafkatest.Collect(e.T, e.Addr, topics...)
}

// Logger discards logs unless the tests run with -v and TEST_LOGS set.
func Logger() *slog.Logger {
	if testing.Verbose() && os.Getenv("TEST_LOGS") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// AllowAll lets a dispatcher publish to any topic.
var AllowAll = protocol.TargetPatterns{"*"}

// Insert stores rows and returns their ids (see fixture.Insert).
func (e *Env) Insert(rows ...fixture.Message) []int64 {
	e.T.Helper()
	return fixture.Insert(e.T, e.Pool, rows...)
}

// Count returns how many rows of deferred_message match where.
func (e *Env) Count(where string, args ...any) int {
	e.T.Helper()
	return fixture.Count(e.T, e.Pool, where, args...)
}

// Exec runs sql, failing the test on an error.
func (e *Env) Exec(sql string, args ...any) {
	e.T.Helper()
	if _, err := e.Pool.Exec(context.Background(), sql, args...); err != nil {
		e.T.Fatalf("%s: %v", sql, err)
	}
}

// Dispatcher returns a dispatch loop for owner with a short poll interval
// and back-off, publishing to targets with the Env's producer.
func (e *Env) Dispatcher(owner string, lease time.Duration, targets protocol.TargetPatterns) *dispatch.Dispatcher {
	e.T.Helper()
	l, err := keylock.New(e.Pool, keylock.Config{Owner: owner, Lease: lease, PerKey: 100})
	if err != nil {
		e.T.Fatal(err)
	}
	d, err := dispatch.New(l, e.Producer, nil, dispatch.Config{BatchKeys: 100, PollInterval: 50 * time.Millisecond,
		MaxBackoff: 200 * time.Millisecond, Targets: targets}, Logger())
	if err != nil {
		e.T.Fatal(err)
	}
	return d
}

// DueNotHeld selects the pending due messages of keys not held by a parked
// message.
const DueNotHeld = `state = 'pending' AND next_run_at <= now() AND (business_key IS NULL OR NOT EXISTS (
	SELECT FROM deferred_key k WHERE k.business_key = deferred_message.business_key AND k.held))`

// Drain runs d's rounds until nothing is due, or fails after within.
// Messages waiting behind a key held by a parked message do not count: they
// are not due to go.
func (e *Env) Drain(d *dispatch.Dispatcher, within time.Duration) {
	e.T.Helper()
	deadline := time.Now().Add(within)
	for {
		st, err := d.Round(context.Background())
		if err != nil {
			e.T.Fatalf("round: %v", err)
		}
		if st.Keys == 0 && e.Count(DueNotHeld) == 0 {
			return
		}
		if time.Now().After(deadline) {
			e.T.Fatalf("still %d due messages after %v", e.Count(DueNotHeld), within)
		}
		if st.Keys == 0 {
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// MustEqual fails the test at once unless got is want.
func MustEqual[T comparable](t testing.TB, what string, got, want T) {
	t.Helper()
	if got != want {
		t.Fatalf("%s = %v, want %v", what, got, want)
	}
}

// Eventually calls cond until it returns true, failing the test after
// within.
func Eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Counter returns the value of the counter among ms whose labels are
// exactly labels, or -1 if none is.
func Counter(ms []*dto.Metric, labels map[string]string) float64 {
	for _, m := range ms {
		if len(m.GetLabel()) != len(labels) {
			continue
		}
		match := true
		for _, lp := range m.GetLabel() {
			match = match && labels[lp.GetName()] == lp.GetValue()
		}
		if match {
			return m.GetCounter().GetValue()
		}
	}
	return -1
}
