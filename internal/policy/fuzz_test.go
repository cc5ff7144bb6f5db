package policy

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

// FuzzParse checks that Parse never panics, that its errors carry a position
// inside the input, and that every policy it accepts gives delays in
// [0, maxDelay] and renders to text that parses back to the same policy.
func FuzzParse(f *testing.F) {
	f.Add("payments.*: ladder 30s,5m,30m,1hx3 dlq {target}.dlq; *: exponential 1s x1.5 cap 10m jitter full max 3", int64(md))
	f.Add("a: exponential 1s x 2 cap 1h forever jitter 20 % release;", int64(time.Hour))
	f.Add("a: ladder 1m,10m forever jitter 0.2 hold", int64(time.Minute))
	f.Add("orders.[a-c]*:exponential 1ns x99999999999999 forever", int64(math.MaxInt64))
	f.Add("a: ladder 1s;;", int64(md))
	f.Add("a: exponential 1sx max 3", int64(md))
	f.Add("", int64(1))
	tries := []int32{math.MinInt32, -1, 0, 1, 2, 3, 9, 10, 63, 64, 1000, 1e9, math.MaxInt32}
	rnds := []float64{0, 0.5, 0.999999, math.Nextafter(1, 0)}
	f.Fuzz(func(t *testing.T, spec string, maxDelayNS int64) {
		maxDelay := time.Duration(maxDelayNS)
		s, err := Parse(spec, maxDelay)
		if err != nil {
			var se *SyntaxError
			if errors.As(err, &se) && (se.Pos < 1 || se.Pos > len(spec)+1) {
				t.Fatalf("Parse(%q): position %d outside 1..%d: %v", spec, se.Pos, len(spec)+1, err)
			}
			if maxDelay > 0 && se == nil {
				t.Fatalf("Parse(%q): %T %v, want a *SyntaxError", spec, err, err)
			}
			return
		}
		policies := []*Policy{s.For("x"), s.For("payments.card"), s.For("")}
		for _, e := range s.entries {
			policies = append(policies, e.policy)
		}
		for _, p := range policies {
			if p == nil {
				t.Fatal("For returned nil")
			}
			for _, a := range tries {
				for _, r := range rnds {
					d, exhausted := p.Next(a, func() float64 { return r })
					if d < 0 || d > maxDelay || (exhausted && d != 0) {
						t.Fatalf("%q under %v: Next(%d) with rnd %v = %v, %v", p.Text, maxDelay, a, r, d, exhausted)
					}
				}
			}
		}
		for _, e := range s.entries {
			text := e.policy.String()
			again, err := Parse("*: "+text, maxDelay)
			if err != nil {
				t.Fatalf("policy %q renders as %q, which does not parse: %v", e.policy.Text, text, err)
			}
			want, got := *e.policy, *again.For("x")
			want.Text, got.Text = "", ""
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("policy %q renders as %q, which parses to\n%#v\nnot\n%#v", e.policy.Text, text, got, want)
			}
		}
		if again, err := Parse(s.String(), maxDelay); err == nil && again.String() != s.String() {
			// The default may not parse under a small maxDelay; when it
			// does, the rendering is stable.
			t.Fatalf("String() not stable: %q then %q", s.String(), again.String())
		}
	})
}

// FuzzClassifier checks that ParseClassifier and Classify never panic, that
// errors carry a position inside the input, and that what Classify returns
// is consistent.
func FuzzClassifier(f *testing.F) {
	f.Add("*JsonParseException, com.acme.*$Fatal,a?c", "com.x.JsonParseException")
	f.Add("a,,b", "a")
	f.Add("*a*a*a*a*b", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
	f.Add("", "PERMANENT")
	f.Add("?", "\xff")
	f.Fuzz(func(t *testing.T, spec, class string) {
		c, err := ParseClassifier(spec)
		if err != nil {
			var se *SyntaxError
			if !errors.As(err, &se) || se.Pos < 1 || se.Pos > len(spec)+1 {
				t.Fatalf("ParseClassifier(%q): %v", spec, err)
			}
			return
		}
		code, detail := c.Classify(class)
		trimmed := strings.TrimSpace(class)
		switch code {
		case "":
			if detail != "" || strings.EqualFold(trimmed, "permanent") {
				t.Fatalf("Classify(%q) = %q, %q", class, code, detail)
			}
		case "permanent":
			if !strings.EqualFold(trimmed, "permanent") {
				t.Fatalf("Classify(%q) = %q, %q", class, code, detail)
			}
		case "non_retriable":
			if trimmed == "" || !strings.Contains(detail, "NON_RETRIABLE_ERRORS pattern") {
				t.Fatalf("Classify(%q) = %q, %q", class, code, detail)
			}
		default:
			t.Fatalf("Classify(%q) = unknown code %q", class, code)
		}
		// Every pattern matches itself when it has no wildcards, and "*"
		// matches anything.
		for _, p := range c.patterns {
			if !strings.ContainsAny(p, "*?") && !globMatch(p, p) {
				t.Fatalf("pattern %q does not match itself", p)
			}
		}
		if !globMatch("*", class) {
			t.Fatalf("* does not match %q", class)
		}
	})
}
