// Package pgbouncertest runs a real PgBouncer in front of a test's
// PostgreSQL server, so that tests connect the way most production
// deployments do: through a pooler that passes on few startup parameters
// and, in transaction mode, gives a client's transactions to whichever
// server session is free.
//
// It runs Debian's pgbouncer (.ci/run installs the package; PGBOUNCER may
// name another binary) with its defaults but for what a test must set:
// the address, the pool mode, trust authentication for the users the test
// names, and a wildcard database entry, so that every database pgtest
// creates is reachable by its own name.
package pgbouncertest

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/pglocal"
)

// Mode is PgBouncer's pool_mode.
type Mode string

// The pool modes the scheduler is tested behind.
const (
	Transaction Mode = "transaction"
	Session     Mode = "session"
)

// Options configure a PgBouncer.
type Options struct {
	Mode Mode
	// Users may log in (trust authentication: PgBouncer still wants each
	// name in its auth_file). The server URL's user is always among them.
	Users []string
	// Settings are added to the [pgbouncer] section as they are, one
	// "name = value" each (ignore_startup_parameters, say).
	Settings []string
}

// Bouncer is a running PgBouncer.
type Bouncer struct {
	port int
	dir  string
}

// Start runs a PgBouncer in front of the server of serverURL (a
// postgres:// URL of a server that trusts its local connections, as
// pgtest's does) until the test ends, and waits until it answers.
func Start(tb testing.TB, serverURL string, opts Options) *Bouncer {
	tb.Helper()
	bin := os.Getenv("PGBOUNCER")
	if bin == "" {
		var err error
		if bin, err = exec.LookPath("pgbouncer"); err != nil {
			if bin, err = exec.LookPath("/usr/sbin/pgbouncer"); err != nil {
				tb.Fatalf("pgbouncertest: pgbouncer not found (install Debian's package pgbouncer, as .ci/run does, or set PGBOUNCER): %v", err)
			}
		}
	}
	server, err := url.Parse(serverURL)
	if err != nil || server.Host == "" {
		tb.Fatalf("pgbouncertest: the server's connection string must be a postgres:// URL with a host: %q", serverURL)
	}
	host, port := server.Hostname(), server.Port()
	if port == "" {
		port = "5432"
	}
	// Not tb.TempDir: its parent is root's alone, and the pooler may run
	// as another user.
	dir, err := os.MkdirTemp("", "pgbouncertest-")
	if err != nil {
		tb.Fatalf("pgbouncertest: %v", err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	b := &Bouncer{dir: dir}
	if b.port, err = pglocal.FreePort(); err != nil {
		tb.Fatalf("pgbouncertest: %v", err)
	}
	users := append([]string{server.User.Username()}, opts.Users...)
	var auth strings.Builder
	for _, u := range users {
		fmt.Fprintf(&auth, "%q \"\"\n", u)
	}
	if opts.Mode == "" {
		opts.Mode = Transaction
	}
	conf := fmt.Sprintf(`[databases]
* = host=%s port=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = %s
max_client_conn = 1000
default_pool_size = 20
logfile = %s
pidfile = %s
%s
`, host, port, b.port, filepath.Join(b.dir, "users.txt"), opts.Mode,
		filepath.Join(b.dir, "pgbouncer.log"), filepath.Join(b.dir, "pgbouncer.pid"), strings.Join(opts.Settings, "\n"))
	for name, text := range map[string]string{"users.txt": auth.String(), "pgbouncer.ini": conf} {
		if err := os.WriteFile(filepath.Join(b.dir, name), []byte(text), 0o644); err != nil {
			tb.Fatalf("pgbouncertest: %v", err)
		}
	}

	cmd := exec.Command(bin, filepath.Join(b.dir, "pgbouncer.ini"))
	cmd.Dir = b.dir
	// The pooler dies with the test process, however that ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if os.Geteuid() == 0 {
		// PgBouncer refuses to run as root.
		cred, err := pglocal.Credential()
		if err != nil {
			tb.Fatalf("pgbouncertest: running as root, and pgbouncer refuses root: %v", err)
		}
		cmd.SysProcAttr.Credential = cred
		if err := os.Chmod(b.dir, 0o777); err != nil {
			tb.Fatalf("pgbouncertest: %v", err)
		}
	}
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		tb.Fatalf("pgbouncertest: start %s: %v", bin, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	tb.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})

	// Ready once a client gets an answer through it.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	probe := b.URL(tb, serverURL)
	for {
		conn, err := pgx.Connect(ctx, probe)
		if err == nil {
			err = conn.Ping(ctx)
			conn.Close(ctx)
			if err == nil {
				return b
			}
		}
		select {
		case werr := <-exited:
			tb.Fatalf("pgbouncertest: pgbouncer exited (%v): %s\n%s", werr, out.String(), b.Log())
		case <-ctx.Done():
			tb.Fatalf("pgbouncertest: pgbouncer on port %d does not answer: %v\n%s", b.port, err, b.Log())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Port is where the pooler listens, on 127.0.0.1.
func (b *Bouncer) Port() int { return b.port }

// URL returns connString (a postgres:// URL of the server the pooler is
// in front of) with its host and port replaced by the pooler's.
func (b *Bouncer) URL(tb testing.TB, connString string) string {
	tb.Helper()
	u, err := url.Parse(connString)
	if err != nil {
		tb.Fatalf("pgbouncertest: %v", err)
	}
	u.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port))
	return u.String()
}

// Log is what the pooler logged so far, for a failing test's message.
func (b *Bouncer) Log() string {
	data, err := os.ReadFile(filepath.Join(b.dir, "pgbouncer.log"))
	if err != nil {
		return fmt.Sprintf("(no pgbouncer log: %v)", err)
	}
	return string(data)
}
