// Package pglocal starts a throwaway PostgreSQL cluster from the system's
// binaries.
//
// It serves the demo, the bench and the chaos run when DATABASE_URL is unset,
// and tests when no server answers. It does not install anything:
// scripts/install-postgres.sh does, for the make targets, and .ci/run for
// CI. A cluster lives in one directory (data, server log and
// unix socket), listens only on 127.0.0.1, trusts every local connection and
// trades durability for speed: it must never hold data anyone cares about.
package pglocal

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ErrNotFound is returned (wrapped) by Binaries when no PostgreSQL server
// binaries are installed.
var ErrNotFound = errors.New("PostgreSQL server binaries (initdb, pg_ctl) not found")

// debianBinGlob is where Debian and Ubuntu install the server binaries; they
// are not on PATH there, only the client wrappers are.
const debianBinGlob = "/usr/lib/postgresql/*/bin"

// osUser is the account initdb and the server run as when we are root.
const osUser = "postgres"

// pgCtlTimeout bounds how long pg_ctl waits for the server to start or stop.
// A throwaway cluster starts in well under a second; a minute covers a
// heavily loaded CI machine.
const pgCtlTimeout = 60 * time.Second

// Binaries locates initdb, pg_ctl and postgres: first a directory on PATH
// holding both initdb and pg_ctl, else the highest-numbered
// /usr/lib/postgresql/*/bin. It returns that directory, or an error wrapping
// ErrNotFound that says to install the postgresql package.
func Binaries() (string, error) {
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		if dir == "" {
			continue
		}
		if hasServerBinaries(dir) {
			return dir, nil
		}
	}
	dirs, err := filepath.Glob(debianBinGlob)
	if err != nil {
		return "", fmt.Errorf("glob %s: %w", debianBinGlob, err)
	}
	dirs = slices.DeleteFunc(dirs, func(d string) bool { return !hasServerBinaries(d) })
	if dir, ok := highestVersion(dirs); ok {
		return dir, nil
	}
	return "", fmt.Errorf("%w on PATH or in %s: install the package postgresql (apt-get install postgresql) or set DATABASE_URL to an existing server",
		ErrNotFound, debianBinGlob)
}

