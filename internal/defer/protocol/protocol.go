// Package protocol is the wire protocol of the defer topic,
// scheduler.defer: the control headers a failing consumer adds to a record
// it forwards there (where and when to republish it, its business key, its
// attempt and error), their validation (Parse, with a stable reason code for
// each way a record can be wrong), and the signatures a producer can put on
// its records (Sign, Verify, Signing). See docs/design.md section 2 and the
// README's Protocol.
package protocol

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"path"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/deferq/scheduler/internal/policy"
	"github.com/deferq/scheduler/internal/reason"
)

// Control headers. Their values are UTF-8 text. Every other header, including
// the original.* headers written by producers, is carried through unchanged.
const (
	// HeaderTarget names the topic to republish to. Required.
	HeaderTarget = "defer.target"
	// HeaderAt is the RFC 3339 time to republish at. A time in the past
	// means now.
	HeaderAt = "defer.at"
	// HeaderDelay is the delay from when ingest read the record: a Go
	// duration ("1500ms", "1h30m") or a whole number of milliseconds
	// ("2500").
	HeaderDelay = "defer.delay"
	// HeaderKey is the business-process key that orders deliveries. When
	// absent the record key is used; when present and empty the record is
	// unordered.
	HeaderKey = "defer.key"
	// HeaderAttempt counts the attempts already made (0..2147483647).
	HeaderAttempt = "defer.attempt"
	// HeaderErrorClass and HeaderErrorMessage describe the failure, for
	// operators.
	HeaderErrorClass   = "defer.error.class"
	HeaderErrorMessage = "defer.error.message"
	// HeaderID and HeaderSeq are written by the scheduler on output; on
	// input they mark a re-deferral of a message it delivered before.
	HeaderID  = "defer.id"
	HeaderSeq = "defer.seq"
	// HeaderScheduledAt is written by the scheduler on output. On input it
	// is an ordinary header: a re-deferred record naturally carries it.
	HeaderScheduledAt = "defer.scheduled-at"
	// HeaderRedriveCount counts how many times operators replayed the
	// message's lineage out of the parking lot (0..2147483647, default 0).
	// The scheduler writes it on output; a re-deferral carries it back, so
	// that a message going round the parking lot again and again shows.
	HeaderRedriveCount = "defer.redrive-count"
	// HeaderSource names the producing service, for signatures: 1 to 128
	// of [A-Za-z0-9._-]. It is carried through to the output.
	HeaderSource = "defer.source"
	// HeaderSignature is the HMAC-SHA256 of the record under the key of its
	// defer.source, 64 lowercase hex digits (see Sign). The scheduler drops
	// it on output: the schedule headers it covers are rewritten there.
	HeaderSignature = "defer.signature"
	// HeaderGroup names the consumer group that handles the record when it
	// comes back (1 to 255 bytes of text): after the scheduler republished
	// the last message of its business key, it keeps the key blocked, for
	// that group's key-state queries, until the group's committed offset
	// passed the republished record (docs/design.md section 23). It is
	// carried through to the output.
	HeaderGroup = "defer.group"
	// HeaderGated, "true", marks a record a consumer did not try: its key
	// was blocked, and the consumer deferred it behind the blocking message
	// instead of handling it. It is not a failure: the row says gated, and
	// the consumer sends the attempt it had, not one more. It is dropped
	// on output.
	HeaderGated = "defer.gated"
)

// MaxGroupBytes is the longest defer.group a record may name: Kafka's own
// limit on a group id is the broker's, this keeps a stored one sane.
const MaxGroupBytes = 255

// Header is one Kafka record header, as on the wire.
type Header struct {
	Key, Value []byte
}

// Record is the part of a consumed Kafka record the protocol reads.
type Record struct {
	Key, Value []byte
	Headers    []Header
}

// TargetPatterns is the allow-list of topics a message may be republished to:
// path.Match globs such as "orders.*". Empty allows nothing.
//
// Kafka topic names cannot contain '/', so path.Match's special treatment of
// it never matters here.
type TargetPatterns []string

