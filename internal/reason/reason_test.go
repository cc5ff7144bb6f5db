package reason

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

func TestCodes(t *testing.T) {
	snake := regexp.MustCompile(`^[a-z][a-z0-9_]*$`)
	seen := map[string]bool{}
	for _, i := range All() {
		if !snake.MatchString(i.Code) {
			t.Errorf("code %q is not snake_case: a code is a metric label and a --reason value", i.Code)
		}
		if seen[i.Code] {
			t.Errorf("code %q is listed twice", i.Code)
		}
		seen[i.Code] = true
		if i.SetBy == "" || i.Means == "" || i.Do == "" {
			t.Errorf("code %q lacks who sets it, what it means or what to do: %+v", i.Code, i)
		}
	}
	for _, c := range []struct{ reason, code string }{
		{"unknown_topic: kafka server: unknown topic", UnknownTopic},
		{"operator: bad address: see OPS-7", Operator},
		{"operator", Operator},
		{"", ""},
		{Format(Exhausted, "after 5 retries"), Exhausted},
	} {
		if got := Code(c.reason); got != c.code {
			t.Errorf("Code(%q) = %q, want %q", c.reason, got, c.code)
		}
		if c.code != "" && !Known(c.code) {
			t.Errorf("Known(%q) = false", c.code)
		}
	}
	if Format(Operator, "") != "operator" {
		t.Errorf("Format without detail = %q", Format(Operator, ""))
	}
}

// The README's table of reason codes has a row for every code, with who
// sets it, what it means and what to do, as All says.
func TestREADMEListsEveryCode(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	for _, i := range All() {
		row := "| `" + i.Code + "` | " + i.SetBy + " | " + i.Means + " | " + i.Do + " |"
		if !strings.Contains(readme, row) {
			t.Errorf("README.md lacks the row\n%s", row)
		}
	}
}
