package policy

import (
	"fmt"
	"math"
	"path"
	"strconv"
	"strings"
	"time"
)

// Limits of the grammar that keep a typo from allocating without bound.
const (
	maxStepCount   = 10000 // COUNT in "1hx3"
	maxLadderSteps = 10000 // steps of one ladder after expansion
)

// optionNames lists the options for error messages.
const optionNames = `"max", "forever", "jitter", "hold", "release" or "dlq"`

type tokenKind int

const (
	tokEOF tokenKind = iota
	tokWord
	tokSemicolon
	tokColon
	tokComma
)

type token struct {
	kind tokenKind
	text string
	pos  int // 0-based byte offset in the source
}

// found describes t for "expected ..., found ..." messages.
func (t token) found() string {
	if t.kind == tokEOF {
		return "the end of the input"
	}
	return strconv.Quote(t.text)
}

// parser is a recursive-descent parser over the raw text, so that every
// error can point at a byte offset.
type parser struct {
	src      string
	pos      int // 0-based offset of the next byte to read
	maxDelay time.Duration
}

func isSpace(c byte) bool {
	switch c {
	case ' ', '\t', '\n', '\r', '\v', '\f':
		return true
	}
	return false
}

func (p *parser) skipSpace() {
	for p.pos < len(p.src) && isSpace(p.src[p.pos]) {
		p.pos++
	}
}

// next reads the next token: one of ";", ":", ",", or a word, a run of bytes
// that are none of those and not white space.
func (p *parser) next() token {
	p.skipSpace()
	start := p.pos
	if start == len(p.src) {
		return token{kind: tokEOF, pos: start}
	}
	switch p.src[start] {
	case ';':
		p.pos++
		return token{kind: tokSemicolon, text: ";", pos: start}
	case ':':
		p.pos++
		return token{kind: tokColon, text: ":", pos: start}
	case ',':
		p.pos++
		return token{kind: tokComma, text: ",", pos: start}
	}
	for p.pos < len(p.src) && !isSpace(p.src[p.pos]) && strings.IndexByte(";:,", p.src[p.pos]) < 0 {
		p.pos++
	}
	return token{kind: tokWord, text: p.src[start:p.pos], pos: start}
}

// peek returns the next token without consuming it.
func (p *parser) peek() token {
	saved := p.pos
	t := p.next()
	p.pos = saved
	return t
}

// nextPattern reads a target pattern: everything up to white space, ":" or
// ";". Unlike a word it may contain ",", which path.Match treats as a plain
// character.
func (p *parser) nextPattern() token {
	p.skipSpace()
	start := p.pos
	for p.pos < len(p.src) && !isSpace(p.src[p.pos]) && p.src[p.pos] != ':' && p.src[p.pos] != ';' {
		p.pos++
	}
	if p.pos > start {
		return token{kind: tokWord, text: p.src[start:p.pos], pos: start}
	}
	p.pos = start
	return p.next()
}

func errAt(pos int, format string, args ...any) *SyntaxError {
	return &SyntaxError{Pos: pos + 1, Msg: fmt.Sprintf(format, args...)}
}

// parseSpec parses: entry { ";" entry } [";"], or nothing at all.
func (p *parser) parseSpec() ([]entry, error) {
	var entries []entry
	for {
		p.skipSpace()
		if p.pos == len(p.src) {
			return entries, nil
		}
		e, last, err := p.parseEntry()
		if err != nil {
			return nil, err
		}
		entries = append(entries, e)
		if last {
			return entries, nil
		}
	}
}

