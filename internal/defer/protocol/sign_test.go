package protocol

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// testKey is a valid signing key: the bytes 0x00 to 0x1f.
var testKey = func() []byte {
	k := make([]byte, MinKeyBytes)
	for i := range k {
		k[i] = byte(i)
	}
	return k
}()

// signedRec is a record with every signed field and an unsigned header.
func signedRec() Record {
	return Record{
		Key:   []byte("order-42"),
		Value: []byte(`{"order":42}`),
		Headers: hs(
			HeaderSource, "billing",
			HeaderTarget, "orders.created",
			HeaderAt, "2026-06-01T13:00:00Z",
			HeaderDelay, "30s",
			HeaderKey, "customer-7",
			HeaderAttempt, "2",
			"trace", "t-1",
		),
	}
}

// withSignature returns rec with defer.signature sig appended.
func withSignature(rec Record, sig string) Record {
	rec.Headers = append(slices.Clone(rec.Headers), Header{Key: []byte(HeaderSignature), Value: []byte(sig)})
	return rec
}

// setHeader returns rec with the first header named name set to value (nil
// value: a null header value), or without it when remove is set, or with
// it appended when absent.
func setHeader(rec Record, name string, value []byte, remove bool) Record {
	var out []Header
	done := false
	for _, h := range rec.Headers {
		if string(h.Key) == name && !done {
			done = true
			if !remove {
				out = append(out, Header{Key: h.Key, Value: value})
			}
			continue
		}
		out = append(out, h)
	}
	if !done && !remove {
		out = append(out, Header{Key: []byte(name), Value: value})
	}
	rec.Headers = out
	return rec
}

func mustSign(t testing.TB, key []byte, rec Record) string {
	t.Helper()
	sig, err := Sign(key, rec)
	if err != nil {
		t.Fatalf("Sign: %v", err)
	}
	return sig
}

// TestSignCoversFields checks that changing any signed field changes the
// signature, and that changing anything else does not.
func TestSignCoversFields(t *testing.T) {
	base := signedRec()
	baseSig := mustSign(t, testKey, base)
	if !regexp.MustCompile(`^[0-9a-f]{64}$`).MatchString(baseSig) {
		t.Fatalf("signature %q is not 64 lowercase hex digits", baseSig)
	}
	otherKey := bytes.Repeat([]byte{7}, MinKeyBytes)
	tests := []struct {
		name    string
		rec     Record
		key     []byte // nil: testKey
		changes bool
	}{
		// Signed fields.
		{name: "source", rec: setHeader(base, HeaderSource, []byte("billing2"), false), changes: true},
		{name: "target", rec: setHeader(base, HeaderTarget, []byte("orders.updated"), false), changes: true},
		{name: "record key", rec: Record{Key: []byte("order-43"), Value: base.Value, Headers: base.Headers}, changes: true},
		{name: "record key null", rec: Record{Value: base.Value, Headers: base.Headers}, changes: true},
		{name: "record value", rec: Record{Key: base.Key, Value: []byte(`{"order":43}`), Headers: base.Headers}, changes: true},
		{name: "record value null", rec: Record{Key: base.Key, Headers: base.Headers}, changes: true},
		{name: "record value empty", rec: Record{Key: base.Key, Value: []byte{}, Headers: base.Headers}, changes: true},
		{name: "at", rec: setHeader(base, HeaderAt, []byte("2026-06-01T13:00:01Z"), false), changes: true},
		{name: "at removed", rec: setHeader(base, HeaderAt, nil, true), changes: true},
		{name: "delay", rec: setHeader(base, HeaderDelay, []byte("31s"), false), changes: true},
		{name: "delay removed", rec: setHeader(base, HeaderDelay, nil, true), changes: true},
		{name: "business key", rec: setHeader(base, HeaderKey, []byte("customer-8"), false), changes: true},
		{name: "business key emptied", rec: setHeader(base, HeaderKey, []byte{}, false), changes: true},
		{name: "business key removed", rec: setHeader(base, HeaderKey, nil, true), changes: true},
		{name: "attempt", rec: setHeader(base, HeaderAttempt, []byte("3"), false), changes: true},
		{name: "attempt removed", rec: setHeader(base, HeaderAttempt, nil, true), changes: true},
		{name: "another key", rec: base, key: otherKey, changes: true},
		// Bytes moved from one field to the next: lengths tell them apart.
		{name: "bytes moved between key and value", rec: Record{Key: []byte("order-4"), Value: []byte(`2{"order":42}`), Headers: base.Headers}, changes: true},

		// Not signed.
		{name: "unsigned header changed", rec: setHeader(base, "trace", []byte("t-2"), false)},
		{name: "unsigned header added", rec: setHeader(base, "baggage", []byte("x"), false)},
		{name: "error class added", rec: setHeader(base, HeaderErrorClass, []byte("Timeout"), false)},
		{name: "defer.id and defer.seq added", rec: setHeader(setHeader(base, HeaderID, []byte("5"), false), HeaderSeq, []byte("9"), false)},
		{name: "old signature present", rec: withSignature(base, strings.Repeat("0", 64))},
		{name: "signed headers in another order", rec: Record{Key: base.Key, Value: base.Value, Headers: reversed(base.Headers)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			key := tt.key
			if key == nil {
				key = testKey
			}
			sig := mustSign(t, key, tt.rec)
			if changed := sig != baseSig; changed != tt.changes {
				t.Errorf("signature changed: %v, want %v", changed, tt.changes)
			}
			// Whatever changed, a record verifies under the signature made
			// for it and not under one made for something else.
			if err := Verify(key, setHeader(tt.rec, HeaderSignature, []byte(sig), false)); err != nil {
				t.Errorf("Verify of its own signature: %v", err)
			}
			if err := Verify(key, setHeader(tt.rec, HeaderSignature, []byte(baseSig), false)); (err == nil) == tt.changes {
				t.Errorf("Verify with the original signature: %v, want an error: %v", err, tt.changes)
			}
		})
	}
}

