package protocol

import (
	"bytes"
	"encoding/hex"
	"errors"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// Bits of FuzzParse's present argument: which headers the record has, and
// which limits apply.
const (
	fuzzTarget     = 1 << iota // defer.target = target
	fuzzAt                     // defer.at = at
	fuzzDelay                  // defer.delay = delay
	fuzzKey                    // defer.key = bizKey
	fuzzAttempt                // defer.attempt = attempt
	fuzzID                     // defer.id = id
	fuzzSeq                    // defer.seq = seq
	fuzzError                  // defer.error.class and defer.error.message = errText
	fuzzExtra                  // extraKey = extraValue, which may be a control header
	fuzzExtraFirst             // the extra header comes first rather than last
	fuzzSmallKey               // MaxKeyBytes = 16
	fuzzNoDelay                // MaxDelay = 0
	fuzzRedrive                // defer.redrive-count = attempt
)

// FuzzParse checks the properties every Parse result must have, whatever the
// record holds.
func FuzzParse(f *testing.F) {
	all := uint16(fuzzTarget | fuzzDelay | fuzzKey | fuzzAttempt | fuzzID | fuzzSeq | fuzzError | fuzzExtra)
	f.Add([]byte("order-1"), []byte(`{"id":1}`), uint16(fuzzTarget|fuzzDelay),
		"orders.created", "", "30s", "", "", "", "", "", []byte(nil), []byte(nil))
	f.Add([]byte("\xff\x00"), []byte(nil), all&^fuzzDelay|fuzzAt,
		"payments", "2026-06-01T18:30:00.5+05:30", "", "customer-7", "3", "42", "7", "Timeout",
		[]byte("original.topic"), []byte("orders"))
	f.Add([]byte(nil), []byte(nil), all|fuzzExtraFirst,
		"orders.x", "", "1h30m", "", "0", "1", "9223372036854775807", "échec",
		[]byte(HeaderTarget), []byte("orders.y"))
	f.Add([]byte("k"), []byte("v"), uint16(fuzzTarget|fuzzAt|fuzzSmallKey|fuzzNoDelay),
		"orders.a", "2020-02-29t00:00:00z", "", "", "", "", "", "", []byte("\xff"), []byte(""))
	f.Add([]byte(strings.Repeat("k", 20)), []byte(nil), uint16(fuzzTarget|fuzzDelay|fuzzSmallKey|fuzzExtra),
		"billing", "", "2500", "", "-1", "0", "x", "\x00",
		[]byte(HeaderScheduledAt), []byte("\xff"))
	f.Add([]byte(nil), []byte(nil), uint16(fuzzTarget|fuzzAt|fuzzDelay),
		"..", "9999-12-31T23:59:59-23:59", "-0s", "", "", "", "", "",
		[]byte(nil), []byte(nil))
	f.Add([]byte("k"), []byte("v"), uint16(fuzzTarget|fuzzAttempt|fuzzRedrive|fuzzID|fuzzSeq),
		"orders.x", "", "", "", "3", "42", "7", "",
		[]byte(nil), []byte(nil))
	f.Add([]byte("k"), []byte("v"), uint16(fuzzTarget|fuzzRedrive|fuzzExtra),
		"orders.x", "", "", "", "2147483648", "", "", "",
		[]byte(HeaderDelay), []byte("1s"))

	f.Add([]byte("k"), []byte("v"), uint16(fuzzTarget|fuzzDelay|fuzzExtra),
		"orders.x", "", "1s", "", "", "", "", "",
		[]byte(HeaderSource), []byte("billing svc"))

	patterns, err := ParseTargetPatterns("orders.*, payments, [a-c]?")
	if err != nil {
		f.Fatal(err)
	}
	known := testCodes()
	now := testNow

	f.Fuzz(func(t *testing.T, key, value []byte, present uint16,
		target, at, delay, bizKey, attempt, id, seq, errText string,
		extraKey, extraValue []byte) {
		rec := Record{Key: key, Value: value}
		extra := Header{Key: extraKey, Value: extraValue}
		if present&(fuzzExtra|fuzzExtraFirst) == fuzzExtra|fuzzExtraFirst {
			rec.Headers = append(rec.Headers, extra)
		}
		add := func(bit uint16, k, v string) {
			if present&bit != 0 {
				rec.Headers = append(rec.Headers, Header{Key: []byte(k), Value: []byte(v)})
			}
		}
		add(fuzzTarget, HeaderTarget, target)
		add(fuzzAt, HeaderAt, at)
		add(fuzzDelay, HeaderDelay, delay)
		add(fuzzKey, HeaderKey, bizKey)
		add(fuzzAttempt, HeaderAttempt, attempt)
		add(fuzzRedrive, HeaderRedriveCount, attempt)
		add(fuzzID, HeaderID, id)
		add(fuzzSeq, HeaderSeq, seq)
		add(fuzzError, HeaderErrorClass, errText)
		add(fuzzError, HeaderErrorMessage, errText)
		if present&(fuzzExtra|fuzzExtraFirst) == fuzzExtra {
			rec.Headers = append(rec.Headers, extra)
		}
		rules := Rules{Targets: patterns, MaxDelay: 24 * time.Hour}
		maxKey := DefaultMaxKeyBytes
		if present&fuzzSmallKey != 0 {
			rules.MaxKeyBytes, maxKey = 16, 16
		}
		if present&fuzzNoDelay != 0 {
			rules.MaxDelay = 0
		}

		s, err := Parse(rec, rules, now)

		// Rejected or not, every string is storable as Postgres text.
		for _, str := range []string{s.Target, s.BusinessKey, s.ErrorClass, s.ErrorMessage} {
			if !isText([]byte(str)) {
				t.Errorf("Schedule holds %q, which is not storable text", str)
			}
		}
		if s.Source != "" && !ValidSource(s.Source) {
			t.Errorf("Schedule holds source %q, which is not a valid defer.source", s.Source)
		}
		if s.Ordered == (s.BusinessKey == "") {
			t.Errorf("Ordered = %v with BusinessKey %q", s.Ordered, s.BusinessKey)
		}
		if s2, err2 := Parse(rec, rules, now); !sameSchedule(s, s2) || !sameError(err, err2) {
			t.Errorf("Parse is not deterministic: %+v, %v then %+v, %v", s, err, s2, err2)
		}
		// Rejected or not, the policy picks the delay exactly when the
		// record names no time.
		timed := slices.ContainsFunc(rec.Headers, func(h Header) bool {
			return string(h.Key) == HeaderAt || string(h.Key) == HeaderDelay
		})
		if s.FromPolicy == timed {
			t.Errorf("FromPolicy = %v, but the record has defer.at or defer.delay: %v", s.FromPolicy, timed)
		}

		if err != nil {
			var rej *RejectError
			if !errors.As(err, &rej) {
				t.Fatalf("err = %#v, want a *RejectError", err)
			}
			if !slices.Contains(known, rej.Code) {
				t.Errorf("unknown code %q (%v)", rej.Code, err)
			}
			if rej.Detail == "" || !isText([]byte(rej.Detail)) {
				t.Errorf("Detail %q is empty or not storable text", rej.Detail)
			}
			if err.Error() != rej.Code+": "+rej.Detail {
				t.Errorf("Error() = %q", err.Error())
			}
			return
		}

		// The extra header may itself be defer.at or defer.delay, so the
		// oracles read the value the accepted record holds (duplicates are
		// rejected, so there is at most one).
		at, delay = headerValue(rec, HeaderAt), headerValue(rec, HeaderDelay)
		if !ValidTopic(s.Target) || !rules.Targets.Allows(s.Target) {
			t.Errorf("accepted target %q", s.Target)
		}
		if s.HasAt {
			if d := s.At.Sub(now); d > rules.MaxDelay {
				t.Errorf("accepted At %v, %v after now", s.At, d)
			}
			want, err := time.Parse(time.RFC3339Nano, strings.NewReplacer("t", "T", "z", "Z").Replace(at))
			if err != nil || !want.Equal(s.At) {
				t.Errorf("defer.at %q gave %v; time.Parse gives %v, %v", at, s.At, want, err)
			}
			if s.Delay != 0 {
				t.Errorf("Delay = %v with HasAt", s.Delay)
			}
		} else if s.FromPolicy {
			if s.Delay != 0 || !s.At.IsZero() {
				t.Errorf("Delay %v, At %v with FromPolicy", s.Delay, s.At)
			}
		} else {
			if s.Delay < 0 || s.Delay > rules.MaxDelay {
				t.Errorf("accepted Delay %v", s.Delay)
			}
			if want, ok := referenceDelay(delay); !ok || want != s.Delay {
				t.Errorf("defer.delay %q gave %v; want %v, %v", delay, s.Delay, want, ok)
			}
			if !s.At.IsZero() {
				t.Errorf("At = %v without HasAt", s.At)
			}
		}
		if s.Ordered && len(s.BusinessKey) > maxKey {
			t.Errorf("accepted business key of %d bytes", len(s.BusinessKey))
		}
		if s.Attempt < 0 || s.OriginID < 0 || s.Seq < 0 || s.RedriveCount < 0 {
			t.Errorf("accepted attempt %d, id %d, seq %d, redrive count %d", s.Attempt, s.OriginID, s.Seq, s.RedriveCount)
		}
		if present&fuzzRedrive != 0 {
			if n, err := strconv.ParseInt(attempt, 10, 32); err != nil || int32(n) != s.RedriveCount {
				t.Errorf("defer.redrive-count %q accepted as %d; strconv gives %d, %v", attempt, s.RedriveCount, n, err)
			}
		}
	})
}

// headerValue returns the value of rec's first header named key, or "".
func headerValue(rec Record, key string) string {
	for _, h := range rec.Headers {
		if string(h.Key) == key {
			return string(h.Value)
		}
	}
	return ""
}

func sameError(a, b error) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Error() == b.Error()
}

