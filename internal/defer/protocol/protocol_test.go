package protocol

import (
	"bytes"
	"errors"
	"math"
	"path"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// testNow is the ingest time of every test record.
var testNow = time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC)

func testRules() Rules {
	return Rules{
		Targets:  TargetPatterns{"orders.*", "payments"},
		MaxDelay: 24 * time.Hour,
	}
}

// hs builds headers from key, value pairs.
func hs(kv ...string) []Header {
	var h []Header
	for i := 0; i+1 < len(kv); i += 2 {
		h = append(h, Header{Key: []byte(kv[i]), Value: []byte(kv[i+1])})
	}
	return h
}

// base is the smallest valid set of control headers; rows append to it.
func base(kv ...string) []Header {
	return hs(append([]string{HeaderTarget, "orders.created", HeaderDelay, "30s"}, kv...)...)
}

func TestParse(t *testing.T) {
	ordered := func(s Schedule, key string) Schedule {
		s.BusinessKey, s.Ordered = key, true
		return s
	}
	delayed := Schedule{Target: "orders.created", Delay: 30 * time.Second}
	at := func(t time.Time) Schedule {
		return Schedule{Target: "orders.created", HasAt: true, At: t}
	}
	withRules := func(f func(*Rules)) *Rules {
		r := testRules()
		f(&r)
		return &r
	}
	long := strings.Repeat("k", DefaultMaxKeyBytes+1)

	tests := []struct {
		name  string
		rec   Record
		rules *Rules // nil means testRules()
		want  Schedule
		// For a rejection: the code, and strings Detail must contain. The
		// first always names the header.
		code   string
		detail []string
	}{
		// Accepted: schedules.
		{name: "delay Go duration", rec: Record{Headers: base()}, want: delayed},
		{
			name: "delay 1500ms",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "1500ms")},
			want: Schedule{Target: "orders.created", Delay: 1500 * time.Millisecond},
		},
		{
			name: "delay 1h30m",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "1h30m")},
			want: Schedule{Target: "orders.created", Delay: 90 * time.Minute},
		},
		{
			name: "delay zero",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "0")},
			want: Schedule{Target: "orders.created"},
		},
		{
			name: "delay whole milliseconds",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "2500")},
			want: Schedule{Target: "orders.created", Delay: 2500 * time.Millisecond},
		},
		{
			name: "delay milliseconds with leading zeros",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "0002500")},
			want: Schedule{Target: "orders.created", Delay: 2500 * time.Millisecond},
		},
		{
			name: "delay exactly the maximum",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "24h")},
			want: Schedule{Target: "orders.created", Delay: 24 * time.Hour},
		},
		{
			name: "at UTC",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T13:00:00Z")},
			want: at(time.Date(2026, 6, 1, 13, 0, 0, 0, time.UTC)),
		},
		{
			name: "at fractional seconds",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T13:00:00.123456789Z")},
			want: at(time.Date(2026, 6, 1, 13, 0, 0, 123456789, time.UTC)),
		},
		{
			name: "at fraction shorter than nanoseconds",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T13:00:00.5Z")},
			want: at(time.Date(2026, 6, 1, 13, 0, 0, 5e8, time.UTC)),
		},
		{
			name: "at fraction beyond nanoseconds is truncated",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T13:00:00.1234567899Z")},
			want: at(time.Date(2026, 6, 1, 13, 0, 0, 123456789, time.UTC)),
		},
		{
			name: "at offset +05:30",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T18:30:00+05:30")},
			want: at(time.Date(2026, 6, 1, 13, 0, 0, 0, time.UTC)),
		},
		{
			name: "at offset -07:00",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T06:00:00-07:00")},
			want: at(time.Date(2026, 6, 1, 13, 0, 0, 0, time.UTC)),
		},
		{
			name: "at offset -00:00",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T13:00:00-00:00")},
			want: at(time.Date(2026, 6, 1, 13, 0, 0, 0, time.UTC)),
		},
		{
			name: "at lower-case t and z",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01t13:00:00z")},
			want: at(time.Date(2026, 6, 1, 13, 0, 0, 0, time.UTC)),
		},
		{
			name:  "at leap day",
			rec:   Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2028-02-29T00:00:00Z")},
			rules: withRules(func(r *Rules) { r.MaxDelay = 3 * 365 * 24 * time.Hour }),
			want:  at(time.Date(2028, 2, 29, 0, 0, 0, 0, time.UTC)),
		},
		{
			name: "at in the past is kept as is",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2020-01-01T00:00:00Z")},
			want: at(time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC)),
		},
		{
			name: "at exactly the maximum delay",
			rec:  Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-02T12:00:00Z")},
			want: at(time.Date(2026, 6, 2, 12, 0, 0, 0, time.UTC)),
		},
		{
			name: "target matching an exact pattern",
			rec:  Record{Headers: hs(HeaderTarget, "payments", HeaderDelay, "30s")},
			want: Schedule{Target: "payments", Delay: 30 * time.Second},
		},

		// Accepted: business keys.
		{name: "no key is unordered", rec: Record{Headers: base()}, want: delayed},
		{name: "empty record key is unordered", rec: Record{Key: []byte{}, Headers: base()}, want: delayed},
		{name: "record key", rec: Record{Key: []byte("order-1"), Headers: base()}, want: ordered(delayed, "order-1")},
		{
			name: "binary record key in hex",
			rec:  Record{Key: []byte("\xff\x00\x01"), Headers: base()},
			want: ordered(delayed, `\xff0001`),
		},
		{
			name: "record key with NUL in hex",
			rec:  Record{Key: []byte("a\x00"), Headers: base()},
			want: ordered(delayed, `\x6100`),
		},
		{
			name: "defer.key overrides record key",
			rec:  Record{Key: []byte("order-1"), Headers: base(HeaderKey, "customer-7")},
			want: ordered(delayed, "customer-7"),
		},
		{
			name: "empty defer.key is unordered despite record key",
			rec:  Record{Key: []byte("order-1"), Headers: base(HeaderKey, "")},
			want: delayed,
		},
		{
			name: "null defer.key is unordered despite record key",
			rec: Record{Key: []byte("order-1"), Headers: append(base(),
				Header{Key: []byte(HeaderKey)})},
			want: delayed,
		},
		{
			name: "binary defer.key in hex",
			rec:  Record{Key: []byte("order-1"), Headers: base(HeaderKey, "\xfe\xff")},
			want: ordered(delayed, `\xfeff`),
		},
		{
			name: "key exactly the default limit",
			rec:  Record{Key: []byte(long[1:]), Headers: base()},
			want: ordered(delayed, long[1:]),
		},
		{
			name:  "binary key exactly the limit in hex",
			rec:   Record{Key: []byte("\xff\xff\xff\xff"), Headers: base()},
			rules: withRules(func(r *Rules) { r.MaxKeyBytes = 10 }),
			want:  ordered(delayed, `\xffffffff`),
		},

		// Accepted: attempts and re-deferrals.
		{
			name: "first deferral",
			rec: Record{Key: []byte("order-1"), Value: []byte(`{"id":1}`), Headers: base(
				"traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
				"original.topic", "orders",
				"original.partition", "3",
				"original.offset", "12345",
				HeaderAttempt, "0",
				HeaderErrorClass, "TimeoutException",
				HeaderErrorMessage, "inventory service: deadline exceeded after 5s",
			)},
			want: Schedule{
				Target: "orders.created", Delay: 30 * time.Second,
				BusinessKey: "order-1", Ordered: true,
				ErrorClass: "TimeoutException", ErrorMessage: "inventory service: deadline exceeded after 5s",
			},
		},
		{
			name: "re-deferral",
			rec: Record{Key: []byte("order-1"), Headers: base(
				HeaderAttempt, "3",
				HeaderID, "42",
				HeaderSeq, "7",
				HeaderScheduledAt, "2026-06-01T11:59:30Z",
				HeaderErrorClass, "Conflict",
				HeaderErrorMessage, "version mismatch",
			)},
			want: Schedule{
				Target: "orders.created", Delay: 30 * time.Second,
				BusinessKey: "order-1", Ordered: true, Attempt: 3,
				ErrorClass: "Conflict", ErrorMessage: "version mismatch",
				OriginID: 42, Seq: 7,
			},
		},
		{
			name: "largest attempt, id and seq",
			rec:  Record{Headers: base(HeaderAttempt, "2147483647", HeaderID, "9223372036854775807", HeaderSeq, "9223372036854775807")},
			want: Schedule{
				Target: "orders.created", Delay: 30 * time.Second,
				Attempt: math.MaxInt32, OriginID: math.MaxInt64, Seq: math.MaxInt64,
			},
		},
		{
			name: "redrive count",
			rec:  Record{Headers: base(HeaderRedriveCount, "2")},
			want: Schedule{Target: "orders.created", Delay: 30 * time.Second, RedriveCount: 2},
		},
		{
			name: "largest redrive count",
			rec:  Record{Headers: base(HeaderRedriveCount, "2147483647")},
			want: Schedule{Target: "orders.created", Delay: 30 * time.Second, RedriveCount: math.MaxInt32},
		},

		// Accepted: no time at all, so the retry policy will pick the delay
		// (it used to be rejected as missing_schedule).
		{
			name: "neither at nor delay: the policy decides",
			rec:  Record{Key: []byte("k"), Headers: hs(HeaderTarget, "orders.created", HeaderAttempt, "1", HeaderErrorClass, "E")},
			want: Schedule{Target: "orders.created", BusinessKey: "k", Ordered: true, Attempt: 1, ErrorClass: "E", FromPolicy: true},
		},
		{
			name: "neither at nor delay, re-deferral",
			rec: Record{Key: []byte("k"), Headers: hs(HeaderTarget, "orders.created", HeaderAttempt, "4",
				HeaderID, "42", HeaderSeq, "7", HeaderRedriveCount, "1")},
			want: Schedule{Target: "orders.created", BusinessKey: "k", Ordered: true, Attempt: 4,
				OriginID: 42, Seq: 7, RedriveCount: 1, FromPolicy: true},
		},
		{
			name: "attempt with leading zeros",
			rec:  Record{Headers: base(HeaderAttempt, "007")},
			want: Schedule{Target: "orders.created", Delay: 30 * time.Second, Attempt: 7},
		},
		{
			name: "defer.scheduled-at is an ordinary header and may repeat",
			rec:  Record{Headers: base(HeaderScheduledAt, "x", HeaderScheduledAt, "\xff")},
			want: delayed,
		},
		{
			name: "ordinary header values need not be text",
			rec:  Record{Headers: base("trace-bin", "\x00\xff", "", "")},
			want: delayed,
		},
		{
			name: "error texts may be any valid UTF-8",
			rec:  Record{Headers: base(HeaderErrorClass, "", HeaderErrorMessage, "échec ✗\n\ttrace")},
			want: Schedule{Target: "orders.created", Delay: 30 * time.Second, ErrorMessage: "échec ✗\n\ttrace"},
		},

		// Rejected, one row or more per code. want is what Parse could
		// still fill in.
		{
			name:   "missing_target",
			rec:    Record{Key: []byte("k"), Headers: hs(HeaderDelay, "30s", HeaderAttempt, "2", HeaderErrorClass, "E")},
			want:   Schedule{Delay: 30 * time.Second, BusinessKey: "k", Ordered: true, Attempt: 2, ErrorClass: "E"},
			code:   codeMissingTarget,
			detail: []string{HeaderTarget},
		},
		{
			name:   "invalid_target: slash",
			rec:    Record{Headers: hs(HeaderTarget, "orders/created", HeaderDelay, "30s")},
			want:   Schedule{Target: "orders/created", Delay: 30 * time.Second},
			code:   codeInvalidTarget,
			detail: []string{HeaderTarget, `"orders/created"`},
		},
		{
			name:   "invalid_target: empty",
			rec:    Record{Headers: hs(HeaderTarget, "", HeaderDelay, "30s")},
			want:   Schedule{Delay: 30 * time.Second},
			code:   codeInvalidTarget,
			detail: []string{HeaderTarget, `""`},
		},
		{
			name:   "invalid_target: dot dot",
			rec:    Record{Headers: hs(HeaderTarget, "..", HeaderDelay, "30s")},
			want:   Schedule{Target: "..", Delay: 30 * time.Second},
			code:   codeInvalidTarget,
			detail: []string{HeaderTarget, `".."`},
		},
		{
			name:   "invalid_target: too long, value truncated",
			rec:    Record{Headers: hs(HeaderTarget, "orders."+strings.Repeat("x", 243), HeaderDelay, "30s")},
			want:   Schedule{Target: "orders." + strings.Repeat("x", 243), Delay: 30 * time.Second},
			code:   codeInvalidTarget,
			detail: []string{HeaderTarget, `"orders.xxx`, `xxx"... (250 bytes)`},
		},
		{
			name:   "target_not_allowed",
			rec:    Record{Headers: hs(HeaderTarget, "billing.invoices", HeaderDelay, "30s")},
			want:   Schedule{Target: "billing.invoices", Delay: 30 * time.Second},
			code:   codeTargetNotAllowed,
			detail: []string{HeaderTarget, `"billing.invoices"`},
		},
		{
			name:   "target_not_allowed: empty allow-list",
			rec:    Record{Headers: base()},
			rules:  withRules(func(r *Rules) { r.Targets = nil }),
			want:   delayed,
			code:   codeTargetNotAllowed,
			detail: []string{HeaderTarget, `"orders.created"`},
		},
		{
			name: "conflicting_schedule",
			rec:  Record{Headers: base(HeaderAt, "2026-06-01T13:00:00Z")},
			want: Schedule{
				Target: "orders.created", Delay: 30 * time.Second,
				HasAt: true, At: time.Date(2026, 6, 1, 13, 0, 0, 0, time.UTC),
			},
			code:   codeConflictingSchedule,
			detail: []string{HeaderAt, HeaderDelay, `"30s"`, `"2026-06-01T13:00:00Z"`},
		},
		{
			name:   "invalid_at: not a time",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "tomorrow")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidAt,
			detail: []string{HeaderAt, `"tomorrow"`},
		},
		{
			name:   "invalid_at: no offset",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T13:00:00")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidAt,
			detail: []string{HeaderAt, `"2026-06-01T13:00:00"`},
		},
		{
			name:   "invalid_at: not a leap year",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2027-02-29T00:00:00Z")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidAt,
			detail: []string{HeaderAt, "day out of range"},
		},
		{
			name:   "invalid_at: offset hour 24",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T13:00:00+24:00")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidAt,
			detail: []string{HeaderAt, "offset out of range"},
		},
		{
			name:   "invalid_at: leap second",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-30T23:59:60Z")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidAt,
			detail: []string{HeaderAt, "leap second"},
		},
		{
			name:   "invalid_at: comma before fraction",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-01T13:00:00,5Z")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidAt,
			detail: []string{HeaderAt},
		},
		{
			name:   "invalid_delay: not a duration",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "soon")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidDelay,
			detail: []string{HeaderDelay, `"soon"`},
		},
		{
			name:   "invalid_delay: empty",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidDelay,
			detail: []string{HeaderDelay, `""`},
		},
		{
			name:   "invalid_delay: negative",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "-5s")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidDelay,
			detail: []string{HeaderDelay, `"-5s"`, "negative"},
		},
		{
			name:   "invalid_delay: signed milliseconds",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "-100")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidDelay,
			detail: []string{HeaderDelay, `"-100"`},
		},
		{
			name:   "invalid_delay: milliseconds overflow",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "9223372036855")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidDelay,
			detail: []string{HeaderDelay, `"9223372036855"`, "overflows"},
		},
		{
			name:   "invalid_delay: duration overflow",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "3000000h")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidDelay,
			detail: []string{HeaderDelay, `"3000000h"`},
		},
		{
			name:   "delay_too_long: delay",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "24h0m0.001s")},
			want:   Schedule{Target: "orders.created", Delay: 24*time.Hour + time.Millisecond},
			code:   codeDelayTooLong,
			detail: []string{HeaderDelay, `"24h0m0.001s"`, "24h0m0s"},
		},
		{
			name:   "delay_too_long: zero maximum allows only now",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "1")},
			rules:  withRules(func(r *Rules) { r.MaxDelay = 0 }),
			want:   Schedule{Target: "orders.created", Delay: time.Millisecond},
			code:   codeDelayTooLong,
			detail: []string{HeaderDelay, `"1"`},
		},
		{
			name:   "delay_too_long: at",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "2026-06-02T13:00:00+01:00")},
			want:   at(time.Date(2026, 6, 2, 12, 0, 0, 0, time.UTC)),
			rules:  withRules(func(r *Rules) { r.MaxDelay = 24*time.Hour - time.Nanosecond }),
			code:   codeDelayTooLong,
			detail: []string{HeaderAt, `"2026-06-02T13:00:00+01:00"`, "24h0m0s after ingest"},
		},
		{
			name:   "delay_too_long: at far in the future",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderAt, "9999-12-31T23:59:59Z")},
			want:   at(time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)),
			code:   codeDelayTooLong,
			detail: []string{HeaderAt, `"9999-12-31T23:59:59Z"`},
		},
		{
			name:   "key_too_long: defer.key",
			rec:    Record{Key: []byte("k"), Headers: base(HeaderKey, long)},
			want:   delayed,
			code:   codeKeyTooLong,
			detail: []string{HeaderKey, "1025 bytes", "limit of 1024"},
		},
		{
			name:   "key_too_long: record key",
			rec:    Record{Key: []byte(long), Headers: base()},
			want:   delayed,
			code:   codeKeyTooLong,
			detail: []string{"record key", "1025 bytes"},
		},
		{
			name:   "key_too_long: binary record key in hex",
			rec:    Record{Key: []byte("\xff\xff\xff\xff\xff"), Headers: base()},
			rules:  withRules(func(r *Rules) { r.MaxKeyBytes = 11 }),
			want:   delayed,
			code:   codeKeyTooLong,
			detail: []string{"record key", `"\xff\xff\xff\xff\xff"`, "12 bytes", "limit of 11"},
		},
		{
			name:   "invalid_attempt: negative",
			rec:    Record{Headers: base(HeaderAttempt, "-1")},
			want:   delayed,
			code:   codeInvalidAttempt,
			detail: []string{HeaderAttempt, `"-1"`},
		},
		{
			name:   "invalid_attempt: overflows int32",
			rec:    Record{Headers: base(HeaderAttempt, "2147483648")},
			want:   delayed,
			code:   codeInvalidAttempt,
			detail: []string{HeaderAttempt, `"2147483648"`},
		},
		{
			name:   "invalid_attempt: empty",
			rec:    Record{Headers: base(HeaderAttempt, "")},
			want:   delayed,
			code:   codeInvalidAttempt,
			detail: []string{HeaderAttempt, `""`},
		},
		{
			name:   "invalid_attempt: space",
			rec:    Record{Headers: base(HeaderAttempt, " 1")},
			want:   delayed,
			code:   codeInvalidAttempt,
			detail: []string{HeaderAttempt, `" 1"`},
		},
		{
			name:   "invalid_id: zero",
			rec:    Record{Headers: base(HeaderID, "0", HeaderSeq, "1")},
			want:   Schedule{Target: "orders.created", Delay: 30 * time.Second, Seq: 1},
			code:   codeInvalidID,
			detail: []string{HeaderID, `"0"`},
		},
		{
			name:   "invalid_id: overflows int64",
			rec:    Record{Headers: base(HeaderID, "9223372036854775808")},
			want:   delayed,
			code:   codeInvalidID,
			detail: []string{HeaderID, `"9223372036854775808"`},
		},
		{
			name:   "invalid_id: signed",
			rec:    Record{Headers: base(HeaderID, "+5")},
			want:   delayed,
			code:   codeInvalidID,
			detail: []string{HeaderID, `"+5"`},
		},
		{
			name:   "invalid_seq",
			rec:    Record{Headers: base(HeaderID, "5", HeaderSeq, "0x10")},
			want:   Schedule{Target: "orders.created", Delay: 30 * time.Second, OriginID: 5},
			code:   codeInvalidSeq,
			detail: []string{HeaderSeq, `"0x10"`},
		},
		{
			name:   "invalid_redrive_count: negative",
			rec:    Record{Headers: base(HeaderRedriveCount, "-1")},
			want:   delayed,
			code:   codeInvalidRedriveCount,
			detail: []string{HeaderRedriveCount, `"-1"`, "0..2147483647"},
		},
		{
			name:   "invalid_redrive_count: overflows int32",
			rec:    Record{Headers: base(HeaderRedriveCount, "2147483648")},
			want:   delayed,
			code:   codeInvalidRedriveCount,
			detail: []string{HeaderRedriveCount, `"2147483648"`},
		},
		{
			name:   "invalid_redrive_count: empty",
			rec:    Record{Headers: base(HeaderRedriveCount, "")},
			want:   delayed,
			code:   codeInvalidRedriveCount,
			detail: []string{HeaderRedriveCount, `""`},
		},
		{
			name:   "duplicate_header: redrive count",
			rec:    Record{Headers: base(HeaderRedriveCount, "1", HeaderRedriveCount, "2")},
			want:   Schedule{Target: "orders.created", Delay: 30 * time.Second, RedriveCount: 1},
			code:   codeDuplicateHeader,
			detail: []string{HeaderRedriveCount, "2 times"},
		},
		{
			name: "source of 128 characters",
			rec:  Record{Headers: base(HeaderSource, strings.Repeat("a", 127)+"Z")},
			want: Schedule{Target: "orders.created", Delay: 30 * time.Second, Source: strings.Repeat("a", 127) + "Z"},
		},
		{
			name: "source with every kind of character",
			rec:  Record{Headers: base(HeaderSource, "Billing-svc.v2_eu")},
			want: Schedule{Target: "orders.created", Delay: 30 * time.Second, Source: "Billing-svc.v2_eu"},
		},
		{
			// Parse does not look at signatures: ingest checks them when
			// signing is configured, and ignores them otherwise.
			name: "signature not checked by Parse",
			rec:  Record{Headers: base(HeaderSignature, "not a signature")},
			want: delayed,
		},
		{
			name:   "invalid_source: empty",
			rec:    Record{Headers: base(HeaderSource, "")},
			want:   delayed,
			code:   codeInvalidSource,
			detail: []string{HeaderSource, `""`, "1 to 128 of [A-Za-z0-9._-]"},
		},
		{
			name:   "invalid_source: too long",
			rec:    Record{Headers: base(HeaderSource, strings.Repeat("a", 129))},
			want:   delayed,
			code:   codeInvalidSource,
			detail: []string{HeaderSource, "(129 bytes)"},
		},
		{
			name:   "invalid_source: space",
			rec:    Record{Headers: base(HeaderSource, "billing svc")},
			want:   delayed,
			code:   codeInvalidSource,
			detail: []string{HeaderSource, `"billing svc"`},
		},
		{
			name: "group and gated kept",
			rec:  Record{Headers: base(HeaderGroup, "payments", HeaderGated, "true")},
			want: Schedule{Target: "orders.created", Delay: 30 * time.Second, Group: "payments", Gated: true},
		},
		{
			name: "gated false, longest group",
			rec:  Record{Headers: base(HeaderGroup, strings.Repeat("g", MaxGroupBytes), HeaderGated, "false")},
			want: Schedule{Target: "orders.created", Delay: 30 * time.Second, Group: strings.Repeat("g", MaxGroupBytes)},
		},
		{
			name:   "invalid_group: empty",
			rec:    Record{Headers: base(HeaderGroup, "")},
			want:   delayed,
			code:   codeInvalidGroup,
			detail: []string{HeaderGroup, `""`, "1 to 255 bytes"},
		},
		{
			name:   "invalid_group: too long",
			rec:    Record{Headers: base(HeaderGroup, strings.Repeat("g", MaxGroupBytes+1))},
			want:   delayed,
			code:   codeInvalidGroup,
			detail: []string{HeaderGroup, "(256 bytes)"},
		},
		{
			name:   "invalid_gated",
			rec:    Record{Headers: base(HeaderGated, "yes")},
			want:   delayed,
			code:   codeInvalidGated,
			detail: []string{HeaderGated, `"yes"`, "true or false"},
		},
		{
			name:   "invalid_encoding: source",
			rec:    Record{Headers: base(HeaderSource, "billing\xff")},
			want:   delayed,
			code:   codeInvalidEncoding,
			detail: []string{HeaderSource, `"billing\xff"`},
		},
		{
			name:   "duplicate_header: signature",
			rec:    Record{Headers: base(HeaderSignature, "a", HeaderSource, "billing", HeaderSignature, "b")},
			want:   Schedule{Target: "orders.created", Delay: 30 * time.Second, Source: "billing"},
			code:   codeDuplicateHeader,
			detail: []string{HeaderSignature, "2 times"},
		},
		{
			name:   "duplicate_header: source",
			rec:    Record{Headers: base(HeaderSource, "a", HeaderSource, "b")},
			want:   Schedule{Target: "orders.created", Delay: 30 * time.Second, Source: "a"},
			code:   codeDuplicateHeader,
			detail: []string{HeaderSource, "2 times"},
		},
		{
			name:   "duplicate_header: target, first one kept",
			rec:    Record{Headers: base(HeaderTarget, "payments")},
			want:   delayed,
			code:   codeDuplicateHeader,
			detail: []string{HeaderTarget, "2 times"},
		},
		{
			name:   "duplicate_header: defer.key, first one kept",
			rec:    Record{Headers: base(HeaderKey, "a", HeaderKey, "b", HeaderKey, "")},
			want:   ordered(delayed, "a"),
			code:   codeDuplicateHeader,
			detail: []string{HeaderKey, "3 times"},
		},
		{
			name:   "invalid_encoding: header key not UTF-8",
			rec:    Record{Headers: base("trace\xff", "x")},
			want:   delayed,
			code:   codeInvalidEncoding,
			detail: []string{`header key "trace\xff"`, "not valid UTF-8"},
		},
		{
			name:   "invalid_encoding: header key with NUL",
			rec:    Record{Headers: base("a\x00b", "x")},
			want:   delayed,
			code:   codeInvalidEncoding,
			detail: []string{`header key "a\x00b"`, "NUL"},
		},
		{
			name:   "invalid_encoding: target",
			rec:    Record{Headers: hs(HeaderTarget, "orders.\xff", HeaderDelay, "30s")},
			want:   Schedule{Delay: 30 * time.Second},
			code:   codeInvalidEncoding,
			detail: []string{HeaderTarget, `"orders.\xff"`},
		},
		{
			name:   "invalid_encoding: delay",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "30s\x00")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidEncoding,
			detail: []string{HeaderDelay, `"30s\x00"`, "NUL"},
		},
		{
			name:   "invalid_encoding: error message, other fields kept",
			rec:    Record{Key: []byte("k"), Headers: base(HeaderAttempt, "4", HeaderErrorClass, "E", HeaderErrorMessage, "bad \xc3(")},
			want:   Schedule{Target: "orders.created", Delay: 30 * time.Second, BusinessKey: "k", Ordered: true, Attempt: 4, ErrorClass: "E"},
			code:   codeInvalidEncoding,
			detail: []string{HeaderErrorMessage, `"bad \xc3("`},
		},
		{
			name:   "invalid_encoding: second occurrence of a duplicate",
			rec:    Record{Headers: base(HeaderAttempt, "1", HeaderAttempt, "\xff")},
			want:   Schedule{Target: "orders.created", Delay: 30 * time.Second, Attempt: 1},
			code:   codeInvalidEncoding,
			detail: []string{HeaderAttempt, `"\xff"`},
		},

		// Rejected with several problems: the first in the documented
		// order wins.
		{
			name:   "order: encoding before duplicate",
			rec:    Record{Headers: base(HeaderTarget, "payments", "\xff", "")},
			want:   delayed,
			code:   codeInvalidEncoding,
			detail: []string{`header key "\xff"`},
		},
		{
			name:   "order: encoding in record order",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderSeq, "\xfe", "\xff", "", HeaderDelay, "\x00")},
			want:   Schedule{Target: "orders.created"},
			code:   codeInvalidEncoding,
			detail: []string{HeaderSeq, `"\xfe"`},
		},
		{
			name:   "order: duplicate before missing target",
			rec:    Record{Headers: hs(HeaderAt, "x", HeaderAt, "y")},
			want:   Schedule{},
			code:   codeDuplicateHeader,
			detail: []string{HeaderAt},
		},
		{
			name:   "order: target before schedule",
			rec:    Record{Headers: hs(HeaderTarget, "billing", HeaderDelay, "x", HeaderAttempt, "-1")},
			want:   Schedule{Target: "billing"},
			code:   codeTargetNotAllowed,
			detail: []string{HeaderTarget},
		},
		{
			name:   "order: conflict before invalid values",
			rec:    Record{Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "x", HeaderAt, "y")},
			want:   Schedule{Target: "orders.created"},
			code:   codeConflictingSchedule,
			detail: []string{HeaderAt, HeaderDelay},
		},
		{
			name:   "order: schedule before key",
			rec:    Record{Key: []byte(long), Headers: hs(HeaderTarget, "orders.created", HeaderDelay, "48h")},
			want:   Schedule{Target: "orders.created", Delay: 48 * time.Hour},
			code:   codeDelayTooLong,
			detail: []string{HeaderDelay},
		},
		{
			name:   "order: key before attempt",
			rec:    Record{Headers: base(HeaderAttempt, "x", HeaderKey, long)},
			want:   delayed,
			code:   codeKeyTooLong,
			detail: []string{HeaderKey},
		},
		{
			name:   "order: attempt, id, seq",
			rec:    Record{Headers: base(HeaderSeq, "0", HeaderID, "0", HeaderAttempt, "x")},
			want:   delayed,
			code:   codeInvalidAttempt,
			detail: []string{HeaderAttempt},
		},
		{
			name:   "order: id before seq",
			rec:    Record{Headers: base(HeaderSeq, "0", HeaderID, "0")},
			want:   delayed,
			code:   codeInvalidID,
			detail: []string{HeaderID},
		},
		{
			name:   "order: redrive count before source",
			rec:    Record{Headers: base(HeaderSource, "a b", HeaderRedriveCount, "x")},
			want:   delayed,
			code:   codeInvalidRedriveCount,
			detail: []string{HeaderRedriveCount},
		},
		{
			name:   "order: seq before redrive count",
			rec:    Record{Headers: base(HeaderRedriveCount, "x", HeaderSeq, "0")},
			want:   delayed,
			code:   codeInvalidSeq,
			detail: []string{HeaderSeq},
		},
	}
	covered := map[string]bool{}
	for _, tt := range tests {
		covered[tt.code] = true
		t.Run(tt.name, func(t *testing.T) {
			rules := testRules()
			if tt.rules != nil {
				rules = *tt.rules
			}
			got, err := Parse(tt.rec, rules, testNow)
			if !sameSchedule(got, tt.want) {
				t.Errorf("Schedule\n got %+v\nwant %+v", got, tt.want)
			}
			if tt.code == "" {
				if err != nil {
					t.Fatalf("err = %v, want nil", err)
				}
				return
			}
			var rej *RejectError
			if !errors.As(err, &rej) {
				t.Fatalf("err = %#v, want a *RejectError", err)
			}
			if rej.Code != tt.code {
				t.Errorf("Code = %q, want %q (%v)", rej.Code, tt.code, err)
			}
			for _, s := range tt.detail {
				if !strings.Contains(rej.Detail, s) {
					t.Errorf("Detail %q does not contain %q", rej.Detail, s)
				}
			}
			if want := rej.Code + ": " + rej.Detail; err.Error() != want {
				t.Errorf("Error() = %q, want %q", err.Error(), want)
			}
		})
	}
	for _, c := range testCodes() {
		if !covered[c] {
			t.Errorf("no test row for code %q", c)
		}
	}
}

