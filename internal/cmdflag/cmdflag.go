// Package cmdflag parses the flags of the scheduler's commands with one
// convention for all of them: --help prints the command's description and
// flags to stdout and exits 0; a bad flag or a stray argument prints one line
// naming it to stderr and exits 2.
package cmdflag

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
)

// Parse parses a command's flags from args into fs. It returns done=true
// with the exit code when the caller should stop: help asked for (describe
// writes the command's description, then the flags follow), or a bad flag or
// argument. The command's name is fs.Name().
func Parse(fs *flag.FlagSet, args []string, stdout, stderr io.Writer, describe func(io.Writer)) (done bool, code int) {
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	err := fs.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		describe(stdout)
		PrintDefaults(stdout, fs)
		return true, 0
	case err != nil:
		fmt.Fprintf(stderr, "scheduler %s: %v (see scheduler %s --help)\n", fs.Name(), err, fs.Name())
		return true, 2
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "scheduler %s: unexpected argument %q (see scheduler %s --help)\n", fs.Name(), fs.Arg(0), fs.Name())
		return true, 2
	}
	return false, 0
}

// PrintDefaults writes fs's flags to w as flag.PrintDefaults does, but
// spelled --name, as the README and every --help text write them (the flag
// package accepts both).
func PrintDefaults(w io.Writer, fs *flag.FlagSet) {
	var b strings.Builder
	out := fs.Output()
	fs.SetOutput(&b)
	fs.PrintDefaults()
	fs.SetOutput(out)
	for _, line := range strings.SplitAfter(b.String(), "\n") {
		if strings.HasPrefix(line, "  -") {
			line = "  --" + line[len("  -"):]
		}
		io.WriteString(w, line)
	}
}

// Indent returns err's text with every line indented by two spaces, for a
// list of problems under a heading.
func Indent(err error) string {
	return "  " + strings.ReplaceAll(err.Error(), "\n", "\n  ")
}

// Lookup returns the value of name in environ (os.Environ form), "" if
// absent. The last occurrence wins, as for a process's environment.
func Lookup(environ []string, name string) string {
	value := ""
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok && k == name {
			value = v
		}
	}
	return value
}
