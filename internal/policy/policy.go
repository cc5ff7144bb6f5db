// Package policy parses and applies retry policies: for a target topic and
// the number of retries already made, how long until the next one, or that
// the message is exhausted; and which error classes are not worth retrying.
//
// The grammar of RETRY_POLICIES and NON_RETRIABLE_ERRORS is in
// docs/policies.md; parse.go implements it.
package policy

import (
	"fmt"
	"math"
	"path"
	"strconv"
	"strings"
	"time"
)

// Kind is the shape of a policy's delays.
type Kind int

const (
	// Exponential: Initial * Factor^attempt, capped at Cap.
	Exponential Kind = iota + 1
	// Ladder: an explicit list of delays, one per retry.
	Ladder
)

// DefaultPolicy is the policy of targets that no RETRY_POLICIES entry
// matches.
const DefaultPolicy = "exponential 30s x2 cap 1h jitter 20% max 10"

// Jitter randomises a delay so that retries of many messages spread out.
type Jitter struct {
	// Full: the delay is uniform in [0, d].
	Full bool
	// Fraction f in (0, 1]: the delay is uniform in [d*(1-f), d*(1+f)].
	// Zero with Full false: no jitter.
	Fraction float64
}

// Policy is one parsed retry policy.
type Policy struct {
	// Text is the policy as configured, for logs and errors.
	Text    string
	Kind    Kind
	Initial time.Duration // Exponential
	Factor  float64       // Exponential; below 1 counts as 1
	Cap     time.Duration // Exponential; 0: none (MaxDelay still applies)
	Steps   []time.Duration
	// MaxRetries is how many retries the policy allows; a message whose
	// defer.attempt is MaxRetries or more is exhausted. Ignored when Forever.
	MaxRetries int32
	Forever    bool
	Jitter     Jitter
	// ReleaseKey: a parked message releases its business key instead of
	// holding it (the default holds).
	ReleaseKey bool
	// DLQ is the dead-letter topic template ("" : no copy). "{target}" in it
	// stands for the target topic.
	DLQ string
	// MaxDelay is MAX_DELAY: Next never returns more, jitter included.
	// Parse sets it; 0 (a Policy built by hand) means no limit.
	MaxDelay time.Duration
}

// defaultPolicy is DefaultPolicy, parsed. It is written out rather than
// parsed at init so that a mistake cannot turn into a panic at start-up; a
// test checks that the two agree.
var defaultPolicy = Policy{
	Text:       DefaultPolicy,
	Kind:       Exponential,
	Initial:    30 * time.Second,
	Factor:     2,
	Cap:        time.Hour,
	MaxRetries: 10,
	Jitter:     Jitter{Fraction: 0.2},
}

// Set is a parsed RETRY_POLICIES value: target patterns, each with a policy,
// tried in order, and a default for targets no pattern matches.
type Set struct {
	entries []entry
	// def is DefaultPolicy with the MaxDelay given to Parse.
	def *Policy
}

// Policies returns the configured policies in order, each with its target
// pattern, for checks that need the whole configuration (a dead-letter topic
// that would loop back, say). The default is not included.
func (s *Set) Policies() (patterns []string, policies []*Policy) {
	if s == nil {
		return nil, nil
	}
	for _, e := range s.entries {
		patterns = append(patterns, e.pattern)
		policies = append(policies, e.policy)
	}
	return patterns, policies
}

// entry is one "pattern: policy" of a Set.
type entry struct {
	pattern string // valid for path.Match: Parse checked it
	policy  *Policy
}

// SyntaxError is a problem in a policy or pattern list, with its position.
type SyntaxError struct {
	Pos int // 1-based byte offset in the parsed text
	Msg string
}

func (e *SyntaxError) Error() string { return fmt.Sprintf("position %d: %s", e.Pos, e.Msg) }

// Parse parses a RETRY_POLICIES value. maxDelay is MAX_DELAY: a step, an
// initial delay or a cap longer than it is an error.
func Parse(spec string, maxDelay time.Duration) (*Set, error) {
	if maxDelay <= 0 {
		return nil, fmt.Errorf("policy: maximum delay must be positive, got %v", maxDelay)
	}
	p := parser{src: spec, maxDelay: maxDelay}
	entries, err := p.parseSpec()
	if err != nil {
		return nil, err
	}
	def := defaultPolicy
	def.MaxDelay = maxDelay
	return &Set{entries: entries, def: &def}, nil
}

// For returns the policy of target: that of the first entry whose pattern
// matches it, else the default. It never returns nil, even on a nil Set
// (which has only the default, with no MaxDelay).
func (s *Set) For(target string) *Policy {
	if s == nil {
		def := defaultPolicy
		return &def
	}
	for _, e := range s.entries {
		// The pattern was validated by Parse, so the only error Match can
		// return (ErrBadPattern) cannot happen.
		if ok, _ := path.Match(e.pattern, target); ok {
			return e.policy
		}
	}
	return s.def
}

// String renders the set canonically, one "pattern: policy" per entry, for
// logs. The default appears as a final "*" entry unless an entry for "*"
// already replaces it.
func (s *Set) String() string {
	if s == nil {
		return "*: " + defaultPolicy.String()
	}
	var b strings.Builder
	star := false
	for i, e := range s.entries {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(e.pattern)
		b.WriteString(": ")
		b.WriteString(e.policy.String())
		star = star || e.pattern == "*"
	}
	if !star {
		if len(s.entries) > 0 {
			b.WriteString("; ")
		}
		b.WriteString("*: ")
		b.WriteString(s.def.String())
	}
	return b.String()
}