// sameSchedule compares schedules with time.Time.Equal for At.
func sameSchedule(a, b Schedule) bool {
	if !a.At.Equal(b.At) {
		return false
	}
	a.At, b.At = time.Time{}, time.Time{}
	return a == b
}

// testCodes lists every rejection code Parse emits. Keep it in step with
// protocol.go: TestParse requires a row for each, and FuzzParse accepts no
// other. codeMissingSchedule is left out on purpose: it is kept for the
// rows and metrics of old, and Parse must never emit it again.
func testCodes() []string {
	return []string{
		codeInvalidEncoding, codeDuplicateHeader,
		codeMissingTarget, codeInvalidTarget, codeTargetNotAllowed,
		codeConflictingSchedule, codeInvalidAt, codeInvalidDelay, codeDelayTooLong,
		codeKeyTooLong, codeInvalidAttempt, codeInvalidID, codeInvalidSeq, codeInvalidRedriveCount,
		codeInvalidSource, codeInvalidGroup, codeInvalidGated,
	}
}

func TestParseDefaultKeyLimit(t *testing.T) {
	for _, limit := range []int{0, -1} {
		rules := testRules()
		rules.MaxKeyBytes = limit
		ok := Record{Key: []byte(strings.Repeat("k", DefaultMaxKeyBytes)), Headers: base()}
		if _, err := Parse(ok, rules, testNow); err != nil {
			t.Errorf("MaxKeyBytes %d, key of %d bytes: %v", limit, DefaultMaxKeyBytes, err)
		}
		tooLong := Record{Key: []byte(strings.Repeat("k", DefaultMaxKeyBytes+1)), Headers: base()}
		if _, err := Parse(tooLong, rules, testNow); err == nil {
			t.Errorf("MaxKeyBytes %d, key of %d bytes: accepted", limit, DefaultMaxKeyBytes+1)
		}
	}
}