// referenceDelay is the defer.delay grammar as documented, built on the
// standard library, to check parseDelay's shortcuts against.
func referenceDelay(s string) (time.Duration, bool) {
	if s != "" && strings.Trim(s, "0123456789") == "" {
		n := strings.TrimLeft(s, "0")
		if len(n) > 19 {
			return 0, false
		}
		var ms uint64
		for _, c := range n {
			ms = ms*10 + uint64(c-'0')
		}
		if ms > math.MaxInt64/uint64(time.Millisecond) {
			return 0, false
		}
		return time.Duration(ms) * time.Millisecond, true
	}
	d, err := time.ParseDuration(s)
	return d, err == nil && d >= 0
}

// FuzzDelay checks parseDelay against referenceDelay.
func FuzzDelay(f *testing.F) {
	for _, s := range []string{"", "0", "2500", "30s", "1500ms", "1h30m", "-0s", "+5s", "1.5h", "5us", "5µs",
		"9223372036854775807ns", "9223372036854775808ns", "9223372036854ms", "9223372036855", "2562047h", "2562048h"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, problem := parseDelay([]byte(s))
		want, ok := referenceDelay(s)
		if ok != (problem == "") || ok && got != want {
			t.Errorf("parseDelay(%q) = %v, %q; want %v, %v", s, got, problem, want, ok)
		}
	})
}