func hasServerBinaries(dir string) bool {
	return isExecutable(filepath.Join(dir, "initdb")) && isExecutable(filepath.Join(dir, "pg_ctl"))
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// highestVersion picks from /usr/lib/postgresql/<version>/bin directories the
// one with the highest version, comparing numerically so that 10 beats 9.6.
func highestVersion(dirs []string) (string, bool) {
	if len(dirs) == 0 {
		return "", false
	}
	version := func(dir string) []int {
		var v []int
		for _, part := range strings.Split(filepath.Base(filepath.Dir(dir)), ".") {
			n, err := strconv.Atoi(part)
			if err != nil {
				n = -1 // not a version: sort it below every real one
			}
			v = append(v, n)
		}
		return v
	}
	return slices.MaxFunc(dirs, func(a, b string) int { return slices.Compare(version(a), version(b)) }), true
}

// Options configures Start.
type Options struct {
	// Logger receives progress messages; nil discards them.
	Logger *slog.Logger
	// Port is the TCP port on 127.0.0.1 to listen on; 0 picks a free one.
	Port int
	// Dir holds the cluster. It must not exist or be empty, because Stop
	// removes it with everything in it. "" creates a new temporary directory.
	Dir string
}

// Cluster is a running throwaway PostgreSQL server. Its methods are safe for
// concurrent use.
type Cluster struct {
	logger *slog.Logger
	bin    string
	dir    string
	data   string
	log    string
	port   int
	cred   *syscall.Credential // nil unless we run the server as osUser

	mu       sync.Mutex
	stopped  bool
	backups  int
	watchdog *exec.Cmd
	wdPipe   *os.File
}

// Start runs initdb (trust auth, UTF8, --no-sync, superuser "postgres") into
// a fresh directory and starts the server with pg_ctl -w on 127.0.0.1 with its
// unix socket in that directory and settings suited to throwaway use
// (fsync=off, synchronous_commit=off, full_page_writes=off,
// max_connections=200).
//
// initdb refuses to run as root, so when the effective user is root the
// directory is given to the OS user "postgres" and initdb and pg_ctl run as
// that user.
//
// A watchdog process stops the server and removes the directory if the
// calling process dies without calling Stop, so a crashed test run leaves no
// server behind. On failure Start cleans up and its error includes the tail of
// the server log.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	logger := opts.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	bin, err := Binaries()
	if err != nil {
		return nil, err
	}
	c := &Cluster{logger: logger, bin: bin, port: opts.Port}
	if os.Geteuid() == 0 {
		c.cred, err = lookupCredential(osUser)
		if err != nil {
			return nil, err
		}
	}

	if c.dir, err = prepareDir(opts.Dir); err != nil {
		return nil, err
	}
	c.data = filepath.Join(c.dir, "data")
	c.log = filepath.Join(c.dir, "server.log")
	if c.cred != nil {
		if err := os.Chown(c.dir, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			c.removeDir()
			return nil, fmt.Errorf("give %s to OS user %s (initdb refuses to run as root): %w", c.dir, osUser, err)
		}
	}
	if err := c.startWatchdog(); err != nil {
		c.removeDir()
		return nil, err
	}
	if err := c.initAndStart(ctx, opts.Port == 0); err != nil {
		c.abort()
		return nil, err
	}
	logger.Info("throwaway PostgreSQL started", "port", c.port, "dir", c.dir, "bin", bin)
	return c, nil
}

// Credential returns the OS user the cluster's server runs as when the
// caller is root ("postgres"): for another server that refuses root, such
// as PgBouncer.
func Credential() (*syscall.Credential, error) { return lookupCredential(osUser) }

