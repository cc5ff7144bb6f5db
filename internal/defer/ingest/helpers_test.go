package ingest

import (
	"bytes"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/policy"
)

// hs builds record headers from key, value pairs.
func hs(kv ...string) []protocol.Header {
	var h []protocol.Header
	for i := 0; i+1 < len(kv); i += 2 {
		h = append(h, protocol.Header{Key: []byte(kv[i]), Value: []byte(kv[i+1])})
	}
	return h
}

// testKey is the signing key of the source "billing" in these tests.
var testKey = bytes.Repeat([]byte{0x2a}, protocol.MinKeyBytes)

// mustSign returns rec's signature under key.
func mustSign(t testing.TB, key []byte, rec protocol.Record) string {
	t.Helper()
	sig, err := protocol.Sign(key, rec)
	if err != nil {
		t.Fatalf("Sign: %v", err)
	}
	return sig
}

// policyRules returns ingest's rules with a retry policy of three retries
// for payments.* (a ladder of 1s, 5s, 30s), with dead-letter copies.
func policyRules(t testing.TB) protocol.Rules {
	t.Helper()
	set, err := policy.Parse("payments.*: ladder 1s,5s,30s dlq {target}.dlq", 24*time.Hour)
	if err != nil {
		t.Fatalf("policy.Parse: %v", err)
	}
	rules := ingestRules()
	rules.Targets = append(rules.Targets, "payments.*")
	rules.Policies = set
	return rules
}

// fixedRand returns v on every draw.
func fixedRand(v float64) func() float64 { return func() float64 { return v } }