// A null header value and an empty one sign alike, and both differ from an
// absent header: a null defer.key makes a record unordered, as an empty one
// does.
func TestSignNullHeaderValue(t *testing.T) {
	base := setHeader(signedRec(), HeaderKey, nil, true)
	absent := mustSign(t, testKey, base)
	null := mustSign(t, testKey, setHeader(base, HeaderKey, nil, false))
	empty := mustSign(t, testKey, setHeader(base, HeaderKey, []byte{}, false))
	if null != empty {
		t.Errorf("null defer.key signs as %s, empty as %s; want the same", null, empty)
	}
	if null == absent {
		t.Errorf("a null defer.key signs like an absent one (%s): adding it would go unnoticed", null)
	}
	// The record key is different: Kafka and the scheduler keep null apart
	// from empty.
	nullKey := mustSign(t, testKey, Record{Value: base.Value, Headers: base.Headers})
	emptyKey := mustSign(t, testKey, Record{Key: []byte{}, Value: base.Value, Headers: base.Headers})
	if nullKey == emptyKey {
		t.Errorf("null and empty record keys sign alike (%s)", nullKey)
	}
}

func TestSignErrors(t *testing.T) {
	tests := []struct {
		name string
		key  []byte
		rec  Record
		want string
	}{
		{"short key", testKey[:MinKeyBytes-1], signedRec(), "31 bytes, want at least 32"},
		{"no key", nil, signedRec(), "0 bytes"},
		{"no source", testKey, setHeader(signedRec(), HeaderSource, nil, true), "no defer.source"},
		{"empty source", testKey, setHeader(signedRec(), HeaderSource, []byte{}, false), `defer.source ""`},
		{"bad source", testKey, setHeader(signedRec(), HeaderSource, []byte("bill ing"), false), `defer.source "bill ing"`},
		{"signed header twice", testKey, setHeader(signedRec(), "x", nil, false), ""}, // replaced below
	}
	tests[len(tests)-1].rec.Headers = append(tests[len(tests)-1].rec.Headers, hs(HeaderDelay, "1s")...)
	tests[len(tests)-1].want = "defer.delay appears more than once"
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sig, err := Sign(tt.key, tt.rec)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Sign = %q, %v; want an error containing %q", sig, err, tt.want)
			}
		})
	}
}

