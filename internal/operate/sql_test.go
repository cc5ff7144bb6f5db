package operate

import (
	"slices"
	"strings"
	"testing"
)

func TestBind(t *testing.T) {
	tests := []struct {
		name  string
		query string
		vars  map[string]string
		want  []Statement
		err   string // a substring of the error; empty: no error
	}{
		{
			name: "text variable", query: "SELECT :'a';", vars: map[string]string{"a": "x"},
			want: []Statement{{"SELECT $1", []any{"x"}}},
		},
		{
			name: "number variable", query: "SELECT 1 LIMIT :limit", vars: map[string]string{"limit": "5"},
			want: []Statement{{"SELECT 1 LIMIT $1", []any{"5"}}},
		},
		{
			name: "one placeholder per name", query: "WHERE (:'t'::text = '' OR target_topic = :'t') AND id = :id",
			vars: map[string]string{"t": "orders", "id": "7"},
			want: []Statement{{"WHERE ($1::text = '' OR target_topic = $1) AND id = $2", []any{"orders", "7"}}},
		},
		{
			name: "a value is an argument, never SQL", query: "SELECT :'a'", vars: map[string]string{"a": "x'; DROP TABLE t; --"},
			want: []Statement{{"SELECT $1", []any{"x'; DROP TABLE t; --"}}},
		},
		{
			name: "casts are not variables", query: "SELECT now()::text, :'a'::interval, x::bigint[]", vars: map[string]string{"a": "1 hour"},
			want: []Statement{{"SELECT now()::text, $1::interval, x::bigint[]", []any{"1 hour"}}},
		},
		{
			name:  "string literals are left alone",
			query: "SELECT ':a', ':''a''', 'it''s :a', '\\x' || :'v'", vars: map[string]string{"v": "1"},
			want: []Statement{{"SELECT ':a', ':''a''', 'it''s :a', '\\x' || $1", []any{"1"}}},
		},
		{
			name: "escape strings", query: `SELECT E'it\'s :a', e'\\', :n`, vars: map[string]string{"n": "1"},
			want: []Statement{{`SELECT E'it\'s :a', e'\\', $1`, []any{"1"}}},
		},
		{
			name: "dollar quotes", query: "SELECT $$ :a ; $$, $tag$ :'a'; $x$ $tag$, $1, a$b, :n",
			vars: map[string]string{"n": "2"},
			want: []Statement{{"SELECT $$ :a ; $$, $tag$ :'a'; $x$ $tag$, $1, a$b, $1", []any{"2"}}},
		},
		{
			name: "quoted identifiers", query: `SELECT 1 AS ":a;", :n`, vars: map[string]string{"n": "2"},
			want: []Statement{{`SELECT 1 AS ":a;", $1`, []any{"2"}}},
		},
		{
			name:  "comments",
			query: "-- header :a; it's\nSELECT /* :a /* nested; */ still ; */ :n -- :b;\n",
			vars:  map[string]string{"n": "3"},
			want:  []Statement{{"-- header :a; it's\nSELECT /* :a /* nested; */ still ; */ $1 -- :b;", []any{"3"}}},
		},
		{
			name: "array slices", query: "SELECT a[1:2], a[:n]", vars: map[string]string{"n": "4"},
			want: []Statement{{"SELECT a[1:2], a[$1]", []any{"4"}}},
		},
		{
			name: "statements are numbered apart", query: "SELECT :'b', :'a';\n\nSELECT :'a';\n-- trailing comment\n",
			vars: map[string]string{"a": "A", "b": "B"},
			want: []Statement{{"SELECT $1, $2", []any{"B", "A"}}, {"SELECT $1", []any{"A"}}},
		},
		{
			name: "a semicolon in parentheses does not end a statement", query: "SELECT (1;2); SELECT 3",
			want: []Statement{{"SELECT (1;2)", nil}, {"SELECT 3", nil}},
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
			got, err := Bind(tt.query, tt.vars)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("error %v, want one containing %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.EqualFunc(got, tt.want, func(a, b Statement) bool {
				return a.SQL == b.SQL && slices.Equal(a.Args, b.Args)
			}) {
				t.Errorf("got  %#v\nwant %#v", got, tt.want)
			}
		})
	}
}
