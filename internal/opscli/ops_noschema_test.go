package opscli

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/pgtest"
)

// unmigratedDB creates an empty database, one `scheduler migrate` never ran
// on, and returns its URL and name.
func unmigratedDB(t *testing.T) (dbURL, name string) {
	t.Helper()
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, pgtest.AdminURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	name = fmt.Sprintf("nomigrate_%d", rand.Uint32())
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		a, err := pgx.Connect(context.Background(), pgtest.AdminURL(t))
		if err == nil {
			a.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
			a.Close(context.Background())
		}
	})
	u, err := url.Parse(pgtest.AdminURL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String(), name
}

// TestOpsOnUnmigratedDatabase checks that every kind of operator command
// run against a database without the scheduler's schema says what is wrong
// and what to do, not PostgreSQL's bare "relation does not exist".
func TestOpsOnUnmigratedDatabase(t *testing.T) {
	dbURL, name := unmigratedDB(t)
	for _, args := range [][]string{
		{"status"},
		{"ls"},
		{"show", "1"},
		{"held"},
		{"expedite", "--id", "1"},
		{"cancel", "1"},
		{"replay", "--target", "*", "--dry-run"},
		{"targets"},
		{"inflight"},
		{"release", "--group", "g", "--dry-run"},
		{"status", "--json"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var stdout, stderr bytes.Buffer
			code := run(ctx, args, []string{"DATABASE_URL=" + dbURL}, &stdout, &stderr)
			if code != 1 {
				t.Errorf("exit code %d, want 1\nstdout:\n%s\nstderr:\n%s", code, stdout.String(), stderr.String())
			}
			got := stderr.String()
			for _, want := range []string{
				"the database " + name + " at 127.0.0.1:", " has no scheduler schema (relation ", " does not exist)",
				"run `scheduler migrate`",
			} {
				if !strings.Contains(got, want) {
					t.Errorf("stderr lacks %q:\n%s", want, got)
				}
			}
			if strings.Contains(got, "SQLSTATE") || strings.Count(strings.TrimSpace(got), "\n") > 0 {
				t.Errorf("stderr is not one explained line:\n%s", got)
			}
		})
	}
}
