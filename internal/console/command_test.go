package console

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/config"
	"github.com/deferq/scheduler/internal/pgtest"
)

// The console's pool takes session settings from its URL as the service's
// does (README, "Session settings"), and one the server refuses is named as
// the URL's, with the server's reason. Its transactions are READ
// COMMITTED, which the head triggers need, over the database's default.
func TestOpenPoolSessionSettings(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db.SetDefault(t, "default_transaction_isolation", "serializable")

	pool, err := OpenPool(ctx, pgtest.WithQuery(t, db.URL, "options=-c%20jit%3Doff"))
	if err != nil {
		t.Fatal(err)
	}
	var jit, name, level string
	err = pool.QueryRow(ctx, "SELECT current_setting('jit'), current_setting('application_name'), current_setting('transaction_isolation')").
		Scan(&jit, &name, &level)
	pool.Close()
	if err != nil || jit != "off" || name != "defer-scheduler-console" || level != "read committed" {
		t.Errorf("jit %q, application_name %q, transaction_isolation %q (%v); want off, defer-scheduler-console and read committed",
			jit, name, level, err)
	}

	_, err = OpenPool(ctx, pgtest.WithQuery(t, db.URL, "default_transaction_isolation=repeatable%20read"))
	if want := "console: CONSOLE_DATABASE_URL or DATABASE_URL sets default_transaction_isolation=repeatable read; the scheduler needs read committed"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("OpenPool with repeatable read: %v; want an error containing %q", err, want)
	}

	_, err = OpenPool(ctx, pgtest.WithQuery(t, db.URL, "options=-c%20jit%3Dsometimes"))
	for _, want := range []string{
		"console: the database at",
		"refused a session setting in CONSOLE_DATABASE_URL or DATABASE_URL (options=-c jit=sometimes)",
		`parameter "jit" requires a Boolean value`,
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("OpenPool with jit=sometimes: %v; want an error containing %q", err, want)
		}
	}
}

// A primary demoted in place, a switchover without a restart, keeps the
// console's sessions open and refuses every action on them. The console
// finds that as the service's readiness does, closes its connections and
// reconnects where its URL leads now: here the other server of its list,
// promoted meanwhile (pgtest.Pair).
func TestConsoleReconnectsWhenThePrimaryTurnsReadOnly(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pair := pgtest.StartPair(t)
	first, second := pair.First, pair.Second
	cfg, err := config.Load([]string{"METRICS_INTERVAL=100ms", "DATABASE_URL=" + pair.URL})
	if err != nil {
		t.Fatal(err)
	}
	// Read once the console is closed, and its watch with it.
	logs := &strings.Builder{}
	srv, err := Start(ctx, &cfg, "127.0.0.1:0", nil, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			srv.Close(time.Second)
		}
	}()
	port := func() int {
		t.Helper()
		var p int
		if err := srv.pool.QueryRow(ctx, "SELECT inet_server_port()").Scan(&p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if got := port(); got != first.Port() {
		t.Fatalf("connected to port %d, want the first server's, %d", got, first.Port())
	}

	pair.Switchover(t)
	deadline := time.Now().Add(time.Minute)
	for port() != second.Port() {
		if time.Now().After(deadline) {
			t.Fatalf("still on port %d a minute after the switchover", first.Port())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := srv.pool.Exec(ctx, "CREATE TABLE t (id int)"); err != nil {
		t.Fatalf("a write after the reconnect: %v", err)
	}
	srv.Close(time.Second)
	closed = true
	if !strings.Contains(logs.String(), "the database takes no writes any more") {
		t.Errorf("the reconnect was not logged: %q", logs.String())
	}
}