func lookupCredential(name string) (*syscall.Credential, error) {
	u, err := user.Lookup(name)
	if err != nil {
		return nil, fmt.Errorf("running as root, and initdb refuses root, but OS user %q to run it as is missing (%w): create it (useradd --system %s), run as another user, or set DATABASE_URL to an existing server",
			name, err, name)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("OS user %s: uid %q: %w", name, u.Uid, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("OS user %s: gid %q: %w", name, u.Gid, err)
	}
	// An empty Groups drops root's supplementary groups in the child.
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, nil
}

// prepareDir returns an absolute, empty directory for the cluster, creating
// it if needed.
func prepareDir(dir string) (string, error) {
	if dir == "" {
		d, err := os.MkdirTemp("", "pglocal-")
		if err != nil {
			return "", fmt.Errorf("create cluster directory: %w", err)
		}
		return d, nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", fmt.Errorf("cluster directory %s: %w", dir, err)
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return "", fmt.Errorf("create cluster directory: %w", err)
	}
	entries, err := os.ReadDir(abs)
	if err != nil {
		return "", fmt.Errorf("read cluster directory: %w", err)
	}
	if len(entries) > 0 {
		// Stop deletes the directory; refuse one that holds anything we did
		// not create.
		return "", fmt.Errorf("cluster directory %s is not empty: give a new or empty directory, or leave Dir empty for a temporary one", abs)
	}
	return abs, nil
}

func (c *Cluster) initAndStart(ctx context.Context, pickPort bool) error {
	c.logger.Debug("running initdb", "data", c.data)
	if out, err := c.run(ctx, "initdb",
		"-D", c.data,
		"-U", "postgres",
		"-A", "trust",
		"-E", "UTF8",
		// An explicit locale, because the environment's may not be
		// installed on the machine and initdb would then fail.
		"--locale=C",
		"--no-sync",
	); err != nil {
		return fmt.Errorf("initdb in %s: %w\n%s", c.data, err, tail(out, 20))
	}

	// Settings go into postgresql.conf rather than pg_ctl -o, because pg_ctl
	// passes -o through a shell, which would mangle unusual directory names.
	// The port stays on the command line: it may change between attempts,
	// and pg_ctl restart reuses it from postmaster.opts.
	conf := fmt.Sprintf(`
# Added by pglocal: a throwaway cluster, durability deliberately off.
listen_addresses = '127.0.0.1'
unix_socket_directories = '%s'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 200
`, strings.ReplaceAll(c.dir, "'", "''"))
	if err := appendFile(filepath.Join(c.data, "postgresql.conf"), conf); err != nil {
		return fmt.Errorf("configure cluster: %w", err)
	}

	// A port picked free may be taken before the server binds it, so a
	// picked port gets a few tries.
	const attempts = 3
	for i := 1; ; i++ {
		if pickPort {
			p, err := FreePort()
			if err != nil {
				return err
			}
			c.port = p
		}
		c.logger.Debug("starting server", "port", c.port)
		out, err := c.run(ctx, "pg_ctl", "start", "-w",
			"-t", strconv.Itoa(int(pgCtlTimeout.Seconds())),
			"-D", c.data,
			"-l", c.log,
			"-o", "-p "+strconv.Itoa(c.port))
		if err == nil {
			return nil
		}
		logTail := c.logTail()
		if pickPort && i < attempts && strings.Contains(logTail, "could not bind") {
			c.logger.Debug("port taken, trying another", "port", c.port)
			continue
		}
		return fmt.Errorf("pg_ctl start on 127.0.0.1:%d: %w\n%s\nserver log:\n%s",
			c.port, err, tail(out, 10), logTail)
	}
}

func appendFile(path, text string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(text); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

// FreePort returns a TCP port on 127.0.0.1 that nothing listens on now.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pick a free port on 127.0.0.1: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// command builds an exec.Cmd for one of the server binaries, running as
// osUser when we are root.
func (c *Cluster) command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, c.tool(name), args...)
	// The cluster directory is one the server's user can always enter,
	// unlike root's working directory.
	cmd.Dir = c.dir
	cmd.Env = cleanEnv()
	if c.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	}
	return cmd
}

// tool returns the path of the server binary name: in the binaries'
// directory, or else beside what pg_ctl there links to (a PATH directory may
// link the few binaries Binaries looks for, not pg_basebackup).
func (c *Cluster) tool(name string) string {
	path := filepath.Join(c.bin, name)
	if isExecutable(path) {
		return path
	}
	if real, err := filepath.EvalSymlinks(filepath.Join(c.bin, "pg_ctl")); err == nil {
		if beside := filepath.Join(filepath.Dir(real), name); isExecutable(beside) {
			return beside
		}
	}
	return path
}

// run runs a server binary and returns its combined output. pg_ctl is always
// given -l, so the server it forks does not inherit (and hold open) the
// output pipe, which would make this wait forever.
func (c *Cluster) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := c.command(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.Bytes(), err
}

// cleanEnv is the environment minus libpq's PG* variables, which would
// otherwise steer pg_ctl's readiness check or initdb towards another server.
func cleanEnv() []string {
	return slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "PG") })
}

func (c *Cluster) logTail() string {
	b, err := os.ReadFile(c.log)
	if err != nil {
		return fmt.Sprintf("(cannot read server log: %v)", err)
	}
	return tail(b, 20)
}

