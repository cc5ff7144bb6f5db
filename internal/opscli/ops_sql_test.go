package opscli

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestOpsBindPsqlVars(t *testing.T) {
	tests := []struct {
		name  string
		query string
		vars  map[string]string
		want  []boundStatement
		err   string // a substring of the error; empty: no error
	}{
		{
			name: "text variable", query: "SELECT :'a';", vars: map[string]string{"a": "x"},
			want: []boundStatement{{"SELECT $1", []any{"x"}}},
		},
		{
			name: "number variable", query: "SELECT 1 LIMIT :limit", vars: map[string]string{"limit": "5"},
			want: []boundStatement{{"SELECT 1 LIMIT $1", []any{"5"}}},
		},
		{
			name: "one placeholder per name", query: "WHERE (:'t'::text = '' OR target_topic = :'t') AND id = :id",
			vars: map[string]string{"t": "orders", "id": "7"},
			want: []boundStatement{{"WHERE ($1::text = '' OR target_topic = $1) AND id = $2", []any{"orders", "7"}}},
		},
		{
			name: "a value is an argument, never SQL", query: "SELECT :'a'", vars: map[string]string{"a": "x'; DROP TABLE t; --"},
			want: []boundStatement{{"SELECT $1", []any{"x'; DROP TABLE t; --"}}},
		},
		{
			name: "casts are not variables", query: "SELECT now()::text, :'a'::interval, x::bigint[]", vars: map[string]string{"a": "1 hour"},
			want: []boundStatement{{"SELECT now()::text, $1::interval, x::bigint[]", []any{"1 hour"}}},
		},
		{
			name:  "string literals are left alone",
			query: "SELECT ':a', ':''a''', 'it''s :a', '\\x' || :'v'", vars: map[string]string{"v": "1"},
			want: []boundStatement{{"SELECT ':a', ':''a''', 'it''s :a', '\\x' || $1", []any{"1"}}},
		},
		{
			name: "escape strings", query: `SELECT E'it\'s :a', e'\\', :n`, vars: map[string]string{"n": "1"},
			want: []boundStatement{{`SELECT E'it\'s :a', e'\\', $1`, []any{"1"}}},
		},
		{
			name: "dollar quotes", query: "SELECT $$ :a ; $$, $tag$ :'a'; $x$ $tag$, $1, a$b, :n",
			vars: map[string]string{"n": "2"},
			want: []boundStatement{{"SELECT $$ :a ; $$, $tag$ :'a'; $x$ $tag$, $1, a$b, $1", []any{"2"}}},
		},
		{
			name: "quoted identifiers", query: `SELECT 1 AS ":a;", :n`, vars: map[string]string{"n": "2"},
			want: []boundStatement{{`SELECT 1 AS ":a;", $1`, []any{"2"}}},
		},
		{
			name:  "comments",
			query: "-- header :a; it's\nSELECT /* :a /* nested; */ still ; */ :n -- :b;\n",
			vars:  map[string]string{"n": "3"},
			want:  []boundStatement{{"-- header :a; it's\nSELECT /* :a /* nested; */ still ; */ $1 -- :b;", []any{"3"}}},
		},
		{
			name: "array slices", query: "SELECT a[1:2], a[:n]", vars: map[string]string{"n": "4"},
			want: []boundStatement{{"SELECT a[1:2], a[$1]", []any{"4"}}},
		},
		{
			name: "statements are numbered apart", query: "SELECT :'b', :'a';\n\nSELECT :'a';\n-- trailing comment\n",
			vars: map[string]string{"a": "A", "b": "B"},
			want: []boundStatement{{"SELECT $1, $2", []any{"B", "A"}}, {"SELECT $1", []any{"A"}}},
		},
		{
			name: "a semicolon in parentheses does not end a statement", query: "SELECT (1;2); SELECT 3",
			want: []boundStatement{{"SELECT (1;2)", nil}, {"SELECT 3", nil}},
		},
		{name: "unset variable", query: "SELECT 1;\n\nSELECT :'missing'", err: `line 3: variable "missing" is not set`},
		{name: "unused variable", query: "SELECT :'a'", vars: map[string]string{"a": "1", "typo": "2"}, err: "variable typo not used"},
		{name: "meta-command", query: "\\set limit 5\nSELECT :limit", err: `psql meta-command \set is not supported`},
		{name: "identifier interpolation", query: `SELECT * FROM :"table"`, err: `:" is not supported`},
		{name: "variable test", query: `SELECT :{?a}`, err: `:{ is not supported`},
		{name: "bad quoted name", query: `SELECT :'a b'`, err: `:'a b' is not a psql variable reference`},
		{name: "unterminated string", query: "SELECT 'abc", err: "line 1: unterminated string literal"},
		{name: "unterminated escape string", query: `SELECT E'abc\'`, err: "unterminated string literal"},
		{name: "unterminated comment", query: "SELECT 1 /* /* */", err: "unterminated /* comment"},
		{name: "unterminated dollar quote", query: "SELECT $q$ abc", err: "unterminated dollar-quoted string $q$"},
		{name: "unterminated identifier", query: `SELECT "abc`, err: "unterminated quoted identifier"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := bindPsqlVars(tt.query, tt.vars)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("error %v, want one containing %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.EqualFunc(got, tt.want, func(a, b boundStatement) bool {
				return a.SQL == b.SQL && slices.Equal(a.Args, b.Args)
			}) {
				t.Errorf("got  %#v\nwant %#v", got, tt.want)
			}
		})
	}
}

