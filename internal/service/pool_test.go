package service

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/config"
	"github.com/deferq/scheduler/internal/pgconnect"
	"github.com/deferq/scheduler/internal/pglocal"
	"github.com/deferq/scheduler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// Session settings ride in DATABASE_URL's query string (README, "Session
// settings"): an operator turns the JIT off, say, without a change to the
// server. A setting the server refuses stops start-up with its name
// and value, and an application_name of the URL's own is kept. Every
// connection is READ COMMITTED, which the head triggers need, over the
// database's default of REPEATABLE READ here; a URL that asks for another
// level stops start-up.
func TestOpenPoolSessionSettings(t *testing.T) {
	db := pgtest.NewDB(t)
	db.SetDefault(t, "default_transaction_isolation", "repeatable read")
	tests := []struct {
		name    string
		query   string            // added to the URL's query string, as written in it
		want    map[string]string // setting -> SHOW's answer
		wantErr []string          // in the error, if it must fail
	}{
		{
			name: "defaults",
			want: map[string]string{"application_name": "defer-scheduler", "transaction_isolation": "read committed"},
		},
		{
			name:  "read committed of the URL's own",
			query: "options=-c%20default_transaction_isolation%3Dread%5C%20committed",
			want:  map[string]string{"transaction_isolation": "read committed"},
		},
		{
			name:    "another isolation level",
			query:   "default_transaction_isolation=serializable",
			wantErr: []string{"DATABASE_URL sets default_transaction_isolation=serializable; the scheduler needs read committed"},
		},
		{
			name:  "jit off and a work_mem",
			query: "jit=off&work_mem=8MB",
			want:  map[string]string{"jit": "off", "work_mem": "8MB", "application_name": "defer-scheduler"},
		},
		{
			// The form the README gives, which psql takes too (libpq
			// refuses a query parameter it does not know, such as jit).
			name:  "jit off through options",
			query: "options=-c%20jit%3Doff%20-c%20work_mem%3D8MB",
			want:  map[string]string{"jit": "off", "work_mem": "8MB"},
		},
		{
			name:  "the URL's application_name",
			query: "application_name=scheduler-eu-1",
			want:  map[string]string{"application_name": "scheduler-eu-1"},
		},
		{
			name:    "a value the server refuses",
			query:   "jit=sometimes",
			wantErr: []string{"refused a session setting in DATABASE_URL (jit=sometimes)", `parameter "jit" requires a Boolean value`},
		},
		{
			name:    "a value the server refuses, through options",
			query:   "options=-c%20jit%3Dsometimes",
			wantErr: []string{"refused a session setting in DATABASE_URL (options=-c jit=sometimes)", `parameter "jit" requires a Boolean value`},
		},
		{
			name:    "a read-only default",
			query:   "options=-c%20default_transaction_read_only%3Don",
			wantErr: []string{"takes no writes (transaction_read_only is on", "target_session_attrs=read-write"},
		},
		{
			name:    "a setting the server does not know",
			query:   "jitt=off",
			wantErr: []string{"refused a session setting in DATABASE_URL (jitt=off)", `unrecognized configuration parameter "jitt"`},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u := db.URL
			if tt.query != "" {
				u = pgtest.WithQuery(t, db.URL, tt.query)
			}
			cfg, err := config.Load(nil)
			if err != nil {
				t.Fatal(err)
			}
			cfg.DatabaseURL = u
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()

			pool, err := openPool(ctx, cfg)
			if tt.wantErr != nil {
				if err == nil {
					pool.Close()
					t.Fatalf("openPool with %s: no error, want one naming %q", tt.query, tt.wantErr)
				}
				for _, w := range tt.wantErr {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("openPool with %s: error %q does not contain %q", tt.query, err, w)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("openPool with %s: %v", tt.query, err)
			}
			defer pool.Close()
			// Every connection of the pool, not only the first: hold two.
			c1, err := pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer c1.Release()
			c2, err := pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer c2.Release()
			for name, want := range tt.want {
				for i, c := range []*pgxpool.Conn{c1, c2} {
					var got string
					if err := c.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&got); err != nil {
						t.Fatalf("connection %d: current_setting(%s): %v", i+1, name, err)
					}
					if got != want {
						t.Errorf("connection %d: %s = %q, want %q", i+1, name, got, want)
					}
				}
			}
		})
	}
}