func TestVerify(t *testing.T) {
	rec := signedRec()
	sig := mustSign(t, testKey, rec)
	tests := []struct {
		name string
		key  []byte
		rec  Record
		is   error // nil: valid
		want string
	}{
		{name: "valid", rec: withSignature(rec, sig)},
		{name: "valid, signature first", rec: Record{Key: rec.Key, Value: rec.Value,
			Headers: append(hs(HeaderSignature, sig), rec.Headers...)}},
		{name: "missing", rec: rec, is: ErrSignatureMissing, want: "not signed"},
		{name: "upper case", rec: withSignature(rec, strings.ToUpper(sig)), is: ErrSignatureInvalid, want: "64 lowercase hex digits"},
		{name: "too short", rec: withSignature(rec, sig[:62]), is: ErrSignatureInvalid, want: "64 lowercase hex digits"},
		{name: "not hex", rec: withSignature(rec, "zz"+sig[2:]), is: ErrSignatureInvalid, want: "64 lowercase hex digits"},
		{name: "empty", rec: withSignature(rec, ""), is: ErrSignatureInvalid, want: `defer.signature ""`},
		{name: "twice", rec: withSignature(withSignature(rec, sig), sig), is: ErrSignatureInvalid, want: "2 times"},
		{name: "one bit off", rec: withSignature(rec, flipHex(sig)), is: ErrSignatureInvalid, want: "does not match"},
		{name: "wrong key", key: bytes.Repeat([]byte{1}, 40), rec: withSignature(rec, sig), is: ErrSignatureInvalid, want: `source "billing"`},
		{name: "no source", rec: withSignature(setHeader(rec, HeaderSource, nil, true), sig), is: ErrSignatureInvalid, want: "no defer.source"},
		{name: "signed header twice", rec: withSignature(setHeader(rec, "x", nil, false), sig), is: ErrSignatureInvalid},
		{name: "short key", key: []byte("short"), rec: withSignature(rec, sig), want: "5 bytes, want at least 32"},
	}
	tests[len(tests)-2].rec.Headers = append(tests[len(tests)-2].rec.Headers, hs(HeaderTarget, "orders.created")...)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			key := tt.key
			if key == nil {
				key = testKey
			}
			err := Verify(key, tt.rec)
			switch {
			case tt.is == nil && tt.want == "":
				if err != nil {
					t.Fatalf("Verify: %v", err)
				}
				return
			case err == nil:
				t.Fatalf("Verify accepted it")
			case tt.is != nil && !errors.Is(err, tt.is):
				t.Errorf("Verify = %v, want it to wrap %v", err, tt.is)
			case tt.is == nil && (errors.Is(err, ErrSignatureInvalid) || errors.Is(err, ErrSignatureMissing)):
				t.Errorf("Verify = %v: a bad key is not a bad signature", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Verify = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func reversed(h []Header) []Header {
	out := slices.Clone(h)
	slices.Reverse(out)
	return out
}

// flipHex flips the lowest bit of the last digit of a hex string.
func flipHex(s string) string {
	b, _ := hex.DecodeString(s)
	b[len(b)-1] ^= 1
	return hex.EncodeToString(b)
}

// TestSigningDocExample checks the worked example of docs/signing.md, which
// other languages' implementations are checked against, against Sign and
// the canonical encoding.
func TestSigningDocExample(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "..", "..", "docs", "signing.md"))
	if err != nil {
		t.Fatalf("docs/signing.md must hold the worked example: %v", err)
	}
	line := regexp.MustCompile(`(?m)^(key|record key|record value|header|canonical|signature) {2,}(.*)$`)
	var (
		key            []byte
		rec            Record
		canonical, sig string
	)
	for _, m := range line.FindAllStringSubmatch(string(data), -1) {
		switch v := m[2]; m[1] {
		case "key":
			if key, err = hex.DecodeString(v); err != nil {
				t.Fatalf("example key %q: %v", v, err)
			}
		case "record key":
			rec.Key = []byte(v)
		case "record value":
			rec.Value = []byte(v)
		case "header":
			name, value, ok := strings.Cut(v, ": ")
			if !ok {
				t.Fatalf("example header %q is not name: value", v)
			}
			rec.Headers = append(rec.Headers, Header{Key: []byte(name), Value: []byte(value)})
		case "canonical":
			canonical = v
		case "signature":
			sig = v
		}
	}
	if key == nil || rec.Key == nil || len(rec.Headers) < 4 || canonical == "" || sig == "" {
		t.Fatalf("the example is incomplete: key %x, record %+v, canonical %q, signature %q", key, rec, canonical, sig)
	}
	f, err := signedContent(rec)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	writeCanonical(&buf, &f)
	if got := hex.EncodeToString(buf.Bytes()); got != canonical {
		t.Errorf("canonical in the docs:\n%s\nthe code gives:\n%s", canonical, got)
	}
	if got := mustSign(t, key, rec); got != sig {
		t.Errorf("signature in the docs %s, Sign gives %s", sig, got)
	}
	if err := Verify(key, withSignature(rec, sig)); err != nil {
		t.Errorf("Verify of the example: %v", err)
	}
	// The field-by-field listing is the canonical string cut into pieces.
	block := regexp.MustCompile("(?s)The canonical string, field by field \\(hex\\):\n\n```text\n(.*?)```").FindStringSubmatch(string(data))
	if block == nil {
		t.Fatal("docs/signing.md lacks the field-by-field listing")
	}
	var joined strings.Builder
	for l := range strings.SplitSeq(block[1], "\n") {
		if hexPart, _, _ := strings.Cut(l, "#"); strings.TrimSpace(hexPart) != "" {
			joined.WriteString(strings.ReplaceAll(strings.TrimSpace(hexPart), " ", ""))
		}
	}
	if joined.String() != canonical {
		t.Errorf("the field-by-field listing reads\n%s\nwant\n%s", joined.String(), canonical)
	}
}

// decodeCanonical parses a canonical signed content back into its fields,
// or fails: the encoding must be unambiguous.
func decodeCanonical(b []byte) ([numSigned]signedField, bool) {
	var f [numSigned]signedField
	rest, ok := bytes.CutPrefix(b, []byte(signatureContext))
	if !ok {
		return f, false
	}
	for i := range f {
		if len(rest) < 1 {
			return f, false
		}
		switch rest[0] {
		case 0:
			rest = rest[1:]
		case 1:
			if len(rest) < 5 {
				return f, false
			}
			n := binary.BigEndian.Uint32(rest[1:5])
			if uint64(len(rest)-5) < uint64(n) {
				return f, false
			}
			f[i] = signedField{true, rest[5 : 5+n]}
			rest = rest[5+n:]
		default:
			return f, false
		}
	}
	return f, len(rest) == 0
}

// FuzzSign checks that the canonical encoding decodes back to the record's
// signed fields (so two different records never share it), that Verify
// accepts what Sign makes and refuses it once a signed field changes.
func FuzzSign(f *testing.F) {
	f.Add([]byte("order-42"), []byte(`{"order":42}`), "billing", "orders.created", "", "30s", "", "2", uint8(0xff), []byte("x"))
	f.Add([]byte(nil), []byte(nil), "a", "", "2026-06-01T13:00:00Z", "", "k", "", uint8(0), []byte(nil))
	f.Add([]byte{}, []byte{}, "s.1_-", "t", "", "", "", "", uint8(0x55), []byte{0})
	f.Fuzz(func(t *testing.T, key, value []byte, source, target, at, delay, bizKey, attempt string, present uint8, flip []byte) {
		rec := Record{Key: key, Value: value}
		add := func(bit uint8, name, v string) {
			if present&bit != 0 {
				rec.Headers = append(rec.Headers, Header{Key: []byte(name), Value: []byte(v)})
			}
		}
		add(1, HeaderTarget, target)
		add(2, HeaderAt, at)
		add(4, HeaderDelay, delay)
		add(8, HeaderKey, bizKey)
		add(16, HeaderAttempt, attempt)
		add(32, "other", string(flip))
		rec.Headers = append(rec.Headers, Header{Key: []byte(HeaderSource), Value: []byte(source)})

		fields, err := signedContent(rec)
		if err != nil {
			t.Fatalf("signedContent: %v", err)
		}
		var buf bytes.Buffer
		writeCanonical(&buf, &fields)
		back, ok := decodeCanonical(buf.Bytes())
		if !ok {
			t.Fatalf("canonical %x does not decode", buf.Bytes())
		}
		for i := range back {
			if back[i].present != fields[i].present || !bytes.Equal(back[i].b, fields[i].b) {
				t.Errorf("field %d decodes as %v %q, was %v %q", i, back[i].present, back[i].b, fields[i].present, fields[i].b)
			}
		}

		sig, err := Sign(testKey, rec)
		if !ValidSource(source) {
			if err == nil {
				t.Fatalf("Sign accepted defer.source %q", source)
			}
			return
		}
		if err != nil {
			t.Fatalf("Sign: %v", err)
		}
		if err := Verify(testKey, withSignature(rec, sig)); err != nil {
			t.Fatalf("Verify(Sign): %v", err)
		}
		// Change one signed header: the signature must no longer verify.
		changed := setHeader(rec, HeaderTarget, append([]byte(target), flip...), false)
		if present&1 == 0 || len(flip) > 0 {
			if err := Verify(testKey, withSignature(changed, sig)); !errors.Is(err, ErrSignatureInvalid) {
				t.Errorf("Verify after changing defer.target: %v, want ErrSignatureInvalid", err)
			}
		}
	})
}

func TestParseSigningKeys(t *testing.T) {
	hexA := strings.Repeat("ab", 32)
	hexB := strings.Repeat("0F", 40)
	keyA, _ := hex.DecodeString(hexA)
	keyB, _ := hex.DecodeString(hexB)
	short := strings.Repeat("cd", 16)
	tests := []struct {
		name string
		in   string
		want map[string][]byte
		// errs: each string must be in the error; secret: none of these
		// may be.
		errs   []string
		secret []string
	}{
		{name: "empty", in: "", want: map[string][]byte{}},
		{name: "one", in: "billing=" + hexA, want: map[string][]byte{"billing": keyA}},
		{name: "two, white space, empty entries, upper case", in: " billing = " + hexA + " ,, orders.v2_x-y=" + hexB + ",",
			want: map[string][]byte{"billing": keyA, "orders.v2_x-y": keyB}},
		{name: "odd number of digits", in: "billing=" + hexA + "a", errs: []string{"entry 1", `source "billing"`, "odd"}, secret: []string{hexA}},
		{name: "not hex", in: "orders=" + hexB + ",billing=" + strings.Repeat("zz", 32),
			errs: []string{"entry 2", `source "billing"`, "not hex"}, secret: []string{"zz"}},
		{name: "base64 is not accepted", in: "billing=q6urq6urq6urq6urq6urq6urq6urq6urq6urq6urq6s=",
			errs: []string{"entry 1", "billing", "not hex"}, secret: []string{"q6ur"}},
		{name: "short", in: "billing=" + short, errs: []string{`source "billing"`, "16 bytes, want at least 32"}, secret: []string{short}},
		{name: "empty key", in: "billing=", errs: []string{`source "billing"`, "empty"}},
		{name: "duplicate source", in: "billing=" + hexA + ",orders=" + hexA + ",billing=" + hexB,
			errs: []string{"entry 3", `source "billing"`, "again", "entry 1"}, secret: []string{hexA, hexB}},
		{name: "no =", in: hexA, errs: []string{"entry 1", "no '='"}, secret: []string{hexA}},
		{name: "bad source name not shown", in: "bill ing" + hexA[:10] + "=" + hexA, errs: []string{"entry 1", "source name (not shown)"},
			secret: []string{hexA[:10]}},
		{name: "key in the place of the name", in: hexA + "=billing", errs: []string{"entry 1", "looks like a key", "not hex"}, secret: []string{hexA}},
		{name: "every problem", in: "a=" + short + ",b=xy,c", errs: []string{"entry 1", "entry 2", "entry 3"}, secret: []string{short}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseSigningKeys(tt.in)
			checkKeysResult(t, got, err, tt.want, tt.errs, tt.secret)
		})
	}
}

