package policy

import (
	"errors"
	"strings"
	"testing"
)

func TestClassify(t *testing.T) {
	const spec = " *JsonParseException , com.acme.Validation?rror,\n*$Fatal,org.*.Schema*Error,exact.Class "
	c, err := ParseClassifier(spec)
	if err != nil {
		t.Fatalf("ParseClassifier(%q): %v", spec, err)
	}
	tests := []struct {
		class, code, detail string
	}{
		{"permanent", "permanent", `defer.error.class "permanent"`},
		{"PERMANENT", "permanent", `defer.error.class "PERMANENT"`},
		{" Permanent ", "permanent", `defer.error.class "Permanent"`},
		{"com.x.JsonParseException", "non_retriable", `defer.error.class "com.x.JsonParseException" matches NON_RETRIABLE_ERRORS pattern "*JsonParseException"`},
		{"JsonParseException", "non_retriable", `defer.error.class "JsonParseException" matches NON_RETRIABLE_ERRORS pattern "*JsonParseException"`},
		{"com.x.JsonParseExceptionX", "", ""}, // the whole value must match
		{"com.x.jsonparseexception", "", ""},  // patterns are case-sensitive
		{"com.acme.ValidationError", "non_retriable", `defer.error.class "com.acme.ValidationError" matches NON_RETRIABLE_ERRORS pattern "com.acme.Validation?rror"`},
		{"com.acme.Validation€rror", "non_retriable", `defer.error.class "com.acme.Validation€rror" matches NON_RETRIABLE_ERRORS pattern "com.acme.Validation?rror"`}, // ? is one character, not one byte
		{"com.acme.Validationrror", "", ""},
		{"com.acme.ValidationXXrror", "", ""},
		{"com.acme.Outer$Fatal", "non_retriable", `defer.error.class "com.acme.Outer$Fatal" matches NON_RETRIABLE_ERRORS pattern "*$Fatal"`},
		{"com.acme.OuterFatal", "", ""},
		{"org.a.b.c.SchemaMismatchError", "non_retriable", `defer.error.class "org.a.b.c.SchemaMismatchError" matches NON_RETRIABLE_ERRORS pattern "org.*.Schema*Error"`},
		{"org.SchemaError", "", ""}, // org.*. needs two dots
		{"exact.Class", "non_retriable", `defer.error.class "exact.Class" matches NON_RETRIABLE_ERRORS pattern "exact.Class"`},
		{"exact.Classes", "", ""},
		{"transient", "", ""},
		{"", "", ""},
		{"   ", "", ""},
	}
	for _, tt := range tests {
		code, detail := c.Classify(tt.class)
		if code != tt.code || detail != tt.detail {
			t.Errorf("Classify(%q) = %q, %q; want %q, %q", tt.class, code, detail, tt.code, tt.detail)
		}
	}
	if got, want := c.String(), "*JsonParseException,com.acme.Validation?rror,*$Fatal,org.*.Schema*Error,exact.Class"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}

	// With no patterns, only "permanent" is non-retriable.
	for _, spec := range []string{"", "  \n "} {
		c, err := ParseClassifier(spec)
		if err != nil {
			t.Fatalf("ParseClassifier(%q): %v", spec, err)
		}
		if code, _ := c.Classify("permanent"); code != "permanent" {
			t.Errorf("ParseClassifier(%q): permanent classified %q", spec, code)
		}
		if code, _ := c.Classify("com.x.JsonParseException"); code != "" {
			t.Errorf("ParseClassifier(%q): a class classified %q", spec, code)
		}
	}
}

func TestGlobMatch(t *testing.T) {
	tests := []struct {
		pattern, s string
		want       bool
	}{
		{"", "", true},
		{"", "a", false},
		{"*", "", true},
		{"*", "a.b$c/d", true},
		{"**", "x", true},
		{"?", "", false},
		{"?", "é", true},
		{"??", "é", false},
		{"a*b*c", "aXbYc", true},
		{"a*b*c", "abc", true},
		{"a*b*c", "acb", false},
		{"*a", "aaaa", true},
		{"*ab", "aab", true},
		{"*.Error", "x.y.Error", true},
		{"[a]", "a", false}, // no classes: "[" is literal
		{"[a]", "[a]", true},
		{`a\*`, `a\xyz`, true}, // no escapes: "\" is literal
		{"a*", "a\xff\xfe", true},
		{"?", "\xff", true},
		{strings.Repeat("*a", 30) + "b", strings.Repeat("a", 200), false}, // linear backtracking: fast
	}
	for _, tt := range tests {
		if got := globMatch(tt.pattern, tt.s); got != tt.want {
			t.Errorf("globMatch(%q, %q) = %v, want %v", tt.pattern, tt.s, got, tt.want)
		}
	}
}

func TestParseClassifierErrors(t *testing.T) {
	tests := []struct {
		spec string
		pos  int
		msg  []string
	}{
		{"a,,b", 3, []string{"expected an error class pattern", `found ","`, "empty item"}},
		{"a, ,b", 4, []string{`found ","`}},
		{",a", 1, []string{`found ","`}},
		{"a,", 3, []string{"found the end of the input"}},
		{"a,  ", 5, []string{"found the end of the input"}},
		{"a b,c", 3, []string{`expected "," between error class patterns`, `found "b" after "a"`}},
		{"x, a\t\tb", 7, []string{`found "b" after "a"`}},
	}
	for _, tt := range tests {
		c, err := ParseClassifier(tt.spec)
		if err == nil {
			t.Errorf("ParseClassifier(%q) = %v, want an error", tt.spec, c)
			continue
		}
		var se *SyntaxError
		if !errors.As(err, &se) {
			t.Errorf("ParseClassifier(%q): %T %v, want a *SyntaxError", tt.spec, err, err)
			continue
		}
		if se.Pos != tt.pos {
			t.Errorf("ParseClassifier(%q): position %d, want %d (%v)", tt.spec, se.Pos, tt.pos, err)
		}
		for _, m := range tt.msg {
			if !strings.Contains(err.Error(), m) {
				t.Errorf("ParseClassifier(%q): %q does not contain %q", tt.spec, err, m)
			}
		}
	}
}