// FuzzRFC3339 checks parseRFC3339 against time.Parse.
func FuzzRFC3339(f *testing.F) {
	for _, s := range []string{"2026-06-01T13:00:00Z", "2026-06-01T18:30:00.123+05:30", "2028-02-29T00:00:00-00:00",
		"2027-02-29T00:00:00Z", "0000-01-01T00:00:00.000000000001z", "9999-12-31T23:59:59-23:59", "2026-06-01T13:00:00,5Z"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, problem := parseRFC3339([]byte(s))
		std, err := time.Parse(time.RFC3339Nano, strings.NewReplacer("t", "T", "z", "Z").Replace(s))
		if problem == "" {
			if err != nil || !std.Equal(got) || got.Location() != time.UTC {
				t.Errorf("parseRFC3339(%q) = %v; time.Parse gives %v, %v", s, got, std, err)
			}
			return
		}
		// time.Parse also accepts forms RFC 3339 does not allow, such as a
		// one-digit hour or a comma before the fraction, so compare only
		// inputs of the RFC's shape. Within that shape it also allows an
		// offset of hour 24 or minute 60, where RFC 3339 stops at 23 and 59.
		if err == nil && rfc3339Shape.MatchString(s) && !offsetBeyondRFC(s) {
			t.Errorf("parseRFC3339(%q): %s; time.Parse accepts it as %v", s, problem, std)
		}
	})
}

// rfc3339Shape is the syntax of an RFC 3339 date-time, without range checks.
var rfc3339Shape = regexp.MustCompile(`^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$`)

// offsetBeyondRFC reports whether s, of rfc3339Shape, ends in an offset with
// hour 24 or minute 60, which time.Parse allows and RFC 3339 does not.
func offsetBeyondRFC(s string) bool {
	if n := len(s); s[n-1] != 'Z' && s[n-1] != 'z' {
		return s[n-5:n-3] == "24" || s[n-2:] == "60"
	}
	return false
}

// FuzzText checks Text and textProblem against their definitions.
func FuzzText(f *testing.F) {
	for _, s := range []string{"", "order-1", "héllo", "\xff", "a\x00b", "aaaaaaa\x00", "aaaaaaaa\x80", `\xff`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		text := utf8.Valid(b) && !bytes.Contains(b, []byte{0})
		if (textProblem(b) == "") != text {
			t.Errorf("textProblem(%q) = %q, want text %v", b, textProblem(b), text)
		}
		s := Text(b)
		if !isText([]byte(s)) || len(s) != textLen(b) {
			t.Errorf("Text(%q) = %q: not text, or textLen %d", b, s, textLen(b))
		}
		if text {
			if s != string(b) {
				t.Errorf("Text(%q) = %q, want it unchanged", b, s)
			}
			return
		}
		if d, err := hex.DecodeString(strings.TrimPrefix(s, `\x`)); err != nil || !bytes.Equal(d, b) || !strings.HasPrefix(s, `\x`) {
			t.Errorf("Text(%q) = %q, which does not decode back: %v", b, s, err)
		}
	})
}