// parseEntry parses pattern ":" policy and the ";" or end after it; last
// reports the end.
func (p *parser) parseEntry() (e entry, last bool, err error) {
	pt := p.nextPattern()
	if pt.kind != tokWord {
		hint := ""
		if pt.kind == tokSemicolon {
			hint = " (an empty entry)"
		}
		return e, false, errAt(pt.pos, "expected a target pattern such as payments.* or *, found %s%s", pt.found(), hint)
	}
	if _, err := path.Match(pt.text, ""); err != nil {
		return e, false, errAt(pt.pos, "expected a target pattern (a path.Match glob such as payments.*), found %q, which is malformed (%v)", pt.text, err)
	}
	if colon := p.next(); colon.kind != tokColon {
		hint := ""
		if pt.text == "exponential" || pt.text == "ladder" {
			hint = ` (every entry starts with a target pattern, e.g. "*: exponential 1s max 5")`
		}
		return e, false, errAt(colon.pos, "expected \":\" after the target pattern %q, found %s%s", pt.text, colon.found(), hint)
	}
	bodyStart := p.pos
	pol, end, err := p.parsePolicy(pt.text)
	if err != nil {
		return e, false, err
	}
	pol.Text = strings.TrimSpace(p.src[bodyStart:end.pos])
	pol.MaxDelay = p.maxDelay
	return entry{pattern: pt.text, policy: pol}, end.kind == tokEOF, nil
}

// parsePolicy parses ( exponential | ladder ) { option } and consumes the
// ";" or end of input after it, which it returns.
func (p *parser) parsePolicy(pattern string) (*Policy, token, error) {
	pol := &Policy{}
	kw := p.next()
	var err error
	switch {
	case kw.kind == tokWord && kw.text == "exponential":
		pol.Kind = Exponential
		err = p.parseExponential(pol)
	case kw.kind == tokWord && kw.text == "ladder":
		pol.Kind = Ladder
		err = p.parseLadder(pol)
	default:
		err = errAt(kw.pos, "expected \"exponential\" or \"ladder\" after %q, found %s", pattern+":", kw.found())
	}
	if err != nil {
		return nil, token{}, err
	}

	// Options seen so far, by slot: "hold" and "release" share one.
	seen := map[string]token{}
	once := func(t token, slot string) error {
		first, dup := seen[slot]
		switch {
		case !dup:
			seen[slot] = t
			return nil
		case first.text != t.text:
			return errAt(t.pos, "expected at most one of \"hold\" and \"release\", found %q after %q at position %d", t.text, first.text, first.pos+1)
		default:
			return errAt(t.pos, "expected each option at most once per entry, found a second %q (the first is at position %d)", t.text, first.pos+1)
		}
	}
	for {
		t := p.next()
		if t.kind == tokEOF || t.kind == tokSemicolon {
			if pol.Kind == Exponential && !pol.Forever && !hasKey(seen, "max") {
				return nil, token{}, errAt(t.pos, "expected \"max N\" or \"forever\" in the exponential policy for %q (an exponential never runs out of delays by itself), found %s", pattern, t.found())
			}
			if pol.Kind == Ladder {
				pol.MaxRetries = int32(len(pol.Steps)) // at most maxLadderSteps
			}
			return pol, t, nil
		}
		if t.kind != tokWord {
			return nil, token{}, errAt(t.pos, "expected an option (%s), \";\" or the end of the input, found %s", optionNames, t.found())
		}
		switch t.text {
		case "max":
			if pol.Kind == Ladder {
				return nil, token{}, errAt(t.pos, "expected an option other than \"max\" in a ladder, found \"max\": a ladder allows one retry per step, so its maximum is its number of steps (add steps, or \"forever\" to repeat the last one)")
			}
			if err := once(t, "max"); err != nil {
				return nil, token{}, err
			}
			if f, ok := seen["forever"]; ok {
				return nil, token{}, errAt(t.pos, "expected \"max\" or \"forever\", not both, found \"max\" after \"forever\" at position %d", f.pos+1)
			}
			n, err := p.integer(t, 0, math.MaxInt32, "a number of retries")
			if err != nil {
				return nil, token{}, err
			}
			pol.MaxRetries = int32(n)
		case "forever":
			if err := once(t, "forever"); err != nil {
				return nil, token{}, err
			}
			if m, ok := seen["max"]; ok {
				return nil, token{}, errAt(t.pos, "expected \"max\" or \"forever\", not both, found \"forever\" after \"max\" at position %d", m.pos+1)
			}
			pol.Forever = true
		case "jitter":
			if err := once(t, "jitter"); err != nil {
				return nil, token{}, err
			}
			j, err := p.jitter()
			if err != nil {
				return nil, token{}, err
			}
			pol.Jitter = j
		case "hold", "release":
			if err := once(t, "hold"); err != nil {
				return nil, token{}, err
			}
			pol.ReleaseKey = t.text == "release"
		case "dlq":
			if err := once(t, "dlq"); err != nil {
				return nil, token{}, err
			}
			topic := p.next()
			if topic.kind != tokWord || !validTopic(strings.ReplaceAll(topic.text, "{target}", "x")) {
				return nil, token{}, errAt(topic.pos, "expected a Kafka topic name after \"dlq\" (1 to 249 of a-z A-Z 0-9 . _ -, not \".\" or \"..\", with {target} standing for the target topic), found %s", topic.found())
			}
			pol.DLQ = topic.text
		case "cap":
			if pol.Kind == Ladder {
				return nil, token{}, errAt(t.pos, "expected an option (%s), found \"cap\", which only an exponential takes", optionNames)
			}
			return nil, token{}, errAt(t.pos, "expected an option (%s), found \"cap\": it must come right after the initial delay and factor, as in \"exponential 1s x2 cap 1h max 5\"", optionNames)
		default:
			hint := ""
			switch {
			case p.peek().kind == tokColon:
				hint = fmt.Sprintf(" (missing \";\" before the entry for %q?)", t.text)
			case pol.Kind == Ladder && isDuration(t.text):
				hint = " (missing \",\" between ladder steps?)"
			}
			return nil, token{}, errAt(t.pos, "expected an option (%s), \";\" or the end of the input, found %q%s", optionNames, t.text, hint)
		}
	}
}