// The README's form of a session setting works for psql too, which the
// runbook commands run with the same DATABASE_URL; the shorter jit=off,
// which the service takes, is refused by libpq. A runbook file's change
// under a stricter default isolation is refused until the URL asks for
// read committed.
func TestSessionSettingsInPsql(t *testing.T) {
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Fatal("psql is not installed (Debian package postgresql-client); the runbook is meant for it")
	}
	db := pgtest.NewDB(t)
	// A database whose default isolation is stricter than the head
	// triggers take: the README's options form gets psql read committed.
	db.SetDefault(t, "default_transaction_isolation", "repeatable read")
	for _, tt := range []struct {
		query, show, want string
		ok                bool
	}{
		{"options=-c%20jit%3Doff", "jit", "off", true},
		{"jit=off", "jit", `invalid URI query parameter: "jit"`, false},
		{"options=-c%20default_transaction_isolation%3Dread%5C%20committed", "transaction_isolation", "read committed", true},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		out, err := exec.CommandContext(ctx, psql, "-X", "-tA", "-d", pgtest.WithQuery(t, db.URL, tt.query), "-c", "SHOW "+tt.show).CombinedOutput()
		cancel()
		if (err == nil) != tt.ok || !strings.Contains(string(out), tt.want) {
			t.Errorf("psql with %s: %v, printed %q; want success %v and %q", tt.query, err, out, tt.ok, tt.want)
		}
	}

	// A runbook file that changes messages, under that default: refused
	// with the fix, then run as the README says.
	var id int64
	if err := db.Pool.QueryRow(context.Background(), `INSERT INTO deferred_message (business_key, target_topic, next_run_at)
		VALUES ('k', 'orders.retry', now() + interval '1 hour') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		query, want string
		ok          bool
	}{
		{"", "can be changed only in a READ COMMITTED transaction; this transaction is REPEATABLE READ", false},
		{"options=-c%20default_transaction_isolation%3Dread%5C%20committed", "k|", true},
	} {
		u := db.URL
		if tt.query != "" {
			u = pgtest.WithQuery(t, db.URL, tt.query)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		out, err := exec.CommandContext(ctx, psql, "-X", "-tA", "-v", "ON_ERROR_STOP=1", "-d", u,
			"-v", fmt.Sprintf("ids=%d", id), "-f", "../../sql/runbook/cancel_id.sql").CombinedOutput()
		cancel()
		if (err == nil) != tt.ok || !strings.Contains(string(out), tt.want) {
			t.Errorf("cancel_id.sql with %q: %v, printed %q; want success %v and %q", tt.query, err, out, tt.ok, tt.want)
		}
	}
	var left int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_message").Scan(&left); err != nil || left != 0 {
		t.Errorf("%d messages left (%v), want the one cancelled", left, err)
	}
}

// DATABASE_URL may list several servers (README, "High availability"):
// with target_session_attrs=read-write the service's connections, and
// psql's with the same URL, go to the one that takes writes, wherever it
// is in the list. Without it they go to the first, and when that one takes
// no writes the service refuses to start, naming it. A standby is stood in
// for here by a server whose sessions are read-only, as a hot standby's
// are.
func TestOpenPoolPicksTheServerThatTakesWrites(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary := pgtest.NewDB(t)
	pc, err := pgx.ParseConfig(primary.URL)
	if err != nil {
		t.Fatal(err)
	}
	standby, err := pglocal.Start(ctx, pglocal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = standby.Stop(context.Background()) })
	sc, err := pgx.Connect(ctx, standby.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	// The same database name as the primary's: pgx tries the next server
	// only when a server refuses a session, not when it lacks the database.
	for _, stmt := range []string{
		"CREATE DATABASE " + pgx.Identifier{pc.Database}.Sanitize(),
		"ALTER SYSTEM SET default_transaction_read_only = on",
		"SELECT pg_reload_conf()",
	} {
		if _, err := sc.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	sc.Close(ctx)

	hosts := fmt.Sprintf("postgres://%s@127.0.0.1:%d,%s:%d/%s?sslmode=disable",
		pc.User, standby.Port(), pc.Host, pc.Port, url.PathEscape(pc.Database))
	for _, tt := range []struct {
		name, query string
		port        int    // the server psql and the pool's connections reach
		wantErr     string // openPool's error, if it must fail
	}{
		{name: "the standby listed first, read-write asked for", query: "&target_session_attrs=read-write", port: int(pc.Port)},
		{name: "without it: the first listed, which takes no writes", port: standby.Port(),
			wantErr: fmt.Sprintf("the database at 127.0.0.1:%d takes no writes (transaction_read_only is on", standby.Port())},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := config.Load(nil)
			if err != nil {
				t.Fatal(err)
			}
			cfg.DatabaseURL = hosts + tt.query

			// psql, which the runbook runs with the same URL.
			out, err := exec.CommandContext(ctx, "psql", "-X", "-tA", "-d", cfg.DatabaseURL, "-c", "SELECT inet_server_port()").CombinedOutput()
			if err != nil || strings.TrimSpace(string(out)) != fmt.Sprint(tt.port) {
				t.Errorf("psql with %s: %v, printed %q; want port %d", cfg.DatabaseURL, err, out, tt.port)
			}

			pool, err := openPool(ctx, cfg)
			if tt.wantErr != "" {
				if err == nil {
					pool.Close()
					t.Fatalf("openPool with %s: no error, want %q", cfg.DatabaseURL, tt.wantErr)
				}
				if !strings.Contains(err.Error(), tt.wantErr) || !strings.Contains(err.Error(), "target_session_attrs=read-write") {
					t.Fatalf("openPool with %s: %v; want an error containing %q and the fix", cfg.DatabaseURL, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			// Every connection of the pool: hold two.
			var conns []*pgxpool.Conn
			for range 2 {
				c, err := pool.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer c.Release()
				conns = append(conns, c)
			}
			for i, c := range conns {
				var port int
				var readOnly string
				if err := c.QueryRow(ctx, "SELECT inet_server_port(), current_setting('transaction_read_only')").Scan(&port, &readOnly); err != nil {
					t.Fatal(err)
				}
				if port != tt.port || readOnly != "off" {
					t.Errorf("connection %d: on port %d, transaction_read_only %s; want %d, off", i+1, port, readOnly, tt.port)
				}
			}
		})
	}
}

// A primary demoted in place, a switchover without a restart, keeps the
// service's sessions open and refuses every write on them. Readiness finds
// that, closes every connection and reports it; the next connections go
// where DATABASE_URL leads now, here the other server of its list, which
// was promoted meanwhile. Two throwaway clusters stand in for the pair:
// each turned read-only or back by a reload, as a demotion or promotion
// changes what a running session may do.
func TestReconnectWhenThePrimaryTurnsReadOnly(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pair := pgtest.StartPair(t)
	first, second := pair.First, pair.Second

	cfg, err := config.Load(nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg.DatabaseURL = pair.URL
	pool, err := openPool(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	logs := &strings.Builder{}
	logger := slog.New(slog.NewTextHandler(logs, nil))
	port := func() int {
		t.Helper()
		var p int
		if err := pool.QueryRow(ctx, "SELECT inet_server_port()").Scan(&p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if got := port(); got != first.Port() {
		t.Fatalf("connected to port %d, want the first server's, %d", got, first.Port())
	}
	if err := pgconnect.ReconnectIfReadOnly(ctx, pool.Pool, "DATABASE_URL", logger); err != nil {
		t.Fatalf("with the primary taking writes: %v", err)
	}

	// The switchover: the first server is demoted in place, the second
	// promoted. The pool's connection to the first stays open and now
	// refuses writes.
	pair.Switchover(t)
	if _, err := pool.Exec(ctx, "CREATE TABLE t (id int)"); err == nil || !strings.Contains(err.Error(), "read-only transaction") {
		t.Fatalf("a write on the demoted primary: %v, want a read-only transaction's refusal", err)
	}
	err = pgconnect.ReconnectIfReadOnly(ctx, pool.Pool, "DATABASE_URL", logger)
	if want := fmt.Sprintf("the database at 127.0.0.1:%d takes no writes; reconnecting through DATABASE_URL", first.Port()); err == nil || err.Error() != want {
		t.Fatalf("after the switchover: %v, want %q", err, want)
	}
	if !strings.Contains(logs.String(), "the database takes no writes any more") {
		t.Errorf("nothing logged: %q", logs.String())
	}
	if got := port(); got != second.Port() {
		t.Fatalf("after the reconnect, on port %d, want the promoted server's, %d", got, second.Port())
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE t (id int)"); err != nil {
		t.Fatalf("a write after the reconnect: %v", err)
	}
	if err := pgconnect.ReconnectIfReadOnly(ctx, pool.Pool, "DATABASE_URL", logger); err != nil {
		t.Fatalf("on the promoted server: %v", err)
	}
}
