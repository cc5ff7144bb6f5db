package schedproc

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"
)

func TestTailKeepsTheEnd(t *testing.T) {
	tail := NewTail(10)
	for _, s := range []string{"hello ", "world, ", "and goodbye"} {
		if n, err := tail.Write([]byte(s)); n != len(s) || err != nil {
			t.Fatalf("Write(%q) = %d, %v", s, n, err)
		}
	}
	if got := tail.String(); got != "nd goodbye" {
		t.Errorf("tail = %q, want the last 10 bytes %q", got, "nd goodbye")
	}
	if NewTail(0).max != 256<<10 {
		t.Error("NewTail(0) is not 256 KiB")
	}
}

// A process that exits during start-up is reported as such, with its
// output, instead of waiting for readiness until the time-out.
func TestWaitReadyReportsAnExit(t *testing.T) {
	p, err := Start(Options{Bin: "/bin/sh", Args: []string{"-c", "echo no database; exit 3"}})
	if err != nil {
		t.Fatal(err)
	}
	err = p.WaitReady(t.Context(), 30*time.Second)
	if err == nil || !strings.Contains(err.Error(), "exited") || !strings.Contains(err.Error(), "no database") {
		t.Errorf("WaitReady = %v, want an error saying it exited, with its output", err)
	}
	if code := p.Cmd.ProcessState.ExitCode(); code != 3 {
		t.Errorf("exit code %d, want 3", code)
	}
}

// StartReady starts a process again when it exited because a port it was
// given was taken meanwhile, three tries in all, and not for other exits.
func TestStartReadyRetriesATakenPort(t *testing.T) {
	for _, tt := range []struct {
		name  string
		say   string
		tries int
	}{
		{"port taken", "listen tcp 127.0.0.1:1: bind: address already in use", 3},
		{"other failure", "no database", 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			count := t.TempDir() + "/tries"
			_, err := StartReady(t.Context(), Options{Bin: "/bin/sh",
				Args: []string{"-c", `echo x >> "$COUNT"; echo "$SAY"; exit 1`},
				Env:  []string{"COUNT=" + count, "SAY=" + tt.say}}, 10*time.Second)
			if !errors.Is(err, ErrExited) || !strings.Contains(err.Error(), tt.say) {
				t.Fatalf("StartReady: %v; want ErrExited with the output", err)
			}
			b, rerr := os.ReadFile(count)
			if rerr != nil {
				t.Fatal(rerr)
			}
			if got := strings.Count(string(b), "x"); got != tt.tries {
				t.Errorf("started %d times, want %d", got, tt.tries)
			}
		})
	}
}
