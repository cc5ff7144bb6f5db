package schema

import (
	"path"
	"regexp"
	"strings"
	"testing"
)

var (
	createFunction = regexp.MustCompile(`(?im)^\s*CREATE\s+(OR\s+REPLACE\s+)?FUNCTION\s+([a-z0-9_]+)\s*\(`)
	createTrigger  = regexp.MustCompile(`(?im)^\s*CREATE\s+(OR\s+REPLACE\s+)?TRIGGER\s+([a-z0-9_]+)\s[^;]*?\sON\s+([a-z0-9_]+)`)
	createView     = regexp.MustCompile(`(?im)^\s*CREATE\s+(OR\s+REPLACE\s+)?VIEW\s+([a-z0-9_]+)`)
	anyCreate      = regexp.MustCompile(`(?im)^\s*(CREATE|DROP|ALTER)\s+(OR\s+REPLACE\s+)?([A-Z]+)`)
)

// TestDefinitions: each file defines what its name says, in a form that can
// be applied again: functions/<name>.sql one function <name>,
// views/<name>.sql one view <name>, triggers/<table>.sql triggers on
// <table>, all with CREATE OR REPLACE.
func TestDefinitions(t *testing.T) {
	defs, err := Definitions()
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]int{}
	for i, d := range defs {
		kind, file := path.Split(d.Name)
		kind = strings.TrimSuffix(kind, "/")
		kinds[kind]++
		if i > 0 {
			prevKind, _ := path.Split(defs[i-1].Name)
			if strings.TrimSuffix(prevKind, "/") == kind && defs[i-1].Name >= d.Name {
				t.Errorf("%s follows %s: want name order within a kind", d.Name, defs[i-1].Name)
			}
		}
		name := strings.TrimSuffix(file, ".sql")
		code := d.Code()
		for _, m := range anyCreate.FindAllStringSubmatch(code, -1) {
			if !strings.EqualFold(m[1], "CREATE") || m[2] == "" {
				t.Errorf("%s: %q: a definition is applied again and again, so only CREATE OR REPLACE (DROP and ALTER belong in a numbered migration)", d.Name, strings.TrimSpace(m[0]))
			}
		}
		switch kind {
		case "functions":
			fns := createFunction.FindAllStringSubmatch(code, -1)
			if len(fns) != 1 || fns[0][2] != name {
				t.Errorf("%s defines functions %v, want exactly one, %s", d.Name, fns, name)
			}
			if strings.Count(code, "$$") != 2 {
				t.Errorf("%s: want one $$-quoted body", d.Name)
			}
		case "views":
			vs := createView.FindAllStringSubmatch(code, -1)
			if len(vs) != 1 || vs[0][2] != name {
				t.Errorf("%s defines views %v, want exactly one, %s", d.Name, vs, name)
			}
		case "triggers":
			ts := createTrigger.FindAllStringSubmatch(code, -1)
			if len(ts) == 0 {
				t.Errorf("%s defines no trigger", d.Name)
			}
			for _, m := range ts {
				if m[3] != name {
					t.Errorf("%s: trigger %s is on %s, want triggers on %s only", d.Name, m[2], m[3], name)
				}
			}
			if n := len(anyCreate.FindAllString(code, -1)); n != len(ts) {
				t.Errorf("%s: %d statements, %d of them triggers: want only triggers", d.Name, n, len(ts))
			}
		default:
			t.Errorf("%s: unknown kind %q", d.Name, kind)
		}
	}
	for _, k := range []string{"functions", "triggers"} {
		if kinds[k] == 0 {
			t.Errorf("no %s embedded", k)
		}
	}
	if !strings.Contains(Tables(), "CREATE TABLE deferred_message (") {
		t.Error("Tables() lacks deferred_message")
	}
}

func TestCode(t *testing.T) {
	d := Definition{SQL: `-- A comment about f.
--
-- More.

CREATE OR REPLACE FUNCTION f(a int) RETURNS int
LANGUAGE plpgsql AS $$
-- kept: the database stores the body
BEGIN

    RETURN a + $1; -- also kept
END
$$;

  -- between statements

CREATE OR REPLACE FUNCTION g() RETURNS text
LANGUAGE sql AS $body$ SELECT '$$' $body$;
-- trailing
`}
	want := `CREATE OR REPLACE FUNCTION f(a int) RETURNS int
LANGUAGE plpgsql AS $$
-- kept: the database stores the body
BEGIN

    RETURN a + $1; -- also kept
END
$$;
CREATE OR REPLACE FUNCTION g() RETURNS text
LANGUAGE sql AS $body$ SELECT '$$' $body$;
`
	if got := d.Code(); got != want {
		t.Errorf("Code() =\n%s\nwant\n%s", got, want)
	}
}
