package ingest

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgtest"
)

// signedMsg is rec(p, key, value, kv...) signed with key signKey: the
// signature is appended as the last header.
func signedMsg(t *testing.T, signKey []byte, p int32, key, value []byte, kv ...string) *sarama.ProducerMessage {
	t.Helper()
	m := rec(p, key, value, kv...)
	r := protocol.Record{Key: key, Value: value, Headers: hs(kv...)}
	m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(protocol.HeaderSignature), Value: []byte(mustSign(t, signKey, r))})
	return m
}

// TestIngestSignatures runs signed, unsigned and mis-signed records through
// the broker and the ingester into Postgres, with a key for the source
// "billing", with and without SIGNING_REQUIRED: the rows' states and
// reasons, the rejected rows kept whole, and the rejection metrics.
func TestIngestSignatures(t *testing.T) {
	const target = "orders.created"
	otherKey := bytes.Repeat([]byte{0x5a}, protocol.MinKeyBytes)
	type want struct {
		state  string
		reason string // prefix of the reason; "" for none
	}
	type tc struct {
		name string
		msg  *sarama.ProducerMessage
		want want
	}
	// sharedCases are the records both runs ingest; with SIGNING_REQUIRED,
	// a source without a key is refused before its signature is looked at.
	sharedCases := func(t *testing.T, required bool) []tc {
		tampered := signedMsg(t, testKey, 0, []byte("k-3"), []byte("v"), protocol.HeaderSource, "billing", protocol.HeaderTarget, target, protocol.HeaderDelay, "1h")
		tampered.Headers[2].Value = []byte("1s") // defer.delay, after signing
		ownKey := want{"pending", ""}
		if required {
			ownKey = want{"rejected", `unknown_source: defer.source "orders"`}
		}
		return []tc{
			{"signed", signedMsg(t, testKey, 0, []byte("k-1"), []byte("v"),
				protocol.HeaderSource, "billing", protocol.HeaderTarget, target, protocol.HeaderDelay, "1h", "trace", "t-1"),
				want{"pending", ""}},
			{"signed, null value, unsigned header changed", func() *sarama.ProducerMessage {
				m := signedMsg(t, testKey, 0, []byte("k-2"), nil, protocol.HeaderSource, "billing", protocol.HeaderTarget, target, protocol.HeaderDelay, "1h", "trace", "t-1")
				m.Headers[3].Value = []byte("t-2")
				return m
			}(), want{"pending", ""}},
			{"mis-signed: delay changed after signing", tampered, want{"rejected", "signature_invalid: defer.signature does not match"}},
			{"unsigned from a keyed source", rec(0, []byte("k-4"), []byte("v"), protocol.HeaderSource, "billing", protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"),
				want{"rejected", `signature_missing: defer.source "billing" has a signing key`}},
			{"signed with another key", signedMsg(t, otherKey, 0, []byte("k-5"), []byte("v"), protocol.HeaderSource, "billing", protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"),
				want{"rejected", "signature_invalid: "}},
			{"signature without a source", rec(0, []byte("k-6"), []byte("v"), protocol.HeaderTarget, target, protocol.HeaderDelay, "1h",
				protocol.HeaderSignature, strings.Repeat("0", 64)),
				want{"rejected", "signature_without_source: "}},
			{"a source without a key, signed with its own", signedMsg(t, otherKey, 1, []byte("k-7"), []byte("v"),
				protocol.HeaderSource, "orders", protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"), ownKey},
		}
	}

	tests := []struct {
		name     string
		required bool
		extra    func(t *testing.T) []tc
		// rejected counts the rejections by code, for the metric.
		rejected map[string]float64
	}{
		{
			name: "keys for some sources",
			extra: func(t *testing.T) []tc {
				return []tc{
					{"a source without a key, unsigned", rec(1, []byte("k-8"), []byte("v"), protocol.HeaderSource, "orders", protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"),
						want{"pending", ""}},
					{"no source", rec(1, []byte("k-9"), []byte("v"), protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"), want{"pending", ""}},
				}
			},
			rejected: map[string]float64{"signature_invalid": 2, "signature_missing": 1, "signature_without_source": 1},
		},
		{
			name:     "SIGNING_REQUIRED",
			required: true,
			extra: func(t *testing.T) []tc {
				return []tc{
					{"a source without a key, unsigned", rec(1, []byte("k-8"), []byte("v"), protocol.HeaderSource, "orders", protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"),
						want{"rejected", `unknown_source: defer.source "orders" has no signing key`}},
					{"no source", rec(1, []byte("k-9"), []byte("v"), protocol.HeaderTarget, target, protocol.HeaderDelay, "1h"),
						want{"rejected", "signature_missing: the record has no defer.source"}},
				}
			},
			rejected: map[string]float64{"signature_invalid": 2, "signature_missing": 2, "signature_without_source": 1, "unknown_source": 2},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			k := newKafka(t)
			cases := append(sharedCases(t, tt.required), tt.extra(t)...)
			for _, c := range cases {
				k.produce(t, c.msg) // one at a time, so offsets follow the table
			}

			signing, err := protocol.NewSigning(map[string][]byte{"billing": testKey}, tt.required)
			if err != nil {
				t.Fatal(err)
			}
			reg := prometheus.NewRegistry()
			cfg := IngestConfig{BatchSize: 4, BatchLinger: 20 * time.Millisecond, Metrics: metrics.New(reg, "test")}
			cfg.Rules = ingestRules()
			cfg.Rules.Signing = signing
			r := startIngester(t.Context(), t, k, db.Pool, "ingest-signatures", cfg, nil)
			r.waitJoined(t)
			waitRows(t, db.Pool, int64(len(cases)), 30*time.Second)

			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					got := rowAt(t, db.Pool, c.msg.Partition, c.msg.Offset)
					if got.State != c.want.state {
						t.Errorf("state %q, want %q (reason %s)", got.State, c.want.state, fmtPtr(got.Reason))
					}
					switch {
					case c.want.reason == "" && got.Reason != nil:
						t.Errorf("reason %s, want none", *got.Reason)
					case c.want.reason != "" && (got.Reason == nil || !strings.HasPrefix(*got.Reason, c.want.reason)):
						t.Errorf("reason %s, want it to start with %q", fmtPtr(got.Reason), c.want.reason)
					}
					// Accepted or rejected, the record is stored whole: its
					// key, value and every header, the signature included.
					if fmtPtr(got.Target) != fmt.Sprintf("%q", target) {
						t.Errorf("target %s, want %q", fmtPtr(got.Target), target)
					}
					var key, value []byte
					if c.msg.Key != nil {
						key, _ = c.msg.Key.Encode()
					}
					if c.msg.Value != nil {
						value, _ = c.msg.Value.Encode()
					}
					if !bytes.Equal(got.Key, key) || !bytes.Equal(got.Value, value) || got.ValueNull != (value == nil) {
						t.Errorf("key %q value %q (null %v), want %q %q", got.Key, got.Value, got.ValueNull, key, value)
					}
					if len(got.HeaderKeys) != len(c.msg.Headers) {
						t.Fatalf("%d headers stored, want %d: %q", len(got.HeaderKeys), len(c.msg.Headers), got.HeaderKeys)
					}
					for i, h := range c.msg.Headers {
						if got.HeaderKeys[i] != string(h.Key) || !bytes.Equal(got.HeaderValues[i], h.Value) {
							t.Errorf("header %d: %s=%q, want %s=%q", i, got.HeaderKeys[i], got.HeaderValues[i], h.Key, h.Value)
						}
					}
				})
			}

			g := gatherIngest(t, reg)
			for code, n := range tt.rejected {
				if name := fmt.Sprintf(`scheduler_ingest_rejected_total{reason=%q}`, code); g[name] != n {
					t.Errorf("%s = %v, want %v", name, g[name], n)
				}
			}
		})
	}
}
