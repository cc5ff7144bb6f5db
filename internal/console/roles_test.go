package console

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/migrations"
)

// TestOperatorRole serves the console connected as the operator role that
// sql/roles/roles.sql and grants.sql create, as docs/console.md says to:
// every page reads and every action acts, within what the role is granted.
func TestOperatorRole(t *testing.T) {
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Fatal("psql is not installed (Debian package postgresql-client); the role scripts are meant for it")
	}
	ctx := context.Background()
	suffix := fmt.Sprintf("%08x", rand.Uint32())
	owner, service, operator, password := "con_owner_"+suffix, "con_service_"+suffix, "con_operator_"+suffix, "pw-"+suffix
	adminURL := pgtest.AdminURL(t)
	admin, err := pgxpool.New(ctx, adminURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	dbName := "console_roles_" + suffix
	// Cleanups run last in, first out: the database goes before the roles
	// that own its objects.
	t.Cleanup(func() {
		for _, role := range []string{owner, service, operator} {
			if _, err := admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+pgx.Identifier{role}.Sanitize()); err != nil {
				t.Errorf("drop role %s: %v", role, err)
			}
		}
	})
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+dbName); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+dbName+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database: %v", err)
		}
	})
	as := func(role string) string {
		u, err := url.Parse(adminURL)
		if err != nil {
			t.Fatal(err)
		}
		u.Path = "/" + dbName
		if role != "" {
			u.User = url.UserPassword(role, password)
		}
		return u.String()
	}
	vars := []string{"-v", "owner=" + owner, "-v", "service=" + service, "-v", "operator=" + operator, "-v", "schema=public",
		"-v", "owner_password=" + password, "-v", "service_password=" + password, "-v", "operator_password=" + password}
	script := func(dbURL, file, want string) {
		t.Helper()
		args := append([]string{"-X", "-d", dbURL}, vars...)
		cmd := exec.Command(psql, append(args, "-f", filepath.Join("..", "..", "sql", "roles", file))...)
		cmd.Env = append(os.Environ(), "PGCONNECT_TIMEOUT=5")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), want) {
			t.Fatalf("%s: %v\n%s", file, err, out)
		}
	}
	script(as(""), "roles.sql", "roles ready")
	ownerPool, err := pgxpool.New(ctx, as(owner))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrations.Apply(ctx, ownerPool, dispatchtest.Logger()); err != nil {
		t.Fatalf("migrate as the owner: %v", err)
	}
	ownerPool.Close()
	script(as(owner), "grants.sql", "grants ready")

	// The seed is data the service would have written: insert it as the
	// administrator.
	superPool, err := pgxpool.New(ctx, as(""))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(superPool.Close)
	fixture.SeedOps(t, superPool)

	pool, err := OpenPool(ctx, as(operator))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var who string
	if err := pool.QueryRow(ctx, "SELECT current_user").Scan(&who); err != nil || who != operator {
		t.Fatalf("connected as %q (%v), want %s", who, err, operator)
	}
	c := login(t, serve(t, testConfig(t), pool), "alice")
	for _, path := range []string{"/", "/api/overview", "/messages?state=parked", "/messages/101", "/messages/112", "/keys?key=order-3",
		"/parked", "/rejected", "/targets"} {
		mustHave(t, path, c.get(path), 200)
	}
	for _, a := range []struct {
		action string
		form   url.Values
		check  string
	}{
		{"expedite", url.Values{"scope": {"key"}, "key": {"order-1"}}, "SELECT next_run_at <= now() FROM deferred_message WHERE id = 102"},
		{"park", url.Values{"ids": {"110"}, "why": {"role test"}}, "SELECT state = 'parked' FROM deferred_message WHERE id = 110"},
		{"replay", url.Values{"state": {"parked"}, "target": {"payments.*"}}, "SELECT count(*) = 0 FROM deferred_message WHERE state = 'parked' AND target_topic = 'payments.retry'"},
		{"fix", url.Values{"ids": {"106"}, "target": {"orders.retry"}}, "SELECT state = 'pending' FROM deferred_message WHERE id = 106"},
		{"pause", url.Values{"target": {"orders.retry"}, "note": {"role test"}}, "SELECT paused FROM target_control WHERE target_topic = 'orders.retry'"},
		{"limit", url.Values{"target": {"orders.retry"}, "rate": {"5"}}, "SELECT rate_limit = 5 FROM target_control WHERE target_topic = 'orders.retry'"},
		{"weight", url.Values{"target": {"orders.retry"}, "weight": {"3"}}, "SELECT weight = 3 FROM target_control WHERE target_topic = 'orders.retry'"},
		{"cancel", url.Values{"ids": {"111"}}, "SELECT count(*) = 0 FROM deferred_message WHERE id = 111"},
	} {
		t.Run(a.action, func(t *testing.T) {
			preview := c.act(a.action, a.form)
			mustHave(t, "preview", preview, 200, "Nothing has changed yet")
			mustHave(t, "confirm", confirm(t, c, a.action, preview, nil), 200, `id="result"`)
			var ok bool
			if err := superPool.QueryRow(ctx, a.check).Scan(&ok); err != nil || !ok {
				t.Errorf("%s as the operator role: not done (%v): %s", a.action, err, a.check)
			}
		})
	}
}