// String renders the policy canonically: the form Parse accepts, with
// defaults spelled out where they matter and repeated ladder steps folded
// ("1h,1h,1h" becomes "1hx3"). Parsing it gives the same policy.
func (p *Policy) String() string {
	var b strings.Builder
	switch p.Kind {
	case Exponential:
		fmt.Fprintf(&b, "exponential %s x%s", formatDuration(p.Initial), strconv.FormatFloat(p.Factor, 'f', -1, 64))
		if p.Cap > 0 {
			fmt.Fprintf(&b, " cap %s", formatDuration(p.Cap))
		}
		if !p.Forever {
			fmt.Fprintf(&b, " max %d", p.MaxRetries)
		}
	case Ladder:
		b.WriteString("ladder ")
		for i := 0; i < len(p.Steps); {
			n := 1
			for i+n < len(p.Steps) && p.Steps[i+n] == p.Steps[i] {
				n++
			}
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(formatDuration(p.Steps[i]))
			if n > 1 {
				fmt.Fprintf(&b, "x%d", n)
			}
			i += n
		}
	default:
		fmt.Fprintf(&b, "invalid policy kind %d", int(p.Kind))
	}
	if p.Forever {
		b.WriteString(" forever")
	}
	switch f := p.Jitter.Fraction; {
	case p.Jitter.Full:
		b.WriteString(" jitter full")
	case f > 0:
		// A whole percentage reads best, but only when it parses back to
		// exactly this fraction; otherwise the shortest exact fraction.
		if pct := math.Round(f * 100); pct/100 == f {
			fmt.Fprintf(&b, " jitter %s%%", strconv.FormatFloat(pct, 'f', -1, 64))
		} else {
			fmt.Fprintf(&b, " jitter %s", strconv.FormatFloat(f, 'f', -1, 64))
		}
	}
	if p.ReleaseKey {
		b.WriteString(" release")
	}
	if p.DLQ != "" {
		fmt.Fprintf(&b, " dlq %s", p.DLQ)
	}
	return b.String()
}

// formatDuration is time.Duration.String without the zero units it appends
// ("1h0m0s" becomes "1h"), still a valid Go duration.
func formatDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

// Next returns the delay before the next retry of a message that has had
// attempt retries already (its defer.attempt), or exhausted if the policy
// allows no more. rnd returns uniform values in [0, 1) for jitter; it is
// called only when the policy has jitter, and nil means no jitter.
//
// A ladder gives step attempt (0-based; past the end the last step, which is
// reached only with forever). An exponential gives Initial*Factor^attempt,
// at most Cap. Jitter applies after the cap; the result is never negative
// and never more than MaxDelay. A negative attempt counts as 0. A policy of
// no known kind, or a ladder without steps, is exhausted.
func (p *Policy) Next(attempt int32, rnd func() float64) (delay time.Duration, exhausted bool) {
	attempt = max(attempt, 0)
	if !p.Forever && attempt >= p.MaxRetries {
		return 0, true
	}
	limit := time.Duration(math.MaxInt64)
	if p.MaxDelay > 0 {
		limit = p.MaxDelay
	}
	var d time.Duration
	switch p.Kind {
	case Ladder:
		if len(p.Steps) == 0 {
			return 0, true
		}
		d = p.Steps[min(int(attempt), len(p.Steps)-1)]
	case Exponential:
		c := limit
		if p.Cap > 0 {
			c = min(c, p.Cap)
		}
		f := p.Factor
		if !(f >= 1) { // also NaN
			f = 1
		}
		// In floating point, the power saturates at +Inf instead of
		// overflowing, so a huge attempt or factor lands on the cap.
		d = clampFloat(float64(p.Initial)*math.Pow(f, float64(attempt)), c)
	default:
		return 0, true
	}
	d = min(max(d, 0), limit)
	if rnd == nil || (!p.Jitter.Full && p.Jitter.Fraction <= 0) {
		return d, false
	}
	r := rnd()
	if !(r >= 0) { // also NaN
		r = 0
	}
	r = min(r, 1)
	x := float64(d)
	if p.Jitter.Full {
		x *= r
	} else {
		f := p.Jitter.Fraction
		x *= 1 - f + 2*f*r
	}
	return clampFloat(x, limit), false
}

// clampFloat converts x nanoseconds to a Duration in [0, limit]. Converting a
// float64 beyond the range of int64 is implementation-defined in Go, so the
// comparison happens before the conversion.
func clampFloat(x float64, limit time.Duration) time.Duration {
	switch {
	case !(x < float64(limit)): // also NaN and +Inf
		return limit
	case !(x > 0):
		return 0
	}
	// x is below float64(limit) and therefore at most limit: if rounding
	// made float64(limit) larger than limit, the next float64 down is
	// below limit.
	return time.Duration(x)
}

// DLQTopic returns the dead-letter topic for target, or "" if none.
func (p *Policy) DLQTopic(target string) string {
	return strings.ReplaceAll(p.DLQ, "{target}", target)
}