// ParseTargetPatterns parses the comma-separated TARGET_TOPICS value. Entries
// are trimmed of surrounding white space and empty entries are ignored, so a
// trailing comma is harmless. An error names the first malformed pattern and
// its 1-based position among the comma-separated entries, counting empty
// ones, so that it can be found by counting commas; it wraps
// path.ErrBadPattern.
func ParseTargetPatterns(s string) (TargetPatterns, error) {
	var p TargetPatterns
	pos := 0
	for e := range strings.SplitSeq(s, ",") {
		pos++
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		// path.Match checks the whole pattern even when the name does not
		// match, so matching against "" validates it.
		if _, err := path.Match(e, ""); err != nil {
			return nil, fmt.Errorf("target pattern %d %q: %w", pos, e, err)
		}
		p = append(p, e)
	}
	return p, nil
}

// Allows reports whether topic matches one of the patterns. A malformed
// pattern, possible only in a TargetPatterns not built by
// ParseTargetPatterns, matches nothing.
func (p TargetPatterns) Allows(topic string) bool {
	for _, pat := range p {
		if ok, err := path.Match(pat, topic); ok && err == nil {
			return true
		}
	}
	return false
}

// DefaultMaxKeyBytes is the business key limit used when Rules.MaxKeyBytes
// is not set. It keeps keys well below the ~2700-byte limit of a Postgres
// B-tree index entry.
const DefaultMaxKeyBytes = 1024

// Rules are the limits a record is validated against, and the retry rules
// that decide what becomes of a valid one.
type Rules struct {
	// Targets are the topics a record may be republished to.
	Targets TargetPatterns
	// MaxDelay is the longest a record may wait, counted from ingest. It
	// has no default: zero allows only immediate delivery.
	MaxDelay time.Duration
	// MaxKeyBytes limits the length of the business key as stored (after
	// Text). Zero or negative means DefaultMaxKeyBytes.
	MaxKeyBytes int
	// Policies are the retry policies (RETRY_POLICIES) by target: the delay
	// of a record that names no time, how many retries it gets, whether it
	// holds its key once parked and where its dead-letter copy goes. Parse
	// does not use them. Nil means the built-in default,
	// policy.Parse("", MaxDelay), which NewIngester resolves once.
	Policies *policy.Set
	// Classifier says which error classes (defer.error.class) are not worth
	// retrying: such records are parked at ingest. The zero value parks
	// only the class "permanent".
	Classifier policy.Classifier
	// Signing holds the signing keys of sources (SIGNING_KEYS): records of a
	// source with a key must be signed by it. Nil checks no signatures.
	Signing *Signing
}

// Schedule is what a valid record asks for.
type Schedule struct {
	Target      string
	BusinessKey string // valid when Ordered
	Ordered     bool
	HasAt       bool // At is set; else Delay is from ingest time
	// At is the requested time, in UTC. It may be in the past, meaning now.
	At           time.Time
	Delay        time.Duration
	Attempt      int32
	ErrorClass   string
	ErrorMessage string
	OriginID     int64 // defer.id of a re-deferral; 0 if none
	Seq          int64 // defer.seq of a re-deferral; 0 if none
	// FromPolicy: the record has neither defer.at nor defer.delay, so the
	// retry policy of Target picks the delay (HasAt is false, Delay 0).
	FromPolicy bool
	// RedriveCount is defer.redrive-count; 0 if absent.
	RedriveCount int32
	// Source is defer.source, the producing service whose key signs the
	// record; "" if absent.
	Source string
	// Group is defer.group, the consumer group whose committed offset
	// releases the key after the message is republished; "" if absent.
	Group string
	// Gated is defer.gated: the consumer did not try the record, it
	// deferred it behind a blocked key.
	Gated bool
}

// Rejection codes, from the one list of reason codes (package reason). They
// are metric label values and are queried by operators, so they never change.
const (
	codeInvalidEncoding     = reason.InvalidEncoding
	codeDuplicateHeader     = reason.DuplicateHeader
	codeMissingTarget       = reason.MissingTarget
	codeInvalidTarget       = reason.InvalidTarget
	codeTargetNotAllowed    = reason.TargetNotAllowed
	codeMissingSchedule     = reason.MissingSchedule
	codeConflictingSchedule = reason.ConflictingSchedule
	codeInvalidAt           = reason.InvalidAt
	codeInvalidDelay        = reason.InvalidDelay
	codeDelayTooLong        = reason.DelayTooLong
	codeKeyTooLong          = reason.KeyTooLong
	codeInvalidAttempt      = reason.InvalidAttempt
	codeInvalidID           = reason.InvalidID
	codeInvalidSeq          = reason.InvalidSeq
	codeInvalidRedriveCount = reason.InvalidRedriveCount
	codeInvalidSource       = reason.InvalidSource
	codeInvalidGroup        = reason.InvalidGroup
	codeInvalidGated        = reason.InvalidGated
)

