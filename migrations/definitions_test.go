package migrations_test

import (
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/deferq/scheduler/migrations"
)

var update = flag.Bool("update", false, "TestDefinitionsSum: record changed definitions in definitions.sum under the highest migration, which must name them")

// sumFile records, for each definition in sql/schema, the migration that
// last changed it and the checksum of its code.
const sumFile = "definitions.sum"

// namingSince is the first migration that must name the definitions it
// changes; those before it wrote the definitions themselves.
const namingSince = lastOldMigration + 1

type sumLine struct {
	version int
	sum     string
	name    string
}

func (l sumLine) String() string { return fmt.Sprintf("%04d %s %s", l.version, l.sum, l.name) }

// readSum reads definitions.sum, by file name.
func readSum(t *testing.T) map[string]sumLine {
	t.Helper()
	b, err := os.ReadFile(sumFile)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]sumLine{}
	for i, line := range strings.Split(string(b), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.Atoi(f[0])
		if len(f) != 3 || err != nil {
			t.Fatalf("%s:%d: %q, want VERSION SHA256 FILE", sumFile, i+1, line)
		}
		if _, dup := out[f[2]]; dup {
			t.Fatalf("%s:%d: %s appears twice", sumFile, i+1, f[2])
		}
		out[f[2]] = sumLine{version: v, sum: f[1], name: f[2]}
	}
	return out
}

// TestDefinitionsSum: every definition in sql/schema is as definitions.sum
// records it, and each record from migration 0006 on names a migration that
// names the file. So a definition cannot change without a new numbered
// migration: the migration is what makes an older binary refuse a database
// that has the new definitions (see the package doc). With -update it
// records the changed definitions under the highest migration, provided
// that migration names each of them.
func TestDefinitionsSum(t *testing.T) {
	all := mustAll(t)
	highest := all[len(all)-1]
	byVersion := map[int]migrations.Migration{}
	for _, m := range all {
		byVersion[m.Version] = m
	}
	recorded := readSum(t)

	var want []sumLine
	var changed []string
	for _, d := range mustDefinitions(t) {
		h := sha256.Sum256([]byte(d.Code()))
		cur := hex.EncodeToString(h[:])
		l, ok := recorded[d.Name]
		switch {
		case !ok:
			changed = append(changed, fmt.Sprintf("sql/schema/%s (new)", d.Name))
			l = sumLine{version: highest.Version, sum: cur, name: d.Name}
		case l.sum != cur:
			changed = append(changed, fmt.Sprintf("sql/schema/%s (recorded with migration %04d)", d.Name, l.version))
			l = sumLine{version: highest.Version, sum: cur, name: d.Name}
		}
		want = append(want, l)
	}
	for name, l := range recorded {
		if !slices.ContainsFunc(want, func(w sumLine) bool { return w.name == name }) {
			changed = append(changed, fmt.Sprintf("sql/schema/%s (deleted; recorded with migration %04d)", name, l.version))
		}
	}
	slices.Sort(changed)

	// Whatever is recorded, from 0006 on, names a migration that names it.
	for _, l := range want {
		m, ok := byVersion[l.version]
		switch {
		case !ok:
			t.Errorf("%s: %s recorded with migration %04d, which does not exist", sumFile, l.name, l.version)
		case l.version >= namingSince && !strings.Contains(m.SQL, l.name):
			t.Errorf("%s: %s recorded with migration %04d_%s, which does not name it: a migration that changes a definition says so, e.g.\n\t-- Changes sql/schema/%s: why.",
				sumFile, l.name, m.Version, m.Name, l.name)
		}
	}
	if len(changed) == 0 {
		return
	}
	if !*update {
		t.Errorf(`sql/schema's definitions differ from %s:
	%s
A definition changes with a new numbered migration that names its file, so
that binaries older than the change refuse the database once it is applied.
Add migrations/%04d_<what>.sql (a comment is enough), for example
	-- Changes sql/schema/<file>: why.
then run
	go test ./migrations -run TestDefinitionsSum -update`,
			sumFile, strings.Join(changed, "\n\t"), highest.Version+1)
		return
	}
	var unnamed []string
	for _, c := range changed {
		name, _, _ := strings.Cut(strings.TrimPrefix(c, "sql/schema/"), " ")
		if highest.Version < namingSince || !strings.Contains(highest.SQL, name) {
			unnamed = append(unnamed, name)
		}
	}
	if len(unnamed) > 0 {
		t.Fatalf("-update: the highest migration, %04d_%s, does not name %s: add a new numbered migration that does (a comment is enough), e.g.\n\t-- Changes sql/schema/%s: why.",
			highest.Version, highest.Name, strings.Join(unnamed, ", "), unnamed[0])
	}
	header, err := os.ReadFile(sumFile)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for line := range strings.Lines(string(header)) {
		if !strings.HasPrefix(line, "#") {
			break
		}
		out.WriteString(line)
	}
	for _, l := range want {
		out.WriteString(l.String() + "\n")
	}
	if err := os.WriteFile(sumFile, []byte(out.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: recorded %s with migration %04d", sumFile, strings.Join(changed, ", "), highest.Version)
}
