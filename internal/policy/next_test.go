package policy

import (
	"math"
	"testing"
	"time"
)

func mustParse(t testing.TB, spec string, maxDelay time.Duration) *Policy {
	t.Helper()
	s, err := Parse("*: "+spec, maxDelay)
	if err != nil {
		t.Fatalf("Parse(%q): %v", spec, err)
	}
	return s.For("any")
}

func TestNext(t *testing.T) {
	const (
		h = time.Hour
		m = time.Minute
		s = time.Second
	)
	tests := []struct {
		policy    string
		maxDelay  time.Duration // 0: md
		attempt   int32
		want      time.Duration
		exhausted bool
	}{
		// A ladder gives step a, 0-based, and is exhausted after its last.
		{policy: "ladder 30s,5m,30m,1hx3", attempt: 0, want: 30 * s},
		{policy: "ladder 30s,5m,30m,1hx3", attempt: 1, want: 5 * m},
		{policy: "ladder 30s,5m,30m,1hx3", attempt: 2, want: 30 * m},
		{policy: "ladder 30s,5m,30m,1hx3", attempt: 3, want: h},
		{policy: "ladder 30s,5m,30m,1hx3", attempt: 5, want: h}, // max-1
		{policy: "ladder 30s,5m,30m,1hx3", attempt: 6, exhausted: true},
		{policy: "ladder 30s,5m,30m,1hx3", attempt: math.MaxInt32, exhausted: true},
		{policy: "ladder 30s,5m,30m,1hx3", attempt: -1, want: 30 * s},
		{policy: "ladder 30s,5m,30m,1hx3", attempt: math.MinInt32, want: 30 * s},
		// Forever repeats the last step.
		{policy: "ladder 1m,10m forever", attempt: 1, want: 10 * m},
		{policy: "ladder 1m,10m forever", attempt: 2, want: 10 * m},
		{policy: "ladder 1m,10m forever", attempt: 1e9, want: 10 * m},
		{policy: "ladder 1m,10m forever", attempt: math.MaxInt32, want: 10 * m},
		// Exponential growth up to the cap, then exhaustion at max.
		{policy: "exponential 1s x2 cap 1h max 100", attempt: 0, want: s},
		{policy: "exponential 1s x2 cap 1h max 100", attempt: 1, want: 2 * s},
		{policy: "exponential 1s x2 cap 1h max 100", attempt: 2, want: 4 * s},
		{policy: "exponential 1s x2 cap 1h max 100", attempt: 11, want: 2048 * s},
		{policy: "exponential 1s x2 cap 1h max 100", attempt: 12, want: h}, // 4096s > 1h
		{policy: "exponential 1s x2 cap 1h max 100", attempt: 99, want: h},
		{policy: "exponential 1s x2 cap 1h max 100", attempt: 100, exhausted: true},
		{policy: "exponential 1s x1.5 max 3", attempt: 2, want: 2250 * time.Millisecond},
		{policy: "exponential 1s max 3", attempt: 2, want: 4 * s},
		{policy: "exponential 1s max 3", attempt: 3, exhausted: true},
		{policy: "exponential 1s max 0", attempt: 0, exhausted: true},
		{policy: "exponential 1s max 0", attempt: -5, exhausted: true},
		{policy: "exponential 1m x1 max 5", attempt: 4, want: m},
		{policy: "exponential 1h cap 1h max 5", attempt: 0, want: h},
		// No cap: MAX_DELAY caps, and a huge attempt or factor saturates.
		{policy: "exponential 1s forever", attempt: 21, want: 2097152 * s},
		{policy: "exponential 1s forever", attempt: 22, want: md},
		{policy: "exponential 1s forever", attempt: 1e9, want: md},
		{policy: "exponential 1s forever", attempt: math.MaxInt32, want: md},
		{policy: "exponential 1s x100000000000000000000000000000 forever", attempt: 1, want: md},
		{policy: "exponential 1s x100000000000000000000000000000 forever", attempt: math.MaxInt32, want: md},
		{policy: "exponential 1s cap 2h forever", attempt: math.MaxInt32, want: 2 * h},
		{policy: "exponential 1s forever", maxDelay: h, attempt: 30, want: h},
		{policy: "exponential 1h forever", maxDelay: h, attempt: 1, want: h},
		{policy: "exponential 1ns forever", maxDelay: time.Duration(math.MaxInt64), attempt: math.MaxInt32, want: time.Duration(math.MaxInt64)},
	}
	for _, tt := range tests {
		maxDelay := tt.maxDelay
		if maxDelay == 0 {
			maxDelay = md
		}
		p := mustParse(t, tt.policy, maxDelay)
		rnd := func() float64 {
			t.Errorf("%q: rnd called for a policy without jitter", tt.policy)
			return 0.5
		}
		d, exhausted := p.Next(tt.attempt, rnd)
		if d != tt.want || exhausted != tt.exhausted {
			t.Errorf("%q (max delay %v).Next(%d) = %v, %v; want %v, %v", tt.policy, maxDelay, tt.attempt, d, exhausted, tt.want, tt.exhausted)
		}
	}
}

// sweep returns rnd values spread over [0, 1), with the extremes the
// generator can return.
func sweep() []float64 {
	vs := []float64{0, 0.999999, math.Nextafter(1, 0)}
	for i := range 1000 {
		vs = append(vs, float64(i)/1000)
	}
	return vs
}

