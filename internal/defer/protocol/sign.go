package protocol

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"

	"github.com/deferq/scheduler/internal/reason"
)

// Record signing (docs/signing.md). A producing service names itself in
// defer.source and signs the record with HMAC-SHA256 under its own key; the
// signature, in defer.signature, covers the fields that say where, when and
// what is republished. A source that has a key configured cannot have
// unsigned or forged records scheduled in its name: they are stored as
// rejected instead.

// MinKeyBytes is the shortest signing key accepted: HMAC-SHA256 gets no
// stronger with longer keys, and a shorter one is weaker than the hash.
const MinKeyBytes = 32

// MaxSourceBytes is the longest defer.source.
const MaxSourceBytes = 128

// signatureContext starts the signed content, so that a signature made for
// this purpose and version cannot pass for any other.
const signatureContext = "defer-signature-v1"

// Rejection codes of signature checks (see Signing). Like every rejection
// code they never change.
const (
	codeSignatureMissing       = reason.SignatureMissing
	codeSignatureInvalid       = reason.SignatureInvalid
	codeSignatureWithoutSource = reason.SignatureWithoutSource
	codeUnknownSource          = reason.UnknownSource
)

// Verify's errors. They are wrapped with what exactly is wrong.
var (
	// ErrSignatureMissing: the record has no defer.signature.
	ErrSignatureMissing = errors.New("no " + HeaderSignature)
	// ErrSignatureInvalid: defer.signature is malformed, or does not match
	// the record under the key.
	ErrSignatureInvalid = errors.New(HeaderSignature + " is not valid")
)

// Indexes of the signed fields, in the order they are signed.
const (
	sigSource = iota
	sigTarget
	sigRecordKey
	sigRecordValue
	sigAt
	sigDelay
	sigKey
	sigAttempt
	numSigned
)

// signedHeaders maps the signed fields that are headers to their names.
var signedHeaders = map[int]string{
	sigSource:  HeaderSource,
	sigTarget:  HeaderTarget,
	sigAt:      HeaderAt,
	sigDelay:   HeaderDelay,
	sigKey:     HeaderKey,
	sigAttempt: HeaderAttempt,
}

// signedHeader returns the signed field a header named name is, if any.
func signedHeader(name []byte) (int, bool) {
	switch string(name) { // does not allocate
	case HeaderSource:
		return sigSource, true
	case HeaderTarget:
		return sigTarget, true
	case HeaderAt:
		return sigAt, true
	case HeaderDelay:
		return sigDelay, true
	case HeaderKey:
		return sigKey, true
	case HeaderAttempt:
		return sigAttempt, true
	}
	return 0, false
}

// signedField is one field of the signed content.
type signedField struct {
	present bool
	b       []byte
}

// signedContent picks the signed fields out of rec. A record key or value
// is present unless it is null; an empty one is present with no bytes. A
// header is present when the record has it; a null value counts as empty,
// since the scheduler reads the two alike (a null defer.key means
// "unordered", as an empty one does), and a signature must not let a
// header be added unnoticed. It fails when a signed header appears twice
// (the scheduler rejects such records anyway) or a field is too long for
// its 4-byte length.
func signedContent(rec Record) ([numSigned]signedField, error) {
	var f [numSigned]signedField
	if rec.Key != nil {
		f[sigRecordKey] = signedField{true, rec.Key}
	}
	if rec.Value != nil {
		f[sigRecordValue] = signedField{true, rec.Value}
	}
	for i := range rec.Headers {
		h := &rec.Headers[i]
		n, ok := signedHeader(h.Key)
		if !ok {
			continue
		}
		if f[n].present {
			return f, fmt.Errorf("%s appears more than once; a signed header may appear only once", signedHeaders[n])
		}
		f[n] = signedField{true, h.Value}
	}
	for n := range f {
		if uint64(len(f[n].b)) > math.MaxUint32 {
			return f, fmt.Errorf("signed field %d is %d bytes, more than a 4-byte length can say", n+1, len(f[n].b))
		}
	}
	return f, nil
}

// writeCanonical writes the signed content of f to w: signatureContext,
// then each field in order as a presence byte (0 absent, 1 present) and,
// when present, its length as 4 bytes big-endian and its bytes. w is a
// hash or a bytes.Buffer, whose Write never fails.
func writeCanonical(w io.Writer, f *[numSigned]signedField) {
	_, _ = io.WriteString(w, signatureContext)
	var head [5]byte
	for i := range f {
		if !f[i].present {
			_, _ = w.Write(head[:1]) // 0
			continue
		}
		head[0] = 1
		binary.BigEndian.PutUint32(head[1:], uint32(len(f[i].b)))
		_, _ = w.Write(head[:])
		_, _ = w.Write(f[i].b)
		head[0] = 0
	}
}

