package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/pglocal"
	"github.com/deferq/scheduler/internal/schedproc"
	"github.com/deferq/scheduler/migrations"
)

// dbMaxConns is the pool size of every in-process contender: the service's
// default DB_MAX_CONNS, so nobody gets more connections than the service.
const dbMaxConns = 20

// postgres is the server the bench works on: a throwaway cluster, or the
// server of DATABASE_URL. Every contender gets a fresh database, cloned from a
// migrated template, so that none inherits another's dead tuples.
type postgres struct {
	cluster  *pglocal.Cluster // nil when DATABASE_URL is used
	adminURL string
	admin    *pgxpool.Pool
	prefix   string // of every database the bench creates
	tmpl     string
	svcTmpl  string // the scheduler binary's own template; "" means tmpl
	locale   string // of the databases not cloned from the bench's templates; "" is the server's
	stmts    bool   // the server tracks statements (pg_stat_statements): statements.go

	mu      sync.Mutex
	created []string
}

// startPostgres connects to dbURL, or starts a throwaway cluster when it is
// empty (the server binaries must be installed: `make bench` runs
// scripts/install-postgres.sh first), and creates the migrated template. With
// explain, a throwaway cluster logs the plan of every statement slower than
// 200ms (auto_explain, nested statements included) and every autovacuum
// run, for close to save. A locale other than "" is every database's
// (BENCH_DB_LOCALE).
func startPostgres(ctx context.Context, dbURL, locale string, explain bool, say func(string, ...any)) (_ *postgres, err error) {
	p := &postgres{adminURL: dbURL, prefix: fmt.Sprintf("bench_%d_", os.Getpid()), locale: locale}
	defer func() {
		if err != nil {
			_ = p.close(context.WithoutCancel(ctx), "") // the error that got us here says more
		}
	}()
	if dbURL == "" {
		if _, err := pglocal.Binaries(); err != nil {
			return nil, fmt.Errorf("%w: run scripts/install-postgres.sh (make bench does), or set DATABASE_URL", err)
		}
		say("starting a throwaway PostgreSQL cluster")
		if p.cluster, err = pglocal.Start(ctx, pglocal.Options{}); err != nil {
			return nil, err
		}
		p.adminURL = p.cluster.URL("postgres")
		if err := enableStatements(ctx, p); err != nil {
			// The report says so: probeStatements fails below.
			say("  load pg_stat_statements: %v", err)
		}
	}
	if p.admin, err = pgxpool.New(ctx, p.adminURL); err != nil {
		return nil, fmt.Errorf("connect to the bench's PostgreSQL: %w", err)
	}
	if p.cluster != nil && explain {
		// The plans of slow statements, including those inside the
		// triggers, go to the server log, which close copies out.
		for _, stmt := range []string{
			"LOAD 'auto_explain'",
			"ALTER SYSTEM SET session_preload_libraries = 'auto_explain'",
			"ALTER SYSTEM SET auto_explain.log_min_duration = '200ms'",
			"ALTER SYSTEM SET auto_explain.log_nested_statements = on",
			// Autovacuum's runs too, with their CPU: its work falls into
			// whichever phase is running, and a longer phase takes more of it.
			"ALTER SYSTEM SET log_autovacuum_min_duration = 0",
			"SELECT pg_reload_conf()",
		} {
			if _, err := p.admin.Exec(ctx, stmt); err != nil {
				return nil, fmt.Errorf("set up auto_explain: %s: %w", stmt, err)
			}
		}
	}
	if err := p.admin.Ping(ctx); err != nil {
		return nil, fmt.Errorf("connect to the bench's PostgreSQL: %w", err)
	}
	if err := p.probeStatements(ctx); err != nil {
		say("  no per-statement times (%v): the report leaves out where Postgres's time goes", err)
	} else {
		p.stmts = true
	}
	p.tmpl = p.prefix + "template"
	if err := p.create(ctx, p.tmpl, ""); err != nil {
		return nil, err
	}
	tu, err := p.url(p.tmpl)
	if err != nil {
		return nil, err
	}
	tp, err := pgxpool.New(ctx, tu)
	if err != nil {
		return nil, fmt.Errorf("connect to template database %s: %w", p.tmpl, err)
	}
	// Closed before any clone: CREATE DATABASE ... TEMPLATE fails while
	// anyone is connected to the template.
	defer tp.Close()
	if _, err := migrations.Apply(ctx, tp, slog.New(slog.DiscardHandler)); err != nil {
		return nil, fmt.Errorf("migrate template database %s: %w", p.tmpl, err)
	}
	return p, nil
}