func TestOpsJSONRequested(t *testing.T) {
	tests := []struct {
		args []string
		want bool
	}{
		{nil, false},
		{[]string{"--json"}, true},
		{[]string{"5", "-json"}, true},
		{[]string{"--json=true"}, true},
		{[]string{"--json=false"}, false},
		{[]string{"--json=maybe"}, false},
		{[]string{"--", "--json"}, false},
		{[]string{"json"}, false},
		{[]string{"--jsonish"}, false},
	}
	for _, tt := range tests {
		if got := jsonRequested(tt.args); got != tt.want {
			t.Errorf("jsonRequested(%q) = %v, want %v", tt.args, got, tt.want)
		}
	}
}

func TestOpsParseIDs(t *testing.T) {
	tests := []struct {
		args []string
		want []int64
		err  string
	}{
		{args: []string{"5"}, want: []int64{5}},
		{args: []string{"5", "6,7", " 8 "}, want: []int64{5, 6, 7, 8}},
		{args: []string{"5", "5,6"}, want: []int64{5, 6}},
		{args: nil, want: nil},
		{args: []string{"x"}, err: `"x" is not a message id`},
		{args: []string{"0"}, err: `"0" is not a message id`},
		{args: []string{"-3"}, err: `"-3" is not a message id`},
		{args: []string{"5,"}, err: `"" is not a message id`},
		{args: []string{"99999999999999999999"}, err: "is not a message id"},
	}
	for _, tt := range tests {
		got, err := parseIDs(tt.args)
		if tt.err != "" {
			var ue usageError
			if err == nil || !strings.Contains(err.Error(), tt.err) || !errors.As(err, &ue) {
				t.Errorf("parseIDs(%q): error %v, want a usage error containing %q", tt.args, err, tt.err)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tt.want) {
			t.Errorf("parseIDs(%q) = %v, %v, want %v", tt.args, got, err, tt.want)
		}
	}
}

func TestOpsPreviewOf(t *testing.T) {
	str := func(s string) *string { return &s }
	tests := []struct {
		name      string
		value     *string
		encoding  *string
		n         int
		want      *string
		truncated bool
	}{
		{"absent", nil, nil, 4, nil, false},
		{"short text", str("abc"), str("text"), 4, str("abc"), false},
		{"exact text", str("abcd"), str("text"), 4, str("abcd"), false},
		{"long text", str("abcdef"), str("text"), 4, str("abcd"), true},
		{"cut before a split character", str("abcé"), str("text"), 4, str("abc"), true},
		{"short hex", str(`\x00ff`), str("hex"), 2, str(`\x00ff`), false},
		{"long hex", str(`\x00ff11`), str("hex"), 2, str(`\x00ff`), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, truncated := previewOf(tt.value, tt.encoding, tt.n)
			if (got == nil) != (tt.want == nil) || (got != nil && *got != *tt.want) || truncated != tt.truncated {
				t.Errorf("previewOf = %v, %v; want %v, %v", deref(got), truncated, deref(tt.want), tt.truncated)
			}
		})
	}
}

func TestOpsPrintable(t *testing.T) {
	tests := []struct {
		in        string
		multiline bool
		want      string
	}{
		{"plain café ☃", false, "plain café ☃"},
		{"\x1b[2J", false, `\x1b[2J`},
		{"a\tb\nc", false, `a\tb\nc`},
		{"a\tb\nc", true, "a\tb\nc"},
		{"\u200b\u0085", false, `\u200b\u0085`},
	}
	for _, tt := range tests {
		if got := printable(tt.in, tt.multiline); got != tt.want {
			t.Errorf("printable(%q, %v) = %q, want %q", tt.in, tt.multiline, got, tt.want)
		}
	}
}

func TestOpsOneLine(t *testing.T) {
	tests := []struct{ in, want string }{
		{"one", "one"},
		{"a\nb", "a; b"},
		{"failed to connect:\n\taddr 1: refused\n\taddr 1: refused\n", "failed to connect: addr 1: refused"},
	}
	for _, tt := range tests {
		if got := oneLine(tt.in); got != tt.want {
			t.Errorf("oneLine(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}