func hasKey(m map[string]token, k string) bool {
	_, ok := m[k]
	return ok
}

// isDuration reports whether s, up to an "x", is a Go duration.
func isDuration(s string) bool {
	if i := strings.IndexByte(s, 'x'); i >= 0 {
		s = s[:i]
	}
	_, err := time.ParseDuration(s)
	return err == nil
}

// parseExponential parses INITIAL [ "x" FACTOR ] [ "cap" CAP ].
func (p *parser) parseExponential(pol *Policy) error {
	initial, x, err := p.durationX(`"exponential"`)
	if err != nil {
		return err
	}
	pol.Initial = initial
	pol.Factor = 2
	if x != nil {
		f, err := decimal(x.text)
		if err != nil || f < 1 {
			return errAt(x.pos, "expected a factor of at least 1 after \"x\", found %s", x.found())
		}
		pol.Factor = f
	}
	if t := p.peek(); t.kind == tokWord && t.text == "cap" {
		p.next()
		c := p.next()
		d, err := p.duration(c, `"cap"`)
		if err != nil {
			return err
		}
		if d < initial {
			return errAt(c.pos, "expected a cap of at least the initial delay %s, found %s", formatDuration(initial), c.found())
		}
		pol.Cap = d
	}
	return nil
}

// parseLadder parses STEP { "," STEP }.
func (p *parser) parseLadder(pol *Policy) error {
	after := `"ladder"`
	for {
		start := p.peek().pos
		d, x, err := p.durationX(after)
		if err != nil {
			return err
		}
		count := 1
		if x != nil {
			n, err := strconv.Atoi(x.text)
			if err != nil || !isDigits(x.text) || n < 1 || n > maxStepCount {
				return errAt(x.pos, "expected a repeat count from 1 to %d after \"x\", found %s", maxStepCount, x.found())
			}
			count = n
		}
		if len(pol.Steps)+count > maxLadderSteps {
			return errAt(start, "expected a ladder of at most %d steps, found more at this step", maxLadderSteps)
		}
		for range count {
			pol.Steps = append(pol.Steps, d)
		}
		if p.peek().kind != tokComma {
			return nil
		}
		p.next()
		after = `","`
	}
}

