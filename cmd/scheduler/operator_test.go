package main

import (
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/config"
	"github.com/deferq/scheduler/internal/pgtest"
)

// SIGTERM while start-up waits for the brokers is a requested stop like any
// other: exit 0 at once, saying it stopped before connecting.
func TestSIGTERMWhileConnectingToKafka(t *testing.T) {
	db := pgtest.NewDB(t)
	brokers := freeAddr(t) // nothing listens there
	p := launch(t, serviceEnv(db.URL, brokers, "e2e-stop-connecting"))
	waitConnecting(t, p, brokers)
	if err := p.Stop(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if logs := p.Logs(); !strings.Contains(logs, "stopped before connecting to Kafka at "+brokers) || strings.Contains(logs, "level=ERROR") {
		t.Errorf("the logs do not say it stopped before connecting, or show an error:\n%s", logs)
	}
}

// silentServer listens on a loopback port and accepts connections without
// ever answering: a database host that is up but hung, or a wrong port
// behind a firewall that swallows packets.
func silentServer(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return l.Addr().String()
}

// `scheduler migrate` against a server that never answers says which server
// did not answer and within how long, without the password.
func TestMigrateSilentServer(t *testing.T) {
	addr := silentServer(t)
	cmd := exec.Command(binary(t), "migrate")
	cmd.Env = []string{"DATABASE_URL=postgres://scheduler:s3cret@" + addr + "/scheduler?sslmode=disable"}
	began := time.Now()
	out, _ := cmd.CombinedOutput()
	if code := cmd.ProcessState.ExitCode(); code != 1 {
		t.Errorf("exit code %d, want 1:\n%s", code, out)
	}
	if took := time.Since(began); took > 20*time.Second {
		t.Errorf("took %v", took)
	}
	for _, want := range []string{"scheduler migrate: ", addr, "did not answer within 10s"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "s3cret") {
		t.Errorf("output shows the password:\n%s", out)
	}
}

// Every command's --help spells its flags --name, as the README does.
func TestHelpSpellsFlagsWithTwoDashes(t *testing.T) {
	for _, tc := range []struct {
		args  []string
		flags []string
	}{
		{[]string{"run", "--help"}, []string{"migrate"}},
		{[]string{"status", "--help"}, []string{"json"}},
		{[]string{"ls", "--help"}, []string{"json", "target", "state", "limit"}},
		{[]string{"replay", "-h"}, []string{"json", "dry-run", "id", "confirm-above", "yes"}},
		{[]string{"release", "--help"}, []string{"json", "group", "dry-run"}},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			out, err := exec.Command(binary(t), tc.args...).CombinedOutput()
			if err != nil {
				t.Fatalf("%v:\n%s", err, out)
			}
			for _, f := range tc.flags {
				if !strings.Contains(string(out), "\n  --"+f) {
					t.Errorf("--help lacks a line for --%s:\n%s", f, out)
				}
				if strings.Contains(string(out), " -"+f) {
					t.Errorf("--help spells -%s with one dash:\n%s", f, out)
				}
			}
		})
	}
}

// Each log line names one component: River's lines say river, not
// dispatch and river.
func TestLogLinesCarryOneComponent(t *testing.T) {
	db := pgtest.NewDB(t)
	p := start(t, append(serviceEnv(db.URL, broker(t), "e2e-components"), "LOG_LEVEL=debug"))
	waitUntil(t, 30*time.Second, "a line of River's", func() (bool, string) {
		return strings.Contains(p.Logs(), "component=river"), ""
	})
	p.stop()
	for _, line := range strings.Split(p.Logs(), "\n") {
		if n := strings.Count(line, "component="); n > 1 {
			t.Errorf("%d components on one line: %s", n, line)
		}
	}
}

// `scheduler migrate` speaks for itself: River's own info lines
// ("rivermigrate.Migrator[...]: Applied migration") stay out of its output,
// which says what it applied, River's migrations included.
func TestMigrateOutputIsTheSchedulers(t *testing.T) {
	dbURL, _ := emptyDB(t)
	cmd := exec.Command(binary(t), "migrate")
	cmd.Env = []string{"DATABASE_URL=" + dbURL}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "rivermigrate") || strings.Contains(string(out), "Applied migration") {
		t.Errorf("migrate prints River's log lines:\n%s", out)
	}
	if !strings.Contains(string(out), "migrations applied: ") || !strings.Contains(string(out), " of River's\n") {
		t.Errorf("migrate does not say what it applied:\n%s", out)
	}
}

// `scheduler run --help` gives, beside each variable's default, the form a
// valid value takes: the same words as the README and the error messages.
func TestRunHelpGivesEachVariablesForm(t *testing.T) {
	out, err := exec.Command(binary(t), "run", "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("run --help: %v\n%s", err, out)
	}
	lines := strings.Split(string(out), "\n")
	for _, v := range config.Vars() {
		if v.Form == "" {
			continue
		}
		found := false
		for _, l := range lines {
			if f := strings.Fields(l); len(f) > 0 && f[0] == v.Name {
				found = true
				if !strings.Contains(l, v.Help+" (accepts: "+v.Form+")") {
					t.Errorf("run --help: the line of %s lacks %q:\n%s", v.Name, "(accepts: "+v.Form+")", l)
				}
			}
		}
		if !found {
			t.Errorf("run --help has no line for %s", v.Name)
		}
	}
}
