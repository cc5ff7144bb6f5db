// Package keystate answers the key-state query of consumers that keep the
// order of a business key end to end (the client library, deferclient):
// for a consumer group and a batch of business keys, which are blocked, and
// why. The answer is read-your-writes with respect to the defer topic: it
// reflects every record produced there before the question was asked,
// because the server waits until ingest has stored every partition of the
// defer topic up to its high-water mark (bounded; past the bound it says
// so, and the client treats the keys as blocked). This package is the wire
// format, which the client library (deferclient) and the server
// (internal/keygate) share; it depends on the standard library only, so
// that the public client pulls in nothing of the server's.
package keystate

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"strconv"
)

// Path is where the scheduler serves the query, on HTTP_ADDR (POST).
const Path = "/v1/key-state"

// Limits of a request; a request past them is refused with 400 (413 for the
// body) and changes nothing.
const (
	MaxKeys      = 1000
	MaxKeyBytes  = 1024 // the protocol's business key limit
	MaxBodyBytes = 2 << 20
	// MaxWaitMillis bounds how long a request may let the server wait for
	// ingest.
	MaxWaitMillis = 10_000
	// MaxPositions bounds Request.Positions: partitions of the defer topic.
	MaxPositions = 10_000
)

// Request asks about Keys, for consumer group Group.
type Request struct {
	Group string   `json:"group"`
	Keys  []string `json:"keys"`
	// WaitMillis bounds how long the server waits for ingest to store what
	// was produced before the request; 0 means the server's default.
	WaitMillis int `json:"wait_ms,omitempty"`
	// Wait says what the server waits for before it answers: WaitAll
	// (also when empty) or WaitPositions.
	Wait string `json:"wait,omitempty"`
	// Positions, with WaitPositions, are what ingest must have stored:
	// per partition of the defer topic, the offset ingest must have read
	// up to (the next offset it reads at least this). Empty: nothing to
	// wait for.
	Positions map[int32]int64 `json:"positions,omitempty"`
}

// What a request waits for (Request.Wait).
const (
	// WaitAll: ingest must have stored every partition of the defer topic
	// up to its high-water mark when the request came in, so that the
	// answer reflects every record produced before the question, whoever
	// produced it. For a consumer that has just been assigned partitions,
	// whose predecessor may have deferred keys, and for callers that know
	// nothing of their own deferrals.
	WaitAll = "all"
	// WaitPositions: ingest must have stored Positions only. For a
	// consumer that keeps its own deferrals blocked until an answer's
	// Stored covers them, and had an answer that waited for all since it
	// got its partitions (docs/design.md, "Read-your-writes").
	WaitPositions = "positions"
)

// Reasons a key is blocked.
const (
	// ReasonPending: a message of the key deferred by the group waits in
	// the scheduler.
	ReasonPending = "pending"
	// ReasonParked: the key's head is a parked message that holds it.
	ReasonParked = "parked"
	// ReasonInFlight: the scheduler republished a message of the key and
	// the group has not committed past it yet.
	ReasonInFlight = "in_flight"
	// ReasonRejected: a message of the key the group deferred was rejected
	// (a bad record): it waits for an operator's fix like a parked one.
	ReasonRejected = "rejected"
)

// State is one key's answer.
type State struct {
	Key     string `json:"key"`
	Blocked bool   `json:"blocked"`
	// Reason is one of the Reason constants; "" when not blocked.
	Reason string `json:"reason,omitempty"`
	// HeadSeq is the seq of the key's first waiting message of the group
	// (pending or parked), 0 when none: a record the scheduler republished
	// with a lower defer.seq may be handled although the key is blocked, a
	// record with a higher one must wait behind it.
	HeadSeq int64 `json:"head_seq,omitempty"`
	// HeadID is that message's id (defer.id), 0 when none.
	HeadID int64 `json:"head_id,omitempty"`
}

// Response answers a Request, in the order of its keys (each once).
type Response struct {
	Keys []State `json:"keys"`
	// Stored is how far ingest had stored each partition of the defer
	// topic (the next offset it reads) before the keys' state was read:
	// every record below it is in the answer. A partition ingest never
	// stored is missing.
	Stored map[int32]int64 `json:"stored,omitempty"`
}

// ErrorResponse is the body of every refusal.
type ErrorResponse struct {
	Error string `json:"error"`
}

// Authentication headers: a source whose signing key the scheduler knows
// (SIGNING_KEYS) signs its requests with it, as it signs its records.
const (
	HeaderSource    = "X-Defer-Source"
	HeaderTimestamp = "X-Defer-Timestamp" // Unix seconds
	HeaderSignature = "X-Defer-Signature" // 64 lowercase hex digits
)

// MaxClockSkew is how far a request's timestamp may be from the server's
// clock, in seconds: a captured request cannot be replayed later than that.
const MaxClockSkew = 300

// Sign returns the signature of a request body sent at timestamp (Unix
// seconds) under key: HMAC-SHA256 over a context string, the timestamp and
// the body, in hex.
func Sign(key []byte, timestamp int64, body []byte) string {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("defer-key-state-v1\n"))
	m.Write([]byte(strconv.FormatInt(timestamp, 10)))
	m.Write([]byte("\n"))
	m.Write(body)
	return hex.EncodeToString(m.Sum(nil))
}

// Verify reports whether signature is Sign(key, timestamp, body), in
// constant time.
func Verify(key []byte, timestamp int64, body []byte, signature string) bool {
	want, err := hex.DecodeString(signature)
	if err != nil || len(signature) != 64 {
		return false
	}
	got, _ := hex.DecodeString(Sign(key, timestamp, body))
	return hmac.Equal(got, want)
}
