// Package pgtest gives tests their own PostgreSQL databases with the
// service's schema applied.
//
// A test package calls Main from TestMain and NewDB from each test that
// needs a database. The first NewDB in a process creates a template database
// and migrates it; every NewDB then clones that template, which is much
// faster than migrating again. Each test binary uses its own template name, so
// test packages running in parallel against one server do not interfere.
//
// The server is TEST_DATABASE_URL if set, else a server on 127.0.0.1:5432
// if one answers, else a throwaway cluster started with pglocal.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/pglocal"
	"github.com/deferq/scheduler/migrations"
)

// defaultURL is the conventional local server CI and developers run.
const defaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// Package state is per test process. It is mutable package-level state on
// purpose: a test binary has exactly one TestMain, and sharing one server and
// one template across its tests is the point of this package.
var (
	mainCalled atomic.Bool

	admin struct {
		once    sync.Once
		url     string
		cluster *pglocal.Cluster // nil unless we started one
		pool    *pgxpool.Pool
		err     error
	}

	tmpl struct {
		once sync.Once
		name string // set once the template exists, so Main drops it
		err  error
	}

	// cloneMu serialises CREATE DATABASE ... TEMPLATE within the process:
	// PostgreSQL refuses to clone a database while another session is
	// connected to it, and the clones are not worth racing for.
	cloneMu sync.Mutex
)

// DB is one test's database.
type DB struct {
	Pool *pgxpool.Pool // connected to the database; closed by the test's cleanup
	URL  string        // connection URL of the database
	Name string        // database name
}

// Main is called from TestMain:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
//
// It runs the tests, then runs cleanups, drops the template database and
// stops the throwaway cluster if it started one, and exits with m.Run's code.
func Main(m *testing.M, cleanups ...func()) {
	mainCalled.Store(true)
	code := m.Run()
	for _, c := range cleanups {
		c()
	}
	if err := teardown(); err != nil {
		// Not a test failure: every test has passed or failed already.
		fmt.Fprintf(os.Stderr, "pgtest: cleanup: %v\n", err)
	}
	os.Exit(code)
}

func teardown() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var errs []error
	if tmpl.name != "" && admin.pool != nil {
		if _, err := admin.pool.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{tmpl.name}.Sanitize()+" WITH (FORCE)"); err != nil {
			errs = append(errs, fmt.Errorf("drop template database %s: %w", tmpl.name, err))
		}
	}
	if admin.pool != nil {
		admin.pool.Close()
	}
	if admin.cluster != nil {
		if err := admin.cluster.Stop(ctx); err != nil {
			errs = append(errs, fmt.Errorf("stop throwaway PostgreSQL: %w", err))
		}
	}
	return errors.Join(errs...)
}

// AdminURL returns the URL of a server to create databases on:
// TEST_DATABASE_URL if set; else defaultURL if a server there answers within
// two seconds; else that of a throwaway cluster started once per process.
func AdminURL(tb testing.TB) string {
	tb.Helper()
	u, err := adminURL()
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	return u
}

func adminURL() (string, error) {
	_, err := adminPool()
	return admin.url, err
}

// adminPool returns the process's pool on the admin database, used for
// CREATE and DROP DATABASE, finding or starting the server on first use.
func adminPool() (*pgxpool.Pool, error) {
	admin.once.Do(func() {
		admin.url, admin.err = findServer()
		if admin.err != nil {
			return
		}
		// pgxpool.New only parses the URL; it connects on first use.
		admin.pool, admin.err = pgxpool.New(context.Background(), admin.url)
		if admin.err != nil {
			admin.err = fmt.Errorf("admin database URL %s: %w", redact(admin.url), admin.err)
		}
	})
	return admin.pool, admin.err
}

func findServer() (string, error) {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u, nil
	}
	if answers(defaultURL) {
		return defaultURL, nil
	}
	if !mainCalled.Load() {
		return "", errors.New("no server on 127.0.0.1:5432 and TEST_DATABASE_URL unset; starting a throwaway cluster needs TestMain to call pgtest.Main(m), which stops it afterwards")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("pkg", "pgtest")
	logger.Info("no server on 127.0.0.1:5432 and TEST_DATABASE_URL unset: starting a throwaway cluster")
	c, err := pglocal.Start(ctx, pglocal.Options{Logger: logger})
	if err != nil {
		return "", fmt.Errorf("no PostgreSQL to test against (set TEST_DATABASE_URL, or run one on 127.0.0.1:5432), and starting a throwaway one failed: %w", err)
	}
	admin.cluster = c
	return c.URL("postgres"), nil
}

// answers reports whether a server at connString accepts a connection and a
// query within two seconds. A server that is up but rejects us (say it wants a
// password) does not count: the tests could not use it.
func answers(connString string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		return false
	}
	defer conn.Close(ctx)
	return conn.Ping(ctx) == nil
}

// template returns the name of the migrated template database, creating it
// on the first call.
func template() (string, error) {
	tmpl.once.Do(func() {
		tmpl.err = createTemplate()
	})
	return tmpl.name, tmpl.err
}

func createTemplate() error {
	if !mainCalled.Load() {
		return errors.New("call pgtest.Main(m) from TestMain, so the template database is dropped after the tests")
	}
	pool, err := adminPool()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	name := "tmpl_" + randomSuffix()
	if _, err := pool.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("create template database %s on %s: %w", name, redact(pool.Config().ConnString()), err)
	}
	// From here on Main drops it, whatever happens next.
	tmpl.name = name

	u, err := withDatabase(pool.Config().ConnString(), name)
	if err != nil {
		return err
	}
	tp, err := pgxpool.New(ctx, u)
	if err != nil {
		return fmt.Errorf("connect to template database %s: %w", name, err)
	}
	// Closed before any clone: CREATE DATABASE ... TEMPLATE fails while
	// anyone is connected to the template.
	defer tp.Close()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if _, err := migrations.Apply(ctx, tp, logger); err != nil {
		return fmt.Errorf("migrate template database %s: %w", name, err)
	}
	return nil
}