// RejectError says why a record cannot be scheduled.
type RejectError struct {
	// Code is a short, stable snake_case identifier of the problem, fit for
	// a bounded metric label.
	Code string
	// Detail names the offending header and value, for a human. Values are
	// quoted and long ones truncated, so Detail is always storable text.
	Detail string
}

// Error returns Code and Detail as "code: detail"; this is the text stored
// as a rejected record's reason.
func (e *RejectError) Error() string {
	return e.Code + ": " + e.Detail
}

// control identifies a control header; it indexes per-header arrays in
// Parse, which avoids a map on the hot path.
type control int

const (
	ctlTarget control = iota
	ctlAt
	ctlDelay
	ctlKey
	ctlAttempt
	ctlErrorClass
	ctlErrorMessage
	ctlID
	ctlSeq
	ctlRedriveCount
	ctlSource
	ctlSignature
	ctlGroup
	ctlGated
	numControl
)

var controlNames = [numControl]string{
	ctlTarget:       HeaderTarget,
	ctlAt:           HeaderAt,
	ctlDelay:        HeaderDelay,
	ctlKey:          HeaderKey,
	ctlAttempt:      HeaderAttempt,
	ctlErrorClass:   HeaderErrorClass,
	ctlErrorMessage: HeaderErrorMessage,
	ctlID:           HeaderID,
	ctlSeq:          HeaderSeq,
	ctlRedriveCount: HeaderRedriveCount,
	ctlSource:       HeaderSource,
	ctlSignature:    HeaderSignature,
	ctlGroup:        HeaderGroup,
	ctlGated:        HeaderGated,
}

// controlOf returns the control header named key. HeaderScheduledAt is not
// one: on input it is an ordinary header.
func controlOf(key []byte) (control, bool) {
	switch string(key) { // does not allocate
	case HeaderTarget:
		return ctlTarget, true
	case HeaderAt:
		return ctlAt, true
	case HeaderDelay:
		return ctlDelay, true
	case HeaderKey:
		return ctlKey, true
	case HeaderAttempt:
		return ctlAttempt, true
	case HeaderErrorClass:
		return ctlErrorClass, true
	case HeaderErrorMessage:
		return ctlErrorMessage, true
	case HeaderID:
		return ctlID, true
	case HeaderSeq:
		return ctlSeq, true
	case HeaderRedriveCount:
		return ctlRedriveCount, true
	case HeaderSource:
		return ctlSource, true
	case HeaderSignature:
		return ctlSignature, true
	case HeaderGroup:
		return ctlGroup, true
	case HeaderGated:
		return ctlGated, true
	}
	return 0, false
}