// create creates database name, from template tmpl unless tmpl is "";
// then in the bench's locale, if it has one (template0 is the only template
// a database of another locale may copy).
func (p *postgres) create(ctx context.Context, name, tmpl string) error {
	stmt := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	switch {
	case tmpl != "":
		stmt += " TEMPLATE " + pgx.Identifier{tmpl}.Sanitize()
	case p.locale != "":
		// configFromEnv let only a locale name's characters through.
		stmt += " TEMPLATE template0 LOCALE '" + p.locale + "'"
	}
	if _, err := p.admin.Exec(ctx, stmt); err != nil {
		if p.locale != "" && tmpl == "" {
			return fmt.Errorf("create database %s in locale %s (BENCH_DB_LOCALE: the server's machine must have it, e.g. localedef -i en_US -f UTF-8 en_US.UTF-8, and a server started after that): %w",
				name, p.locale, err)
		}
		return fmt.Errorf("create database %s (the bench needs CREATEDB on DATABASE_URL's server): %w", name, err)
	}
	p.mu.Lock()
	p.created = append(p.created, name)
	p.mu.Unlock()
	return nil
}

// url returns the URL of database name on the bench's server.
func (p *postgres) url(name string) (string, error) {
	u, err := url.Parse(p.adminURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", fmt.Errorf("DATABASE_URL must be a postgres:// URL (the bench creates databases next to its database)")
	}
	u.Path = "/" + name
	return u.String(), nil
}

// database is one contender's fresh database.
type database struct {
	name string
	url  string
	pool *pgxpool.Pool
}

// serviceTemplate makes the template of the service's databases: migrated
// by bin's own `migrate`, so that a scheduler binary of another version
// (BENCH_SCHEDULER) runs on its own schema, not on this tree's, which it
// would refuse as newer or lack. The in-process contenders, built from this
// tree, keep the template startPostgres migrated.
func (p *postgres) serviceTemplate(ctx context.Context, bin string) error {
	name := p.prefix + "svc_template"
	if err := p.create(ctx, name, ""); err != nil {
		return err
	}
	u, err := p.url(name)
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, bin, "migrate")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+u)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("migrate the service's template database %s with %s migrate: %w\n%s", name, bin, err, out)
	}
	p.svcTmpl = name
	return nil
}

// fresh creates a database for one in-process contender, cloned from the
// migrated template, with a pool of dbMaxConns connections.
func (p *postgres) fresh(ctx context.Context, label string) (*database, error) {
	return p.freshFrom(ctx, label, p.tmpl)
}

// freshService is fresh for a database the scheduler binary runs on: cloned
// from the template its own migrate made (serviceTemplate) when there is
// one.
func (p *postgres) freshService(ctx context.Context, label string) (*database, error) {
	if p.svcTmpl == "" {
		return p.freshFrom(ctx, label, p.tmpl)
	}
	return p.freshFrom(ctx, label, p.svcTmpl)
}

func (p *postgres) freshFrom(ctx context.Context, label, tmpl string) (*database, error) {
	name := p.prefix + label
	if err := p.create(ctx, name, tmpl); err != nil {
		return nil, err
	}
	u, err := p.url(name)
	if err != nil {
		return nil, err
	}
	pc, err := pgxpool.ParseConfig(u)
	if err != nil {
		return nil, fmt.Errorf("database %s: %w", name, err)
	}
	pc.MaxConns = dbMaxConns
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect to database %s: %w", name, err)
	}
	return &database{name: name, url: u, pool: pool}, nil
}

// drop closes d's pool and drops it, so that later contenders do not share
// the disk and cache with its leftovers.
func (p *postgres) drop(ctx context.Context, d *database) error {
	d.pool.Close()
	if _, err := p.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{d.name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", d.name, err)
	}
	p.mu.Lock()
	for i, n := range p.created {
		if n == d.name {
			p.created = append(p.created[:i], p.created[i+1:]...)
			break
		}
	}
	p.mu.Unlock()
	return nil
}