func checkKeysResult(t *testing.T, got map[string][]byte, err error, want map[string][]byte, errs, secret []string) {
	t.Helper()
	if len(errs) == 0 {
		if err != nil {
			t.Fatalf("error: %v", err)
		}
		if !maps.EqualFunc(got, want, bytes.Equal) {
			t.Errorf("keys %x, want %x", got, want)
		}
		return
	}
	if err == nil {
		t.Fatalf("no error; keys %x", got)
	}
	for _, s := range errs {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error lacks %q:\n%v", s, err)
		}
	}
	for _, s := range secret {
		if strings.Contains(err.Error(), s) {
			t.Errorf("error shows key material %q:\n%v", s, err)
		}
	}
}

func TestParseSigningKeysFile(t *testing.T) {
	hexA := strings.Repeat("ab", 32)
	keyA, _ := hex.DecodeString(hexA)
	hexB := strings.Repeat("12", 33)
	keyB, _ := hex.DecodeString(hexB)
	tests := []struct {
		name   string
		in     string
		want   map[string][]byte
		errs   []string
		secret []string
	}{
		{name: "empty file", in: "", want: map[string][]byte{}},
		{name: "comments, blank lines, CRLF, white space",
			in:   "# signing keys\r\n\r\nbilling=" + hexA + "\r\n   # indented comment\n\t orders = " + hexB + "  \n",
			want: map[string][]byte{"billing": keyA, "orders": keyB}},
		{name: "line numbers", in: "# c\nbilling=" + hexA + "\n\norders=" + hexB[:20] + "\n",
			errs: []string{"line 4", `source "orders"`, "10 bytes"}, secret: []string{hexB[:20]}},
		{name: "duplicate", in: "billing=" + hexA + "\nbilling=" + hexB,
			errs: []string{"line 2", "again", "line 1"}, secret: []string{hexA, hexB}},
		{name: "inline comment is not a comment", in: "billing=" + hexA + " # main key",
			errs: []string{"line 1", `source "billing"`, "not hex"}, secret: []string{hexA}},
		{name: "bare key", in: hexA, errs: []string{"line 1", "no '='"}, secret: []string{hexA}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseSigningKeysFile([]byte(tt.in))
			checkKeysResult(t, got, err, tt.want, tt.errs, tt.secret)
		})
	}
}