// Parse validates rec against rules. now is the ingest time; it is used only
// to check defer.at against rules.MaxDelay.
//
// A record may have several problems; Parse reports the first in this order,
// which goes from the bytes of the record to its meaning:
//
//  1. invalid_encoding: the first header, in record order, whose key is not
//     text (valid UTF-8 without NUL; keys are stored as Postgres text) or
//     that is a control header whose value is not text. defer.key is
//     exempt: like a record key, a binary value is used in its Text form.
//  2. duplicate_header: the first control header, in record order, that
//     appears again.
//  3. defer.target: missing_target, invalid_target (not a legal Kafka topic
//     name), target_not_allowed (not in rules.Targets).
//  4. defer.at and defer.delay: conflicting_schedule (both), then
//     invalid_at, invalid_delay (unparsable, negative or overflowing) and
//     delay_too_long (longer than rules.MaxDelay from now). Neither is not
//     a problem: the Schedule says FromPolicy, and the retry policy picks
//     the delay after Parse (the code missing_schedule is no longer used).
//  5. business key: key_too_long.
//  6. invalid_attempt, invalid_id, invalid_seq, invalid_redrive_count, in
//     that order.
//  7. invalid_source: defer.source is not 1 to 128 of [A-Za-z0-9._-].
//  8. invalid_group: defer.group is empty or longer than MaxGroupBytes;
//     invalid_gated: defer.gated is not "true" or "false".
//
// Parse only validates: rules.Policies, rules.Classifier and rules.Signing
// play no part in it. Signatures are checked after Parse accepted a record
// (see Signing), so their codes come after these.
//
// On rejection Parse returns a *RejectError and, still, the Schedule filled
// in as far as the record could be parsed, so that the rejected row stays
// useful to an operator: each field whose header is present and valid on its
// own is set. When a control header is duplicated, its first occurrence is
// used. A business key that is too long is left out, since storing it is what
// the limit prevents.
func Parse(rec Record, rules Rules, now time.Time) (Schedule, error) {
	var (
		s     Schedule
		rej   rejection
		val   [numControl][]byte // first occurrence
		count [numControl]int
		text  [numControl]bool // first occurrence is text
		dup   control          = -1
	)
	for i := range rec.Headers {
		h := &rec.Headers[i]
		if p := textProblem(h.Key); p != "" {
			rej.addf(codeInvalidEncoding, "header key %s %s", quote(h.Key), p)
			continue
		}
		c, ok := controlOf(h.Key)
		if !ok {
			continue
		}
		count[c]++
		p := textProblem(h.Value)
		if count[c] == 1 {
			val[c], text[c] = h.Value, p == ""
		} else if dup < 0 {
			dup = c
		}
		if p != "" && c != ctlKey {
			rej.addf(codeInvalidEncoding, "%s value %s %s", controlNames[c], quote(h.Value), p)
		}
	}
	if dup >= 0 {
		rej.addf(codeDuplicateHeader, "%s appears %d times", controlNames[dup], count[dup])
	}

	// Below, a control header present with a value that is not text has
	// already been rejected above, so it is only left out of s.

	switch {
	case count[ctlTarget] == 0:
		rej.addf(codeMissingTarget, "%s is absent", HeaderTarget)
	case text[ctlTarget]:
		s.Target = string(val[ctlTarget])
		switch {
		case !ValidTopic(s.Target):
			rej.addf(codeInvalidTarget, "%s %s is not a legal Kafka topic name (1 to 249 of [a-zA-Z0-9._-], not \".\" or \"..\")",
				HeaderTarget, quote(val[ctlTarget]))
		case !rules.Targets.Allows(s.Target):
			rej.addf(codeTargetNotAllowed, "%s %s matches no allowed target pattern (TARGET_TOPICS)",
				HeaderTarget, quote(val[ctlTarget]))
		}
	}

	hasAt, hasDelay := count[ctlAt] > 0, count[ctlDelay] > 0
	switch {
	case !hasAt && !hasDelay:
		s.FromPolicy = true
	case hasAt && hasDelay:
		rej.addf(codeConflictingSchedule, "both %s %s and %s %s are present; send one",
			HeaderAt, quote(val[ctlAt]), HeaderDelay, quote(val[ctlDelay]))
	}
	if hasAt && text[ctlAt] {
		at, problem := parseRFC3339(val[ctlAt])
		if problem != "" {
			rej.addf(codeInvalidAt, "%s %s is not an RFC 3339 time: %s", HeaderAt, quote(val[ctlAt]), problem)
		} else {
			s.HasAt, s.At = true, at
			// Sub saturates, so a far-off time cannot wrap around.
			if d := at.Sub(now); d > rules.MaxDelay {
				rej.addf(codeDelayTooLong, "%s %s is %v after ingest, more than the maximum delay %v",
					HeaderAt, quote(val[ctlAt]), d, rules.MaxDelay)
			}
		}
	}
	if hasDelay && text[ctlDelay] {
		d, problem := parseDelay(val[ctlDelay])
		if problem != "" {
			rej.addf(codeInvalidDelay, "%s %s %s", HeaderDelay, quote(val[ctlDelay]), problem)
		} else {
			s.Delay = d
			if d > rules.MaxDelay {
				rej.addf(codeDelayTooLong, "%s %s is more than the maximum delay %v",
					HeaderDelay, quote(val[ctlDelay]), rules.MaxDelay)
			}
		}
	}

	maxKey := rules.MaxKeyBytes
	if maxKey <= 0 {
		maxKey = DefaultMaxKeyBytes
	}
	key, keySource := rec.Key, "record key"
	if count[ctlKey] > 0 {
		key, keySource = val[ctlKey], HeaderKey
	}
	// An empty key means unordered, whichever its source: an absent record
	// key, or a defer.key that says so explicitly.
	if len(key) > 0 {
		// Measure before converting, so an oversized key is never copied.
		if n := textLen(key); n > maxKey {
			rej.addf(codeKeyTooLong, "%s %s is %d bytes as a business key, more than the limit of %d",
				keySource, quote(key), n, maxKey)
		} else {
			s.BusinessKey, s.Ordered = Text(key), true
		}
	}

	if count[ctlAttempt] > 0 && text[ctlAttempt] {
		if n, ok := parseDecimal(val[ctlAttempt], math.MaxInt32); ok {
			s.Attempt = int32(n)
		} else {
			rej.addf(codeInvalidAttempt, "%s %s is not a decimal integer in 0..%d",
				HeaderAttempt, quote(val[ctlAttempt]), math.MaxInt32)
		}
	}
	if count[ctlErrorClass] > 0 && text[ctlErrorClass] {
		s.ErrorClass = string(val[ctlErrorClass])
	}
	if count[ctlErrorMessage] > 0 && text[ctlErrorMessage] {
		s.ErrorMessage = string(val[ctlErrorMessage])
	}
	if count[ctlID] > 0 && text[ctlID] {
		if n, ok := parseDecimal(val[ctlID], math.MaxInt64); ok && n > 0 {
			s.OriginID = n
		} else {
			rej.addf(codeInvalidID, "%s %s is not a positive decimal int64", HeaderID, quote(val[ctlID]))
		}
	}
	if count[ctlSeq] > 0 && text[ctlSeq] {
		if n, ok := parseDecimal(val[ctlSeq], math.MaxInt64); ok && n > 0 {
			s.Seq = n
		} else {
			rej.addf(codeInvalidSeq, "%s %s is not a positive decimal int64", HeaderSeq, quote(val[ctlSeq]))
		}
	}
	if count[ctlRedriveCount] > 0 && text[ctlRedriveCount] {
		if n, ok := parseDecimal(val[ctlRedriveCount], math.MaxInt32); ok {
			s.RedriveCount = int32(n)
		} else {
			rej.addf(codeInvalidRedriveCount, "%s %s is not a decimal integer in 0..%d",
				HeaderRedriveCount, quote(val[ctlRedriveCount]), math.MaxInt32)
		}
	}

	if count[ctlSource] > 0 && text[ctlSource] {
		if ValidSource(val[ctlSource]) {
			s.Source = string(val[ctlSource])
		} else {
			rej.addf(codeInvalidSource, "%s %s is not 1 to %d of [A-Za-z0-9._-]",
				HeaderSource, quote(val[ctlSource]), MaxSourceBytes)
		}
	}

	if count[ctlGroup] > 0 && text[ctlGroup] {
		if n := len(val[ctlGroup]); n > 0 && n <= MaxGroupBytes {
			s.Group = string(val[ctlGroup])
		} else {
			rej.addf(codeInvalidGroup, "%s %s is not 1 to %d bytes", HeaderGroup, quote(val[ctlGroup]), MaxGroupBytes)
		}
	}
	if count[ctlGated] > 0 && text[ctlGated] {
		switch string(val[ctlGated]) {
		case "true":
			s.Gated = true
		case "false":
		default:
			rej.addf(codeInvalidGated, "%s %s is not true or false", HeaderGated, quote(val[ctlGated]))
		}
	}

	if rej.err != nil {
		return s, rej.err
	}
	return s, nil
}

