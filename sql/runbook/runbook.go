// Package runbook embeds the operator runbook: one SQL file per operator task
// (backlog, next due, held keys, a message's story and history, expedite,
// cancel, park, the parking lot and replay, per-target pause and rate
// limits, the keys in flight for consumer groups and their release), each
// meant to be run as is with psql. The scheduler's operator commands
// (scheduler status, ls, show, held, expedite, cancel, park, replay, pause,
// resume, limit, targets, inflight, release) run the same files, so what an
// operator reads in the runbook is what the CLI does.
//
// Each file starts with a comment header saying what it does, when to use it
// and how to call it. Parameters are psql variables, :'name' for text and
// :name for numbers; every variable a file mentions must be set.
package runbook

import (
	"embed"
	"fmt"
	"io/fs"
	"slices"
	"strings"
)

// files is the only package variable, because go:embed needs one; nothing
// assigns to it.
//
//go:embed *.sql
var files embed.FS

// Query returns the text of the runbook file name, e.g. "next_due.sql".
func Query(name string) (string, error) {
	b, err := files.ReadFile(name)
	if err != nil {
		return "", fmt.Errorf("runbook: no file %q (files: %s)", name, strings.Join(Names(), ", "))
	}
	return string(b), nil
}

// Names returns the runbook's file names in lexical order.
func Names() []string {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		// The embedded root always exists; a failure here is a build defect.
		panic(fmt.Sprintf("runbook: read embedded files: %v", err))
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	slices.Sort(names)
	return names
}
