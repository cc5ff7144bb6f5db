package pglocal

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestStartRestartStop(t *testing.T) {
	if _, err := Binaries(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("no PostgreSQL server binaries and not root: %v", err)
		}
		t.Fatalf("running as root, so the server binaries should be installed (bash .ci/run does): %v", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()

	logger := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	c, err := Start(ctx, Options{Logger: logger})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			c.Stop(context.Background())
		}
	})
	if c.Port() == 0 {
		t.Fatal("Port() = 0 after Start with a picked port")
	}

	selectOne(ctx, t, c.URL("postgres"))
	if err := c.Restart(ctx); err != nil {
		t.Fatalf("Restart: %v", err)
	}
	selectOne(ctx, t, c.URL("postgres"))

	dir := c.Dir()
	if err := c.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	stopped = true
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("cluster directory %s still there after Stop (stat: %v)", dir, err)
	}
	if err := c.Stop(ctx); err != nil {
		t.Errorf("second Stop: %v", err)
	}
	if err := c.Restart(ctx); err == nil {
		t.Error("Restart after Stop succeeded")
	}
}

// Backup copies a running cluster; Rewind takes it back to the copy, as a
// failover to a lagging replica or a restore would.
func TestBackupRewind(t *testing.T) {
	if _, err := Binaries(); err != nil {
		t.Skipf("no PostgreSQL server binaries: %v", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	c, err := Start(ctx, Options{})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { c.Stop(context.Background()) })
	exec := func(sql string) {
		t.Helper()
		conn, err := pgx.Connect(ctx, c.URL("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	count := func() int {
		t.Helper()
		conn, err := pgx.Connect(ctx, c.URL("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	exec("CREATE TABLE t (n int); INSERT INTO t SELECT generate_series(1, 10)")
	// A session stays open across the backup: the server keeps serving.
	open, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close(context.Background())
	name, err := c.Backup(ctx)
	if err != nil {
		t.Fatalf("Backup: %v", err)
	}
	if _, err := open.Exec(ctx, "INSERT INTO t SELECT generate_series(11, 15)"); err != nil {
		t.Fatalf("the server stopped serving during the backup: %v", err)
	}
	if n := count(); n != 15 {
		t.Fatalf("%d rows before the rewind, want 15", n)
	}
	for range 2 { // the backup stays for another rewind
		if err := c.Rewind(ctx, name); err != nil {
			t.Fatalf("Rewind: %v", err)
		}
		if n := count(); n != 10 {
			t.Errorf("%d rows after the rewind, want the 10 the backup held", n)
		}
		exec("INSERT INTO t VALUES (99)")
	}
	if err := c.Rewind(ctx, "backup-none"); err == nil {
		t.Error("Rewind to a backup that does not exist succeeded")
	}
}

func selectOne(ctx context.Context, t *testing.T, url string) {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT 1").Scan(&n); err != nil || n != 1 {
		t.Fatalf("SELECT 1 = %d, %v", n, err)
	}
}

func TestStartRefusesNonEmptyDir(t *testing.T) {
	dir := t.TempDir()
	keep := filepath.Join(dir, "keep")
	if err := os.WriteFile(keep, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := prepareDir(dir); err == nil {
		t.Fatal("prepareDir accepted a non-empty directory, which Stop would delete")
	}
	if _, err := os.Stat(keep); err != nil {
		t.Errorf("file in the refused directory: %v", err)
	}
}

func TestBinariesPrefersPath(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"initdb", "pg_ctl"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", filepath.Join(dir, "missing")+string(os.PathListSeparator)+dir)
	got, err := Binaries()
	if err != nil || got != dir {
		t.Fatalf("Binaries() = %q, %v; want %q", got, err, dir)
	}
}

func TestBinariesNotFound(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	_, err := Binaries()
	if err == nil {
		if m, _ := filepath.Glob(debianBinGlob); len(m) > 0 {
			t.Skip("server binaries installed under " + debianBinGlob)
		}
		t.Fatal("Binaries found something on an empty PATH")
	}
	if !errors.Is(err, ErrNotFound) || !bytes.Contains([]byte(err.Error()), []byte("postgresql")) {
		t.Errorf("error %q should wrap ErrNotFound and name the package postgresql", err)
	}
}

func TestHighestVersion(t *testing.T) {
	dirs := []string{
		"/usr/lib/postgresql/9.6/bin",
		"/usr/lib/postgresql/15/bin",
		"/usr/lib/postgresql/10/bin",
		"/usr/lib/postgresql/devel/bin",
	}
	got, ok := highestVersion(dirs)
	if want := "/usr/lib/postgresql/15/bin"; !ok || got != want {
		t.Errorf("highestVersion = %q, %v; want %q", got, ok, want)
	}
	if _, ok := highestVersion(nil); ok {
		t.Error("highestVersion(nil) reported a directory")
	}
}
