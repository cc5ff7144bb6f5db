package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/deferq/scheduler/internal/schedproc"
	"github.com/twmb/franz-go/pkg/kfake"
)

// consumerGroup is the services' ingest consumer group.
const consumerGroup = "chaos"

// serviceEnv is the services' configuration: a short Kafka timeout and a
// short lease (the service requires more than 17 x KAFKA_TIMEOUT + 0.3 s;
// 20 x is used) so that the work of a killed process is taken over within
// seconds, as the service's own crash tests do, and a short retry ladder for
// the re-deferrals that name no delay.
func serviceEnv(dbURL, brokers string, kafkaTimeout time.Duration) []string {
	return []string{
		"DATABASE_URL=" + dbURL, "KAFKA_BROKERS=" + brokers, "CONSUMER_GROUP=" + consumerGroup,
		"TARGET_TOPICS=" + targetPattern, "RETRY_POLICIES=" + retryPolicies,
		"KAFKA_TIMEOUT=" + kafkaTimeout.String(), "LEASE_DURATION=" + (20 * kafkaTimeout).String(), "POLL_INTERVAL=100ms",
		"DISPATCH_LOOP_DURATION=2s", "INGEST_BATCH_LINGER=10ms", "SHUTDOWN_TIMEOUT=15s",
		"LOG_LEVEL=info", "PATH=" + os.Getenv("PATH"),
	}
}

// migrate runs `scheduler migrate` once, before the services start, so that
// they do not race on it.
func migrate(ctx context.Context, bin string, env []string) error {
	cmd := exec.CommandContext(ctx, bin, "migrate")
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("scheduler migrate: %w\n%s", err, out)
	}
	return nil
}

// restartBackoff is the pause before restarting a process that exited on
// its own.
const restartBackoff = time.Second

// proc is one `scheduler run` process.
type proc struct {
	*schedproc.Process
	// clientID is the process's KAFKA_CLIENT_ID, unique per process
	// (chaos-s<slot>-<start>): the broker prefixes its consumer-group member
	// IDs with it, so a member can be told apart by the process it belongs to.
	clientID string
}

// fleet is the three service slots. A slot always has a process: killing
// one starts its successor at once, as an orchestrator would.
type fleet struct {
	bin  string
	env  []string
	logs *schedproc.Tail
	live io.Writer // nil, or where the logs go as they come

	mu         sync.Mutex
	procs      []*proc
	gens       []int // per slot, bumped by each kill
	starts     []int // per slot, processes started
	stopping   bool
	unexpected int // exits nobody asked for (each is restarted)
	// dead holds, by Kafka client ID, when each process that is no longer
	// running (killed, or exited on its own) went.
	dead map[string]time.Time
}

func newFleet(bin string, env []string, n int, live io.Writer) (*fleet, error) {
	f := &fleet{bin: bin, env: env, logs: schedproc.NewTail(256 << 10), live: live, procs: make([]*proc, n), gens: make([]int, n), starts: make([]int, n), dead: map[string]time.Time{}}
	for i := range n {
		p, err := f.spawn(i)
		if err != nil {
			f.killAll()
			return nil, err
		}
		f.procs[i] = p
	}
	return f, nil
}

// spawn starts a process for slot i without waiting for it to be ready: a
// process restarted during a database outage becomes ready only after it.
func (f *fleet) spawn(i int) (*proc, error) {
	f.starts[i]++
	clientID := fmt.Sprintf("chaos-s%d-%d", i, f.starts[i])
	var w io.Writer = &prefixed{prefix: fmt.Sprintf("[s%d] ", i), w: f.logs}
	if f.live != nil {
		w = io.MultiWriter(w, &prefixed{prefix: fmt.Sprintf("[s%d] ", i), w: f.live})
	}
	sp, err := schedproc.Start(schedproc.Options{Bin: f.bin, Logs: w, TailBytes: 16 << 10,
		Env: append(append([]string(nil), f.env...), "KAFKA_CLIENT_ID="+clientID)})
	if err != nil {
		return nil, err
	}
	p := &proc{Process: sp, clientID: clientID}
	fmt.Fprintf(w, "[chaos] started pid %d, Kafka client id %s\n", p.Pid(), p.clientID)
	go func() {
		<-p.Done()
		f.exited(i, p)
	}()
	return p, nil
}

