// Package schema holds the scheduler's current schema, one place to read
// and edit it:
//
//   - tables.sql: every sequence, table (columns, defaults, constraints,
//     storage parameters, comments) and index of the scheduler, as they
//     stand after the last numbered migration;
//   - functions/<name>.sql: each function, CREATE OR REPLACE FUNCTION, as
//     the database runs it;
//   - views/<name>.sql: each view, CREATE OR REPLACE VIEW;
//   - triggers/<table>.sql: each table's triggers, CREATE OR REPLACE
//     TRIGGER (PostgreSQL 14 or later).
//
// The functions, views and triggers are the definitions: `scheduler
// migrate` (package migrations) applies them, in Definitions' order, after
// the numbered migrations, whenever they differ from what the database last
// received or a numbered migration ran. They must therefore be applicable
// any number of times, and they are the only place a function's body is
// written: to change a function, edit its file here, add a numbered
// migration that names the file (it may hold nothing but that comment), and
// run `go test ./migrations -run TestDefinitionsSum -update`; the change
// then shows as a diff of that one file. The migrations package documents
// why the migration is needed (it is what makes older binaries refuse the
// changed database) and its tests check that it exists. Comment lines
// around the statements are not part of a definition (Definition.Code):
// rewording them needs no migration.
//
// tables.sql is not applied by migrate: tables hold data, and change only by
// numbered migrations (ALTER TABLE ...). To add a column, write the
// migration and make the same change in tables.sql. The migrations
// package's tests build one database with the migrations and another from
// tables.sql and the definitions, and fail when their catalogs differ
// (columns, constraints, indexes, storage parameters, sequences, functions,
// triggers, views), so the two cannot drift apart.
//
// Within each kind files are applied in name order. A LANGUAGE sql function
// is checked against the objects it names when it is created, so it may name
// tables, and functions applied before it, but not views; PL/pgSQL functions
// are checked only when they run.
package schema

import (
	"embed"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strings"
)

//go:embed tables.sql functions views triggers
var files embed.FS

// Kinds are the folders of definitions, in the order they are applied:
// functions first (views and triggers name them), triggers last.
var Kinds = []string{"functions", "views", "triggers"}

// Definition is one file of definitions.
type Definition struct {
	// Name is the file's path in this folder, such as
	// "functions/deferred_key_refresh.sql". Numbered migrations name the
	// definitions they change by it.
	Name string
	// SQL is the file's statements, which can be applied again and again.
	SQL string
}

// Code returns the definition as far as the database is concerned: its text
// without the blank lines and the lines holding only a comment, outside
// dollar-quoted bodies (a function's body is kept whole, its comments too,
// since the database stores it). Checksums are taken over it, so that
// rewording the comments around a definition is not a change of the
// definition: it needs no migration, and migrate does not apply it again.
func (d Definition) Code() string {
	var out strings.Builder
	var tag string // the dollar quote we are in, or "" outside one
	for line := range strings.Lines(d.SQL) {
		if tag == "" {
			if t := strings.TrimSpace(line); t == "" || strings.HasPrefix(t, "--") {
				continue
			}
		}
		out.WriteString(line)
		for rest := line; rest != ""; {
			if tag != "" {
				i := strings.Index(rest, tag)
				if i < 0 {
					break
				}
				rest, tag = rest[i+len(tag):], ""
				continue
			}
			loc := dollarQuote.FindStringIndex(rest)
			if loc == nil {
				break
			}
			rest, tag = rest[loc[1]:], rest[loc[0]:loc[1]]
		}
	}
	return out.String()
}

// dollarQuote is the opening or closing of a dollar-quoted string: $$ or
// $tag$.
var dollarQuote = regexp.MustCompile(`\$([A-Za-z_][A-Za-z_0-9]*)?\$`)

// Definitions returns the definitions in the order migrate applies them:
// Kinds in order, and the files of each kind in name order.
func Definitions() ([]Definition, error) {
	var out []Definition
	for _, kind := range Kinds {
		entries, err := fs.ReadDir(files, kind)
		if err != nil {
			return nil, fmt.Errorf("read embedded %s: %w", kind, err)
		}
		names := make([]string, 0, len(entries))
		for _, e := range entries {
			if e.IsDir() || !strings.HasSuffix(e.Name(), ".sql") {
				return nil, fmt.Errorf("sql/schema/%s/%s: want only .sql files", kind, e.Name())
			}
			names = append(names, e.Name())
		}
		slices.Sort(names)
		for _, n := range names {
			name := path.Join(kind, n)
			body, err := fs.ReadFile(files, name)
			if err != nil {
				return nil, fmt.Errorf("read embedded %s: %w", name, err)
			}
			out = append(out, Definition{Name: name, SQL: string(body)})
		}
	}
	return out, nil
}

// Tables returns tables.sql: the tables, sequences and indexes the numbered
// migrations build, as one script that creates them in an empty schema. It
// is the reference for readers and code generators, and what the tests
// compare the migrations against; migrate never runs it.
func Tables() string {
	b, err := files.ReadFile("tables.sql")
	if err != nil {
		panic("sql/schema: tables.sql is not embedded: " + err.Error()) // cannot happen: go:embed names it
	}
	return string(b)
}