// tail returns the last n lines of b.
func tail(b []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// watchdogScript waits for a line on stdin. "done" means Stop has cleaned up;
// end of input means the process that started the cluster died, so the
// watchdog stops the server and removes the directory itself. It ignores the
// signals a terminal sends on Ctrl-C or hangup so that it outlives its
// parent long enough to clean up.
const watchdogScript = `trap '' INT HUP TERM QUIT
read -r line
[ "$line" = done ] && exit 0
"$1/pg_ctl" stop -m immediate -D "$2/data" >/dev/null 2>&1
rm -rf "$2"`

func (c *Cluster) startWatchdog() error {
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("watchdog pipe: %w", err)
	}
	defer r.Close()
	// Not CommandContext: the watchdog must outlive Start's context.
	cmd := exec.Command("/bin/sh", "-c", watchdogScript, "pglocal-watchdog", c.bin, c.dir)
	cmd.Dir = c.dir
	cmd.Env = cleanEnv()
	cmd.Stdin = r
	// Its own process group keeps it out of reach of the terminal's Ctrl-C.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: c.cred}
	if err := cmd.Start(); err != nil {
		w.Close()
		return fmt.Errorf("start cluster watchdog: %w", err)
	}
	c.watchdog, c.wdPipe = cmd, w
	return nil
}

// dismissWatchdog tells the watchdog that cleanup is done and reaps it.
func (c *Cluster) dismissWatchdog() {
	if c.watchdog == nil {
		return
	}
	if _, err := io.WriteString(c.wdPipe, "done\n"); err != nil {
		c.logger.Warn("dismiss cluster watchdog", "err", err)
	}
	c.wdPipe.Close()
	if err := c.watchdog.Wait(); err != nil {
		c.logger.Warn("cluster watchdog", "err", err)
	}
	c.watchdog = nil
}

// abort tears down a cluster whose Start failed, on a fresh context because
// Start's may be the reason it failed.
func (c *Cluster) abort() {
	ctx, cancel := context.WithTimeout(context.Background(), pgCtlTimeout)
	defer cancel()
	if _, err := os.Stat(filepath.Join(c.data, "postmaster.pid")); err == nil {
		// Best effort: the directory, and with it the cluster, goes next.
		_, _ = c.run(ctx, "pg_ctl", "stop", "-m", "immediate", "-w", "-D", c.data)
	}
	c.dismissWatchdog()
	c.removeDir()
}

func (c *Cluster) removeDir() {
	if err := os.RemoveAll(c.dir); err != nil {
		c.logger.Warn("remove cluster directory", "dir", c.dir, "err", err)
	}
}

// URL returns a connection URL for database dbname as superuser postgres.
func (c *Cluster) URL(dbname string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.port, url.PathEscape(dbname))
}

// Port returns the TCP port the server listens on at 127.0.0.1.
func (c *Cluster) Port() int { return c.port }

// Dir returns the directory holding the cluster's data, log and socket.
func (c *Cluster) Dir() string { return c.dir }

// Restart restarts the server (pg_ctl restart -m fast -w), dropping every
// connection; fault tests use it to simulate a database outage.
func (c *Cluster) Restart(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return errors.New("restart PostgreSQL: cluster is stopped")
	}
	out, err := c.run(ctx, "pg_ctl", "restart", "-m", "fast", "-w",
		"-t", strconv.Itoa(int(pgCtlTimeout.Seconds())),
		"-D", c.data,
		"-l", c.log)
	if err != nil {
		return fmt.Errorf("pg_ctl restart on port %d: %w\n%s\nserver log %s:\n%s",
			c.port, err, tail(out, 10), c.log, c.logTail())
	}
	c.logger.Info("throwaway PostgreSQL restarted", "port", c.port)
	return nil
}

// Backup copies the running cluster with pg_basebackup, as a backup or an
// asynchronous replica holds it: online, the server keeps serving. It
// returns the copy's name for Rewind. Copies live in the cluster's
// directory and go with it.
func (c *Cluster) Backup(ctx context.Context) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return "", errors.New("back up PostgreSQL: cluster is stopped")
	}
	c.backups++
	name := fmt.Sprintf("backup-%d", c.backups)
	// -X stream brings the WAL the copy needs to be consistent; -c fast
	// starts at once instead of waiting for the next checkpoint.
	out, err := c.run(ctx, "pg_basebackup", "-D", filepath.Join(c.dir, name), "-X", "stream", "-c", "fast",
		"--no-sync", "-h", c.dir, "-p", strconv.Itoa(c.port), "-U", "postgres")
	if err != nil {
		return "", fmt.Errorf("pg_basebackup of the cluster on port %d: %w\n%s", c.port, err, tail(out, 10))
	}
	c.logger.Info("throwaway PostgreSQL backed up", "port", c.port, "backup", name)
	return name, nil
}

