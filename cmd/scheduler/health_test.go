package main

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pglocal"
	"github.com/deferq/scheduler/internal/pgtest"
)

// /readyz fails naming postgres while the database server is down, and
// naming kafka while the broker is, and recovers by itself each time; the
// scheduler keeps working after both outages.
func TestReadyzFollowsPostgresAndKafka(t *testing.T) {
	if _, err := pglocal.Binaries(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("no PostgreSQL server binaries and not root: %v", err)
		}
		t.Fatalf("running as root, so the server binaries should be installed (bash .ci/run does): %v", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	// A cluster of our own: the shared test server must not go down.
	pg, err := pglocal.Start(ctx, pglocal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Stop(context.Background()) })

	// The broker keeps its state in a directory, so that a new broker on the
	// same port after Close is the same cluster restarted.
	kdir := t.TempDir()
	kopts := []kfake.Opt{kfake.NumBrokers(1), kfake.DataDir(kdir)}
	kc, err := kfake.NewCluster(append(kopts, kfake.SeedTopics(4, deferTopic, targetTopic))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kc.Close() })
	brokers := kc.ListenAddrs()[0]
	_, portText, _ := net.SplitHostPort(brokers)
	port, _ := strconv.Atoi(portText)

	p := start(t, serviceEnv(pg.URL("postgres"), brokers, "e2e-health"), "--migrate")
	out := read(t, brokers, targetTopic)
	prod := producer(t, brokers)

	stopPostgres(ctx, t, pg.URL("postgres"))
	waitReadyz(t, p, 503, "postgres")
	if s := scrapeMetrics(t, p); !s.is(0, metrics.Ready) {
		t.Errorf("%s should be 0 while /readyz fails", metrics.Ready)
	}
	if err := pg.Restart(ctx); err != nil { // starts a stopped server
		t.Fatal(err)
	}
	waitReadyz(t, p, 200, "")

	kc.Close()
	waitReadyz(t, p, 503, "kafka")
	kc, err = kfake.NewCluster(append(kopts, kfake.Ports(port))...)
	if err != nil {
		t.Fatal(err)
	}
	waitReadyz(t, p, 200, "")
	if s := scrapeMetrics(t, p); !s.is(1, metrics.Ready) {
		t.Errorf("%s should be 1 again", metrics.Ready)
	}

	// Recovered for real, not only in /readyz: a record goes through.
	if _, _, err := prod.SendMessage(deferRecord("k", "after", "defer.target", targetTopic, "defer.delay", "0")); err != nil {
		t.Fatal(err)
	}
	out.until(t, 20*time.Second, "a delivery after both outages", func(ds []delivery) bool {
		for _, d := range ds {
			if d.value == "after" {
				return true
			}
		}
		return false
	})
	p.stop()
}

// stopPostgres shuts the server at url down the way `pg_ctl stop -m fast`
// does, by sending its postmaster SIGINT, and waits until it has exited. The
// server names its own data directory, where postmaster.pid holds the
// postmaster's pid. pglocal.Cluster has Restart, which also starts a stopped
// server, but no Stop that keeps the data; this is that half.
func stopPostgres(ctx context.Context, t *testing.T, url string) {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	var dataDir string
	err = conn.QueryRow(ctx, "SHOW data_directory").Scan(&dataDir)
	conn.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pidFile, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		t.Fatal(err)
	}
	first, _, _ := strings.Cut(string(pidFile), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		t.Fatalf("postmaster.pid: %v", err)
	}
	if err := syscall.Kill(pid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	// The postmaster removes its pid file last thing on a clean shutdown.
	// (Probing the pid instead could see a zombie nobody reaps.)
	for {
		if _, err := os.Stat(filepath.Join(dataDir, "postmaster.pid")); errors.Is(err, os.ErrNotExist) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("postmaster %d did not exit: %v", pid, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// waitReadyz polls /readyz until it answers code and, for 503, names the
// failing check want.
func waitReadyz(t *testing.T, p *proc, code int, want string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var got int
	var body string
	for time.Now().Before(deadline) {
		got, body = p.Get("/readyz")
		if got == code && got == 200 {
			return
		}
		if got == code {
			failing, _ := readyzBody(t, body)["failing"].(map[string]any)
			if failing[want] != nil {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("/readyz = %d %s, want %d naming %q", got, body, code, want)
}

// PPROF_ADDR serves the runtime profiles on a listener of its own; the
// metrics address does not serve them.
func TestPprofAddr(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, deferTopic, targetTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	db := pgtest.NewDB(t)
	addr := freeAddr(t)
	p := start(t, append(serviceEnv(db.URL, kc.ListenAddrs()[0], "e2e-pprof"), "PPROF_ADDR="+addr))

	resp, err := http.Get("http://" + addr + "/debug/pprof/heap?debug=1")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "heap profile") {
		t.Fatalf("PPROF_ADDR heap profile: %d %.200s", resp.StatusCode, body)
	}
	if code, _ := p.Get("/debug/pprof/heap"); code != http.StatusNotFound {
		t.Errorf("HTTP_ADDR serves /debug/pprof/heap: %d, want 404", code)
	}
	if !strings.Contains(p.Logs(), "serving pprof") {
		t.Error("the log does not say pprof is served")
	}
	p.stop()
}
