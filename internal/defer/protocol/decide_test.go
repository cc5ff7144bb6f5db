package protocol

import (
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/policy"
)

// testPolicies is the RETRY_POLICIES of the decision tests: a ladder with a
// dead-letter topic, an exponential that retries forever and releases keys,
// and, for every other target, the built-in default.
const testPolicies = `payments.*: ladder 1s,5s,30s dlq {target}.dlq;
	audit.*: exponential 1s x2 cap 1m forever jitter full release`

// testDecisionRules returns rules with testPolicies and a classifier for
// JSON parse errors and one validation class.
func testDecisionRules(t testing.TB) Rules {
	t.Helper()
	set, err := policy.Parse(testPolicies, 24*time.Hour)
	if err != nil {
		t.Fatalf("policy.Parse: %v", err)
	}
	cls, err := policy.ParseClassifier("*JsonParseException, com.acme.Validation?")
	if err != nil {
		t.Fatalf("policy.ParseClassifier: %v", err)
	}
	rules := testRules()
	rules.Targets = TargetPatterns{"orders.*", "payments.*", "audit.*"}
	rules.Policies, rules.Classifier = set, cls
	return rules
}

// fixedRand returns v on every draw.
func fixedRand(v float64) func() float64 { return func() float64 { return v } }

func TestDecide(t *testing.T) {
	rules := testDecisionRules(t)
	pay := func(s Schedule) Schedule { s.Target = "payments.card"; return s }
	const payDLQ = "payments.card.dlq"
	tests := []struct {
		name     string
		schedule Schedule
		rnd      float64 // every jitter draw
		want     Decision
		// reason: strings the park reason must contain, after its code.
		reason []string
	}{
		// Classification comes first, whatever the attempt and schedule.
		{
			name:     "permanent is parked",
			schedule: pay(Schedule{ErrorClass: "permanent", FromPolicy: true}),
			want:     Decision{Park: &ParkReason{Code: codePermanent}, DLQTopic: payDLQ},
			reason:   []string{`defer.error.class "permanent"`},
		},
		{
			name:     "permanent in any case, before exhaustion",
			schedule: pay(Schedule{ErrorClass: "PERMANENT", Attempt: 9, Delay: time.Second}),
			want:     Decision{Park: &ParkReason{Code: codePermanent}, DLQTopic: payDLQ},
			reason:   []string{`"PERMANENT"`},
		},
		{
			name:     "NON_RETRIABLE_ERRORS pattern",
			schedule: pay(Schedule{ErrorClass: "com.fasterxml.jackson.core.JsonParseException", FromPolicy: true}),
			want:     Decision{Park: &ParkReason{Code: codeNonRetriable}, DLQTopic: payDLQ},
			reason:   []string{`"com.fasterxml.jackson.core.JsonParseException"`, `"*JsonParseException"`},
		},
		{
			name:     "NON_RETRIABLE_ERRORS ? matches one character",
			schedule: Schedule{Target: "orders.created", ErrorClass: "com.acme.Validation2", Delay: time.Minute},
			want:     Decision{Park: &ParkReason{Code: codeNonRetriable}},
			reason:   []string{`"com.acme.Validation?"`},
		},
		{
			name:     "a class no pattern matches is retried",
			schedule: pay(Schedule{ErrorClass: "com.acme.Validation22", FromPolicy: true}),
			want:     Decision{Delay: time.Second, DLQTopic: payDLQ},
		},
		{
			name:     "transient is retried",
			schedule: pay(Schedule{ErrorClass: "transient", Attempt: 1, FromPolicy: true}),
			want:     Decision{Delay: 5 * time.Second, DLQTopic: payDLQ},
		},

		// A gated record was never tried: neither its class nor its
		// attempts can park it, and it takes no delay of the policy's.
		{
			name:     "gated with a permanent class is pending",
			schedule: pay(Schedule{ErrorClass: "permanent", Gated: true, FromPolicy: true}),
			want:     Decision{DLQTopic: payDLQ},
		},
		{
			name:     "gated past the retries is pending",
			schedule: pay(Schedule{Attempt: 9, Gated: true, FromPolicy: true}),
			want:     Decision{DLQTopic: payDLQ},
		},

		// The ladder: one step per retry, then exhausted.
		{
			name:     "ladder first step",
			schedule: pay(Schedule{FromPolicy: true}),
			want:     Decision{Delay: time.Second, DLQTopic: payDLQ},
		},
		{
			name:     "ladder last step: one retry left",
			schedule: pay(Schedule{Attempt: 2, FromPolicy: true}),
			want:     Decision{Delay: 30 * time.Second, DLQTopic: payDLQ},
		},
		{
			name:     "ladder exhausted at its length",
			schedule: pay(Schedule{Attempt: 3, FromPolicy: true}),
			want:     Decision{Park: &ParkReason{Code: codeExhausted}, DLQTopic: payDLQ},
			reason:   []string{"3 retries made", `"ladder 1s,5s,30s dlq {target}.dlq"`, "payments.card", "allows 3"},
		},
		{
			name:     "exhausted even with an explicit delay",
			schedule: pay(Schedule{Attempt: 4, Delay: time.Minute}),
			want:     Decision{Park: &ParkReason{Code: codeExhausted}, DLQTopic: payDLQ},
			reason:   []string{"4 retries made"},
		},
		{
			name:     "exhausted even with an explicit time",
			schedule: pay(Schedule{Attempt: 3, HasAt: true, At: testNow}),
			want:     Decision{Park: &ParkReason{Code: codeExhausted}, DLQTopic: payDLQ},
			reason:   []string{"3 retries made"},
		},

		// An explicit time wins over the policy's delay.
		{
			name:     "explicit delay: no policy delay",
			schedule: pay(Schedule{Attempt: 1, Delay: 7 * time.Second}),
			want:     Decision{DLQTopic: payDLQ},
		},
		{
			name:     "explicit zero delay: no policy delay",
			schedule: pay(Schedule{Attempt: 1}),
			want:     Decision{DLQTopic: payDLQ},
		},
		{
			name:     "explicit time: no policy delay",
			schedule: pay(Schedule{HasAt: true, At: testNow.Add(time.Hour)}),
			want:     Decision{DLQTopic: payDLQ},
		},

		// Forever, full jitter, release, no dead-letter topic.
		{
			name:     "forever never exhausts; full jitter of the cap",
			schedule: Schedule{Target: "audit.log", Attempt: 1_000_000, FromPolicy: true},
			rnd:      0.5,
			want:     Decision{Delay: 30 * time.Second, ReleaseKey: true},
		},
		{
			name:     "full jitter at its low end",
			schedule: Schedule{Target: "audit.log", Attempt: 3, FromPolicy: true},
			rnd:      0,
			want:     Decision{Delay: 0, ReleaseKey: true},
		},
		{
			name:     "a parked record releases its key under a release policy",
			schedule: Schedule{Target: "audit.log", ErrorClass: "permanent"},
			want:     Decision{Park: &ParkReason{Code: codePermanent}, ReleaseKey: true},
			reason:   []string{`"permanent"`},
		},

		// Targets no entry matches: the default, exponential 30s x2 cap 1h
		// jitter 20% max 10.
		{
			name:     "default policy, no jitter drawn at the middle",
			schedule: Schedule{Target: "orders.created", Attempt: 1, FromPolicy: true},
			rnd:      0.5,
			want:     Decision{Delay: time.Minute},
		},
		{
			name:     "default policy capped",
			schedule: Schedule{Target: "orders.created", Attempt: 9, FromPolicy: true},
			rnd:      0.5,
			want:     Decision{Delay: time.Hour},
		},
		{
			name:     "default policy exhausted at 10",
			schedule: Schedule{Target: "orders.created", Attempt: 10, FromPolicy: true},
			want:     Decision{Park: &ParkReason{Code: codeExhausted}},
			reason:   []string{"10 retries made", "allows 10", policy.DefaultPolicy},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := tt.schedule
			before := s
			got := Decide(&s, rules.Policies, rules.Classifier, fixedRand(tt.rnd))
			if !sameSchedule(s, before) {
				t.Errorf("decide changed the schedule: %+v, was %+v", s, before)
			}
			if got.Delay != tt.want.Delay || got.ReleaseKey != tt.want.ReleaseKey || got.DLQTopic != tt.want.DLQTopic {
				t.Errorf("Decision{Delay: %v, ReleaseKey: %v, DLQTopic: %q}, want {%v, %v, %q}",
					got.Delay, got.ReleaseKey, got.DLQTopic, tt.want.Delay, tt.want.ReleaseKey, tt.want.DLQTopic)
			}
			switch {
			case tt.want.Park == nil && got.Park != nil:
				t.Errorf("parked: %s; want pending", got.Park)
			case tt.want.Park != nil && got.Park == nil:
				t.Errorf("pending; want parked %s", tt.want.Park.Code)
			case tt.want.Park != nil:
				if got.Park.Code != tt.want.Park.Code {
					t.Errorf("park code %q, want %q (%s)", got.Park.Code, tt.want.Park.Code, got.Park)
				}
				if !strings.HasPrefix(got.Park.String(), tt.want.Park.Code+": ") {
					t.Errorf("reason %q does not start with %q", got.Park, tt.want.Park.Code+": ")
				}
				for _, w := range tt.reason {
					if !strings.Contains(got.Park.Detail, w) {
						t.Errorf("reason %q does not contain %q", got.Park, w)
					}
				}
			}
		})
	}
}

