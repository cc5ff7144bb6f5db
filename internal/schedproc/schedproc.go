// Package schedproc builds the scheduler binary and runs it as a child
// process, as an operator's supervisor would: for the end-to-end tests of
// cmd/scheduler, the bench and the chaos run, which all drive the real
// binary over its real interfaces (environment, signals, HTTP, logs).
package schedproc

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Package is the scheduler command's import path.
const Package = "github.com/deferq/scheduler/cmd/scheduler"

// Build builds the scheduler command into dir and returns the binary's path.
func Build(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "scheduler")
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, Package).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build %s: %w\n%s", Package, err, out)
	}
	return bin, nil
}

// Options says how to start a process.
type Options struct {
	// Bin is the scheduler binary (see Build).
	Bin string
	// Args are the command and its flags; nil means "run".
	Args []string
	// Env is the process's whole environment; Start adds HTTP_ADDR (a free
	// loopback address) and, with Pprof, PPROF_ADDR.
	Env []string
	// HTTPAddr, when set, is the HTTP_ADDR to use instead of a free one:
	// a scheduler started again where its clients know it.
	HTTPAddr string
	// Pprof serves net/http/pprof on a free loopback address too.
	Pprof bool
	// Logs, when not nil, gets the process's output as it comes, besides
	// the tail Logs returns.
	Logs io.Writer
	// TailBytes bounds what Logs keeps of the output; 0 means 256 KiB.
	TailBytes int
}

// Process is a running scheduler.
type Process struct {
	// Cmd is the process's command; read ProcessState after Done.
	Cmd *exec.Cmd
	// HTTPAddr is its HTTP_ADDR (/healthz, /readyz, /metrics);
	// PprofAddr its PPROF_ADDR, "" without Options.Pprof.
	HTTPAddr, PprofAddr string

	tail *Tail
	done chan struct{}
}

// Start starts the process and returns without waiting for it to be ready
// (see WaitReady).
func Start(opts Options) (*Process, error) {
	addr, err := opts.HTTPAddr, error(nil)
	if addr == "" {
		if addr, err = FreeAddr(); err != nil {
			return nil, err
		}
	}
	args := opts.Args
	if args == nil {
		args = []string{"run"}
	}
	p := &Process{HTTPAddr: addr, tail: NewTail(opts.TailBytes), done: make(chan struct{})}
	env := append(append([]string(nil), opts.Env...), "HTTP_ADDR="+addr)
	if opts.Pprof {
		if p.PprofAddr, err = FreeAddr(); err != nil {
			return nil, err
		}
		env = append(env, "PPROF_ADDR="+p.PprofAddr)
	}
	p.Cmd = exec.Command(opts.Bin, args...)
	p.Cmd.Env = env
	var w io.Writer = p.tail
	if opts.Logs != nil {
		w = io.MultiWriter(p.tail, opts.Logs)
	}
	p.Cmd.Stdout, p.Cmd.Stderr = w, w
	if err := p.Cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s %s: %w", opts.Bin, strings.Join(args, " "), err)
	}
	go func() {
		_ = p.Cmd.Wait() // the exit status is in ProcessState
		close(p.done)
	}()
	return p, nil
}

// StartReady is Start, then WaitReady within, started again (three tries in
// all) when the process exits during start-up because a loopback port
// Start chose was taken meanwhile: FreeAddr's port is free when it looks,
// and another process (a parallel test's connection, whose ephemeral port
// comes from the same range) may bind it before the scheduler does.
func StartReady(ctx context.Context, opts Options, within time.Duration) (*Process, error) {
	for attempt := 1; ; attempt++ {
		p, err := Start(opts)
		if err != nil {
			return nil, err
		}
		err = p.WaitReady(ctx, within)
		if err == nil {
			return p, nil
		}
		p.Kill()
		if attempt < 3 && errors.Is(err, ErrExited) && strings.Contains(p.Logs(), "address already in use") {
			continue
		}
		return nil, err
	}
}

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exited reports whether the process has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Pid returns the process id.
func (p *Process) Pid() int { return p.Cmd.Process.Pid }

// Logs returns the tail of the process's output.
func (p *Process) Logs() string { return p.tail.String() }