func TestMergeSigningKeys(t *testing.T) {
	a, b, c := bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32), bytes.Repeat([]byte{3}, 32)
	keys := map[string][]byte{"billing": a, "orders": b}
	err := MergeSigningKeys(keys, map[string][]byte{"orders": c, "shipping": c})
	if err == nil || !strings.Contains(err.Error(), `source "orders" is given in both`) {
		t.Errorf("MergeSigningKeys: %v, want an error naming orders", err)
	}
	for _, k := range [][]byte{a, b, c} {
		if strings.Contains(err.Error(), string(k)) || strings.Contains(err.Error(), hex.EncodeToString(k)) {
			t.Errorf("error shows a key: %v", err)
		}
	}
	want := map[string][]byte{"billing": a, "orders": b, "shipping": c}
	if !maps.EqualFunc(keys, want, bytes.Equal) {
		t.Errorf("merged %x, want %x (the first key of a duplicate kept)", keys, want)
	}
}

func TestNewSigning(t *testing.T) {
	good := bytes.Repeat([]byte{0xaa}, MinKeyBytes)
	s, err := NewSigning(map[string][]byte{"orders": good, "billing": good}, true)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.Sources(); !slices.Equal(got, []string{"billing", "orders"}) || !s.Required() {
		t.Errorf("Sources() = %q, Required() = %v", got, s.Required())
	}
	good[0] = 0 // NewSigning copied the keys
	if s.keys["orders"][0] != 0xaa {
		t.Error("NewSigning kept the caller's key slice")
	}
	// Formatted any way, only the sources show.
	for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%x", "%q", "%d"} {
		out := fmt.Sprintf(verb, s) + fmt.Sprintf(verb, Rules{Signing: s})
		if strings.Contains(out, "aaaaaaaa") || strings.Contains(out, "170 170") || strings.Contains(out, "\xaa\xaa") {
			t.Errorf("%s shows the key: %s", verb, out)
		}
		if !strings.Contains(out, "billing") {
			t.Errorf("%s does not show the sources: %s", verb, out)
		}
	}
	var none *Signing
	if none.Sources() != nil || none.Required() || none.String() != "signing off" {
		t.Errorf("nil Signing: %v %v %q", none.Sources(), none.Required(), none.String())
	}

	_, err = NewSigning(map[string][]byte{"ok": good, "bad name": good, "short": good[:31]}, false)
	for _, want := range []string{`source "bad name"`, `source "short": key is 31 bytes`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("NewSigning error %v, want it to contain %q", err, want)
		}
	}
}