// Jittered policy delays stay within their bounds over the whole range of
// draws.
func TestDecideJitterBounds(t *testing.T) {
	rules := testDecisionRules(t)
	tests := []struct {
		target   string
		attempt  int32
		min, max time.Duration
	}{
		{"orders.created", 0, 24 * time.Second, 36 * time.Second}, // default: 30s +-20%
		{"orders.created", 2, 96 * time.Second, 144 * time.Second},
		{"audit.log", 2, 0, 4 * time.Second}, // full jitter of 4s
	}
	for _, tt := range tests {
		lo, hi := time.Duration(1<<62), time.Duration(-1)
		for _, r := range []float64{0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.999999} {
			s := Schedule{Target: tt.target, Attempt: tt.attempt, FromPolicy: true}
			d := Decide(&s, rules.Policies, rules.Classifier, fixedRand(r))
			if d.Park != nil {
				t.Fatalf("%s attempt %d parked: %s", tt.target, tt.attempt, d.Park)
			}
			lo, hi = min(lo, d.Delay), max(hi, d.Delay)
		}
		if lo < tt.min || hi > tt.max || lo == hi {
			t.Errorf("%s attempt %d: delays in [%v, %v], want within [%v, %v] and spread", tt.target, tt.attempt, lo, hi, tt.min, tt.max)
		}
	}
}

