package protocol

import (
	"errors"
	"fmt"
	"time"

	"github.com/deferq/scheduler/internal/policy"
	"github.com/deferq/scheduler/internal/reason"
)

// Reason codes of records parked at ingest, from package reason. Like the
// rejection codes they are metric label values and operators filter on them
// (split_part(reason, ':', 1)), so they never change.
const (
	// codePermanent: defer.error.class is "permanent".
	codePermanent = reason.Permanent
	// codeNonRetriable: defer.error.class matches NON_RETRIABLE_ERRORS.
	codeNonRetriable = reason.NonRetriable
	// codeExhausted: defer.attempt has reached the policy's maximum.
	codeExhausted = reason.Exhausted
)

// ParkReason says why a valid record goes straight to the parking lot.
type ParkReason struct {
	// Code is one of a few stable snake_case identifiers (permanent,
	// non_retriable, exhausted), fit for a metric label.
	Code string
	// Detail says what matched, for a human.
	Detail string
}

// String returns Code and Detail as "code: detail", the stored reason, of the
// same form as a rejection's.
func (r *ParkReason) String() string { return r.Code + ": " + r.Detail }

// Decision is what the retry rules make of a record that Parse accepted. Its
// zero value stores the record as pending at the time it asked for, holding
// its key if it is ever parked, with no dead-letter copy.
type Decision struct {
	// Park, when set, stores the record as parked with Park.String() as the
	// reason: it is kept and never sent until an operator acts.
	Park *ParkReason
	// Delay is the policy's delay, counted from ingest. It applies only when
	// the record names no time (Schedule.FromPolicy); defer.at and
	// defer.delay win over the policy.
	Delay time.Duration
	// ReleaseKey: once parked, now or later (by dispatch or an operator's
	// UPDATE), the message releases its business key rather than holding
	// it; the column park_holds_key is its negation.
	ReleaseKey bool
	// DLQTopic is the topic a copy of the message goes to when it is
	// parked; "" for none.
	DLQTopic string
}

// Decide applies the retry rules to s, a schedule Parse accepted. set is
// the resolved rules.Policies (never nil); cls is rules.Classifier; rnd
// draws the policy's jitter, uniform in [0, 1).
//
// A gated record (defer.gated) is pending at the time it asked for, or at
// once; it is never parked. Otherwise, in this order: an error class not
// worth retrying parks the record; else
// a record whose retries are exhausted under its target's policy is parked;
// else it is pending, at the time it asked for or, when it asked for none,
// after the policy's delay. Whatever the outcome, the policy's key and
// dead-letter settings are recorded, so that a later park by dispatch or by
// an operator follows the same policy.
func Decide(s *Schedule, set *policy.Set, cls policy.Classifier, rnd func() float64) Decision {
	p := set.For(s.Target)
	d := Decision{ReleaseKey: p.ReleaseKey, DLQTopic: p.DLQTopic(s.Target)}
	// "{target}.dlq" of a target near Kafka's 249-byte limit is no legal
	// topic; a copy could never be published, and retrying it forever helps
	// no one. The parked row is what matters, so it goes without a copy.
	if d.DLQTopic != "" && !ValidTopic(d.DLQTopic) {
		d.DLQTopic = ""
	}
	if s.Gated {
		// Not a failure: the consumer never tried the record. It waits
		// behind its key's blocking message, with no delay of its own
		// unless it asked for one, and no retry is counted against it.
		return d
	}
	if code, detail := cls.Classify(s.ErrorClass); code != "" {
		d.Park = &ParkReason{Code: code, Detail: detail}
		return d
	}
	if !p.Forever && s.Attempt >= p.MaxRetries {
		d.Park = &ParkReason{Code: codeExhausted, Detail: fmt.Sprintf(
			"%d retries made (%s); retry policy %q of %s allows %d",
			s.Attempt, HeaderAttempt, p.Text, s.Target, p.MaxRetries)}
		return d
	}
	if s.FromPolicy {
		delay, exhausted := p.Next(s.Attempt, rnd)
		if exhausted {
			// Next and MaxRetries agree on exhaustion; should a policy
			// ever disagree, parking is the side that loses nothing.
			d.Park = &ParkReason{Code: codeExhausted, Detail: fmt.Sprintf(
				"%d retries made (%s); retry policy %q of %s has no further delay", s.Attempt, HeaderAttempt, p.Text, s.Target)}
			return d
		}
		d.Delay = delay
	}
	return d
}

// Judge is what the scheduler makes of one record read from the defer
// topic: Parse, then the signature check (after Parse, so a record with
// several problems is rejected for the first in Parse's order), then, unless
// the record is rejected, the retry rules (Decide). rules.Policies must be
// set. A rejected record's schedule holds what Parse could read of it, and
// its decision is the zero value.
func Judge(rec Record, rules Rules, now time.Time, rnd func() float64) (Schedule, Decision, *RejectError) {
	sc, err := Parse(rec, rules, now)
	if err != nil {
		var rej *RejectError
		if !errors.As(err, &rej) {
			rej = &RejectError{Code: "invalid_record", Detail: err.Error()}
		}
		return sc, Decision{}, rej
	}
	if rej := rules.Signing.Check(rec, &sc); rej != nil {
		return sc, Decision{}, rej
	}
	return sc, Decide(&sc, rules.Policies, rules.Classifier, rnd), nil
}