// TestSigningCheck checks the signature rules applied after Parse, case by
// case, with and without SIGNING_REQUIRED.
func TestSigningCheck(t *testing.T) {
	keyed, err := NewSigning(map[string][]byte{"billing": testKey}, false)
	if err != nil {
		t.Fatal(err)
	}
	required, err := NewSigning(map[string][]byte{"billing": testKey}, true)
	if err != nil {
		t.Fatal(err)
	}
	unsigned := Record{Key: []byte("k"), Headers: base(HeaderSource, "billing")}
	signed := withSignature(unsigned, mustSign(t, testKey, unsigned))
	otherSource := Record{Key: []byte("k"), Headers: base(HeaderSource, "orders")}
	noSource := Record{Key: []byte("k"), Headers: base()}
	sigNoSource := withSignature(noSource, strings.Repeat("a", 64))
	tampered := setHeader(signed, HeaderDelay, []byte("1s"), false)
	otherKey := bytes.Repeat([]byte{9}, MinKeyBytes)
	otherSig := mustSign(t, otherKey, otherSource)
	otherSigned := withSignature(otherSource, otherSig)

	tests := []struct {
		name    string
		signing *Signing
		rec     Record
		code    string // "" accepted
		detail  string
	}{
		{"no signing: unsigned", nil, unsigned, "", ""},
		{"no signing: signature without source ignored", nil, sigNoSource, "", ""},
		{"no signing: garbage signature ignored", nil, withSignature(unsigned, "x"), "", ""},
		{"no keys, not required: ignored", &Signing{}, sigNoSource, "", ""},
		{"signed", keyed, signed, "", ""},
		{"signed, required", required, signed, "", ""},
		{"unsigned from a keyed source", keyed, unsigned, codeSignatureMissing, `defer.source "billing" has a signing key`},
		{"tampered", keyed, tampered, codeSignatureInvalid, "does not match"},
		{"malformed", keyed, withSignature(unsigned, "XYZ"), codeSignatureInvalid, "64 lowercase hex digits"},
		{"signed with another source's key", keyed, withSignature(unsigned, otherSig), codeSignatureInvalid, "does not match"},
		{"unkeyed source", keyed, otherSource, "", ""},
		{"unkeyed source, its own signature ignored", keyed, otherSigned, "", ""},
		{"unkeyed source, required", required, otherSource, codeUnknownSource, `"orders" has no signing key`},
		{"no source", keyed, noSource, "", ""},
		{"no source, required", required, noSource, codeSignatureMissing, "no defer.source and no defer.signature"},
		{"signature without source", keyed, sigNoSource, codeSignatureWithoutSource, "defer.source is absent"},
		{"signature without source, required", required, sigNoSource, codeSignatureWithoutSource, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rules := testRules()
			rules.Signing = tt.signing
			sc, err := Parse(tt.rec, rules, testNow)
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			rej := tt.signing.Check(tt.rec, &sc)
			if tt.code == "" {
				if rej != nil {
					t.Fatalf("rejected: %v", rej)
				}
				return
			}
			if rej == nil {
				t.Fatalf("accepted, want %s", tt.code)
			}
			if rej.Code != tt.code || !strings.Contains(rej.Detail, tt.detail) || !isText([]byte(rej.Detail)) {
				t.Errorf("rejected %v, want code %s with %q", rej, tt.code, tt.detail)
			}
		})
	}
}