// NewDB creates a database for one test, cloned from the process's migrated
// template, and registers cleanups that close its pool and drop it.
func NewDB(tb testing.TB) DB {
	tb.Helper()
	tmplName, err := template()
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	pool, err := adminPool()
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	name := "t_" + randomSuffix()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	cloneMu.Lock()
	_, err = pool.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE "+pgx.Identifier{tmplName}.Sanitize())
	cloneMu.Unlock()
	if err != nil {
		tb.Fatalf("pgtest: create database %s from template %s: %v", name, tmplName, err)
	}
	// Registered before connecting, so the database goes even if that fails.
	// Cleanup runs after the test's context is cancelled, hence a fresh one.
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := pool.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			tb.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})

	u, err := withDatabase(pool.Config().ConnString(), name)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	db, err := pgxpool.New(ctx, u)
	if err != nil {
		tb.Fatalf("pgtest: connect to %s: %v", name, err)
	}
	// Registered after the drop, so it runs first: cleanups run last in,
	// first out.
	tb.Cleanup(db.Close)
	return DB{Pool: db, URL: u, Name: name}
}

// SetDefault makes value the database's default of the session setting
// name (ALTER DATABASE ... SET), as an administrator would: sessions opened
// after it take it, the pool's open ones keep theirs.
func (db DB) SetDefault(tb testing.TB, name, value string) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	stmt := "ALTER DATABASE " + pgx.Identifier{db.Name}.Sanitize() + " SET " + pgx.Identifier{name}.Sanitize() +
		" = '" + strings.ReplaceAll(value, "'", "''") + "'"
	if _, err := db.Pool.Exec(ctx, stmt); err != nil {
		tb.Fatalf("pgtest: %s: %v", stmt, err)
	}
}

// WithQuery returns the URL connString with query (name=value pairs, as
// written in a URL) added to its query string. It fails the test when
// connString is libpq's keyword=value form (a TEST_DATABASE_URL written so):
// tests of what a URL's query string carries need a URL.
func WithQuery(tb testing.TB, connString, query string) string {
	tb.Helper()
	if !strings.HasPrefix(connString, "postgres://") && !strings.HasPrefix(connString, "postgresql://") {
		tb.Fatalf("pgtest: the test server's connection string is not a URL (set TEST_DATABASE_URL as postgres://...); this test adds %q to its query string", query)
	}
	if strings.Contains(connString, "?") {
		return connString + "&" + query
	}
	return connString + "?" + query
}

// withDatabase returns connString with its database replaced by name. It
// accepts both URLs and libpq's keyword=value form.
func withDatabase(connString, name string) (string, error) {
	if strings.HasPrefix(connString, "postgres://") || strings.HasPrefix(connString, "postgresql://") {
		u, err := url.Parse(connString)
		if err != nil {
			return "", fmt.Errorf("parse database URL: %w", err)
		}
		u.Path = "/" + name
		u.RawPath = ""
		return u.String(), nil
	}
	// In keyword=value form a later keyword overrides an earlier one.
	return connString + " dbname=" + name, nil
}

// redact hides a password in a connection URL before it goes into a message.
func redact(connString string) string {
	u, err := url.Parse(connString)
	if err != nil || u.User == nil {
		return connString
	}
	return u.Redacted()
}

// randomSuffix returns 12 lowercase hex characters: short enough for
// readable names, random enough that two processes sharing a server never
// collide.
func randomSuffix() string {
	var b [6]byte
	rand.Read(b[:]) // cannot fail: since Go 1.24 it crashes the program instead
	return hex.EncodeToString(b[:])
}

// Pair is two throwaway clusters standing in for a primary and the
// standby a switchover promotes: URL lists both with
// target_session_attrs=read-write, the first takes writes and the second
// does not. Switchover turns the first read-only and the second writable
// by a reload, as a demotion in place and a promotion change what open
// sessions may do.
type Pair struct {
	First, Second *pglocal.Cluster
	URL           string
}

// StartPair starts a Pair, stopped when the test ends.
func StartPair(tb testing.TB) *Pair {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var cs [2]*pglocal.Cluster
	for i := range cs {
		c, err := pglocal.Start(ctx, pglocal.Options{})
		if err != nil {
			tb.Fatalf("pgtest: %v", err)
		}
		tb.Cleanup(func() { _ = c.Stop(context.Background()) })
		cs[i] = c
	}
	p := &Pair{First: cs[0], Second: cs[1], URL: fmt.Sprintf(
		"postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		cs[0].Port(), cs[1].Port())}
	setReadOnly(tb, p.Second, true)
	return p
}

// Switchover demotes the first server in place and promotes the second.
func (p *Pair) Switchover(tb testing.TB) {
	tb.Helper()
	setReadOnly(tb, p.First, true)
	setReadOnly(tb, p.Second, false)
}

func setReadOnly(tb testing.TB, c *pglocal.Cluster, on bool) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	defer conn.Close(ctx)
	for _, stmt := range []string{fmt.Sprintf("ALTER SYSTEM SET default_transaction_read_only = %v", on), "SELECT pg_reload_conf()"} {
		if _, err := conn.Exec(ctx, stmt); err != nil {
			tb.Fatalf("pgtest: %s: %v", stmt, err)
		}
	}
}