func TestNextJitter(t *testing.T) {
	tests := []struct {
		policy   string
		attempt  int32
		lo, hi   time.Duration // bounds every result must be within
		near     time.Duration // how close the extremes must come to them
		maxDelay time.Duration // 0: md
	}{
		{policy: "ladder 10s jitter 20%", lo: 8 * time.Second, hi: 12 * time.Second, near: 100 * time.Microsecond},
		{policy: "ladder 10s jitter 0.5", lo: 5 * time.Second, hi: 15 * time.Second, near: 100 * time.Microsecond},
		{policy: "ladder 10s jitter 1", lo: 0, hi: 20 * time.Second, near: 100 * time.Microsecond},
		{policy: "ladder 10s jitter full", lo: 0, hi: 10 * time.Second, near: 100 * time.Microsecond},
		// Jitter applies after the cap: 1s*2^10 is capped at 100s first.
		{policy: "exponential 1s cap 100s jitter 10% max 20", attempt: 10, lo: 90 * time.Second, hi: 110 * time.Second, near: time.Millisecond},
		// And the result is clamped to MAX_DELAY.
		{policy: "ladder 720h jitter 50%", lo: 360 * time.Hour, hi: md, near: time.Millisecond},
		{policy: "exponential 1h forever jitter 100%", attempt: 40, maxDelay: 2 * time.Hour, lo: 0, hi: 2 * time.Hour, near: time.Millisecond},
	}
	for _, tt := range tests {
		maxDelay := tt.maxDelay
		if maxDelay == 0 {
			maxDelay = md
		}
		p := mustParse(t, tt.policy, maxDelay)
		lowest, highest := time.Duration(math.MaxInt64), time.Duration(math.MinInt64)
		for _, r := range sweep() {
			d, exhausted := p.Next(tt.attempt, func() float64 { return r })
			if exhausted {
				t.Fatalf("%q.Next(%d): exhausted", tt.policy, tt.attempt)
			}
			if d < tt.lo || d > tt.hi {
				t.Errorf("%q.Next(%d) with rnd %v = %v, outside [%v, %v]", tt.policy, tt.attempt, r, d, tt.lo, tt.hi)
			}
			lowest, highest = min(lowest, d), max(highest, d)
		}
		if lowest > tt.lo+tt.near || highest < tt.hi-tt.near {
			t.Errorf("%q.Next(%d) ranged over [%v, %v], want about [%v, %v]", tt.policy, tt.attempt, lowest, highest, tt.lo, tt.hi)
		}
	}
}

func TestNextJitterOddRnd(t *testing.T) {
	p := mustParse(t, "ladder 10s jitter 20%", md)
	tests := []struct {
		name string
		rnd  func() float64
		want time.Duration
	}{
		{"nil rnd: no jitter", nil, 10 * time.Second},
		{"below 0 counts as 0", func() float64 { return -3 }, 8 * time.Second},
		{"NaN counts as 0", func() float64 { return math.NaN() }, 8 * time.Second},
		{"above 1 counts as 1", func() float64 { return 7 }, 12 * time.Second},
		{"+Inf counts as 1", func() float64 { return math.Inf(1) }, 12 * time.Second},
		{"0.5 is the middle", func() float64 { return 0.5 }, 10 * time.Second},
	}
	for _, tt := range tests {
		if d, _ := p.Next(0, tt.rnd); d != tt.want {
			t.Errorf("%s: Next = %v, want %v", tt.name, d, tt.want)
		}
	}
}

// Policies built by hand rather than parsed: Next must still be total.
func TestNextHandBuilt(t *testing.T) {
	half := func() float64 { return 0.5 }
	tests := []struct {
		name      string
		p         Policy
		attempt   int32
		want      time.Duration
		exhausted bool
		rnd       func() float64 // nil: half
	}{
		{"zero policy", Policy{}, 0, 0, true, nil},
		{"no kind, forever", Policy{Forever: true}, 3, 0, true, nil},
		{"ladder without steps", Policy{Kind: Ladder, Forever: true}, 0, 0, true, nil},
		{"ladder past its steps", Policy{Kind: Ladder, Steps: []time.Duration{time.Second}, MaxRetries: 5}, 4, time.Second, false, nil},
		{"factor 0 counts as 1", Policy{Kind: Exponential, Initial: time.Second, Forever: true}, 30, time.Second, false, nil},
		{"NaN factor counts as 1", Policy{Kind: Exponential, Initial: time.Second, Factor: math.NaN(), Forever: true}, 30, time.Second, false, nil},
		{"no MaxDelay, no cap", Policy{Kind: Exponential, Initial: time.Hour, Factor: 2, Forever: true}, math.MaxInt32, time.Duration(math.MaxInt64), false, nil},
		{"no MaxDelay, full jitter", Policy{Kind: Exponential, Initial: time.Hour, Factor: 2, Forever: true, Jitter: Jitter{Fraction: 1}}, math.MaxInt32, time.Duration(math.MaxInt64), false, nil},
		{"fraction above 1 never negative", Policy{Kind: Ladder, Steps: []time.Duration{time.Second}, Forever: true, Jitter: Jitter{Fraction: 3}}, 0, 0, false, func() float64 { return 0 }},
		{"negative step", Policy{Kind: Ladder, Steps: []time.Duration{-time.Second}, Forever: true}, 0, 0, false, nil},
		{"step above MaxDelay", Policy{Kind: Ladder, Steps: []time.Duration{time.Hour}, Forever: true, MaxDelay: time.Minute}, 0, time.Minute, false, nil},
	}
	for _, tt := range tests {
		rnd := tt.rnd
		if rnd == nil {
			rnd = half
		}
		d, exhausted := tt.p.Next(tt.attempt, rnd)
		if d != tt.want || exhausted != tt.exhausted {
			t.Errorf("%s: Next(%d) = %v, %v; want %v, %v", tt.name, tt.attempt, d, exhausted, tt.want, tt.exhausted)
		}
	}
}