// durationX parses DURATION [ "x" NUMBER ], where the "x" part may be glued
// to the duration ("1hx3"), a word of its own ("1h x3") or split ("1h x 3").
// A Go duration never contains "x", so the first one ends the duration. x is
// the NUMBER token, nil if there is no "x".
func (p *parser) durationX(after string) (time.Duration, *token, error) {
	t := p.next()
	if t.kind != tokWord {
		return 0, nil, errAt(t.pos, "expected a duration after %s, found %s", after, t.found())
	}
	dt, rest, glued := strings.Cut(t.text, "x")
	durTok := t
	if dt != "" {
		durTok.text = dt
	}
	d, err := p.duration(durTok, after)
	if err != nil {
		return 0, nil, err
	}
	var xAt int // 0-based offset of the "x"
	switch {
	case glued:
		xAt = t.pos + len(dt)
	default:
		n := p.peek()
		if n.kind != tokWord || n.text[0] != 'x' {
			return d, nil, nil
		}
		p.next()
		rest, xAt = n.text[1:], n.pos
	}
	if rest != "" {
		return d, &token{kind: tokWord, text: rest, pos: xAt + 1}, nil
	}
	n := p.next()
	if n.kind != tokWord {
		return 0, nil, errAt(n.pos, "expected a number after \"x\", found %s", n.found())
	}
	return d, &n, nil
}

// duration parses t as a Go duration in (0, maxDelay].
func (p *parser) duration(t token, after string) (time.Duration, error) {
	if t.kind != tokWord {
		return 0, errAt(t.pos, "expected a duration after %s, found %s", after, t.found())
	}
	d, err := time.ParseDuration(t.text)
	switch {
	case err != nil:
		return 0, errAt(t.pos, "expected a duration after %s, found %s (%v)", after, t.found(), err)
	case d <= 0:
		return 0, errAt(t.pos, "expected a positive duration after %s, found %s", after, t.found())
	case d > p.maxDelay:
		return 0, errAt(t.pos, "expected a duration of at most the maximum delay %s after %s, found %s", formatDuration(p.maxDelay), after, t.found())
	}
	return d, nil
}

// integer reads a decimal integer in [lo, hi] after the keyword kw.
func (p *parser) integer(kw token, lo, hi int64, what string) (int64, error) {
	t := p.next()
	n, err := strconv.ParseInt(t.text, 10, 64)
	if t.kind != tokWord || !isDigits(t.text) || err != nil || n < lo || n > hi {
		return 0, errAt(t.pos, "expected %s from %d to %d after %q, found %s", what, lo, hi, kw.text, t.found())
	}
	return n, nil
}

// jitter parses "full" | "none" | PCT "%" | FRACTION.
func (p *parser) jitter() (Jitter, error) {
	t := p.next()
	if t.kind == tokWord {
		switch t.text {
		case "full":
			return Jitter{Full: true}, nil
		case "none":
			return Jitter{}, nil
		}
		num, pct := strings.CutSuffix(t.text, "%")
		if v, err := decimal(num); err == nil {
			if !pct {
				if n := p.peek(); n.kind == tokWord && n.text == "%" {
					p.next()
					pct = true
				}
			}
			if pct {
				if v <= 0 || v > 100 {
					return Jitter{}, errAt(t.pos, "expected a jitter percentage above 0%% and at most 100%%, found %s%s", t.found(), noneHint(v))
				}
				return Jitter{Fraction: v / 100}, nil
			}
			if v <= 0 || v > 1 {
				return Jitter{}, errAt(t.pos, "expected a jitter fraction above 0 and at most 1, found %s%s", t.found(), noneHint(v))
			}
			return Jitter{Fraction: v}, nil
		}
	}
	return Jitter{}, errAt(t.pos, "expected \"full\", \"none\", a percentage such as 20%% or a fraction such as 0.2 after \"jitter\", found %s", t.found())
}

func noneHint(v float64) string {
	if v == 0 {
		return ` (write "jitter none" for no jitter)`
	}
	return ""
}

// decimal parses a plain decimal number: digits with at most one ".", no
// sign, exponent, hex, underscores, Inf or NaN, which ParseFloat would all
// accept.
func decimal(s string) (float64, error) {
	digits, dots := 0, 0
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c >= '0' && c <= '9':
			digits++
		case c == '.':
			dots++
		default:
			return 0, fmt.Errorf("not a decimal number: %q", s)
		}
	}
	if digits == 0 || dots > 1 {
		return 0, fmt.Errorf("not a decimal number: %q", s)
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil { // out of range: +Inf
		return 0, err
	}
	return v, nil
}

func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// validTopic reports whether name is a legal Kafka topic name.
func validTopic(name string) bool {
	if name == "" || len(name) > 249 || name == "." || name == ".." {
		return false
	}
	for i := 0; i < len(name); i++ {
		switch c := name[i]; {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}
