package policy

import (
	"errors"
	"math"
	"os"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

const md = 720 * time.Hour // MAX_DELAY's default

// steps expands "30s", "5m" ... into durations; a test helper for ladders.
func steps(t *testing.T, ds ...string) []time.Duration {
	t.Helper()
	var out []time.Duration
	for _, s := range ds {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, d)
	}
	return out
}

func repeat(d time.Duration, n int) []time.Duration {
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = d
	}
	return out
}

func TestParsePolicies(t *testing.T) {
	tests := []struct {
		name string
		spec string
		want Policy // of the first entry; Text and MaxDelay are checked too
	}{
		{"exponential minimal", "*: exponential 1s max 5",
			Policy{Text: "exponential 1s max 5", Kind: Exponential, Initial: time.Second, Factor: 2, MaxRetries: 5}},
		{"exponential factor and cap", "a: exponential 500ms x1.5 cap 10m max 7",
			Policy{Text: "exponential 500ms x1.5 cap 10m max 7", Kind: Exponential, Initial: 500 * time.Millisecond, Factor: 1.5, Cap: 10 * time.Minute, MaxRetries: 7}},
		{"factor glued to the duration", "a: exponential 1sx3 max 1",
			Policy{Text: "exponential 1sx3 max 1", Kind: Exponential, Initial: time.Second, Factor: 3, MaxRetries: 1}},
		{"factor as two words", "a: exponential 1s x 3 max 1",
			Policy{Text: "exponential 1s x 3 max 1", Kind: Exponential, Initial: time.Second, Factor: 3, MaxRetries: 1}},
		{"factor 1", "a: exponential 1m x1 max 3",
			Policy{Text: "exponential 1m x1 max 3", Kind: Exponential, Initial: time.Minute, Factor: 1, MaxRetries: 3}},
		{"cap equal to initial", "a: exponential 1h cap 1h max 3",
			Policy{Text: "exponential 1h cap 1h max 3", Kind: Exponential, Initial: time.Hour, Factor: 2, Cap: time.Hour, MaxRetries: 3}},
		{"initial at the maximum delay", "a: exponential 720h forever",
			Policy{Text: "exponential 720h forever", Kind: Exponential, Initial: md, Factor: 2, Forever: true}},
		{"exponential forever", "a: exponential 1s cap 1h forever",
			Policy{Text: "exponential 1s cap 1h forever", Kind: Exponential, Initial: time.Second, Factor: 2, Cap: time.Hour, Forever: true}},
		{"max 0", "a: exponential 1s max 0",
			Policy{Text: "exponential 1s max 0", Kind: Exponential, Initial: time.Second, Factor: 2}},
		{"max at the int32 limit", "a: exponential 1s max 2147483647",
			Policy{Text: "exponential 1s max 2147483647", Kind: Exponential, Initial: time.Second, Factor: 2, MaxRetries: math.MaxInt32}},
		{"ladder", "a: ladder 30s,5m,30m",
			Policy{Text: "ladder 30s,5m,30m", Kind: Ladder, Steps: steps(t, "30s", "5m", "30m"), MaxRetries: 3}},
		{"ladder with repeats", "a: ladder 30s,5m,30m,1hx3",
			Policy{Text: "ladder 30s,5m,30m,1hx3", Kind: Ladder, Steps: steps(t, "30s", "5m", "30m", "1h", "1h", "1h"), MaxRetries: 6}},
		{"ladder with spaced commas and counts", "a: ladder 1s , 2s x2,3s x 2",
			Policy{Text: "ladder 1s , 2s x2,3s x 2", Kind: Ladder, Steps: steps(t, "1s", "2s", "2s", "3s", "3s"), MaxRetries: 5}},
		{"ladder of one step", "a: ladder 1h30m",
			Policy{Text: "ladder 1h30m", Kind: Ladder, Steps: steps(t, "1h30m"), MaxRetries: 1}},
		{"ladder forever", "a: ladder 1m,10m forever",
			Policy{Text: "ladder 1m,10m forever", Kind: Ladder, Steps: steps(t, "1m", "10m"), MaxRetries: 2, Forever: true}},
		{"ladder count at the limit", "a: ladder 1sx10000",
			Policy{Text: "ladder 1sx10000", Kind: Ladder, Steps: repeat(time.Second, 10000), MaxRetries: 10000}},
		{"jitter full", "a: ladder 1s jitter full",
			Policy{Text: "ladder 1s jitter full", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1, Jitter: Jitter{Full: true}}},
		{"jitter none", "a: ladder 1s jitter none",
			Policy{Text: "ladder 1s jitter none", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1}},
		{"jitter percent", "a: ladder 1s jitter 20%",
			Policy{Text: "ladder 1s jitter 20%", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1, Jitter: Jitter{Fraction: 0.2}}},
		{"jitter percent apart", "a: ladder 1s jitter 20 %",
			Policy{Text: "ladder 1s jitter 20 %", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1, Jitter: Jitter{Fraction: 0.2}}},
		{"jitter 100%", "a: ladder 1s jitter 100%",
			Policy{Text: "ladder 1s jitter 100%", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1, Jitter: Jitter{Fraction: 1}}},
		{"jitter fraction", "a: ladder 1s jitter 0.2",
			Policy{Text: "ladder 1s jitter 0.2", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1, Jitter: Jitter{Fraction: 0.2}}},
		{"jitter fraction 1", "a: ladder 1s jitter 1",
			Policy{Text: "ladder 1s jitter 1", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1, Jitter: Jitter{Fraction: 1}}},
		{"hold", "a: ladder 1s hold",
			Policy{Text: "ladder 1s hold", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1}},
		{"release", "a: ladder 1s release",
			Policy{Text: "ladder 1s release", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1, ReleaseKey: true}},
		{"dlq", "a: ladder 1s dlq dead.letters",
			Policy{Text: "ladder 1s dlq dead.letters", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1, DLQ: "dead.letters"}},
		{"dlq template", "a: ladder 1s dlq {target}.dlq",
			Policy{Text: "ladder 1s dlq {target}.dlq", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1, DLQ: "{target}.dlq"}},
		{"every option, any order", "a: exponential 1s x2 cap 1h dlq x_dlq release jitter full max 4",
			Policy{Text: "exponential 1s x2 cap 1h dlq x_dlq release jitter full max 4", Kind: Exponential, Initial: time.Second, Factor: 2, Cap: time.Hour,
				MaxRetries: 4, Jitter: Jitter{Full: true}, ReleaseKey: true, DLQ: "x_dlq"}},
		{"newlines and tabs between tokens", "\n\ta\n:\n\texponential\n1s\nx2\ncap\n1h\nmax\n3\n",
			Policy{Text: "exponential\n1s\nx2\ncap\n1h\nmax\n3", Kind: Exponential, Initial: time.Second, Factor: 2, Cap: time.Hour, MaxRetries: 3}},
		{"no space after the colon", "a:ladder 1s",
			Policy{Text: "ladder 1s", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1}},
		{"trailing semicolon", "a: ladder 1s ;  \n",
			Policy{Text: "ladder 1s", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1}},
		{"pattern with a class", "orders.[a-c]*: ladder 1s",
			Policy{Text: "ladder 1s", Kind: Ladder, Steps: steps(t, "1s"), MaxRetries: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := Parse(tt.spec, md)
			if err != nil {
				t.Fatalf("Parse(%q): %v", tt.spec, err)
			}
			if len(s.entries) == 0 {
				t.Fatalf("Parse(%q): no entries", tt.spec)
			}
			tt.want.MaxDelay = md
			if got := s.entries[0].policy; !reflect.DeepEqual(*got, tt.want) {
				t.Errorf("Parse(%q) =\n%#v\nwant\n%#v", tt.spec, *got, tt.want)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name string
		spec string
		pos  int
		msg  []string // each must be in the message
	}{
		{"unknown kind", "a: linear 1s", 4, []string{`expected "exponential" or "ladder" after "a:"`, `found "linear"`}},
		{"kind missing", "a:", 3, []string{`expected "exponential" or "ladder"`, "found the end of the input"}},
		{"unknown option", "a: ladder 1s retry 3", 14, []string{"expected an option", `found "retry"`}},
		{"missing semicolon", "a: ladder 1s b: ladder 2s", 14, []string{`found "b"`, `missing ";"`}},
		{"missing comma", "a: ladder 1s 2s", 14, []string{`found "2s"`, `missing ","`}},
		{"missing colon", "a ladder 1s", 3, []string{`expected ":" after the target pattern "a"`, `found "ladder"`}},
		{"no pattern", "exponential 1s max 3", 13, []string{`expected ":" after the target pattern "exponential"`, "every entry starts with a target pattern"}},
		{"only a pattern", "payments.*", 11, []string{`expected ":"`, "found the end of the input"}},
		{"bad duration", "a: ladder 30s,5q", 15, []string{`expected a duration after ","`, `found "5q"`, `unknown unit "q"`}},
		{"bad duration after ladder", "a: ladder 5qx3", 11, []string{`expected a duration after "ladder"`, `found "5q"`}},
		{"bad initial", "a: exponential soon max 3", 16, []string{`expected a duration after "exponential"`, `found "soon"`}},
		{"duration missing", "a: ladder", 10, []string{`expected a duration after "ladder"`, "found the end of the input"}},
		{"keyword for a duration", "a: ladder forever", 11, []string{`found "forever"`}},
		{"zero duration", "a: ladder 1s,0s", 14, []string{"expected a positive duration", `found "0s"`}},
		{"bare zero", "a: exponential 0 max 1", 16, []string{"expected a positive duration", `found "0"`}},
		{"negative duration", "a: exponential -1s max 3", 16, []string{"expected a positive duration", `found "-1s"`}},
		{"step beyond the maximum delay", "a: ladder 1s,721h", 14, []string{"at most the maximum delay 720h", `found "721h"`}},
		{"initial beyond the maximum delay", "a: exponential 1000h max 3", 16, []string{"at most the maximum delay", `found "1000h"`}},
		{"cap beyond the maximum delay", "a: exponential 1s cap 721h max 3", 23, []string{`after "cap"`, "at most the maximum delay", `found "721h"`}},
		{"factor below 1", "a: exponential 1s x0.5 max 3", 20, []string{"expected a factor of at least 1", `found "0.5"`}},
		{"factor not a number", "a: exponential 1s x two max 3", 21, []string{"expected a factor", `found "two"`}},
		{"factor in hex", "a: exponential 1s x0x10 max 3", 20, []string{"expected a factor", `found "0x10"`}},
		{"factor inf", "a: exponential 1s xInf max 3", 20, []string{"expected a factor", `found "Inf"`}},
		{"factor missing", "a: exponential 1s x", 20, []string{`expected a number after "x"`, "found the end of the input"}},
		{"cap below initial", "a: exponential 1m cap 30s max 3", 23, []string{"expected a cap of at least the initial delay 1m", `found "30s"`}},
		{"cap after options", "a: exponential 1s max 3 cap 1h", 25, []string{`found "cap"`, "right after the initial delay"}},
		{"cap on a ladder", "a: ladder 1s cap 1h", 14, []string{`found "cap"`, "only an exponential"}},
		{"duplicate max", "a: exponential 1s max 3 max 4", 25, []string{`a second "max"`, "the first is at position 19"}},
		{"duplicate jitter", "a: ladder 1s jitter full jitter none", 26, []string{`a second "jitter"`, "position 14"}},
		{"duplicate dlq", "a: ladder 1s dlq x dlq y", 20, []string{`a second "dlq"`}},
		{"duplicate hold", "a: ladder 1s hold hold", 19, []string{`a second "hold"`}},
		{"hold and release", "a: ladder 1s hold release", 19, []string{`at most one of "hold" and "release"`, `found "release" after "hold" at position 14`}},
		{"duplicate forever", "a: ladder 1s forever forever", 22, []string{`a second "forever"`}},
		{"max and forever", "a: exponential 1s max 1 forever", 25, []string{`"max" or "forever", not both`, `found "forever" after "max" at position 19`}},
		{"forever and max", "a: exponential 1s forever max 1", 27, []string{`"max" or "forever", not both`, `found "max" after "forever" at position 19`}},
		{"max on a ladder", "a: ladder 1s,2s max 5", 17, []string{`found "max"`, "a ladder allows one retry per step"}},
		{"max negative", "a: exponential 1s max -1", 23, []string{"expected a number of retries from 0 to 2147483647", `found "-1"`}},
		{"max too big", "a: exponential 1s max 2147483648", 23, []string{"from 0 to 2147483647", `found "2147483648"`}},
		{"max huge", "a: exponential 1s max 99999999999999999999999", 23, []string{`found "99999999999999999999999"`}},
		{"max signed", "a: exponential 1s max +3", 23, []string{`found "+3"`}},
		{"max missing", "a: exponential 1s max", 22, []string{"expected a number of retries", "found the end of the input"}},
		{"exponential without max", "a: exponential 1s cap 1h; b: ladder 1s", 25, []string{`expected "max N" or "forever" in the exponential policy for "a"`, `found ";"`}},
		{"exponential without max at the end", "a: exponential 1s", 18, []string{`expected "max N" or "forever"`, "found the end of the input"}},
		{"jitter 0%", "a: ladder 1s jitter 0%", 21, []string{"above 0% and at most 100%", `found "0%"`, "jitter none"}},
		{"jitter 150%", "a: ladder 1s jitter 150%", 21, []string{"above 0% and at most 100%", `found "150%"`}},
		{"jitter 1.5", "a: ladder 1s jitter 1.5", 21, []string{"fraction above 0 and at most 1", `found "1.5"`}},
		{"jitter 0", "a: ladder 1s jitter 0", 21, []string{"fraction above 0", "jitter none"}},
		{"jitter -0.1", "a: ladder 1s jitter -0.1", 21, []string{`"full", "none", a percentage`, `found "-0.1"`}},
		{"jitter word", "a: ladder 1s jitter some", 21, []string{`found "some"`}},
		{"jitter missing", "a: ladder 1s jitter", 20, []string{`after "jitter"`, "found the end of the input"}},
		{"jitter percent twice", "a: ladder 1s jitter 20%%", 21, []string{`found "20%%"`}},
		{"bad pattern", "[: ladder 1s", 1, []string{"malformed", `found "["`}},
		{"bad pattern later", "a: ladder 1s; orders.[x: ladder 1s", 15, []string{"malformed", `found "orders.[x"`}},
		{"dlq with a slash", "a: ladder 1s dlq a/b", 18, []string{"expected a Kafka topic name", `found "a/b"`}},
		{"dlq dot", "a: ladder 1s dlq .", 18, []string{`found "."`}},
		{"dlq dot dot", "a: ladder 1s dlq ..", 18, []string{`found ".."`}},
		{"dlq too long", "a: ladder 1s dlq " + strings.Repeat("d", 250), 18, []string{"expected a Kafka topic name"}},
		{"dlq template too long", "a: ladder 1s dlq {target}" + strings.Repeat("d", 249), 18, []string{"expected a Kafka topic name"}},
		{"dlq unknown placeholder", "a: ladder 1s dlq {topic}.dlq", 18, []string{`found "{topic}.dlq"`}},
		{"dlq missing", "a: ladder 1s dlq", 17, []string{"expected a Kafka topic name", "found the end of the input"}},
		{"dlq then colon", "a: ladder 1s dlq :", 18, []string{"expected a Kafka topic name", `found ":"`}},
		{"count 0", "a: ladder 1hx0", 14, []string{"repeat count from 1 to 10000", `found "0"`}},
		{"count huge", "a: ladder 1hx10001", 14, []string{"repeat count from 1 to 10000", `found "10001"`}},
		{"count enormous", "a: ladder 1hx99999999999999999999", 14, []string{`found "99999999999999999999"`}},
		{"count signed", "a: ladder 1h x+3", 15, []string{`found "+3"`}},
		{"ladder too long", "a: ladder 1sx10000,2s", 20, []string{"at most 10000 steps"}},
		{"empty entry", "a: ladder 1s;;b: ladder 1s", 14, []string{"expected a target pattern", `found ";"`, "empty entry"}},
		{"only a semicolon", ";", 1, []string{"expected a target pattern", "empty entry"}},
		{"comma after max", "a: exponential 1s max, 3", 22, []string{"expected a number of retries", `found ","`}},
		{"colon in options", "a: ladder 1s :", 14, []string{"expected an option", `found ":"`}},
		{"second error is not reached", "a: ladder 1s; b: linear; c: ladder 0s", 18, []string{`found "linear"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := Parse(tt.spec, md)
			if err == nil {
				t.Fatalf("Parse(%q) = %v, want an error", tt.spec, s)
			}
			var se *SyntaxError
			if !errors.As(err, &se) {
				t.Fatalf("Parse(%q): %T %v, want a *SyntaxError", tt.spec, err, err)
			}
			if se.Pos != tt.pos {
				t.Errorf("Parse(%q): position %d, want %d (%v)", tt.spec, se.Pos, tt.pos, err)
			}
			if want := "position " + strconv.Itoa(tt.pos) + ": "; !strings.HasPrefix(err.Error(), want) {
				t.Errorf("Parse(%q): %q does not start with %q", tt.spec, err.Error(), want)
			}
			for _, m := range tt.msg {
				if !strings.Contains(se.Msg, m) {
					t.Errorf("Parse(%q): %q does not contain %q", tt.spec, se.Msg, m)
				}
			}
		})
	}
}

func TestParseMaxDelay(t *testing.T) {
	for _, d := range []time.Duration{0, -time.Second} {
		if _, err := Parse("", d); err == nil {
			t.Errorf("Parse with maxDelay %v succeeded, want an error", d)
		}
	}
	// The same step is fine under a larger maximum.
	if _, err := Parse("a: ladder 2h", time.Hour); err == nil {
		t.Error("a 2h step under a maximum delay of 1h parsed")
	}
	if _, err := Parse("a: ladder 2h", 2*time.Hour); err != nil {
		t.Errorf("a 2h step under a maximum delay of 2h: %v", err)
	}
}

func TestFor(t *testing.T) {
	const spec = `
		payments.*: ladder 1s ;
		payments.card: ladder 2s ;   # never used: payments.* comes first
		orders.retry: exponential 3s max 1;
	`
	// The comment above is deliberately not part of the grammar: check that
	// it is an error rather than silently accepted, then test without it.
	if _, err := Parse(spec, md); err == nil {
		t.Fatal("a # comment parsed")
	}
	s, err := Parse(strings.Replace(spec, "# never used: payments.* comes first", "", 1), md)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		target string
		want   string // Text of the policy
	}{
		{"payments.card", "ladder 1s"}, // first match wins
		{"payments.x", "ladder 1s"},
		{"payments", DefaultPolicy},
		{"orders.retry", "exponential 3s max 1"},
		{"orders.retry.2", DefaultPolicy},
		{"", DefaultPolicy},
	}
	for _, tt := range tests {
		if got := s.For(tt.target); got == nil || got.Text != tt.want {
			t.Errorf("For(%q) = %+v, want the policy %q", tt.target, got, tt.want)
		}
	}

	star, err := Parse("a: ladder 1s; *: ladder 9s; b: ladder 2s", md)
	if err != nil {
		t.Fatal(err)
	}
	for target, want := range map[string]string{"a": "ladder 1s", "b": "ladder 9s", "zzz": "ladder 9s"} {
		if got := star.For(target).Text; got != want {
			t.Errorf("with a * entry, For(%q) = %q, want %q", target, got, want)
		}
	}
}

func TestDefault(t *testing.T) {
	s, err := Parse("*: "+DefaultPolicy, md)
	if err != nil {
		t.Fatalf("DefaultPolicy does not parse: %v", err)
	}
	want := defaultPolicy
	want.MaxDelay = md
	if got := s.For("x"); !reflect.DeepEqual(*got, want) {
		t.Errorf("DefaultPolicy parses to %#v, want %#v", *got, want)
	}

	for _, spec := range []string{"", " \n\t ", "a: ladder 1s"} {
		s, err := Parse(spec, md)
		if err != nil {
			t.Fatalf("Parse(%q): %v", spec, err)
		}
		if got := s.For("unmatched"); !reflect.DeepEqual(*got, want) {
			t.Errorf("Parse(%q).For(unmatched) = %#v, want the default", spec, *got)
		}
	}

	// The default keeps MAX_DELAY even when it is below the default's cap.
	s, err = Parse("", 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if d, exhausted := s.For("x").Next(9, func() float64 { return 0.999999 }); exhausted || d != 10*time.Minute {
		t.Errorf("default under MAX_DELAY 10m, attempt 9: %v, %v; want 10m0s, false", d, exhausted)
	}

	var nilSet *Set
	if got := nilSet.For("x"); got == nil || got.Text != DefaultPolicy {
		t.Errorf("nil Set: For = %+v, want the default", got)
	}
}

func TestString(t *testing.T) {
	tests := []struct {
		spec, want string
	}{
		{"", "*: " + "exponential 30s x2 cap 1h max 10 jitter 20%"},
		{"a: ladder 1s,1s,2m,1h,1h hold", "a: ladder 1sx2,2m,1hx2; *: exponential 30s x2 cap 1h max 10 jitter 20%"},
		{"a: ladder 90m forever jitter 0.125 release dlq {target}.dlq ; *: exponential 1s x1.5 max 3",
			"a: ladder 1h30m forever jitter 0.125 release dlq {target}.dlq; *: exponential 1s x1.5 max 3"},
		{"*: exponential 1s x1 cap 1s forever jitter 0.333", "*: exponential 1s x1 cap 1s forever jitter 0.333"},
		{"*: exponential 1s forever jitter full", "*: exponential 1s x2 forever jitter full"},
		{"*: exponential 1s forever jitter 0.07", "*: exponential 1s x2 forever jitter 7%"},
	}
	for _, tt := range tests {
		s, err := Parse(tt.spec, md)
		if err != nil {
			t.Fatalf("Parse(%q): %v", tt.spec, err)
		}
		got := s.String()
		if got != tt.want {
			t.Errorf("Parse(%q).String() = %q, want %q", tt.spec, got, tt.want)
		}
		again, err := Parse(got, md)
		if err != nil {
			t.Fatalf("String() output %q does not parse: %v", got, err)
		}
		if again.String() != got {
			t.Errorf("String() is not stable: %q then %q", got, again.String())
		}
	}
}

func TestDLQTopic(t *testing.T) {
	tests := []struct {
		dlq, target, want string
	}{
		{"", "orders", ""},
		{"dead", "orders", "dead"},
		{"{target}.dlq", "orders", "orders.dlq"},
		{"dlq.{target}.{target}", "o", "dlq.o.o"},
	}
	for _, tt := range tests {
		p := &Policy{DLQ: tt.dlq}
		if got := p.DLQTopic(tt.target); got != tt.want {
			t.Errorf("DLQ %q: DLQTopic(%q) = %q, want %q", tt.dlq, tt.target, got, tt.want)
		}
	}
}

// TestDocExamples parses every example in docs/policies.md, so that the
// documentation cannot drift from the grammar.
func TestDocExamples(t *testing.T) {
	doc, err := os.ReadFile("../../docs/policies.md")
	if err != nil {
		t.Fatal(err)
	}
	examples := regexp.MustCompile(`(?s)(RETRY_POLICIES|NON_RETRIABLE_ERRORS)='([^']*)'`).FindAllStringSubmatch(string(doc), -1)
	if len(examples) < 4 {
		t.Fatalf("found %d examples in docs/policies.md, want at least 4", len(examples))
	}
	for _, ex := range examples {
		switch ex[1] {
		case "RETRY_POLICIES":
			if _, err := Parse(ex[2], md); err != nil {
				t.Errorf("example %q: %v", ex[2], err)
			}
		default:
			if _, err := ParseClassifier(ex[2]); err != nil {
				t.Errorf("example %q: %v", ex[2], err)
			}
		}
	}

	const bad = "payments.*: ladder 30s,5q"
	_, err = Parse(bad, md)
	if err == nil || !strings.Contains(string(doc), "`"+err.Error()+"`") {
		t.Errorf("docs/policies.md does not show the error of %q, %v", bad, err)
	}
}
