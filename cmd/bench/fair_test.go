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
	for _, want := range []string{"FAIRNESS BETWEEN TARGETS", topicFairBacklog, topicFairQuiet, "due during the drain",
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
