package pgconnect

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/pgbouncertest"
	"github.com/deferq/scheduler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// newRole creates a login role that is no superuser, dropped when the test
// ends, and returns its name and dbURL as that role.
func newRole(t *testing.T, db pgtest.DB) (string, string) {
	t.Helper()
	ctx := context.Background()
	name := fmt.Sprintf("pgconnect_%08x", rand.Uint32())
	if _, err := db.Pool.Exec(ctx, "CREATE ROLE "+name+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Its sessions go with the database, which pgtest drops after
		// this; a role still connected cannot be dropped, so wait for it.
		_, _ = db.Pool.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name)
		for range 100 {
			if _, err := db.Pool.Exec(ctx, "DROP ROLE IF EXISTS "+name); err == nil {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Errorf("drop role %s: still in use", name)
	})
	u, err := url.Parse(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(name)
	return name, u.String()
}

// levels reads, on two connections of the pool held at once, what a
// transaction that names no level gets.
func levels(t *testing.T, p *Pool) []string {
	t.Helper()
	ctx := t.Context()
	var got []string
	for range 2 {
		c, err := p.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
		var level string
		if err := c.QueryRow(ctx, "SELECT current_setting('transaction_isolation')").Scan(&level); err != nil {
			t.Fatal(err)
		}
		got = append(got, level)
	}
	return got
}

// Open works directly and behind a real PgBouncer in either mode with the
// pooler's defaults, which refuse every startup parameter but a few. It
// tells a pooler in transaction mode, where it prepares no statement by
// name, from the others, and every session is READ COMMITTED.
func TestOpenThroughPgBouncer(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	tx := pgbouncertest.Start(t, db.URL, pgbouncertest.Options{Mode: pgbouncertest.Transaction})
	session := pgbouncertest.Start(t, db.URL, pgbouncertest.Options{Mode: pgbouncertest.Session})
	for _, tt := range []struct {
		name     string
		url      string
		pooled   bool
		execMode pgx.QueryExecMode
	}{
		{"direct", db.URL, false, pgx.QueryExecModeCacheStatement},
		{"session mode", session.URL(t, db.URL), false, pgx.QueryExecModeCacheStatement},
		{"transaction mode", tx.URL(t, db.URL), true, pgx.QueryExecModeExec},
		{"transaction mode, the URL's own exec mode", tx.URL(t, db.URL) + "&default_query_exec_mode=simple_protocol", true, pgx.QueryExecModeSimpleProtocol},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Open(t.Context(), tt.url, Options{Source: "DATABASE_URL", AppName: "pgconnect-test"})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			if p.TransactionPooled != tt.pooled {
				t.Errorf("TransactionPooled = %v, want %v", p.TransactionPooled, tt.pooled)
			}
			if got := p.Config().ConnConfig.DefaultQueryExecMode; got != tt.execMode {
				t.Errorf("exec mode %v, want %v", got, tt.execMode)
			}
			if _, ok := p.Config().ConnConfig.RuntimeParams[isolationSetting]; ok {
				t.Errorf("sent %s, though the server's default is read committed", isolationSetting)
			}
			for _, l := range levels(t, p) {
				if l != "read committed" {
					t.Errorf("transaction_isolation %q, want read committed", l)
				}
			}
			// The same statement many times, as the service runs its
			// statements: a statement prepared by name on one server
			// session would be missing on the next.
			for i := range 20 {
				var n int
				if err := p.QueryRow(t.Context(), "SELECT $1::int + 1", i).Scan(&n); err != nil || n != i+1 {
					t.Fatalf("statement %d: %d, %v", i, n, err)
				}
			}
			c, err := Connect(t.Context(), tt.url, Options{Source: "DATABASE_URL", AllowReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close(context.Background())
			if c.TransactionPooled != tt.pooled {
				t.Errorf("Connect: TransactionPooled = %v, want %v", c.TransactionPooled, tt.pooled)
			}
		})
	}
}

// Where the server's default is stricter than READ COMMITTED, Open
// overrides it with a startup parameter: directly that works; a pooler
// refuses it or drops it, and the error says to set the role's default on
// the server, after which Open works through the pooler too.
func TestStricterDefaultThroughPgBouncer(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	db.SetDefault(t, "default_transaction_isolation", "repeatable read")
	role, roleURL := newRole(t, db)
	refusing := pgbouncertest.Start(t, db.URL, pgbouncertest.Options{Users: []string{role}})
	dropping := pgbouncertest.Start(t, db.URL, pgbouncertest.Options{Users: []string{role},
		Settings: []string{"ignore_startup_parameters = default_transaction_isolation"}})

	p, err := Open(t.Context(), roleURL, Options{Source: "DATABASE_URL"})
	if err != nil {
		t.Fatalf("directly: %v", err)
	}
	if got := p.Config().ConnConfig.RuntimeParams[isolationSetting]; got != "read committed" {
		t.Errorf("directly: %s %q, want the override", isolationSetting, got)
	}
	for _, l := range levels(t, p) {
		if l != "read committed" {
			t.Errorf("directly: transaction_isolation %q, want read committed", l)
		}
	}
	p.Close()

	for _, tt := range []struct {
		name string
		b    *pgbouncertest.Bouncer
		want []string
	}{
		{"a pooler that refuses it", refusing, []string{
			"the database's default isolation level for DATABASE_URL's sessions is repeatable read",
			"refused the startup parameter that overrides it",
			"ALTER ROLE CURRENT_USER SET default_transaction_isolation = 'read committed'",
			"unsupported startup parameter: default_transaction_isolation", "RECONNECT"}},
		{"a pooler that drops it", dropping, []string{
			"sessions of DATABASE_URL at 127.0.0.1:", "are repeatable read",
			"PgBouncer's ignore_startup_parameters",
			"ALTER ROLE CURRENT_USER SET default_transaction_isolation = 'read committed'", "RECONNECT"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Open(t.Context(), tt.b.URL(t, roleURL), Options{Source: "DATABASE_URL"})
			if err == nil {
				p.Close()
				t.Fatal("opened; want the stricter default refused")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}

	// The fix the error gives, as the role itself: no superuser needed.
	rc, err := pgx.Connect(t.Context(), roleURL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rc.Exec(t.Context(), "ALTER ROLE CURRENT_USER SET default_transaction_isolation = 'read committed'"); err != nil {
		t.Fatalf("the error's fix: %v", err)
	}
	rc.Close(t.Context())
	// And new server sessions, which take it: the pooler's open ones
	// keep the default they started with.
	if _, err := db.Pool.Exec(t.Context(), "SELECT pg_terminate_backend(pid, 60000) FROM pg_stat_activity WHERE usename = $1", role); err != nil {
		t.Fatal(err)
	}
	for _, b := range []*pgbouncertest.Bouncer{refusing, dropping} {
		p, err := Open(t.Context(), b.URL(t, roleURL), Options{Source: "DATABASE_URL"})
		if err != nil {
			t.Fatalf("after ALTER ROLE: %v", err)
		}
		for _, l := range levels(t, p) {
			if l != "read committed" {
				t.Errorf("after ALTER ROLE: transaction_isolation %q, want read committed", l)
			}
		}
		p.Close()
	}
}

// What a pooler refuses or a server would run wrongly under is named, with
// the fix.
func TestOpenRefuses(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	role, roleURL := newRole(t, db)
	replica, replicaURL := newRole(t, db)
	// Only a superuser may set it, for a role or a session.
	if _, err := db.Pool.Exec(t.Context(), "ALTER ROLE "+replica+" SET session_replication_role = replica"); err != nil {
		t.Fatal(err)
	}
	tx := pgbouncertest.Start(t, db.URL, pgbouncertest.Options{Users: []string{role, replica}})
	statement := pgbouncertest.Start(t, db.URL, pgbouncertest.Options{Mode: "statement"})
	for _, tt := range []struct {
		name string
		url  string
		want []string
	}{
		{"a session setting of the URL's, through a pooler", tx.URL(t, db.URL) + "&jit=off", []string{
			"the server at 127.0.0.1:", "refused the session setting jit of DATABASE_URL",
			"ALTER ROLE CURRENT_USER SET jit = ...", "ignore_startup_parameters", "unsupported startup parameter: jit"}},
		{"triggers off for the role", replicaURL, []string{
			"sessions of DATABASE_URL at", "run with session_replication_role = replica",
			"a message is stored with no head and never delivered", "RESET session_replication_role"}},
		{"triggers off for the role, through a pooler", tx.URL(t, replicaURL), []string{
			"run with session_replication_role = replica"}},
		{"triggers off in the URL, as a role that may not", pgtest.WithQuery(t, roleURL, "options=-c%20session_replication_role%3Dreplica"), []string{
			"refused a session setting in DATABASE_URL (options=-c session_replication_role=replica)",
			`permission denied to set parameter "session_replication_role"`}},
		{"a pooler in statement mode", statement.URL(t, db.URL), []string{
			"a pooler in statement mode refuses transactions", "use transaction or session mode"}},
		{"no server", "postgres://postgres@127.0.0.1:1/x?sslmode=disable&connect_timeout=5", []string{
			"connect to the database at 127.0.0.1:1"}},
		{"not a URL", "postgres://a b", []string{"DATABASE_URL is not a valid PostgreSQL URL"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Open(t.Context(), tt.url, Options{Source: "DATABASE_URL"})
			if err == nil {
				p.Close()
				t.Fatal("opened; want an error")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

// The console's check, run by a program without readiness: once the
// server takes no writes, the pool's connections are closed. A read-only
// session default stands in for a demotion, as both make every open
// session refuse writes (the service's test and internal/console's switch
// two clusters over).
func TestWatchWritable(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	p, err := Open(t.Context(), db.URL, Options{Source: "DATABASE_URL", MaxConns: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	pid := func() int32 {
		t.Helper()
		var pid int32
		if err := p.QueryRow(t.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		return pid
	}
	before := pid()
	// The pool's one session turns read-only, as a demoted primary's do.
	if _, err := p.Exec(t.Context(), "SET default_transaction_read_only = on"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	logs := &strings.Builder{} // read once the watch is done
	go func() {
		defer close(done)
		WatchWritable(ctx, p.Pool, "DATABASE_URL", 20*time.Millisecond, slog.New(slog.NewTextHandler(logs, nil)))
	}()
	deadline := time.Now().Add(time.Minute)
	for pid() == before {
		if time.Now().After(deadline) {
			t.Fatalf("still on server process %d a minute after its session turned read-only", before)
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	<-done
	if want := "the database takes no writes any more"; !strings.Contains(logs.String(), want) {
		t.Errorf("logged %q, want %q", logs.String(), want)
	}
}