func TestParseTargetPatterns(t *testing.T) {
	tests := []struct {
		in      string
		want    TargetPatterns
		wantErr []string // strings the error must contain
	}{
		{in: "", want: nil},
		{in: " , ,", want: nil},
		{in: "orders.*", want: TargetPatterns{"orders.*"}},
		{in: " orders.* ,payments, ", want: TargetPatterns{"orders.*", "payments"}},
		{in: ",,a", want: TargetPatterns{"a"}},
		{in: "[ab].x,\\*", want: TargetPatterns{"[ab].x", "\\*"}},
		{in: "orders.*,[", wantErr: []string{`2 "["`}},
		{in: "a,, b[ ", wantErr: []string{`3 "b["`}},
		{in: `x\`, wantErr: []string{`1 "x\\"`}},
		{in: "[^a", wantErr: []string{`1 "[^a"`}},
	}
	for _, tt := range tests {
		got, err := ParseTargetPatterns(tt.in)
		if tt.wantErr != nil {
			if err == nil {
				t.Errorf("ParseTargetPatterns(%q) = %q, want an error", tt.in, got)
				continue
			}
			if !errors.Is(err, path.ErrBadPattern) {
				t.Errorf("ParseTargetPatterns(%q): %v does not wrap path.ErrBadPattern", tt.in, err)
			}
			for _, s := range tt.wantErr {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("ParseTargetPatterns(%q): error %q does not contain %q", tt.in, err, s)
				}
			}
			continue
		}
		if err != nil || !slices.Equal(got, tt.want) {
			t.Errorf("ParseTargetPatterns(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
}

func TestTargetPatternsAllows(t *testing.T) {
	tests := []struct {
		patterns TargetPatterns
		topic    string
		want     bool
	}{
		{nil, "orders", false},
		{TargetPatterns{}, "orders", false},
		{TargetPatterns{"*"}, "anything.at-all", true},
		{TargetPatterns{"orders.*"}, "orders.created", true},
		{TargetPatterns{"orders.*"}, "orders.", true},
		{TargetPatterns{"orders.*"}, "orders", false},
		{TargetPatterns{"orders.*"}, "x.orders.created", false},
		{TargetPatterns{"payments"}, "payments", true},
		{TargetPatterns{"payments"}, "payments2", false},
		{TargetPatterns{"a", "orders.?"}, "orders.x", true},
		{TargetPatterns{"[ab].x"}, "b.x", true},
		{TargetPatterns{"[ab].x"}, "c.x", false},
		{TargetPatterns{"["}, "[", false}, // malformed: matches nothing
	}
	for _, tt := range tests {
		if got := tt.patterns.Allows(tt.topic); got != tt.want {
			t.Errorf("%q.Allows(%q) = %v, want %v", tt.patterns, tt.topic, got, tt.want)
		}
	}
}

func TestText(t *testing.T) {
	tests := []struct {
		in   []byte
		want string
	}{
		{nil, ""},
		{[]byte{}, ""},
		{[]byte("order-1"), "order-1"},
		{[]byte("héllo ✓"), "héllo ✓"},
		{[]byte(`\xff`), `\xff`},
		{[]byte{0xff}, `\xff`},
		{[]byte{0}, `\x00`},
		{[]byte("a\x00b"), `\x610062`},
		{[]byte{0xde, 0xad, 0xbe, 0xef}, `\xdeadbeef`},
		{[]byte("\xed\xa0\x80"), `\xeda080`}, // a UTF-16 surrogate is not UTF-8
	}
	for _, tt := range tests {
		if got := Text(tt.in); got != tt.want {
			t.Errorf("Text(%q) = %q, want %q", tt.in, got, tt.want)
		}
		if got := textLen(tt.in); got != len(tt.want) {
			t.Errorf("textLen(%q) = %d, want %d", tt.in, got, len(tt.want))
		}
	}
}

// TestTextProblem puts each kind of byte at each position around the
// eight-byte words textProblem reads, and compares it with the definition.
func TestTextProblem(t *testing.T) {
	for n := 0; n <= 20; n++ {
		for pos := 0; pos < n; pos++ {
			for _, ins := range []string{"\x00", "\x01", "\x7f", "\x80", "\xff", "é", "✓", "\xed\xa0\x80"} {
				b := []byte(strings.Repeat("a", pos) + ins + strings.Repeat("b", n-pos))
				b = append(b, "\x00"[:n%2]...) // a trailing NUL on odd lengths
				want := utf8.Valid(b) && !bytes.Contains(b, []byte{0})
				if got := textProblem(b) == ""; got != want {
					t.Errorf("textProblem(%q) = %q, want text %v", b, textProblem(b), want)
				}
			}
		}
	}
}

func TestValidTopic(t *testing.T) {
	tests := []struct {
		name string
		want bool
	}{
		{"orders.created", true},
		{"a", true},
		{"A-Z_a-z.0-9", true},
		{"...", true},
		{strings.Repeat("x", 249), true},
		{"", false},
		{".", false},
		{"..", false},
		{strings.Repeat("x", 250), false},
		{"orders/created", false},
		{"orders created", false},
		{"orders\x00", false},
		{"ordérs", false},
		{"orders*", false},
	}
	for _, tt := range tests {
		if got := ValidTopic(tt.name); got != tt.want {
			t.Errorf("ValidTopic(%q) = %v, want %v", tt.name, got, tt.want)
		}
	}
}

func TestParseRFC3339(t *testing.T) {
	tests := []struct {
		in      string
		want    time.Time
		problem string // "" for accepted; else a string the problem must contain
	}{
		{in: "2026-06-01T13:00:00Z", want: time.Date(2026, 6, 1, 13, 0, 0, 0, time.UTC)},
		{in: "0000-01-01T00:00:00Z", want: time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC)},
		{in: "9999-12-31T23:59:59.999999999-23:59", want: time.Date(10000, 1, 1, 23, 58, 59, 999999999, time.UTC)},
		{in: "2000-02-29T00:00:00+00:00", want: time.Date(2000, 2, 29, 0, 0, 0, 0, time.UTC)},
		{in: "2026-06-01T13:00:00.000001Z", want: time.Date(2026, 6, 1, 13, 0, 0, 1000, time.UTC)},
		{in: "1900-02-29T00:00:00Z", problem: "day out of range"},
		{in: "2026-04-31T00:00:00Z", problem: "day out of range"},
		{in: "2026-00-01T00:00:00Z", problem: "month out of range"},
		{in: "2026-13-01T00:00:00Z", problem: "month out of range"},
		{in: "2026-01-00T00:00:00Z", problem: "day out of range"},
		{in: "2026-01-01T24:00:00Z", problem: "hour out of range"},
		{in: "2026-01-01T00:60:00Z", problem: "minute out of range"},
		{in: "2026-01-01T00:00:61Z", problem: "second out of range"},
		{in: "2026-01-01T00:00:00+00:60", problem: "offset out of range"},
		{in: "2026-01-01T00:00:00.Z", problem: "form"},
		{in: "2026-01-01T00:00:00+0100", problem: "form"},
		{in: "2026-01-01T00:00:00+01:00:00", problem: "form"},
		{in: "2026-01-01 00:00:00Z", problem: "form"},
		{in: "2026-1-01T00:00:00Z", problem: "form"},
		{in: "+2026-01-01T00:00:00Z", problem: "form"},
		{in: "2026-01-01T00:00:00ZZ", problem: "form"},
		{in: "2026-01-01T0a:00:00Z", problem: "form"},
		{in: "2026-01-01T00:00:00+0a:00", problem: "form"},
		{in: "2026-01-01", problem: "form"},
		{in: "", problem: "form"},
	}
	for _, tt := range tests {
		got, problem := parseRFC3339([]byte(tt.in))
		if tt.problem != "" {
			if !strings.Contains(problem, tt.problem) {
				t.Errorf("parseRFC3339(%q) problem = %q, want %q", tt.in, problem, tt.problem)
			}
			continue
		}
		if problem != "" || !got.Equal(tt.want) || got.Location() != time.UTC {
			t.Errorf("parseRFC3339(%q) = %v, %q; want %v", tt.in, got, problem, tt.want)
		}
		if std, err := time.Parse(time.RFC3339Nano, tt.in); err != nil || !std.Equal(got) {
			t.Errorf("time.Parse(%q) = %v, %v; parseRFC3339 gave %v", tt.in, std, err, got)
		}
	}
}

func TestQuote(t *testing.T) {
	long := strings.Repeat("a", 63) + "é" + "tail"
	tests := []struct {
		in, want string
	}{
		{"", `""`},
		{"x\x00\xff", `"x\x00\xff"`},
		{strings.Repeat("a", 64), `"` + strings.Repeat("a", 64) + `"`},
		// The cut backs off to the start of "é" rather than split it.
		{long, `"` + strings.Repeat("a", 63) + `"... (69 bytes)`},
	}
	for _, tt := range tests {
		if got := quote([]byte(tt.in)); got != tt.want {
			t.Errorf("quote(%q) = %s, want %s", tt.in, got, tt.want)
		}
	}
}

func TestParseAllocs(t *testing.T) {
	rec := benchRecord()
	rules := testRules()
	// Target, business key, error class and error message are the only
	// strings a record needs copied.
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := Parse(rec, rules, testNow); err != nil {
			t.Fatal(err)
		}
	})
	if allocs > 4 {
		t.Errorf("Parse allocates %v times per record, want at most 4", allocs)
	}
}

// benchRecord is a typical first deferral: six headers, one of them the
// producer's own.
func benchRecord() Record {
	return Record{
		Key:   []byte("order-1234567"),
		Value: []byte(`{"order_id":1234567,"status":"created"}`),
		Headers: hs(
			"traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
			HeaderTarget, "orders.created",
			HeaderDelay, "30s",
			HeaderAttempt, "2",
			HeaderErrorClass, "TimeoutException",
			HeaderErrorMessage, "inventory service: deadline exceeded after 5s",
		),
	}
}

func BenchmarkParse(b *testing.B) {
	rules := testRules()
	b.Run("delay", func(b *testing.B) {
		rec := benchRecord()
		b.ReportAllocs()
		for b.Loop() {
			if _, err := Parse(rec, rules, testNow); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("at", func(b *testing.B) {
		rec := benchRecord()
		rec.Headers[2] = Header{Key: []byte(HeaderAt), Value: []byte("2026-06-01T18:30:00.123+05:30")}
		b.ReportAllocs()
		for b.Loop() {
			if _, err := Parse(rec, rules, testNow); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("rejected", func(b *testing.B) {
		rec := benchRecord()
		rec.Headers[1].Value = []byte("billing.invoices")
		b.ReportAllocs()
		for b.Loop() {
			if _, err := Parse(rec, rules, testNow); err == nil {
				b.Fatal("accepted")
			}
		}
	})
}