// rejection keeps the first problem found. Parse carries on past a problem to
// fill in the Schedule, so later problems must not overwrite the first.
type rejection struct {
	err *RejectError
}

func (r *rejection) addf(code, format string, args ...any) {
	if r.err == nil {
		r.err = &RejectError{Code: code, Detail: fmt.Sprintf(format, args...)}
	}
}

// Text returns b as a Postgres-storable string: b itself if it is valid UTF-8
// without NUL bytes, else `\x` followed by lowercase hex of b (Postgres bytea
// hex notation). It is used for business keys taken from binary record keys
// and for header keys that are not text.
//
// The two forms can collide: the text `\xff` and the single byte 0xff give
// the same string. Producers that mix text and binary keys of that shape
// should set defer.key.
func Text(b []byte) string {
	if isText(b) {
		return string(b)
	}
	const digits = "0123456789abcdef"
	var sb strings.Builder
	sb.Grow(textLen(b))
	sb.WriteString(`\x`)
	for _, c := range b {
		sb.WriteByte(digits[c>>4])
		sb.WriteByte(digits[c&0x0f])
	}
	return sb.String()
}

// textLen returns len(Text(b)) without building it.
func textLen(b []byte) int {
	if isText(b) {
		return len(b)
	}
	return 2 + 2*len(b)
}

