package cmdflag

import (
	"errors"
	"flag"
	"io"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		args           []string
		done           bool
		code           int
		stdout, stderr string
	}{
		{args: nil},
		{args: []string{"--json"}},
		{args: []string{"--help"}, done: true, code: 0, stdout: "Usage: scheduler demo"},
		{args: []string{"-h"}, done: true, code: 0, stdout: "-json"},
		{args: []string{"--nope"}, done: true, code: 2, stderr: "scheduler demo: flag provided but not defined: -nope (see scheduler demo --help)"},
		{args: []string{"extra"}, done: true, code: 2, stderr: `scheduler demo: unexpected argument "extra"`},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			fs := flag.NewFlagSet("demo", flag.ContinueOnError)
			fs.Bool("json", false, "print JSON")
			var stdout, stderr strings.Builder
			done, code := Parse(fs, tt.args, &stdout, &stderr, func(w io.Writer) { io.WriteString(w, "Usage: scheduler demo\n") })
			if done != tt.done || code != tt.code {
				t.Errorf("Parse = %v, %d; want %v, %d", done, code, tt.done, tt.code)
			}
			if !strings.Contains(stdout.String(), tt.stdout) || (tt.stdout == "" && stdout.Len() > 0) {
				t.Errorf("stdout %q, want it to contain %q", stdout.String(), tt.stdout)
			}
			if !strings.Contains(stderr.String(), tt.stderr) || (tt.stderr == "" && stderr.Len() > 0) {
				t.Errorf("stderr %q, want it to contain %q", stderr.String(), tt.stderr)
			}
		})
	}
}

func TestIndentAndLookup(t *testing.T) {
	if got := Indent(errors.New("a\nb")); got != "  a\n  b" {
		t.Errorf("Indent = %q", got)
	}
	env := []string{"A=1", "B=2", "A=3", "NOEQUALS"}
	for name, want := range map[string]string{"A": "3", "B": "2", "C": "", "NOEQUALS": ""} {
		if got := Lookup(env, name); got != want {
			t.Errorf("Lookup(%s) = %q, want %q (the last occurrence wins)", name, got, want)
		}
	}
}