// prepare parses, then decides only for records Parse accepted: a rejected
// record gets no policy at all, so its row neither holds its key nor has a
// dead-letter topic.
func TestJudge(t *testing.T) {
	rules := testDecisionRules(t)
	tests := []struct {
		name       string
		rec        Record
		wantReject string
		want       Decision
		fromPolicy bool
	}{
		{
			name:       "no schedule: the policy's delay",
			rec:        Record{Key: []byte("k"), Headers: hs(HeaderTarget, "payments.card", HeaderAttempt, "1")},
			want:       Decision{Delay: 5 * time.Second, DLQTopic: "payments.card.dlq"},
			fromPolicy: true,
		},
		{
			name: "explicit delay",
			rec:  Record{Key: []byte("k"), Headers: hs(HeaderTarget, "payments.card", HeaderDelay, "2s", HeaderAttempt, "1")},
			want: Decision{DLQTopic: "payments.card.dlq"},
		},
		{
			name:       "rejected: no decision even though the policy has a dead-letter topic",
			rec:        Record{Key: []byte("k"), Headers: hs(HeaderTarget, "payments.card", HeaderDelay, "soon", HeaderErrorClass, "permanent")},
			wantReject: codeInvalidDelay,
		},
		{
			name:       "rejected: no decision for an exhausted record",
			rec:        Record{Key: []byte("k"), Headers: hs(HeaderTarget, "payments.card", HeaderAttempt, "9", HeaderRedriveCount, "x")},
			wantReject: codeInvalidRedriveCount,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var e struct {
				Schedule Schedule
				Decision Decision
				Reject   *RejectError
			}
			e.Schedule, e.Decision, e.Reject = Judge(tt.rec, rules, testNow, fixedRand(0.5))
			if tt.wantReject != "" {
				if e.Reject == nil || e.Reject.Code != tt.wantReject {
					t.Fatalf("Reject %v, want code %s", e.Reject, tt.wantReject)
				}
				if e.Decision != (Decision{}) {
					t.Errorf("rejected record decided %+v, want nothing", e.Decision)
				}
				return
			}
			if e.Reject != nil {
				t.Fatalf("rejected: %v", e.Reject)
			}
			if e.Decision != tt.want || e.Schedule.FromPolicy != tt.fromPolicy {
				t.Errorf("Decision %+v FromPolicy %v, want %+v, %v", e.Decision, e.Schedule.FromPolicy, tt.want, tt.fromPolicy)
			}
		})
	}
}

// A dead-letter topic that {target} makes longer than Kafka allows is
// dropped at ingest: the copy could never be published.
func TestDecideDropsIllegalDLQTopic(t *testing.T) {
	set, err := policy.Parse("*: ladder 1s dlq {target}.dlq", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		target, want string
	}{
		{"orders.retry", "orders.retry.dlq"},
		{strings.Repeat("t", 245), strings.Repeat("t", 245) + ".dlq"},
		{strings.Repeat("t", 246), ""},
	} {
		s := Schedule{Target: tc.target, FromPolicy: true}
		if got := Decide(&s, set, policy.Classifier{}, func() float64 { return 0 }).DLQTopic; got != tc.want {
			t.Errorf("target of %d bytes: DLQTopic = %q, want %q", len(tc.target), got, tc.want)
		}
	}
}