// ErrExited is returned, wrapped, by WaitReady when the process exits first.
var ErrExited = errors.New("the scheduler exited")

// WaitReady waits until /readyz answers 200, the process exits, ctx ends or
// within passes; the error then carries the last /readyz answer and the
// tail of the output.
func (p *Process) WaitReady(ctx context.Context, within time.Duration) error {
	deadline := time.Now().Add(within)
	var last string
	for {
		code, body := p.Get("/readyz")
		if code == http.StatusOK {
			return nil
		}
		last = fmt.Sprintf("%d %s", code, strings.TrimSpace(body))
		select {
		case <-p.done:
			return fmt.Errorf("%w during start-up (%v); its last output:\n%s", ErrExited, p.Cmd.ProcessState, p.Logs())
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the scheduler is not ready after %v (/readyz: %s); its last output:\n%s", within, last, p.Logs())
		}
	}
}

// Get fetches path from the process's HTTP_ADDR and returns the status code
// (0 when it does not answer) and the body (the error then).
func (p *Process) Get(path string) (int, string) {
	client := &http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get("http://" + p.HTTPAddr + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// Stop sends SIGTERM and waits up to within for the process to exit; it is
// an error when it does not, or exits with a code other than 0.
func (p *Process) Stop(within time.Duration) error {
	if err := p.Cmd.Process.Signal(syscall.SIGTERM); err != nil && !p.Exited() {
		return fmt.Errorf("stop the scheduler: %w", err)
	}
	select {
	case <-p.done:
	case <-time.After(within):
		p.Kill()
		return fmt.Errorf("the scheduler did not stop within %v of SIGTERM; its last output:\n%s", within, p.Logs())
	}
	if code := p.Cmd.ProcessState.ExitCode(); code != 0 {
		return fmt.Errorf("the scheduler exited with code %d after SIGTERM; its last output:\n%s", code, p.Logs())
	}
	return nil
}

// Kill ends the process at once, as a crash would (SIGKILL), and waits for
// it to be gone. Once the process has exited (after Stop, say) it does
// nothing, so a caller may defer it right after starting the process.
func (p *Process) Kill() {
	_ = p.Cmd.Process.Kill() // it may have exited already
	<-p.done
}

// Memory returns the process's peak (VmHWM) and current (VmRSS) resident
// set size in bytes, from /proc.
func (p *Process) Memory() (hwm, rss int64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", p.Pid()))
	if err != nil {
		return 0, 0, fmt.Errorf("read the scheduler's memory: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || (name != "VmHWM" && name != "VmRSS") {
			continue
		}
		fields := strings.Fields(rest) // "12345 kB"
		if len(fields) != 2 || fields[1] != "kB" {
			return 0, 0, fmt.Errorf("unexpected %s line in /proc/%d/status: %q", name, p.Pid(), sc.Text())
		}
		kb, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("unexpected %s line in /proc/%d/status: %q", name, p.Pid(), sc.Text())
		}
		if name == "VmHWM" {
			hwm = kb << 10
		} else {
			rss = kb << 10
		}
	}
	if err := sc.Err(); err != nil {
		return 0, 0, fmt.Errorf("read the scheduler's memory: %w", err)
	}
	if hwm == 0 || rss == 0 {
		return 0, 0, fmt.Errorf("no VmHWM/VmRSS in /proc/%d/status", p.Pid())
	}
	return hwm, rss, nil
}

// FreeAddr returns a loopback address that was free a moment ago.
func FreeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free loopback port: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// Tail keeps the last bytes written to it: enough of a process's output to
// explain a failure without holding a long run's output in memory. Safe for
// concurrent use.
type Tail struct {
	mu  sync.Mutex
	max int
	buf []byte
}

// NewTail returns a Tail of max bytes; 0 means 256 KiB.
func NewTail(max int) *Tail {
	if max <= 0 {
		max = 256 << 10
	}
	return &Tail{max: max}
}

// Write implements io.Writer.
func (t *Tail) Write(b []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, b...)
	if over := len(t.buf) - t.max; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(b), nil
}

// String returns what the tail holds.
func (t *Tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}