// Judge checks signatures after Parse: a record with another problem is
// rejected for that one, and a rejected signature is never parked by the
// retry rules.
func TestJudgeChecksSignatures(t *testing.T) {
	signing, err := NewSigning(map[string][]byte{"billing": testKey}, false)
	if err != nil {
		t.Fatal(err)
	}
	rules := testDecisionRules(t)
	rules.Signing = signing
	rnd := func() float64 { return 0.5 }

	unsigned := Record{Key: []byte("k"), Headers: base(HeaderSource, "billing", HeaderErrorClass, "permanent")}
	sc, d, rej := Judge(unsigned, rules, testNow, rnd)
	if rej == nil || rej.Code != codeSignatureMissing || d.Park != nil {
		t.Errorf("unsigned permanent record: reject %v, park %v; want signature_missing and no park", rej, d.Park)
	}
	if sc.Target != "orders.created" || sc.Source != "billing" {
		t.Errorf("rejected record's schedule %+v lost its fields", sc)
	}

	both := Record{Key: []byte("k"), Headers: hs(HeaderSource, "billing", HeaderDelay, "1s")}
	if _, _, rej := Judge(both, rules, testNow, rnd); rej == nil || rej.Code != codeMissingTarget {
		t.Errorf("unsigned record without a target: %v, want missing_target (Parse's problems first)", rej)
	}

	signed := withSignature(unsigned, mustSign(t, testKey, unsigned))
	if _, d, rej := Judge(signed, rules, testNow, rnd); rej != nil || d.Park == nil || d.Park.Code != codePermanent {
		t.Errorf("signed permanent record: reject %v, park %v; want parked as permanent", rej, d.Park)
	}
}
