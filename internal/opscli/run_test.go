package opscli

import (
	"context"
	"io"
	"net"
	"strings"
	"testing"

	"github.com/deferq/scheduler/internal/pgtest"
)

// run runs the operator command args[0] as the scheduler binary would, with
// no input: a question (replay above --confirm-above) reads end of input.
func run(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	return runWithInput(ctx, args, environ, strings.NewReader(""), stdout, stderr)
}

// runWithInput is run with stdin answering the questions a command asks.
func runWithInput(ctx context.Context, args, environ []string, stdin io.Reader, stdout, stderr io.Writer) int {
	code, ok := Run(ctx, args[0], args[1:], environ, stdin, stdout, stderr)
	if !ok {
		panic("not an operator command: " + args[0])
	}
	return code
}

func TestRunKnowsEveryCommand(t *testing.T) {
	for _, name := range Commands() {
		// --help needs no database and exits 0 for every command.
		var out strings.Builder
		if code, ok := Run(t.Context(), name, []string{"--help"}, nil, strings.NewReader(""), &out, io.Discard); !ok || code != 0 {
			t.Errorf("Run(%q, --help) = %d, %v; want 0, true", name, code, ok)
		}
		if !strings.Contains(out.String(), "scheduler "+name) {
			t.Errorf("%s --help does not name the command:\n%s", name, out.String())
		}
	}
	if _, ok := Run(t.Context(), "run", nil, nil, strings.NewReader(""), io.Discard, io.Discard); ok {
		t.Error("Run knows \"run\", which is not an operator command")
	}
}

// freeAddr returns a loopback address nothing listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func TestMain(m *testing.M) { pgtest.Main(m) }
