package main

import (
	"strings"
	"testing"
	"time"
)

// The fairness scenario alone (BENCH_ONLY=fair) in the smoke size: the
// backlog is made due and drains, the quiet target's records arrive, every
// message of both targets is there in per-key order, and the report has
// its table and RESULT keys. The lateness is not checked against the bar:
// make test must not depend on the machine's speed (make bench reports it).
func TestSmokeFair(t *testing.T) {
	cfg, report, vals := runSmoke(t, onlyFair)
	for _, k := range []string{"fair_quiet_p99_ms", "fair_quiet_p50_ms", "fair_quiet_max_ms", "fair_quiet_msgs",
		"fair_quiet_alone_p99_ms", "fair_backlog_msgs_per_s", "fair_quiet_to_store_p99_ms", "fair_quiet_to_publish_p99_ms", "fair_cpu_speed", "fair_expected"} {
		if vals[k] <= 0 {
			t.Errorf("%s = %v, want a positive measurement", k, vals[k])
		}
	}
	if vals["fair_backlog_msgs"] != float64(cfg.FairBacklog) {
		t.Errorf("fair_backlog_msgs = %v, want %d", vals["fair_backlog_msgs"], cfg.FairBacklog)
	}
	// The warm-up, the backlog and at least the quiet records sent alone.
	if least := float64(cfg.Warmup + cfg.FairBacklog + cfg.FairRate); vals["fair_expected"] < least ||
		vals["fair_delivered"] != vals["fair_expected"] || vals["fair_out_of_order"] != 0 {
		t.Errorf("delivered %v of %v messages (want at least %v), %v out of per-key order",
			vals["fair_delivered"], vals["fair_expected"], least, vals["fair_out_of_order"])
	}
	// Whether autovacuum runs in the smoke size is up to Postgres: the keys
	// must be there, not positive.
	for _, k := range []string{"fair_quiet_vacuum_p99_ms", "fair_quiet_novacuum_p99_ms"} {
		if _, ok := vals[k]; !ok {
			t.Errorf("RESULT lacks %s", k)
		}
	}
	// The weighted drain: both backlogs delivered in order, the weight
	// set. At this size one round takes both whole, so their ratio means
	// nothing here.
	if each := float64(max(1, cfg.FairBacklog/2)); vals["weight_expected"] != 2*each || vals["weight_delivered"] != vals["weight_expected"] ||
		vals["weight_out_of_order"] != 0 || vals["weight_applied"] != 1 {
		t.Errorf("weighted drain: delivered %v of %v messages (want %v), %v out of per-key order, weight applied %v",
			vals["weight_delivered"], vals["weight_expected"], 2*each, vals["weight_out_of_order"], vals["weight_applied"])
	}
	for _, k := range []string{"weight_heavy_msgs_per_s", "weight_drain_msgs_per_s"} {
		if vals[k] <= 0 {
			t.Errorf("%s = %v, want a positive measurement", k, vals[k])
		}
	}
	// Its quiet target: the stream runs fairAside past the drain, so it
	// sent some, and every one arrived in order. How many fell due during
	// the drain is up to the machine; their lateness keys are there.
	if vals["weight_quiet_expected"] < float64(cfg.FairRate) || vals["weight_quiet_delivered"] != vals["weight_quiet_expected"] ||
		vals["weight_quiet_out_of_order"] != 0 {
		t.Errorf("weighted drain's quiet target: delivered %v of %v (want at least %d), %v out of per-key order",
			vals["weight_quiet_delivered"], vals["weight_quiet_expected"], cfg.FairRate, vals["weight_quiet_out_of_order"])
	}
	for _, k := range []string{"weight_quiet_msgs", "weight_quiet_p50_ms", "weight_quiet_p99_ms", "weight_quiet_max_ms"} {
		if _, ok := vals[k]; !ok {
			t.Errorf("RESULT lacks %s", k)
		}
	}
	for _, want := range []string{"WEIGHTED DRAIN", topicWeightHeavy, topicWeightLight, topicWeightQuiet, "times as fast as", "its quiet target",
		"FAIRNESS BETWEEN TARGETS", topicFairBacklog, topicFairQuiet, "due during the drain",
		"machine:", "speed:", "COMPARED WITH THE TARGETS", "quiet target p99 lateness", "Autovacuum", "during the drain: due to stored p50"} {
		if !strings.Contains(report, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("report:\n%s", report)
	}
}

func TestConfigFromEnvFairScale(t *testing.T) {
	for _, tc := range []struct {
		environ []string
		only    string
		backlog int
		largest int
	}{
		{[]string{"BENCH_ONLY=fair"}, onlyFair, 1_000_000, 10_000_000},
		{[]string{"BENCH_QUICK=1", "BENCH_ONLY=scale"}, onlyScale, 200_000, 1_000_000},
		{[]string{"BENCH_SMOKE=1", "BENCH_ONLY=scale"}, onlyScale, 2_000, 10_000},
	} {
		cfg, err := configFromEnv(tc.environ)
		if err != nil {
			t.Fatalf("configFromEnv(%q): %v", tc.environ, err)
		}
		if cfg.Only != tc.only || cfg.FairBacklog != tc.backlog || cfg.ScaleBacklogs[len(cfg.ScaleBacklogs)-1] != tc.largest {
			t.Errorf("configFromEnv(%q) = only %q, fair backlog %d, scale backlogs %v; want %q, %d, up to %d",
				tc.environ, cfg.Only, cfg.FairBacklog, cfg.ScaleBacklogs, tc.only, tc.backlog, tc.largest)
		}
	}
}

// TestVacuumRunningAt checks how a quiet record's due time is matched with
// the autovacuum samples: the last sample at or before it decides.
func TestVacuumRunningAt(t *testing.T) {
	t0 := time.Date(2026, 11, 25, 19, 0, 0, 0, time.UTC)
	v := vacuumSeen{
		at:      []time.Time{t0, t0.Add(50 * time.Millisecond), t0.Add(100 * time.Millisecond)},
		running: []bool{false, true, false},
	}
	for _, tc := range []struct {
		at   time.Duration
		want bool
	}{
		{-time.Millisecond, false}, // before the first sample
		{0, false},
		{49 * time.Millisecond, false},
		{50 * time.Millisecond, true},
		{99 * time.Millisecond, true},
		{100 * time.Millisecond, false},
		{time.Hour, false}, // after the last sample, which saw none
	} {
		if got := v.runningAt(t0.Add(tc.at)); got != tc.want {
			t.Errorf("runningAt(t0%+v) = %v, want %v", tc.at, got, tc.want)
		}
	}
}

// TestLatenessSplitByAutovacuum: a lateness phase's records are split by
// the sample before their due time, their percentiles taken apart, and the
// workers' time summed by what they vacuumed.
func TestLatenessSplitByAutovacuum(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 15, 0, 0, 0, time.UTC)
	seen := vacuumSeen{
		at:      []time.Time{t0, t0.Add(50 * time.Millisecond), t0.Add(100 * time.Millisecond)},
		running: []bool{false, true, false},
		busy: map[string]time.Duration{
			"autovacuum: VACUUM public.deferred_message": 50 * time.Millisecond,
			"autovacuum: ANALYZE public.deferred_key":    100 * time.Millisecond,
		},
	}
	due := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	ds := []delivery{
		{scheduledAt: due(10)}, {scheduledAt: due(60)}, {scheduledAt: due(70)}, {scheduledAt: due(120)},
	}
	ls := []time.Duration{5 * time.Millisecond, 300 * time.Millisecond, 200 * time.Millisecond, 7 * time.Millisecond}

	for _, tc := range []struct {
		name                    string
		watched                 bool
		under, clear            int
		underP99, clearP99, p99 time.Duration
	}{
		{"watched", true, 2, 2, 300 * time.Millisecond, 7 * time.Millisecond, 300 * time.Millisecond},
		{"not watched", false, 0, 0, 0, 0, 300 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := &latencies{offered: 5000, sent: len(ds)}
			if tc.watched {
				l.autovacuum = &autovacuumSplit{seen: seen}
			}
			l.measured(ds, ls)
			if l.p99 != tc.p99 || l.max != 300*time.Millisecond || l.p50 != 7*time.Millisecond {
				t.Errorf("p50/p99/max = %v/%v/%v, want 7ms/%v/300ms", l.p50, l.p99, l.max, tc.p99)
			}
			if !tc.watched {
				if l.autovacuum != nil {
					t.Errorf("autovacuum split made for a phase not watched")
				}
				return
			}
			a := l.autovacuum
			if a.under.sent != tc.under || a.clear.sent != tc.clear || a.under.p99 != tc.underP99 || a.clear.p99 != tc.clearP99 {
				t.Errorf("with a worker %d records, p99 %v; without %d, p99 %v; want %d, %v; %d, %v",
					a.under.sent, a.under.p99, a.clear.sent, a.clear.p99, tc.under, tc.underP99, tc.clear, tc.clearP99)
			}
		})
	}
	if got, want := seen.summary(), "ANALYZE public.deferred_key 0.1s, VACUUM public.deferred_message 0.1s"; got != want {
		t.Errorf("summary = %q, want %q", got, want)
	}
	if got := (vacuumSeen{}).summary(); got != "none" {
		t.Errorf("summary of no worker = %q, want none", got)
	}
}