// isText reports whether b can be stored as Postgres text: valid UTF-8
// without NUL bytes, which Postgres rejects even though UTF-8 allows them.
func isText(b []byte) bool {
	return textProblem(b) == ""
}

// textProblem says why b is not text, or returns "" if it is. When b has both
// problems, either may be reported.
//
// It is called for every header key and control value, and is most of the
// cost of Parse. Those are nearly all short ASCII, so it skips ASCII without
// NUL eight bytes at a time itself rather than calling utf8.Valid and
// bytes.IndexByte, whose set-up costs more than the work.
func textProblem(b []byte) string {
	const lo, hi = 0x0101010101010101, 0x8080808080808080
	i := 0
	for ; i+8 <= len(b); i += 8 {
		// A byte with its top bit set is not ASCII; a zero byte borrows in
		// the subtraction and so sets its top bit. Other bytes can set it
		// too, by a borrow from a zero below them, but a false alarm only
		// sends the word to the exact loop below.
		if x := binary.LittleEndian.Uint64(b[i:]); (x|(x-lo))&hi != 0 {
			break
		}
	}
	for ; i < len(b); i++ {
		switch c := b[i]; {
		case c == 0:
			return "contains a NUL byte"
		case c >= utf8.RuneSelf:
			rest := b[i:]
			if !utf8.Valid(rest) {
				return "is not valid UTF-8"
			}
			if bytes.IndexByte(rest, 0) >= 0 {
				return "contains a NUL byte"
			}
			return ""
		}
	}
	return ""
}