// mac returns the HMAC-SHA256 of f's signed content under key.
func mac(key []byte, f *[numSigned]signedField) []byte {
	h := hmac.New(sha256.New, key)
	writeCanonical(h, f)
	return h.Sum(nil)
}

func checkKey(key []byte) error {
	if len(key) < MinKeyBytes {
		return fmt.Errorf("signing key is %d bytes, want at least %d", len(key), MinKeyBytes)
	}
	return nil
}

// Sign returns the defer.signature of rec under key (at least MinKeyBytes):
// the HMAC-SHA256, in lowercase hex, of the record's signed content (see
// docs/signing.md for the exact bytes). rec must carry the defer.source the
// key belongs to; it may carry a defer.signature already, which is not
// signed and is ignored. The caller adds the result as the defer.signature
// header, replacing any old one.
//
// The signature covers defer.source, defer.target, the record key and
// value, defer.at, defer.delay, defer.key and defer.attempt. Other headers
// (the error context, defer.id, the producer's own) can change without
// breaking it.
func Sign(key []byte, rec Record) (string, error) {
	if err := checkKey(key); err != nil {
		return "", fmt.Errorf("sign record: %w", err)
	}
	f, err := signedContent(rec)
	if err != nil {
		return "", fmt.Errorf("sign record: %w", err)
	}
	if err := checkSource(&f); err != nil {
		return "", fmt.Errorf("sign record: %w", err)
	}
	return hex.EncodeToString(mac(key, &f)), nil
}

// checkSource checks that the signed content names a valid source: a
// signature without one could not be attributed to a key.
func checkSource(f *[numSigned]signedField) error {
	switch src := f[sigSource]; {
	case !src.present:
		return fmt.Errorf("the record has no %s, which names the key that signs it", HeaderSource)
	case !ValidSource(src.b):
		return fmt.Errorf("%s %s is not 1 to %d of [A-Za-z0-9._-]", HeaderSource, quote(src.b), MaxSourceBytes)
	}
	return nil
}

// Verify checks rec's defer.signature under key, in constant time. It
// returns nil when the signature is Sign's for rec, an error wrapping
// ErrSignatureMissing when there is none, and one wrapping
// ErrSignatureInvalid when it is malformed (not 64 lowercase hex digits,
// given twice), the record could not have been signed (no defer.source, a
// signed header twice) or it does not match.
func Verify(key []byte, rec Record) error {
	if err := checkKey(key); err != nil {
		return fmt.Errorf("verify record: %w", err)
	}
	if missing, problem := verify(key, rec); problem != "" {
		if missing {
			return fmt.Errorf("%w: %s", ErrSignatureMissing, problem)
		}
		return fmt.Errorf("%w: %s", ErrSignatureInvalid, problem)
	}
	return nil
}

// verify is Verify without the key check; it says whether the signature is
// missing, and the problem, or "" when the signature is good.
func verify(key []byte, rec Record) (missing bool, problem string) {
	var sig []byte
	n := 0
	for i := range rec.Headers {
		if string(rec.Headers[i].Key) == HeaderSignature {
			if n == 0 {
				sig = rec.Headers[i].Value
			}
			n++
		}
	}
	switch {
	case n == 0:
		return true, "the record is not signed"
	case n > 1:
		return false, fmt.Sprintf("%s appears %d times", HeaderSignature, n)
	}
	want, ok := decodeSignature(sig)
	if !ok {
		return false, fmt.Sprintf("%s %s is not %d lowercase hex digits", HeaderSignature, quote(sig), 2*sha256.Size)
	}
	f, err := signedContent(rec)
	if err != nil {
		return false, err.Error()
	}
	if err := checkSource(&f); err != nil {
		return false, err.Error()
	}
	if !hmac.Equal(mac(key, &f), want) {
		return false, fmt.Sprintf("%s does not match the record under the key of source %q (it covers %s, %s, the record key and value, %s, %s, %s and %s)",
			HeaderSignature, f[sigSource].b, HeaderSource, HeaderTarget, HeaderAt, HeaderDelay, HeaderKey, HeaderAttempt)
	}
	return false, ""
}

// decodeSignature decodes a defer.signature value: exactly 64 lowercase hex
// digits. Upper case is refused so that a signature has one spelling.
func decodeSignature(b []byte) ([]byte, bool) {
	if len(b) != 2*sha256.Size {
		return nil, false
	}
	for _, c := range b {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return nil, false
		}
	}
	out := make([]byte, sha256.Size)
	if _, err := hex.Decode(out, b); err != nil {
		return nil, false
	}
	return out, true
}

