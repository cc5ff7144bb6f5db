// Package reason is the one list of reason codes: why a message is parked or
// rejected. Every producer of a reason (ingest's rejections and parks,
// dispatch's parks, the operator's park) takes its code from here, so that
// the stored reason (deferred_message.reason and deferred_attempt.reason,
// "code: detail"), the metric labels (reason, kind), the filters
// (`scheduler ls --reason`, `replay --reason`, split_part(reason, ':', 1) in
// the runbook) and the README's table all say the same word.
//
// Codes are metric label values and operators query them, so they never
// change once released; add new ones instead. A code no longer produced
// stays in the list, so that old rows remain explained.
package reason

import "strings"

// Rejection codes: ingest stored the record as rejected, because it cannot
// be scheduled as it is.
const (
	InvalidEncoding     = "invalid_encoding"
	DuplicateHeader     = "duplicate_header"
	MissingTarget       = "missing_target"
	InvalidTarget       = "invalid_target"
	TargetNotAllowed    = "target_not_allowed"
	MissingSchedule     = "missing_schedule" // no longer produced: the retry policy picks the delay
	ConflictingSchedule = "conflicting_schedule"
	InvalidAt           = "invalid_at"
	InvalidDelay        = "invalid_delay"
	DelayTooLong        = "delay_too_long"
	KeyTooLong          = "key_too_long"
	InvalidAttempt      = "invalid_attempt"
	InvalidID           = "invalid_id"
	InvalidSeq          = "invalid_seq"
	InvalidRedriveCount = "invalid_redrive_count"
	InvalidSource       = "invalid_source"
	InvalidGroup        = "invalid_group"
	InvalidGated        = "invalid_gated"
	// Signature checks (SIGNING_KEYS), made after all of the above.
	SignatureWithoutSource = "signature_without_source"
	SignatureMissing       = "signature_missing"
	UnknownSource          = "unknown_source"
	SignatureInvalid       = "signature_invalid"
	// StoreFailed: the database refused the record's row; the detail is its
	// error.
	StoreFailed = "store_failed"
)

// Codes of records ingest parks by their retry policy.
const (
	// Permanent: defer.error.class is "permanent".
	Permanent = "permanent"
	// NonRetriable: defer.error.class matches NON_RETRIABLE_ERRORS.
	NonRetriable = "non_retriable"
	// Exhausted: defer.attempt reached the policy's maximum.
	Exhausted = "exhausted"
)

// Codes of messages dispatch parks because the broker refused them for good
// (also the kind label of the publish error metrics), or because their
// target may not be published to (InvalidTarget, TargetNotAllowed: the same
// codes as ingest's rejections).
const (
	UnknownTopic  = "unknown_topic"
	InvalidTopic  = "invalid_topic"
	NotAuthorized = "not_authorized"
	TooLarge      = "too_large"
	InvalidRecord = "invalid_record"
)

// Operator is the code of a message an operator parked (park_id.sql,
// `scheduler park`): "operator: <why>".
const Operator = "operator"

// Format returns the stored form of a reason: "code: detail", or the code
// alone when there is no detail.
func Format(code, detail string) string {
	if detail == "" {
		return code
	}
	return code + ": " + detail
}

// Code returns the code of a stored reason, the part before the first colon,
// as the runbook's split_part(reason, ':', 1) does.
func Code(reason string) string {
	code, _, _ := strings.Cut(reason, ":")
	return code
}

// Info describes one code for the README's table and `--help`.
type Info struct {
	Code  string // the code
	SetBy string // who sets it
	Means string // what it means
	Do    string // what an operator does about it
}

// All returns every code, in the README table's order.
func All() []Info {
	const rej = "ingest (rejected)"
	const fixRow = "fix the producer; fix the row in SQL and replay with --state rejected, or cancel it"
	return []Info{
		{MissingTarget, rej, "no defer.target header", fixRow},
		{InvalidTarget, "ingest (rejected), dispatch (parked)", "defer.target is not a legal Kafka topic name", fixRow},
		{TargetNotAllowed, "ingest (rejected), dispatch (parked)", "the target is not in TARGET_TOPICS", "add the topic to TARGET_TOPICS and restart, then replay"},
		{InvalidEncoding, rej, "a header key or control value is not valid UTF-8", fixRow},
		{DuplicateHeader, rej, "a control header appears more than once", fixRow},
		{ConflictingSchedule, rej, "both defer.at and defer.delay", fixRow},
		{InvalidAt, rej, "defer.at is not an RFC 3339 time", fixRow},
		{InvalidDelay, rej, "defer.delay is not a positive Go duration", fixRow},
		{DelayTooLong, rej, "the due time is beyond MAX_DELAY", fixRow},
		{KeyTooLong, rej, "defer.key is longer than allowed", fixRow},
		{InvalidAttempt, rej, "defer.attempt is not a non-negative integer", fixRow},
		{InvalidID, rej, "defer.id is not a positive integer", fixRow},
		{InvalidSeq, rej, "defer.seq is not a positive integer", fixRow},
		{InvalidRedriveCount, rej, "defer.redrive-count is not a non-negative integer", fixRow},
		{InvalidSource, rej, "a defer.source-* header is malformed", fixRow},
		{InvalidGroup, rej, "defer.group is empty or too long", fixRow},
		{InvalidGated, rej, "defer.gated is not true or false", fixRow},
		{SignatureWithoutSource, rej, "defer.signature without defer.source", fixRow},
		{SignatureMissing, rej, "SIGNING_KEYS requires a signature and the record has none", "sign the producer's records (deferclient), then replay with --state rejected"},
		{UnknownSource, rej, "defer.source names no key of SIGNING_KEYS", "add the source's key to SIGNING_KEYS, or fix the producer"},
		{SignatureInvalid, rej, "the signature does not match the record", "find who altered or forged the record; cancel it"},
		{StoreFailed, rej, "the database refused the row; the detail is its error", "read the error; fix the row in SQL and replay with --state rejected, or cancel it"},
		{MissingSchedule, rej, "no schedule (no longer produced: the retry policy picks the delay)", "replay with --state rejected"},
		{Exhausted, "ingest (parked)", "defer.attempt reached the retry policy's maximum", "fix the consumer's cause, then replay (--reset-attempts to start the policy over)"},
		{Permanent, "ingest (parked)", "the consumer gave defer.error.class permanent", "fix the data or the consumer, then replay, or cancel"},
		{NonRetriable, "ingest (parked)", "defer.error.class matches NON_RETRIABLE_ERRORS", "fix the data or the consumer, then replay, or cancel"},
		{UnknownTopic, "dispatch (parked)", "the broker has no such target topic", "create the topic, then replay"},
		{NotAuthorized, "dispatch (parked)", "the scheduler may not write to the target topic", "grant the ACL, then replay"},
		{TooLarge, "dispatch (parked)", "the record exceeds KAFKA_MAX_MESSAGE_BYTES or the topic's max.message.bytes", "raise the limit, then replay; or cancel"},
		{InvalidTopic, "dispatch (parked)", "the broker calls the target topic invalid", "fix the target in SQL, then replay; or cancel"},
		{InvalidRecord, "dispatch (parked)", "the broker or client refused the record itself (policy violation, encoding)", "read the detail; replay once fixed, or cancel"},
		{Operator, "an operator (scheduler park, park_id.sql)", "parked by hand; the detail says why", "replay when the reason is over, or cancel"},
	}
}

// Known reports whether code is in the list.
func Known(code string) bool {
	for _, i := range All() {
		if i.Code == code {
			return true
		}
	}
	return false
}
