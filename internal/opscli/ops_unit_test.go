package opscli

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

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
