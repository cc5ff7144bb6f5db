package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/config"
)

func TestHelpAndUsage(t *testing.T) {
	var allVars []string
	for _, v := range config.Vars() {
		allVars = append(allVars, v.Name)
	}
	tests := []struct {
		name    string
		args    []string
		environ []string
		code    int
		// stdout and stderr must contain all of these; a nil list means the
		// stream must be empty.
		stdout, stderr []string
	}{
		{name: "no arguments", args: nil, code: 2, stderr: []string{"Usage:", "scheduler <command>"}},
		{name: "--help", args: []string{"--help"}, code: 0, stdout: []string{"Usage:", "run", "migrate", "version", "make demo"}},
		{name: "-h", args: []string{"-h"}, code: 0, stdout: []string{"Usage:", "run", "migrate", "version", "make demo"}},
		{name: "help", args: []string{"help"}, code: 0, stdout: []string{"Usage:", "run", "migrate", "version", "make demo"}},
		{name: "run --help", args: []string{"run", "--help"}, code: 0, stdout: append([]string{"Usage: scheduler run", "-migrate"}, allVars...)},
		{name: "run -h", args: []string{"run", "-h"}, code: 0, stdout: append([]string{"Usage: scheduler run"}, allVars...)},
		{name: "migrate --help", args: []string{"migrate", "--help"}, code: 0, stdout: []string{"Usage: scheduler migrate"}},
		{name: "the demo is not in the production binary", args: []string{"demo"}, code: 2, stderr: []string{`"demo"`, "unknown command"}},
		{name: "--help lists the operator commands", args: []string{"--help"}, code: 0, stdout: []string{
			"\n  status ", "\n  ls ", "\n  show ", "\n  held ", "\n  expedite ", "\n  cancel ", "\n  park ",
			"\n  replay ", "\n  pause ", "\n  resume ", "\n  limit ", "\n  targets ",
		}},
		{name: "version", args: []string{"version"}, code: 0, stdout: []string{"scheduler " + version}},
		{name: "unknown command", args: []string{"frob"}, code: 2, stderr: []string{`"frob"`, "unknown command", "replay", "targets"}},
		{name: "unknown flag", args: []string{"run", "--nosuchflag"}, code: 2, stderr: []string{"nosuchflag", "scheduler run --help"}},
		{name: "unknown migrate flag", args: []string{"migrate", "-x"}, code: 2, stderr: []string{"-x", "scheduler migrate --help"}},
		{name: "extra argument", args: []string{"run", "extra"}, code: 2, stderr: []string{`"extra"`, "unexpected argument"}},
		{name: "migrate extra argument", args: []string{"migrate", "now"}, code: 2, stderr: []string{`"now"`}},
		{name: "migrate without DATABASE_URL", args: []string{"migrate"}, code: 2, stderr: []string{"DATABASE_URL", "not set"}},
		{name: "run without DATABASE_URL or KAFKA_BROKERS", args: []string{"run"}, code: 2, stderr: []string{"DATABASE_URL", "KAFKA_BROKERS"}},
		{name: "migrate with a bad variable", args: []string{"migrate"}, environ: []string{"DATABASE_URL=postgres://u@127.0.0.1:1/db", "LOG_LEVEL=loud"},
			code: 2, stderr: []string{`LOG_LEVEL="loud"`}},
		{name: "run with a bad variable", args: []string{"run"},
			environ: []string{"DATABASE_URL=postgres://u@127.0.0.1:1/db", "KAFKA_BROKERS=127.0.0.1:1", "INGEST_BATCH_SIZE=0"},
			code:    2, stderr: []string{"INGEST_BATCH_SIZE", "integer 1..100000"}},
		{name: "run with a bad signing key", args: []string{"run"},
			environ: []string{"DATABASE_URL=postgres://u@127.0.0.1:1/db", "KAFKA_BROKERS=127.0.0.1:1", "SIGNING_KEYS=orders=a1a1a1a1zz"},
			code:    2, stderr: []string{"SIGNING_KEYS", "orders"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var stdout, stderr bytes.Buffer
			code := run(ctx, tt.args, tt.environ, &stdout, &stderr)
			if code != tt.code {
				t.Errorf("exit code %d, want %d\nstdout:\n%s\nstderr:\n%s", code, tt.code, stdout.String(), stderr.String())
			}
			// Key material never shows, whatever the command prints.
			if strings.Contains(stdout.String()+stderr.String(), "a1a1a1a1") {
				t.Errorf("the output shows key material:\n%s%s", stdout.String(), stderr.String())
			}
			for _, s := range []struct {
				name string
				got  string
				want []string
			}{{"stdout", stdout.String(), tt.stdout}, {"stderr", stderr.String(), tt.stderr}} {
				if s.want == nil && s.got != "" {
					t.Errorf("%s is not empty:\n%s", s.name, s.got)
				}
				for _, w := range s.want {
					if !strings.Contains(s.got, w) {
						t.Errorf("%s lacks %q:\n%s", s.name, w, s.got)
					}
				}
			}
		})
	}
}

// TestHelpRunListsDefaults checks that each variable's line in `run --help`
// shows its default (or - for none) and what it is for.
func TestHelpRunListsDefaults(t *testing.T) {
	var stdout bytes.Buffer
	if code := run(context.Background(), []string{"run", "--help"}, nil, &stdout, &stdout); code != 0 {
		t.Fatalf("run --help: exit %d:\n%s", code, stdout.String())
	}
	lines := strings.Split(stdout.String(), "\n")
	for _, v := range config.Vars() {
		t.Run(v.Name, func(t *testing.T) {
			var line string
			for _, l := range lines {
				if f := strings.Fields(l); len(f) > 0 && f[0] == v.Name {
					line = l
					break
				}
			}
			if line == "" {
				t.Fatalf("run --help has no line for %s", v.Name)
			}
			def := v.Default
			if def == "" {
				def = "-"
			}
			if f := strings.Fields(line); len(f) < 3 || f[1] != def {
				t.Errorf("line %q: want default %q second", line, def)
			}
			if v.Help == "" || !strings.Contains(line, v.Help) {
				t.Errorf("line %q lacks the help text %q", line, v.Help)
			}
		})
	}
}
