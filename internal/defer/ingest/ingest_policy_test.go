package ingest

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/internal/policy"
)

// TestIngestPolicies runs records through the broker and the ingester with
// retry policies: records without a time get the policy's delay (with real
// jitter, so within its bounds), records not worth retrying or out of
// retries are parked with their reason, an explicit delay wins, and the
// partition keeps flowing past the parked ones.
func TestIngestPolicies(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	set, err := policy.Parse("orders.*: exponential 10s x2 cap 1h max 5 jitter 20% dlq {target}.dlq", 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cls, err := policy.ParseClassifier("*JsonParseException")
	if err != nil {
		t.Fatal(err)
	}
	rules := ingestRules()
	rules.Policies, rules.Classifier = set, cls

	const target, dlq = "orders.created", "orders.created.dlq"
	type want struct {
		state          string
		reasonPrefix   string
		minDelay, maxD time.Duration // next_run_at - created_at
		dlq            *string
	}
	pending := func(lo, hi time.Duration, dlq *string) want {
		return want{state: "pending", minDelay: lo, maxD: hi, dlq: dlq}
	}
	parked := func(prefix string, dlq *string) want {
		return want{state: "parked", reasonPrefix: prefix, dlq: dlq}
	}
	cases := []struct {
		name string
		msg  *sarama.ProducerMessage
		want want
	}{
		{"first retry: 10s +-20%", rec(0, []byte("k-0"), []byte("v"), protocol.HeaderTarget, target),
			pending(8*time.Second, 12*time.Second, ptr(dlq))},
		{"third retry: 40s +-20%", rec(0, []byte("k-1"), []byte("v"), protocol.HeaderTarget, target, protocol.HeaderAttempt, "2"),
			pending(32*time.Second, 48*time.Second, ptr(dlq))},
		{"permanent", rec(0, []byte("k-2"), []byte("v"), protocol.HeaderTarget, target, protocol.HeaderErrorClass, "permanent"),
			parked("permanent: ", ptr(dlq))},
		{"non-retriable class", rec(0, []byte("k-3"), []byte("v"), protocol.HeaderTarget, target,
			protocol.HeaderErrorClass, "com.fasterxml.jackson.core.JsonParseException", protocol.HeaderDelay, "1s"),
			parked("non_retriable: ", ptr(dlq))},
		{"exhausted", rec(0, []byte("k-4"), []byte("v"), protocol.HeaderTarget, target, protocol.HeaderAttempt, "5"),
			parked("exhausted: 5 retries made", ptr(dlq))},
		{"explicit delay wins", rec(0, []byte("k-5"), []byte("v"), protocol.HeaderTarget, target, protocol.HeaderAttempt, "1", protocol.HeaderDelay, "1h"),
			pending(time.Hour, time.Hour, ptr(dlq))},
		{"default policy for other targets: 30s +-20%", rec(0, []byte("k-6"), []byte("v"), protocol.HeaderTarget, "payments.retry"),
			pending(24*time.Second, 36*time.Second, nil)},
		{"after the parked ones", validRec(0, "k-7", "v"), pending(time.Hour, time.Hour, ptr(dlq))},
		{"another partition", rec(1, []byte("k-8"), []byte("v"), protocol.HeaderTarget, target, protocol.HeaderAttempt, "4"),
			pending(128*time.Second, 192*time.Second, ptr(dlq))},
	}
	for _, c := range cases {
		k.produce(t, c.msg) // one at a time, so offsets follow the table
	}

	reg := prometheus.NewRegistry()
	cfg := IngestConfig{BatchSize: 4, BatchLinger: 20 * time.Millisecond, Metrics: metrics.New(reg, "test")}
	cfg.Rules = rules
	r := startIngester(t.Context(), t, k, db.Pool, "ingest-policies", cfg, nil)
	r.waitJoined(t)
	waitFor(t, 30*time.Second, "every record stored and committed", func() (bool, string) {
		committed := k.committed(t, "ingest-policies")
		n := countRows(t, db.Pool)
		return n == int64(len(cases)) && committed[0] == 8 && committed[1] == 1,
			fmt.Sprintf("%d rows, committed %v", n, committed)
	})

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := readPolicyColumns(t, db.Pool, c.msg.Partition, c.msg.Offset)
			if got.State != c.want.state {
				t.Errorf("state %q, want %q (reason %s)", got.State, c.want.state, fmtPtr(got.Reason))
			}
			if c.want.state == "parked" {
				if got.Reason == nil || !strings.HasPrefix(*got.Reason, c.want.reasonPrefix) {
					t.Errorf("reason %s, want it to start with %q", fmtPtr(got.Reason), c.want.reasonPrefix)
				}
				if got.ParkedAt == nil {
					t.Error("parked_at is NULL")
				}
			} else if d := got.NextRunAt.Sub(got.CreatedAt); d < c.want.minDelay-time.Second || d > c.want.maxD {
				// Less up to a second: the delay counts from the read, and
				// the time the record waited in ingest comes off it.
				t.Errorf("next_run_at - created_at = %v, want within [%v less up to 1s, %v]", d, c.want.minDelay, c.want.maxD)
			}
			if fmtPtr(got.DLQTopic) != fmtPtr(c.want.dlq) || !got.HoldsKey {
				t.Errorf("dlq_topic %s park_holds_key %v, want %s, true", fmtPtr(got.DLQTopic), got.HoldsKey, fmtPtr(c.want.dlq))
			}
		})
	}
	// A parked message holds its key (the policy's default).
	if h, ok := readHead(t, db.Pool, "k-2"); !ok || !h.Held || h.NextRunAt != "infinity" {
		t.Errorf("head of k-2: %+v (present %v), want held, at 'infinity'", h, ok)
	}

	stored, rejected, dups := r.in.Counts()
	if stored != int64(len(cases)) || rejected != 0 || dups != 0 || r.in.Parked() != 3 {
		t.Errorf("Counts() = %d stored, %d rejected, %d duplicates, Parked() = %d; want %d, 0, 0, 3",
			stored, rejected, dups, r.in.Parked(), len(cases))
	}
	g := gatherIngest(t, reg)
	for name, want := range map[string]float64{
		`scheduler_ingest_records_total{result="stored"}`:            float64(len(cases)),
		`scheduler_ingest_records_total{result="rejected"}`:          0,
		`scheduler_ingest_parked_total{reason="permanent"}`:          1,
		`scheduler_ingest_parked_total{reason="non_retriable"}`:      1,
		`scheduler_ingest_parked_total{reason="exhausted"}`:          1,
		`scheduler_ingest_rejected_total{reason="missing_schedule"}`: 0,
	} {
		if g[name] != want {
			t.Errorf("%s = %v, want %v", name, g[name], want)
		}
	}
}

// Without policies the ingester uses the built-in default; it needs a
// positive maximum delay to cap it.
func TestNewIngesterDefaultPolicies(t *testing.T) {
	// A log that is never asked: NewIngester only keeps it.
	cfg := IngestConfig{Topic: ingestTopic, BatchSize: 1, BatchLinger: time.Millisecond, Rules: protocol.Rules{MaxDelay: time.Minute},
		Log: NewPartitionLog(nil)}
	in, err := NewIngester(nil, nil, cfg, nil)
	if err != nil {
		t.Fatalf("NewIngester: %v", err)
	}
	p := in.cfg.Rules.Policies.For("orders.created")
	if p.Text != policy.DefaultPolicy || p.MaxDelay != time.Minute {
		t.Errorf("default policy %q capped at %v, want %q capped at 1m", p.Text, p.MaxDelay, policy.DefaultPolicy)
	}
	if in.cfg.Rand == nil {
		t.Error("no jitter source")
	}
	cfg.Rules.MaxDelay = 0
	if _, err := NewIngester(nil, nil, cfg, nil); err == nil || !strings.Contains(err.Error(), "default retry policy") {
		t.Errorf("NewIngester with MaxDelay 0: %v, want an error about the default retry policy", err)
	}
}