// ValidSource reports whether b is a valid defer.source: 1 to
// MaxSourceBytes of [A-Za-z0-9._-].
func ValidSource[T string | []byte](b T) bool {
	if len(b) == 0 || len(b) > MaxSourceBytes {
		return false
	}
	for i := 0; i < len(b); i++ {
		switch c := b[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// Signing is what ingest checks signatures with: the key of each source and
// whether every record must be signed. A nil *Signing checks nothing.
//
// It never shows its keys: formatted with any verb it prints only its
// sources.
type Signing struct {
	keys     map[string][]byte
	required bool
}

// NewSigning returns the checks for keys, by source, copied. With required,
// records without defer.source, or from a source with no key, are rejected
// too. Each source must be a valid defer.source and each key at least
// MinKeyBytes; errors name the source, never the key.
func NewSigning(keys map[string][]byte, required bool) (*Signing, error) {
	s := &Signing{keys: make(map[string][]byte, len(keys)), required: required}
	var errs []error
	for _, src := range sortedSources(keys) {
		key := keys[src]
		switch {
		case !ValidSource(src):
			errs = append(errs, fmt.Errorf("source %s: not 1 to %d of [A-Za-z0-9._-]", sourceLabel(src), MaxSourceBytes))
		case len(key) < MinKeyBytes:
			errs = append(errs, fmt.Errorf("source %s: key is %d bytes, want at least %d", sourceLabel(src), len(key), MinKeyBytes))
		default:
			s.keys[src] = slices.Clone(key)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return s, nil
}

// Sources returns the sources that have a key, sorted.
func (s *Signing) Sources() []string {
	if s == nil {
		return nil
	}
	return sortedSources(s.keys)
}

// Required reports whether every record must be signed.
func (s *Signing) Required() bool { return s != nil && s.required }

// Keys returns a copy of the signing keys, by source: the key-state query
// authenticates a source's requests with the key that signs its records.
// Nil for a nil Signing.
func (s *Signing) Keys() map[string][]byte {
	if s == nil {
		return nil
	}
	out := make(map[string][]byte, len(s.keys))
	for src, k := range s.keys {
		out[src] = slices.Clone(k)
	}
	return out
}

// enabled reports whether signatures are checked at all.
func (s *Signing) enabled() bool { return s != nil && (len(s.keys) > 0 || s.required) }

// String describes s without its keys.
func (s *Signing) String() string {
	if !s.enabled() {
		return "signing off"
	}
	return fmt.Sprintf("signing: sources [%s], required %v", strings.Join(s.Sources(), " "), s.required)
}

// Format implements fmt.Formatter so that no verb, %#v included, prints
// the keys.
func (s *Signing) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, s.String()) }

func sortedSources(keys map[string][]byte) []string {
	out := make([]string, 0, len(keys))
	for src := range keys {
		out = append(out, src)
	}
	slices.Sort(out)
	return out
}

// Check applies the signature rules to rec, which Parse accepted as sc,
// and returns the rejection, or nil. In this order:
//
//   - no defer.source: with a defer.signature, signature_without_source (it
//     cannot be checked); without, signature_missing when every record must
//     be signed; else the record is accepted.
//   - a source without a key: unknown_source when every record must be
//     signed, else accepted (a signature is then ignored).
//   - a source with a key: signature_missing without defer.signature,
//     signature_invalid when it does not verify.
//
// With no keys and nothing required, signatures are ignored altogether.
func (s *Signing) Check(rec Record, sc *Schedule) *RejectError {
	if !s.enabled() {
		return nil
	}
	if sc.Source == "" {
		switch {
		case hasHeader(rec, HeaderSignature):
			return &RejectError{Code: codeSignatureWithoutSource, Detail: fmt.Sprintf(
				"%s is present but %s is absent, so no key can check it", HeaderSignature, HeaderSource)}
		case s.required:
			return &RejectError{Code: codeSignatureMissing, Detail: fmt.Sprintf(
				"the record has no %s and no %s, and every record must be signed (SIGNING_REQUIRED)", HeaderSource, HeaderSignature)}
		}
		return nil
	}
	key, ok := s.keys[sc.Source]
	if !ok {
		if s.required {
			return &RejectError{Code: codeUnknownSource, Detail: fmt.Sprintf(
				"%s %q has no signing key, and every record must be signed (SIGNING_REQUIRED)", HeaderSource, sc.Source)}
		}
		return nil
	}
	missing, problem := verify(key, rec)
	switch {
	case missing:
		return &RejectError{Code: codeSignatureMissing, Detail: fmt.Sprintf(
			"%s %q has a signing key, but the record has no %s", HeaderSource, sc.Source, HeaderSignature)}
	case problem != "":
		return &RejectError{Code: codeSignatureInvalid, Detail: problem}
	}
	return nil
}

func hasHeader(rec Record, name string) bool {
	for i := range rec.Headers {
		if string(rec.Headers[i].Key) == name {
			return true
		}
	}
	return false
}

// ParseSigningKeys parses a list of signing keys, SIGNING_KEYS: entries
// "source=KEY" separated by commas, where KEY is the key in hex (upper or
// lower case, at least 2*MinKeyBytes digits). White space around entries
// and their parts is ignored, and so are empty entries. Every problem is
// reported, by entry number (1-based, counting empty ones) and source;
// neither a key nor an entry that cannot be told apart from one is ever
// quoted.
func ParseSigningKeys(list string) (map[string][]byte, error) {
	keys := map[string][]byte{}
	where := map[string]string{}
	var errs []error
	pos := 0
	for entry := range strings.SplitSeq(list, ",") {
		pos++
		if strings.TrimSpace(entry) == "" {
			continue
		}
		if err := addKeyEntry(keys, where, entry, fmt.Sprintf("entry %d", pos)); err != nil {
			errs = append(errs, err)
		}
	}
	return keys, errors.Join(errs...)
}

// ParseSigningKeysFile parses the contents of a signing key file,
// SIGNING_KEYS_FILE: one "source=KEY" per line, as in ParseSigningKeys.
// Blank lines and lines whose first non-blank character is '#' are
// ignored. Problems are reported by line number and source, never quoting
// a key.
func ParseSigningKeysFile(data []byte) (map[string][]byte, error) {
	keys := map[string][]byte{}
	where := map[string]string{}
	var errs []error
	for i, line := range strings.Split(string(data), "\n") {
		t := strings.TrimSpace(line)
		if t == "" || strings.HasPrefix(t, "#") {
			continue
		}
		if err := addKeyEntry(keys, where, t, fmt.Sprintf("line %d", i+1)); err != nil {
			errs = append(errs, err)
		}
	}
	return keys, errors.Join(errs...)
}

// MergeSigningKeys adds the keys of more to keys. A source in both is an
// error, one per source, naming it but not its keys: two keys for one
// source is a mistake that no order of precedence would make right.
func MergeSigningKeys(keys, more map[string][]byte) error {
	var errs []error
	for _, src := range sortedSources(more) {
		if _, dup := keys[src]; dup {
			errs = append(errs, fmt.Errorf("source %s is given in both; give each source one key", sourceLabel(src)))
			continue
		}
		keys[src] = more[src]
	}
	return errors.Join(errs...)
}

// addKeyEntry parses one "source=KEY" entry found at pos and adds it to
// keys, noting in where where each source was found.
func addKeyEntry(keys map[string][]byte, where map[string]string, entry, pos string) error {
	src, hexKey, ok := strings.Cut(entry, "=")
	src, hexKey = strings.TrimSpace(src), strings.TrimSpace(hexKey)
	switch {
	case !ok:
		// The entry may be a bare key: it is not shown.
		return fmt.Errorf("%s has no '=': want source=KEY", pos)
	case !ValidSource(src):
		// A name this malformed may be a key given in the wrong place.
		return fmt.Errorf("%s: the source name (not shown) is not 1 to %d of [A-Za-z0-9._-]", pos, MaxSourceBytes)
	}
	label := sourceLabel(src)
	if first, dup := where[src]; dup {
		return fmt.Errorf("%s: source %s is given again (first at %s)", pos, label, first)
	}
	where[src] = pos
	key, problem := decodeKey(hexKey)
	if problem != "" {
		return fmt.Errorf("%s: source %s: key %s", pos, label, problem)
	}
	keys[src] = key
	return nil
}

// decodeKey decodes a hex key. It returns the problem, which never quotes
// the key, or "".
func decodeKey(s string) ([]byte, string) {
	if s == "" {
		return nil, "is empty"
	}
	if len(s)%2 != 0 {
		return nil, fmt.Sprintf("is not hex: %d digits, an odd number", len(s))
	}
	key, err := hex.DecodeString(s)
	if err != nil {
		// hex's error quotes the offending character: not shown.
		return nil, "is not hex: it has characters other than 0-9, a-f and A-F"
	}
	if len(key) < MinKeyBytes {
		return nil, fmt.Sprintf("is %d bytes, want at least %d (%d hex digits)", len(key), MinKeyBytes, 2*MinKeyBytes)
	}
	return key, ""
}

// sourceLabel quotes a source name for an error, unless it looks like a
// key (at least 2*MinKeyBytes hex digits: a key typed where the name
// belongs), which is not shown.
func sourceLabel(src string) string {
	if len(src) >= 2*MinKeyBytes && strings.Trim(src, "0123456789abcdefABCDEF") == "" {
		return "(a name that looks like a key, not shown)"
	}
	return fmt.Sprintf("%q", src)
}
