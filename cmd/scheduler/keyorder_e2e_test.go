package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/internal/schedproc"
)

// buildExample builds examples/orders-consumer once per test binary.
var buildExample = sync.OnceValues(func() (string, error) {
	bin := filepath.Join(binDir, "orders-consumer")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/deferq/scheduler/examples/orders-consumer").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build examples/orders-consumer: %w\n%s", err, out)
	}
	return bin, nil
})

// example is a running examples/orders-consumer.
type example struct {
	cmd  *exec.Cmd
	logs *schedproc.Tail
	done chan struct{}
}

func startExample(t *testing.T, env []string) *example {
	t.Helper()
	bin, err := buildExample()
	if err != nil {
		t.Fatal(err)
	}
	e := &example{cmd: exec.Command(bin), logs: schedproc.NewTail(64 << 10), done: make(chan struct{})}
	e.cmd.Env = env
	e.cmd.Stdout, e.cmd.Stderr = e.logs, e.logs
	if err := e.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = e.cmd.Wait(); close(e.done) }()
	t.Cleanup(func() {
		_ = e.cmd.Process.Kill()
		<-e.done
		if t.Failed() {
			t.Logf("logs of orders-consumer pid %d:\n%s", e.cmd.Process.Pid, e.logs.String())
		}
	})
	return e
}

// TestKeyOrderEndToEnd: two scheduler replicas and two instances of
// examples/orders-consumer in one consumer group, 1,000 keys x 20 messages
// on the main topic, a fifth of all handlings failing, and one example and
// one scheduler killed with SIGKILL mid-run. Per key, no record may be
// handled before every earlier record of its key was handled at least once
// (a record handled again after a crash is allowed); nothing may be lost,
// and nothing may stay blocked at the end. It runs once with the example
// on each Kafka client (KAFKA_CLIENT).
func TestKeyOrderEndToEnd(t *testing.T) {
	for _, client := range kafkaClients {
		t.Run(client, func(t *testing.T) { testKeyOrderEndToEnd(t, client) })
	}
}

func testKeyOrderEndToEnd(t *testing.T, client string) {
	keys, perKey := 1000, 20
	if testing.Short() {
		keys = 200
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, deferTopic, targetTopic, mainTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	brokers := c.ListenAddrs()[0]
	db := pgtest.NewDB(t)
	env := append(serviceEnv(db.URL, brokers, "keyorder-e2e"),
		"RETRY_POLICIES=orders.*: exponential 300ms x1 forever jitter none")
	schedulers := []*proc{start(t, env, "--migrate"), start(t, env)}
	var urls []string
	for _, s := range schedulers {
		urls = append(urls, "http://"+s.HTTPAddr)
	}

	out := filepath.Join(t.TempDir(), "handled.tsv")
	exEnv := []string{"KAFKA_CLIENT=" + client, "KAFKA_BROKERS=" + brokers, "MAIN_TOPIC=" + mainTopic, "RETRY_TOPIC=" + targetTopic,
		"GROUP=orders-e2e", "SCHEDULER_URL=" + strings.Join(urls, ","), "OUT_FILE=" + out, "FAIL_RATE=0.2",
		"PATH=" + os.Getenv("PATH")}
	examples := []*example{startExample(t, exEnv), startExample(t, exEnv)}

	// Every key's messages in order, keys interleaved.
	prod := producer(t, brokers)
	total := keys * perKey
	batch := make([]*sarama.ProducerMessage, 0, keys)
	for i := range perKey {
		batch = batch[:0]
		for k := range keys {
			batch = append(batch, &sarama.ProducerMessage{Topic: mainTopic, Key: sarama.StringEncoder(fmt.Sprintf("order-%d", k)),
				Value: sarama.StringEncoder(strconv.Itoa(i))})
		}
		if err := prod.SendMessages(batch); err != nil {
			t.Fatal(err)
		}
	}

	lines := func() []string {
		b, err := os.ReadFile(out)
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		var ls []string
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			ls = append(ls, sc.Text())
		}
		return ls
	}
	waitLines := func(n int, within time.Duration) {
		deadline := time.Now().Add(within)
		for len(lines()) < n {
			if time.Now().After(deadline) {
				t.Fatalf("%d lines handled within %v, want %d", len(lines()), within, n)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	// Mid-run, one of each dies without a word.
	waitLines(total/3, 3*time.Minute)
	if err := examples[0].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	schedulers[0].Kill()
	t.Logf("killed an example and a scheduler at %d lines", len(lines()))

	// Wait until every record was handled at least once, checking order.
	deadline := time.Now().Add(5 * time.Minute)
	var handledSet map[string]map[int]bool
	var violations []string
	for {
		handledSet = map[string]map[int]bool{}
		violations = violations[:0]
		complete := 0
		for n, l := range lines() {
			key, v, ok := strings.Cut(l, "\t")
			i, err := strconv.Atoi(v)
			if !ok || err != nil {
				t.Fatalf("line %d of the output is %q, not key<TAB>number", n+1, l)
			}
			seen := handledSet[key]
			if seen == nil {
				seen = map[int]bool{}
				handledSet[key] = seen
			}
			for j := range i {
				if !seen[j] && len(violations) < 20 {
					violations = append(violations, fmt.Sprintf("line %d: %s %d handled before %d", n+1, key, i, j))
					break
				}
			}
			if !seen[i] {
				seen[i] = true
				if len(seen) == perKey {
					complete++
				}
			}
		}
		if len(violations) > 0 {
			t.Fatalf("order violated:\n%s", strings.Join(violations, "\n"))
		}
		if complete == keys {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d keys complete after the kills; nothing should be lost", complete, keys)
		}
		time.Sleep(250 * time.Millisecond)
	}
	n := len(lines())
	t.Logf("%d records handled, %d handlings (%d again after a crash)", total, n, n-total)

	// Nothing stays blocked: no message waits, no key stays in flight.
	stuck := time.Now().Add(time.Minute)
	for {
		var waiting, inflight int
		if err := db.Pool.QueryRow(t.Context(), `SELECT (SELECT count(*) FROM deferred_message),
			(SELECT count(*) FROM deferred_inflight)`).Scan(&waiting, &inflight); err != nil {
			t.Fatal(err)
		}
		if waiting == 0 && inflight == 0 {
			break
		}
		if time.Now().After(stuck) {
			t.Fatalf("at the end %d messages still wait and %d keys are in flight", waiting, inflight)
		}
		time.Sleep(250 * time.Millisecond)
	}

	// The survivor stops cleanly on SIGTERM.
	if err := examples[1].cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-examples[1].done:
		if code := examples[1].cmd.ProcessState.ExitCode(); code != 0 {
			t.Errorf("orders-consumer exited %d on SIGTERM, want 0", code)
		}
	case <-time.After(30 * time.Second):
		t.Error("orders-consumer did not stop within 30 s of SIGTERM")
	}
}
