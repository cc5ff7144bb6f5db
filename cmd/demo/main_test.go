package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/pgtest"
)

// `make demo` must keep working: run the scenario, once on a throwaway
// cluster as on a fresh machine, once on a given DATABASE_URL, which it must
// leave as it found it, and once more on that URL with session settings in
// its query string (README, "Session settings") and a database whose
// default isolation is stricter than the scheduler takes.
func TestMain(m *testing.M) { pgtest.Main(m) }

func TestDemo(t *testing.T) {
	db := pgtest.NewDB(t)
	tests := []struct {
		name   string
		env    []string
		strict bool // the given database's default isolation is repeatable read first
	}{
		{name: "throwaway PostgreSQL"},
		{name: "given DATABASE_URL", env: []string{"DATABASE_URL=" + db.URL}},
		{name: "given DATABASE_URL with options, repeatable read by default",
			env:    []string{"DATABASE_URL=" + pgtest.WithQuery(t, db.URL, "options=-c%20jit%3Doff%20-c%20work_mem%3D8MB")},
			strict: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if tt.strict {
				db.SetDefault(t, "default_transaction_isolation", "repeatable read")
			}
			var out, errOut bytes.Buffer
			env := append([]string{"PATH=" + os.Getenv("PATH")}, tt.env...)
			if code := run(ctx, nil, env, &out, &errOut); code != 0 {
				t.Fatalf("demo exited %d\nstdout:\n%s\nstderr:\n%s", code, out.String(), errOut.String())
			}
			for _, want := range []string{
				"demo-42 #1", "demo-42 #3", "UPDATE deferred_message SET next_run_at = now()",
				"missing_target: defer.target is absent",
				"consumer: charge failed", "consumer: refund not handled: order-99 is blocked by the charge",
				"the refund, which arrived while the charge waited, was handled only after the charge succeeded",
				"scheduler stopped cleanly",
			} {
				if !strings.Contains(out.String(), want) {
					t.Fatalf("demo output lacks %q:\n%s", want, out.String())
				}
			}
		})
	}
	// The given database is as it was: no demo schema, no rows, no positions.
	var schemas, rows int
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'scheduler_demo%'").Scan(&schemas); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT (SELECT count(*) FROM deferred_message) + (SELECT count(*) FROM ingest_offset)").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if schemas != 0 || rows != 0 {
		t.Fatalf("the demo left %d schemas and %d rows in the database it was given", schemas, rows)
	}
}

// syncBuffer is a bytes.Buffer the demo writes to while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestDemoConsole: with --console the demo serves the console with a
// password of its own, printed at the start, keeps it up after the
// scenario, and stops cleanly when interrupted.
func TestDemoConsole(t *testing.T) {
	db := pgtest.NewDB(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"--console", addr}, []string{"PATH=" + os.Getenv("PATH"), "DATABASE_URL=" + db.URL}, &out, &errOut)
	}()
	printed := regexp.MustCompile(`operator console: http://` + regexp.QuoteMeta(addr) + ` \(user demo, password (\S+)\)`)
	var password string
	deadline := time.Now().Add(90 * time.Second)
	for password == "" || !strings.Contains(out.String(), "the console stays at") {
		select {
		case code := <-done:
			t.Fatalf("demo exited %d before serving the console\nstdout:\n%s\nstderr:\n%s", code, out.String(), errOut.String())
		case <-time.After(100 * time.Millisecond):
		}
		if m := printed.FindStringSubmatch(out.String()); m != nil {
			password = m[1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no console line and end of scenario within 90s:\n%s", out.String())
		}
	}

	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar, Timeout: 10 * time.Second}
	for _, tt := range []struct {
		password string
		want     int
	}{{"not-" + password, http.StatusUnauthorized}, {password, http.StatusOK}} {
		resp, err := client.PostForm("http://"+addr+"/login", url.Values{"user": {"demo"}, "password": {tt.password}})
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tt.want {
			t.Fatalf("login with password %q: %d, want %d\n%s", tt.password, resp.StatusCode, tt.want, body)
		}
		// The right password lands, through the redirect, on the overview,
		// which shows the scenario's target.
		if tt.want == http.StatusOK && (!strings.Contains(string(body), "Overview") || !strings.Contains(string(body), "payments.retry")) {
			t.Fatalf("after login: no overview of payments.retry:\n%s", body)
		}
	}

	cancel()
	select {
	case code := <-done:
		if code != 0 || !strings.Contains(out.String(), "scheduler stopped cleanly") {
			t.Fatalf("demo exited %d after the interrupt\nstdout:\n%s\nstderr:\n%s", code, out.String(), errOut.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the demo did not stop within 30s of the interrupt:\n%s", out.String())
	}
}
