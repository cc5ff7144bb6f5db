package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/pgtest"
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
	bin := filepath.Join(binDir, "scheduler")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build: %v\n%s", err, out)
	}
	return bin, nil
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

// proc is a running `scheduler run`.
type proc struct {
	t    *testing.T
	cmd  *exec.Cmd
	http string
	mu   sync.Mutex
	out  bytes.Buffer
	done chan struct{}
}

func (p *proc) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.Write(b)
}

func (p *proc) logs() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// start runs the binary with env and waits until /readyz answers 200.
func start(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{t: t, http: freeAddr(t), done: make(chan struct{})}
	p.cmd = exec.Command(binary(t), append([]string{"run"}, args...)...)
	p.cmd.Env = append(env, "HTTP_ADDR="+p.http)
	p.cmd.Stdout, p.cmd.Stderr = p, p
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			t.Logf("logs of scheduler pid %d:\n%s", p.cmd.Process.Pid, p.logs())
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		if code, _ := p.get("/readyz"); code == http.StatusOK {
			return p
		}
		select {
		case <-p.done:
			t.Fatalf("scheduler exited during start-up:\n%s", p.logs())
		default:
		}
		if time.Now().After(deadline) {
			_, body := p.get("/readyz")
			t.Fatalf("scheduler not ready after 30s: %s\n%s", body, p.logs())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (p *proc) get(path string) (int, string) {
	resp, err := http.Get("http://" + p.http + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(resp.Body)
	return resp.StatusCode, b.String()
}

// kill stops the process the hard way, as a crash would.
func (p *proc) kill() {
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop sends SIGTERM and requires a clean exit 0.
func (p *proc) stop() {
	p.t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		p.t.Fatalf("scheduler did not stop within 30s of SIGTERM:\n%s", p.logs())
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 0 {
		p.t.Fatalf("exit code %d after SIGTERM, want 0:\n%s", code, p.logs())
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
				d := delivery{partition: m.Partition, key: string(m.Key), value: string(m.Value), at: time.Now(), headers: map[string]string{}}
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
