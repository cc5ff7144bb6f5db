package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/internal/schedproc"
)

// binDir holds the scheduler binary the end-to-end tests run.
var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "scheduler-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	pgtest.Main(m, func() { os.RemoveAll(dir) })
}

var buildOnce = sync.OnceValues(func() (string, error) {
	return schedproc.Build(context.Background(), binDir)
})

// binary returns the path of the built scheduler.
func binary(t *testing.T) string {
	t.Helper()
	bin, err := buildOnce()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

const (
	deferTopic  = "scheduler.defer"
	targetTopic = "orders.retry"
)

// broker starts an in-process Kafka broker with the defer and target topics.
func broker(t *testing.T) string {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, deferTopic, targetTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c.ListenAddrs()[0]
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// serviceEnv is a configuration tuned for tests: short Kafka timeouts so
// that the lease (and so the wait after a crash) is a few seconds.
func serviceEnv(dbURL, brokers, group string) []string {
	return []string{
		"DATABASE_URL=" + dbURL, "KAFKA_BROKERS=" + brokers, "CONSUMER_GROUP=" + group,
		"TARGET_TOPICS=orders.*", "KAFKA_TIMEOUT=300ms", "LEASE_DURATION=6s",
		"POLL_INTERVAL=100ms", "DISPATCH_LOOP_DURATION=2s", "INGEST_BATCH_LINGER=10ms",
		"SHUTDOWN_TIMEOUT=15s", "LOG_LEVEL=info", "PATH=" + os.Getenv("PATH"),
	}
}

// proc is a running `scheduler run`, owned by a test: it is killed when the
// test ends, and its logs are printed if the test failed.
type proc struct {
	*schedproc.Process
	t *testing.T
}

// start runs `scheduler run` with env and its flags args, and waits until
// /readyz answers 200. A port the test chose for it and another test took
// meanwhile gets it started again (schedproc.StartReady).
func start(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	sp, err := schedproc.StartReady(t.Context(), schedproc.Options{Bin: binary(t), Args: append([]string{"run"}, args...), Env: env}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	return own(t, sp)
}

// launch runs `scheduler run` with env and its flags args, without waiting
// for it to become ready.
func launch(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	sp, err := schedproc.Start(schedproc.Options{Bin: binary(t), Args: append([]string{"run"}, args...), Env: env})
	if err != nil {
		t.Fatal(err)
	}
	return own(t, sp)
}

// own makes sp the test's: it is killed when the test ends, and its logs
// are printed if the test failed.
func own(t *testing.T, sp *schedproc.Process) *proc {
	p := &proc{Process: sp, t: t}
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("logs of scheduler pid %d:\n%s", p.Pid(), p.Logs())
		}
	})
	return p
}

// stop sends SIGTERM and requires a clean exit 0 within 30 seconds.
func (p *proc) stop() {
	p.t.Helper()
	if err := p.Stop(30 * time.Second); err != nil {
		p.t.Fatal(err)
	}
}

// producer returns a sarama producer that keys records like the Java client.
func producer(t *testing.T, brokers string) sarama.SyncProducer {
	t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	c.Producer.Return.Successes = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Partitioner = sarama.NewMurmur2Partitioner
	// Idempotent, so that a retried produce cannot put a record in the
	// defer topic twice and pass for a duplicate of the scheduler's.
	c.Producer.Idempotent = true
	c.Net.MaxOpenRequests = 1
	p, err := sarama.NewSyncProducer([]string{brokers}, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// deferRecord builds a record for the defer topic.
func deferRecord(key, value string, headers ...string) *sarama.ProducerMessage {
	m := &sarama.ProducerMessage{Topic: deferTopic, Key: sarama.StringEncoder(key), Value: sarama.StringEncoder(value)}
	for i := 0; i+1 < len(headers); i += 2 {
		m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(headers[i]), Value: []byte(headers[i+1])})
	}
	return m
}

// delivery is one record read from the target topic.
type delivery struct {
	partition int32
	offset    int64
	key       string
	value     string
	id        string
	seq       int64
	at        time.Time
	headers   map[string]string
}

// reader collects the target topic from the oldest offset.
type reader struct {
	mu   sync.Mutex
	msgs []delivery
}

func read(t *testing.T, brokers, topic string) *reader {
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
	r := &reader{}
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
				d := delivery{partition: m.Partition, offset: m.Offset, key: string(m.Key), value: string(m.Value), at: time.Now(), headers: map[string]string{}}
				for _, h := range m.Headers {
					d.headers[string(h.Key)] = string(h.Value)
				}
				d.id = d.headers["defer.id"]
				d.seq, _ = strconv.ParseInt(d.headers["defer.seq"], 10, 64)
				r.mu.Lock()
				r.msgs = append(r.msgs, d)
				r.mu.Unlock()
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
	return r
}

func (r *reader) all() []delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]delivery(nil), r.msgs...)
}

// until waits for cond over the deliveries so far.
func (r *reader) until(t *testing.T, within time.Duration, what string, cond func([]delivery) bool) []delivery {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		got := r.all()
		if cond(got) {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v (%d deliveries)", what, within, len(got))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func atLeast(n int) func([]delivery) bool { return func(d []delivery) bool { return len(d) >= n } }

func readyzBody(t *testing.T, body string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatalf("readyz body %q: %v", body, err)
	}
	return m
}

func waitRows(t *testing.T, pool *pgxpool.Pool, within time.Duration, query string, want int, args ...any) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		var n int
		if err := pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s = %d, want %d, after %v", query, n, want, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