// exited restarts slot i when its process p died on its own.
func (f *fleet) exited(i int, p *proc) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopping || f.procs[i] != p {
		return // stopped or killed on purpose
	}
	f.unexpected++
	f.dead[p.clientID] = time.Now()
	fmt.Fprintf(f.logs, "[chaos] scheduler s%d (pid %d) exited on its own: %v; restarting it in %s\n", i, p.Pid(), p.Cmd.ProcessState, restartBackoff)
	f.procs[i] = nil
	gen := f.gens[i]
	f.mu.Unlock()
	// As an orchestrator would: a process that fails at start-up (say,
	// during the database restart) is not restarted in a tight loop.
	time.Sleep(restartBackoff)
	f.mu.Lock()
	if f.stopping || f.gens[i] != gen {
		return // stopped, or killed and restarted by the driver meanwhile
	}
	np, err := f.spawn(i)
	if err != nil {
		fmt.Fprintf(f.logs, "[chaos] restart s%d: %v\n", i, err)
		return
	}
	f.procs[i] = np
}

// kill SIGKILLs slot i's process and starts its successor.
func (f *fleet) kill(i int) error {
	f.mu.Lock()
	old := f.procs[i]
	f.procs[i] = nil // so that exited does not count or restart it
	f.gens[i]++      // nor restart it after its back-off
	f.mu.Unlock()
	if old != nil {
		old.Kill()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if old != nil {
		f.dead[old.clientID] = time.Now()
	}
	p, err := f.spawn(i)
	if err != nil {
		return err
	}
	f.procs[i] = p
	return nil
}

// waitReady waits until every slot's current process answers /readyz 200.
func (f *fleet) waitReady(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		f.mu.Lock()
		procs := append([]*proc(nil), f.procs...)
		f.mu.Unlock()
		var notReady []string
		for i, p := range procs {
			if p == nil {
				notReady = append(notReady, fmt.Sprintf("s%d: restarting", i))
				continue
			}
			if code, body := p.Get("/readyz"); code != http.StatusOK {
				notReady = append(notReady, fmt.Sprintf("s%d: %d %s", i, code, strings.TrimSpace(body)))
			}
		}
		if len(notReady) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("schedulers not ready within %s: %v; their last output:\n%s", timeout, notReady, f.logs)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// stop sends SIGTERM to every process and requires each to exit 0 within a
// minute; it returns how many did.
func (f *fleet) stop() (clean int, err error) {
	f.mu.Lock()
	f.stopping = true
	procs := append([]*proc(nil), f.procs...)
	f.mu.Unlock()
	var errs []error
	for i, p := range procs {
		if p == nil {
			continue
		}
		if err := p.Stop(time.Minute); err != nil {
			errs = append(errs, fmt.Errorf("scheduler s%d: %w", i, err))
			continue
		}
		clean++
	}
	return clean, errors.Join(errs...)
}

// killAll ends every process at once (errors and cancellation only).
func (f *fleet) killAll() {
	f.mu.Lock()
	f.stopping = true
	procs := append([]*proc(nil), f.procs...)
	f.mu.Unlock()
	for _, p := range procs {
		if p != nil {
			p.Kill()
		}
	}
}

// gone returns, by Kafka client ID, when each process that is no longer
// running went.
func (f *fleet) gone() map[string]time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.dead)
}

// running returns the Kafka client IDs of the processes running now.
func (f *fleet) running() map[string]bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	ids := map[string]bool{}
	for _, p := range f.procs {
		if p != nil {
			ids[p.clientID] = true
		}
	}
	return ids
}

// groupSummary describes a consumer group as the broker holds it: state,
// generation, each member with its process (running or gone, by its client
// ID) and its partitions of topic, and the partitions of topic (nparts of
// them) nobody is assigned.
func groupSummary(g *kfake.GroupInfo, topic string, nparts int32, running map[string]bool) string {
	if g == nil {
		return "consumer group unknown to the broker"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "consumer group %s: %s, generation %d", g.Group, g.State, g.Epoch)
	owned := map[int32]bool{}
	for _, m := range g.Members {
		state := "process gone"
		if running[m.ClientID] {
			state = "running"
		}
		ps := m.Assignment[topic]
		for _, p := range ps {
			owned[p] = true
		}
		fmt.Fprintf(&b, "; member %s (%s) %v", m.MemberID, state, ps)
	}
	var unowned []int32
	for p := range nparts {
		if !owned[p] {
			unowned = append(unowned, p)
		}
	}
	if len(unowned) > 0 {
		fmt.Fprintf(&b, "; %s partitions assigned to nobody: %v", topic, unowned)
	}
	return b.String()
}

func (f *fleet) unexpectedExits() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.unexpected
}

// prefixed writes each write to w with prefix in front; the services write
// whole lines, so that is enough to tell them apart.
type prefixed struct {
	prefix string
	w      io.Writer
}

func (p *prefixed) Write(b []byte) (int, error) {
	if _, err := p.w.Write(append([]byte(p.prefix), b...)); err != nil {
		return 0, err
	}
	return len(b), nil
}
