package protocol

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestParseBadInput runs Parse over the awkward records of the "bad input,
// at scale" list (cmd/scheduler's TestBadInputAtScale sends the same through
// the whole service): what it accepts, with what schedule, and the code of
// what it rejects.
func TestParseBadInput(t *testing.T) {
	now := time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)
	rules := Rules{Targets: TargetPatterns{"orders.*"}, MaxDelay: 17520 * time.Hour}
	target := func(kv ...string) []Header { return hs(append([]string{HeaderTarget, "orders.retry"}, kv...)...) }
	many := target(HeaderDelay, "0")
	for i := range 5000 {
		many = append(many, Header{Key: []byte("h-" + strconv.Itoa(i%100)), Value: []byte{byte(i), 0xff}})
	}
	utc := func(s string) time.Time {
		t.Helper()
		v, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			t.Fatal(err)
		}
		return v.UTC()
	}

	tests := []struct {
		name string
		rec  Record
		// Accepted: the business key ("" unordered) and due time (zero:
		// a delay, checked as delay).
		bizKey string
		at     time.Time
		delay  time.Duration
		// Rejected: the code.
		code string
	}{
		{name: "1 MiB value", rec: Record{Key: []byte("k"), Value: make([]byte, 1<<20), Headers: target(HeaderDelay, "0")}, bizKey: "k"},
		{name: "5000 headers, duplicated, binary values", rec: Record{Key: []byte("k"), Headers: many}, bizKey: "k"},
		{name: "binary record key", rec: Record{Key: []byte("\xff\x00a"), Headers: target(HeaderDelay, "1s")}, bizKey: `\xff0061`, delay: time.Second},
		{name: "empty record key", rec: Record{Key: []byte{}, Headers: target(HeaderDelay, "1s")}, delay: time.Second},
		{name: "null key and value", rec: Record{Headers: target(HeaderDelay, "1s")}, delay: time.Second},
		{name: "binary value of a plain header", rec: Record{Key: []byte("k"), Headers: target(HeaderDelay, "0", "trace", "\xff\xfe")}, bizKey: "k"},
		{name: "binary value of a control header", rec: Record{Key: []byte("k"), Headers: target(HeaderDelay, "\xff1s")}, code: codeInvalidEncoding},
		{name: "at +14:00", rec: Record{Headers: target(HeaderAt, "2026-11-22T14:00:00+14:00")}, at: utc("2026-11-22T00:00:00Z")},
		{name: "at -12:00", rec: Record{Headers: target(HeaderAt, "2026-11-21T12:00:00.5-12:00")}, at: utc("2026-11-22T00:00:00.5Z")},
		{name: "at +05:45", rec: Record{Headers: target(HeaderAt, "2026-11-22T05:45:00+05:45")}, at: utc("2026-11-22T00:00:00Z")},
		{name: "at leap day, last nanosecond", rec: Record{Headers: target(HeaderAt, "2028-02-29T23:59:59.999999999+01:00")},
			at: time.Date(2028, 2, 29, 22, 59, 59, 999999999, time.UTC)},
		{name: "at 2027-02-29", rec: Record{Headers: target(HeaderAt, "2027-02-29T00:00:00Z")}, code: codeInvalidAt},
		{name: "at offset +24:00", rec: Record{Headers: target(HeaderAt, "2026-11-22T14:00:00+24:00")}, code: codeInvalidAt},
		{name: "negative delay", rec: Record{Headers: target(HeaderDelay, "-1s")}, code: codeInvalidDelay},
		{name: "negative milliseconds", rec: Record{Headers: target(HeaderDelay, "-1")}, code: codeInvalidDelay},
		{name: "delay beyond MAX_DELAY", rec: Record{Headers: target(HeaderDelay, "17521h")}, code: codeDelayTooLong},
		{name: "delay of max int64 ns", rec: Record{Headers: target(HeaderDelay, "9223372036854775807ns")}, code: codeDelayTooLong},
		{name: "max int64 milliseconds", rec: Record{Headers: target(HeaderDelay, "9223372036854775807")}, code: codeInvalidDelay},
		{name: "at beyond MAX_DELAY", rec: Record{Headers: target(HeaderAt, "9999-12-31T23:59:59Z")}, code: codeDelayTooLong},
		{name: "target with /", rec: Record{Headers: hs(HeaderTarget, "orders./x", HeaderDelay, "0")}, code: codeInvalidTarget},
		{name: "target with space", rec: Record{Headers: hs(HeaderTarget, "orders. x", HeaderDelay, "0")}, code: codeInvalidTarget},
		{name: "target with *", rec: Record{Headers: hs(HeaderTarget, "orders.*", HeaderDelay, "0")}, code: codeInvalidTarget},
		{name: "target with unicode", rec: Record{Headers: hs(HeaderTarget, "orders.ü", HeaderDelay, "0")}, code: codeInvalidTarget},
		{name: "target of 250 chars", rec: Record{Headers: hs(HeaderTarget, "orders."+strings.Repeat("x", 243), HeaderDelay, "0")}, code: codeInvalidTarget},
		{name: "target of 249 chars", rec: Record{Headers: hs(HeaderTarget, "orders."+strings.Repeat("x", 242), HeaderDelay, "0")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := Parse(tt.rec, rules, now)
			if tt.code != "" {
				var rej *RejectError
				if !errors.As(err, &rej) || rej.Code != tt.code {
					t.Fatalf("Parse = %+v, %v; want a rejection %s", s, err, tt.code)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if s.Ordered != (tt.bizKey != "") || s.BusinessKey != tt.bizKey {
				t.Errorf("business key %q (ordered %v), want %q", s.BusinessKey, s.Ordered, tt.bizKey)
			}
			if !tt.at.IsZero() {
				if !s.HasAt || !s.At.Equal(tt.at) {
					t.Errorf("at %v (has %v), want %v", s.At, s.HasAt, tt.at)
				}
			} else if s.HasAt || s.Delay != tt.delay {
				t.Errorf("delay %v (has at %v), want %v", s.Delay, s.HasAt, tt.delay)
			}
		})
	}
}