// ValidTopic reports whether name is a legal Kafka topic name: 1 to 249
// characters of [a-zA-Z0-9._-], not "." or "..".
func ValidTopic(name string) bool {
	if len(name) == 0 || len(name) > 249 || name == "." || name == ".." {
		return false
	}
	for i := 0; i < len(name); i++ {
		switch c := name[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9',
			c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// maxQuoted is how much of a value a Detail quotes: enough to recognise it,
// little enough to keep reasons short whatever a producer sends.
const maxQuoted = 64

// quote returns b quoted with %q, truncated to about maxQuoted bytes. The
// result is valid UTF-8 without NUL bytes whatever b holds, since %q escapes
// both.
func quote(b []byte) string {
	if len(b) <= maxQuoted {
		return fmt.Sprintf("%q", b)
	}
	// Cut at a rune boundary so that a multi-byte character is not shown
	// as escaped garbage.
	n := maxQuoted
	for n > maxQuoted-utf8.UTFMax && !utf8.RuneStart(b[n]) {
		n--
	}
	return fmt.Sprintf("%q... (%d bytes)", b[:n], len(b))
}

// parseDecimal parses b as a decimal integer in 0..limit. Only ASCII digits
// are accepted: no sign, no space, no underscores, not empty.
func parseDecimal(b []byte, limit int64) (int64, bool) {
	if len(b) == 0 {
		return 0, false
	}
	var n int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		d := int64(c - '0')
		if n > (limit-d)/10 {
			return 0, false
		}
		n = n*10 + d
	}
	return n, true
}

// parseDelay parses a defer.delay value. It returns the problem, as a phrase
// to follow the quoted value, or "".
func parseDelay(b []byte) (time.Duration, string) {
	if len(b) > 0 && isDigits(b) {
		ms, ok := parseDecimal(b, math.MaxInt64/int64(time.Millisecond))
		if !ok {
			return 0, "overflows a duration (about 292 years)"
		}
		return time.Duration(ms) * time.Millisecond, ""
	}
	if d, ok := parseSimpleDuration(b); ok {
		return d, ""
	}
	d, err := time.ParseDuration(string(b))
	if err != nil {
		// ParseDuration does not say whether the syntax was wrong or the
		// value overflowed, so neither can we.
		return 0, "is neither a Go duration (such as 1500ms or 1h30m) within about 292 years nor whole milliseconds"
	}
	if d < 0 {
		return 0, "is negative"
	}
	return d, ""
}

// parseSimpleDuration parses the common form of a Go duration, a count and
// one ASCII unit such as "30s" or "1500ms", exactly as time.ParseDuration
// would. It exists because ParseDuration takes a string, and converting the
// header value costs an allocation per record. Anything else, including
// values that overflow, is left to ParseDuration.
func parseSimpleDuration(b []byte) (time.Duration, bool) {
	i := 0
	for i < len(b) && '0' <= b[i] && b[i] <= '9' {
		i++
	}
	if i == 0 {
		return 0, false
	}
	var unit time.Duration
	switch string(b[i:]) { // does not allocate
	case "ns":
		unit = time.Nanosecond
	case "us":
		unit = time.Microsecond
	case "ms":
		unit = time.Millisecond
	case "s":
		unit = time.Second
	case "m":
		unit = time.Minute
	case "h":
		unit = time.Hour
	default:
		return 0, false
	}
	n, ok := parseDecimal(b[:i], math.MaxInt64/int64(unit))
	if !ok {
		return 0, false
	}
	return time.Duration(n) * unit, true
}

func isDigits(b []byte) bool {
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// parseRFC3339 parses b as an RFC 3339 date-time (section 5.6):
//
//	2006-01-02T15:04:05[.fraction](Z|+07:00|-07:00)
//
// with any number of fractional digits, truncated to nanoseconds, and 'T'
// and 'Z' in either case as the RFC allows. Leap seconds (:60) are rejected
// because time.Time cannot represent them. The result is in UTC. It returns
// the problem, or "".
//
// time.Parse would do, but it allocates a string and, for most offsets, a
// Location on every call, and its fallback parser accepts forms RFC 3339
// does not, such as "," before the fraction and offset hour 24.
func parseRFC3339(b []byte) (time.Time, string) {
	const form = "not of the form 2006-01-02T15:04:05[.999999999](Z|±07:00)"
	if len(b) < len("2006-01-02T15:04:05Z") ||
		b[4] != '-' || b[7] != '-' || (b[10] != 'T' && b[10] != 't') || b[13] != ':' || b[16] != ':' {
		return time.Time{}, form
	}
	year, ok1 := digits(b[0:4])
	month, ok2 := digits(b[5:7])
	day, ok3 := digits(b[8:10])
	hour, ok4 := digits(b[11:13])
	minute, ok5 := digits(b[14:16])
	sec, ok6 := digits(b[17:19])
	if !(ok1 && ok2 && ok3 && ok4 && ok5 && ok6) {
		return time.Time{}, form
	}

	rest := b[19:]
	nsec := 0
	if rest[0] == '.' {
		n := 1
		for n < len(rest) && '0' <= rest[n] && rest[n] <= '9' {
			if n <= 9 {
				nsec = nsec*10 + int(rest[n]-'0')
			}
			n++
		}
		if n == 1 {
			return time.Time{}, form
		}
		for i := n; i <= 9; i++ {
			nsec *= 10
		}
		rest = rest[n:]
	}

	var offset int // seconds east of UTC
	switch {
	case len(rest) == 1 && (rest[0] == 'Z' || rest[0] == 'z'):
	case len(rest) == len("+07:00") && (rest[0] == '+' || rest[0] == '-') && rest[3] == ':':
		oh, ok1 := digits(rest[1:3])
		om, ok2 := digits(rest[4:6])
		if !ok1 || !ok2 {
			return time.Time{}, form
		}
		if oh > 23 || om > 59 {
			return time.Time{}, "offset out of range"
		}
		offset = (oh*60 + om) * 60
		if rest[0] == '-' {
			offset = -offset
		}
	default:
		return time.Time{}, form
	}

	switch {
	case month < 1 || month > 12:
		return time.Time{}, "month out of range"
	case day < 1 || day > daysIn(month, year):
		return time.Time{}, "day out of range"
	case hour > 23:
		return time.Time{}, "hour out of range"
	case minute > 59:
		return time.Time{}, "minute out of range"
	case sec == 60:
		return time.Time{}, "leap seconds are not supported"
	case sec > 59:
		return time.Time{}, "second out of range"
	}
	t := time.Date(year, time.Month(month), day, hour, minute, sec, nsec, time.UTC)
	return t.Add(-time.Duration(offset) * time.Second), ""
}

// digits parses b, which is short, as ASCII decimal digits.
func digits(b []byte) (int, bool) {
	n := 0
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}

// daysIn returns the number of days in month of year, in the proleptic
// Gregorian calendar that RFC 3339 uses.
func daysIn(month, year int) int {
	switch month {
	case 2:
		if year%4 == 0 && (year%100 != 0 || year%400 == 0) {
			return 29
		}
		return 28
	case 4, 6, 9, 11:
		return 30
	}
	return 31
}
