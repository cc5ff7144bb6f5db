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
// the URL's, with the server's reason.
func TestOpenPoolSessionSettings(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	pool, err := OpenPool(ctx, pgtest.WithQuery(t, db.URL, "options=-c%20jit%3Doff"))
	if err != nil {
		t.Fatal(err)
	}
	var jit, name string
	err = pool.QueryRow(ctx, "SELECT current_setting('jit'), current_setting('application_name')").Scan(&jit, &name)
	pool.Close()
	if err != nil || jit != "off" || name != "defer-scheduler-console" {
		t.Errorf("jit %q, application_name %q (%v); want off and defer-scheduler-console", jit, name, err)
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