// Rewind stops the server, puts back the data directory Backup copied under
// name, and starts the server again on the same port: the database goes
// back in time as after a failover to an asynchronous replica that lagged,
// or a restore of last night's backup. Every connection drops, as in those
// cases. The backup stays, for another Rewind.
func (c *Cluster) Rewind(ctx context.Context, name string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return errors.New("rewind PostgreSQL: cluster is stopped")
	}
	backup := filepath.Join(c.dir, name)
	if _, err := os.Stat(filepath.Join(backup, "PG_VERSION")); err != nil {
		return fmt.Errorf("rewind PostgreSQL to %s: not a backup of this cluster: %w", name, err)
	}
	if out, err := c.run(ctx, "pg_ctl", "stop", "-m", "fast", "-w",
		"-t", strconv.Itoa(int(pgCtlTimeout.Seconds())), "-D", c.data); err != nil {
		return fmt.Errorf("rewind PostgreSQL: pg_ctl stop on port %d: %w\n%s", c.port, err, tail(out, 10))
	}
	if err := os.RemoveAll(c.data); err != nil {
		return fmt.Errorf("rewind PostgreSQL: remove the data directory: %w", err)
	}
	// cp -a keeps the server user's ownership and modes; as root, Go's
	// copies would belong to root, which the server refuses.
	if out, err := exec.CommandContext(ctx, "cp", "-a", backup, c.data).CombinedOutput(); err != nil {
		return fmt.Errorf("rewind PostgreSQL: copy %s back: %w\n%s", name, err, tail(out, 10))
	}
	if out, err := c.run(ctx, "pg_ctl", "start", "-w",
		"-t", strconv.Itoa(int(pgCtlTimeout.Seconds())),
		"-D", c.data, "-l", c.log, "-o", "-p "+strconv.Itoa(c.port)); err != nil {
		return fmt.Errorf("rewind PostgreSQL: pg_ctl start on port %d: %w\n%s\nserver log:\n%s",
			c.port, err, tail(out, 10), c.logTail())
	}
	c.logger.Info("throwaway PostgreSQL rewound", "port", c.port, "backup", name)
	return nil
}

// Stop stops the server (pg_ctl stop -m fast, falling back to -m immediate)
// and removes the cluster's directory. Calling it again does nothing.
func (c *Cluster) Stop(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return nil
	}
	c.stopped = true

	var errs []error
	out, err := c.run(ctx, "pg_ctl", "stop", "-m", "fast", "-w",
		"-t", strconv.Itoa(int(pgCtlTimeout.Seconds())), "-D", c.data)
	if err != nil {
		c.logger.Warn("fast shutdown failed, trying immediate", "err", err, "output", tail(out, 5))
		if out2, err2 := c.run(ctx, "pg_ctl", "stop", "-m", "immediate", "-w", "-D", c.data); err2 != nil {
			errs = append(errs, fmt.Errorf("pg_ctl stop on port %d: %w\n%s\nserver log:\n%s",
				c.port, err2, tail(out2, 10), c.logTail()))
		}
	}
	c.dismissWatchdog()
	if err := os.RemoveAll(c.dir); err != nil {
		errs = append(errs, fmt.Errorf("remove cluster directory: %w", err))
	}
	if len(errs) == 0 {
		c.logger.Info("throwaway PostgreSQL stopped", "port", c.port)
	}
	return errors.Join(errs...)
}
