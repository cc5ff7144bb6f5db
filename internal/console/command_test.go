package console

import (
	"context"
	"strings"
	"testing"
	"time"

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