// close drops every database the bench created and stops the throwaway
// cluster, copying its server log to saveLog first when that is not "".
func (p *postgres) close(ctx context.Context, saveLog string) error {
	var errs []error
	if p.cluster != nil && saveLog != "" {
		if b, err := os.ReadFile(filepath.Join(p.cluster.Dir(), "server.log")); err != nil {
			errs = append(errs, fmt.Errorf("read the server log: %w", err))
		} else if err := os.WriteFile(saveLog, b, 0o644); err != nil {
			errs = append(errs, fmt.Errorf("save the server log: %w", err))
		}
	}
	if p.admin != nil {
		p.mu.Lock()
		names := append([]string(nil), p.created...)
		p.mu.Unlock()
		if p.cluster == nil { // a throwaway cluster goes as a whole
			for _, n := range names {
				if _, err := p.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{n}.Sanitize()+" WITH (FORCE)"); err != nil {
					errs = append(errs, fmt.Errorf("drop database %s: %w", n, err))
				}
			}
		}
		p.admin.Close()
	}
	if p.cluster != nil {
		if err := p.cluster.Stop(ctx); err != nil {
			errs = append(errs, fmt.Errorf("stop throwaway PostgreSQL: %w", err))
		}
	}
	return errors.Join(errs...)
}

// serverInfo describes the server for the report: version and the settings
// that matter most for write throughput.
func (p *postgres) serverInfo(ctx context.Context) string {
	var version, fsync, syncCommit, sharedBuffers, collate string
	err := p.admin.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('fsync'),
		current_setting('synchronous_commit'), current_setting('shared_buffers'),
		(SELECT datcollate FROM pg_database WHERE datname = $1)`, p.tmpl).Scan(&version, &fsync, &syncCommit, &sharedBuffers, &collate)
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	where := "DATABASE_URL"
	if p.cluster != nil {
		where = "throwaway cluster (internal/pglocal)"
	}
	return fmt.Sprintf("PostgreSQL %s, %s, fsync=%s synchronous_commit=%s shared_buffers=%s, databases collate %s",
		version, where, fsync, syncCommit, sharedBuffers, collate)
}

// postmasterPID returns the server's postmaster process id when the server
// runs on this machine and its data directory is readable, else 0: CPU
// accounting then leaves Postgres out.
func (p *postgres) postmasterPID(ctx context.Context) int {
	var dir string
	if p.cluster != nil {
		dir = filepath.Join(p.cluster.Dir(), "data")
	} else if err := p.admin.QueryRow(ctx, "SELECT current_setting('data_directory')").Scan(&dir); err != nil {
		return 0
	}
	b, err := os.ReadFile(filepath.Join(dir, "postmaster.pid"))
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		return 0
	}
	return pid
}

// startKafka starts an in-process broker with the given topics. Each
// contender gets its own, so that none reads another's records and kfake's
// in-memory logs are freed between contenders. Its goroutines carry the
// profiler label component=kfake, so CPU profiles tell the broker apart.
func startKafka(partitions int32, topics ...string) (*kfake.Cluster, string, error) {
	var (
		c   *kfake.Cluster
		err error
	)
	pprof.Do(context.Background(), pprof.Labels("component", "kfake"), func(context.Context) {
		c, err = kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topics...))
	})
	if err != nil {
		return nil, "", fmt.Errorf("start in-process Kafka broker: %w", err)
	}
	return c, c.ListenAddrs()[0], nil
}

// service is a running `scheduler run` subprocess.
type service struct {
	*schedproc.Process
}

// startService runs `scheduler run` with the service's defaults except what
// the bench's environment requires, and waits until /readyz answers 200.
//
// With profile set the service also serves net/http/pprof (PPROF_ADDR), for
// cpuProfile. env are further NAME=value settings a scenario measures the
// service with (the scaling curves' DISPATCH_WORKERS).
func (b *bench) startService(ctx context.Context, dbURL, brokers string, profile bool, env ...string) (*service, error) {
	// Nothing inherited: the service sees its defaults, these, and
	// BENCH_SERVICE_ENV's settings (an experiment's, printed in the report).
	env = append(append([]string{"DATABASE_URL=" + dbURL, "KAFKA_BROKERS=" + brokers, "TARGET_TOPICS=bench.*"}, env...),
		b.cfg.ServiceEnv...)
	p, err := schedproc.StartReady(ctx, schedproc.Options{Bin: b.bin, Pprof: profile, Logs: b.cfg.ServiceLogs, TailBytes: 64 << 10,
		Env: env}, 60*time.Second)
	if err != nil {
		return nil, err
	}
	return &service{p}, nil
}

// cpuTimes is CPU time spent so far by the parts of a run.
type cpuTimes struct {
	service  time.Duration // the scheduler subprocess (0 when none runs)
	postgres time.Duration // the server's processes (0 when not readable)
	bench    time.Duration // this process: kfake, load generators, in-process contenders
}

func (a cpuTimes) sub(b cpuTimes) cpuTimes {
	return cpuTimes{a.service - b.service, a.postgres - b.postgres, a.bench - b.bench}
}

// userHZ is the unit of the times in /proc/PID/stat; Linux fixes it at 100
// for user space whatever the kernel's internal tick.
const userHZ = 100

// sampleCPU reads the CPU time of the service (svcPID, 0 for none), of the
// Postgres server whose postmaster is pmPID (0 for unknown: its processes and
// the children it has reaped), and of this process.
func sampleCPU(svcPID, pmPID int) cpuTimes {
	var t cpuTimes
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		t.bench = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if svcPID > 0 {
		if st, ok := procStat(svcPID); ok {
			t.service = ticks(st.utime + st.stime)
		}
	}
	if pmPID > 0 {
		if st, ok := procStat(pmPID); ok {
			total := st.utime + st.stime + st.cutime + st.cstime
			entries, _ := os.ReadDir("/proc")
			for _, e := range entries {
				pid, err := strconv.Atoi(e.Name())
				if err != nil || pid == pmPID {
					continue
				}
				if c, ok := procStat(pid); ok && c.ppid == pmPID {
					total += c.utime + c.stime
				}
			}
			t.postgres = ticks(total)
		}
	}
	return t
}

func ticks(n int64) time.Duration { return time.Duration(n) * time.Second / userHZ }

type stat struct {
	ppid                         int
	utime, stime, cutime, cstime int64
}

// procStat parses /proc/PID/stat. The command name (field 2) may contain
// spaces and parentheses, so fields are counted from its closing one.
func procStat(pid int) (stat, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return stat{}, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return stat{}, false
	}
	f := strings.Fields(string(b[i+1:])) // f[0] is field 3 (state)
	if len(f) < 15 {
		return stat{}, false
	}
	num := func(j int) int64 {
		n, _ := strconv.ParseInt(f[j], 10, 64)
		return n
	}
	// Fields 4 (ppid) and 14-17 (utime, stime, cutime, cstime).
	return stat{ppid: int(num(1)), utime: num(11), stime: num(12), cutime: num(13), cstime: num(14)}, true
}

// cpuProfile fetches a CPU profile of the service over d into path, in the
// background, and returns a function that waits for it. A process runs one
// CPU profile at a time, so it starts once after, the wait of the previous
// profile, has returned (nil: at once). It does nothing when the service does
// not serve pprof.
func (s *service) cpuProfile(path string, d time.Duration, after func() error) func() error {
	if s.PprofAddr == "" {
		return func() error { return nil }
	}
	done := make(chan error, 1)
	go func() {
		var prev error
		if after != nil {
			prev = after()
		}
		done <- errors.Join(prev, func() error {
			client := &http.Client{Timeout: d + 10*time.Second}
			resp, err := client.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", s.PprofAddr, max(1, int(d.Seconds()))))
			if err != nil {
				return fmt.Errorf("service CPU profile: %w", err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("service CPU profile: %s", resp.Status)
			}
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				return fmt.Errorf("BENCH_PROFILE_DIR: %w", err)
			}
			f, err := os.Create(path)
			if err != nil {
				return fmt.Errorf("BENCH_PROFILE_DIR: %w", err)
			}
			if _, err := io.Copy(f, resp.Body); err != nil {
				f.Close()
				return fmt.Errorf("service CPU profile %s: %w", path, err)
			}
			return f.Close()
		}())
	}()
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() { err = <-done })
		return err
	}
}
